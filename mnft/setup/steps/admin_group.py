"""Step `admin_group` (`mnft setup --admin-group NAME`): the group whose members are the lab's mnft admins, written
where every host reads it: /etc/mnft/admin-group, root's and not writable by anyone else (mnft.onhost.drain reads
only such a file). Its members may drain and undrain GPUs and hosts (`mnft drain`), as root may.

The group must exist on the host (its members are the host's to say: `groupadd labops`, `usermod -aG labops ann`);
a host that names another group already is told and changed (the file is mnft's: its first line says so), a file
someone else wrote is never overwritten. Undo removes the file only where mnft wrote it. Needs root.
"""

from __future__ import annotations

import re

from mnft.hosts.settings import Host
from mnft.onhost.drain import ADMIN_FILES
from mnft.setup.steps.base import Context, Outcome, Param, Plan, read_ops, standard, write_op

TAGS = ("admins",)
NEEDS_ROOT = True
PARAMS = {
    "group": Param("str", None, "the admins' group (it must exist on every host); left out: say which group each host names"),
}

PATH = ADMIN_FILES[0]
MARK = "# written by mnft setup (admin_group)"


def validate(params: dict) -> str | None:
    group = params["group"]
    if group is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", group):
        return f"key 'group': {group!r} is not a group name"
    return None


def file_text(group: str) -> str:
    return (f"{MARK}: members of this group may drain and undrain (mnft drain); remove with: mnft setup --only admin_group --undo\n"
            f"{group}\n")


def named(text: str | None) -> str | None:
    """The group a file names (its first line that is not a comment), as the hosts read it."""
    names = [w.strip() for w in (text or "").splitlines() if w.strip() and not w.strip().startswith("#")]
    return names[0] if names else None


def plan_host(facts: dict, group: str | None) -> Plan:
    plan = Plan()
    now = named(facts["text"])
    if group is None:
        plan.notes.append(f"the admins are root and group {now} ({PATH})" if now else f"the admins are root only ({PATH} names no group)")
        return plan
    if not facts["group_exists"]:
        plan.error = f"group {group} does not exist on this host: create it (groupadd {group}) and add the admins (usermod -aG {group} USER)"
        return plan
    if facts["text"] is not None and not facts["text"].startswith(MARK):
        plan.error = f"{PATH} was not written by mnft (it names {now or 'no group'}): edit it by hand, or remove it and run setup again"
        return plan
    if facts["text"] == file_text(group) and facts["root_only"]:
        plan.notes.append(f"the admins are root and group {group}")
        return plan
    plan.changes.append(f"name group {group} the admins in {PATH}" + (f" (was {now})" if now and now != group else ""))
    plan.ops += [write_op(PATH, file_text(group), mode=0o644, dir_mode=0o755, expect=facts["sha"]),
                 {"op": "fit_drain", "was": now}]  # the drain file: the new admins' to write, its marks still honoured
    return plan


def plan_undo(facts: dict) -> Plan:
    plan = Plan()
    if facts["text"] is None:
        return plan
    if not facts["text"].startswith(MARK):
        plan.notes.append(f"{PATH} was not written by mnft: kept")
        return plan
    plan.changes.append(f"delete {PATH} (the admins are root only again)")
    plan.ops += [{"op": "remove", "path": PATH, "expect_sha256": facts["sha"]},
                 {"op": "fit_drain", "was": named(facts["text"])}]  # root's alone again, its marks still honoured
    return plan


def read(ctx: Context, host: Host, group: str | None):
    ops = [{"op": "read", "path": PATH}]
    if group is not None:
        ops.append({"op": "run", "argv": ["getent", "group", group]})
    results, failure = read_ops(ctx, host, ops, root=True)
    if failure:
        return None, failure
    current = results[0]
    exists = current.get("exists")
    return {
        "text": current.get("text") if exists else None,
        "sha": current.get("sha256") if exists else None,
        "root_only": bool(exists and current.get("uid") == 0 and not (current.get("mode") or 0) & 0o022),
        "group_exists": group is None or results[1].get("rc") == 0,
    }, None


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    group = params["group"]
    return standard(ctx, lambda c, h: read(c, h, group), lambda facts: {n: plan_host(f, group) for n, f in facts.items()}, root=True)


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, lambda c, h: read(c, h, None), lambda facts: {n: plan_undo(f) for n, f in facts.items()}, root=True)
