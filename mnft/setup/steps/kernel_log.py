"""Step `kernel_log`: the lab's members see the GPUs' Xid errors, where kernel.dmesg_restrict=1 keeps them from
/dev/kmsg (Debian's and Ubuntu's default).

What it chose is said per host:
- no NVIDIA driver on the host: nothing (there are no Xid lines to read);
- kernel.dmesg_restrict=0: nothing (every user reads /dev/kmsg already);
- otherwise mnft's reader: /usr/local/libexec/mnft-kernel-xids (root-owned, mnft/onhost/xidreader.py with the host's
  /usr/bin/python3 in isolated mode), which prints only the driver's Xid records of the kernel log, and
  /etc/sudoers.d/mnft-kernel-xids, which lets `users` (default every user) run it as root without a password and
  without arguments. The sudoers file is checked with `visudo -cf` under a name sudo ignores before it is put in
  place, so a bad file never breaks sudo.
The host side (mnft.onhost.kernellog) reads /dev/kmsg, else this reader, else the journal. Granting the journal
(systemd-journal membership) is the admin's choice: it shows the whole system journal, not only Xids. Undo removes
the two files where they are still what mnft wrote. Needs root.
"""

from __future__ import annotations

import hashlib
import re

from mnft.hosts import payload
from mnft.hosts.settings import Host
from mnft.onhost.kernellog import READER
from mnft.setup.steps.base import Context, Outcome, Param, Plan, read_ops, standard, write_op

TAGS = ("gpu",)
NEEDS_ROOT = True
PARAMS = {
    "users": Param("str", "ALL", "who may run the reader: ALL, a user, or %group (a sudoers user list)"),
}

SUDOERS = "/etc/sudoers.d/mnft-kernel-xids"
CHECKING = "/etc/sudoers.d/.mnft-kernel-xids.check"  # a name with a dot: sudo never reads it
PYTHON = "/usr/bin/python3"  # the system's, root-owned: what the reader runs with as root
SUDO, VISUDO = "/usr/bin/sudo", "/usr/sbin/visudo"
RESTRICT = "/proc/sys/kernel/dmesg_restrict"
DRIVER = ("/proc/driver/nvidia", "/usr/bin/nvidia-smi", "/usr/local/bin/nvidia-smi")
ROOT_ONLY = ("/usr/local", "/usr/local/libexec", READER)  # whoever may write one of these could replace what sudo runs as root


def validate(params: dict) -> str | None:
    """A parameter problem the types cannot express, or None: `users` goes into a sudoers line."""
    if not re.fullmatch(r"ALL|%?[A-Za-z_][A-Za-z0-9_.-]*", params["users"]):
        return f"key 'users': {params['users']!r} is not ALL, a user name or %group"
    return None


def reader_text() -> str:
    return f"#!{PYTHON} -I\n" + payload.standalone("xidreader")


def sudoers_text(users: str) -> str:
    return ("# written by mnft setup (kernel_log): the NVIDIA driver's Xid lines of the kernel log, nothing else, for the\n"
            "# lab's members (kernel.dmesg_restrict=1); remove with: mnft setup --only kernel_log --undo\n"
            f"Defaults!{READER} !syslog, !pam_session, !requiretty\n"  # read at every look, over SSH without a terminal
            f'{users} ALL=(root) NOPASSWD: {READER} ""\n')


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def plan_host(facts: dict, users: str) -> Plan:
    plan = Plan()
    if not facts["driver"]:
        plan.notes.append("no NVIDIA driver: no Xid lines to read, nothing installed")
        return plan
    if facts["restrict"] == "0":
        plan.notes.append("the kernel log is readable by every user (kernel.dmesg_restrict=0): nothing installed")
        return plan
    if not facts["sudo"]:
        plan.error = (f"sudo is not installed ({SUDO}): install it (apt-get install sudo) for mnft's reader of Xid lines, "
                      "or add the lab's members to the systemd-journal group (they then read the whole journal)")
        return plan
    if not facts["python"]:
        plan.error = f"{PYTHON} is not there or not root's: install python3 (the reader runs with the system's Python as root)"
        return plan
    if facts["unsafe"]:
        plan.error = (f"{facts['unsafe']} is not root's alone (another user or group may write it): a reader there would give them "
                      "root through sudo; make it root's, 0755, then run setup again")
        return plan
    reader, sudoers = reader_text(), sudoers_text(users)
    chose = f"the lab's members read the driver's Xid lines through mnft's reader ({READER}, run by sudo: {SUDOERS})"
    if facts["reader_sha"] == _sha(reader) and facts["sudoers_sha"] == _sha(sudoers):
        plan.notes.append(chose)
        return plan
    if facts["reader_sha"] != _sha(reader):
        plan.changes.append(f"install {READER} (root's; prints only the NVIDIA driver's Xid records of the kernel log)")
        plan.ops.append(write_op(READER, reader, mode=0o755, dir_mode=0o755, expect=facts["reader_sha"]))
    if facts["sudoers_sha"] != _sha(sudoers):
        plan.changes.append(f"let {'every user' if users == 'ALL' else users} run it as root, without arguments ({SUDOERS})")
        plan.ops += [write_op(CHECKING, sudoers, mode=0o440),
                     {"op": "run", "argv": [VISUDO, "-cf", CHECKING], "check": True},
                     write_op(SUDOERS, sudoers, mode=0o440, expect=facts["sudoers_sha"]),
                     {"op": "remove", "path": CHECKING}]
    plan.notes.append(chose)
    return plan


def plan_undo(facts: dict, users: str) -> Plan:
    plan = Plan()
    kept_rule = False
    for path, text in ((SUDOERS, sudoers_text(users)), (READER, reader_text())):  # the rule first: never one naming a missing file
        sha = facts["sudoers_sha" if path == SUDOERS else "reader_sha"]
        if sha is None:
            continue
        if sha != _sha(text) or (path == READER and kept_rule):
            plan.notes.append(f"{path} is not what mnft writes (changed by someone, or another version's): kept" if sha != _sha(text) else
                              f"{path} kept: the sudo rule beside it names it")
            kept_rule = kept_rule or path == SUDOERS
            continue
        plan.changes.append(f"delete {path}")
        plan.ops.append({"op": "remove", "path": path, "expect_sha256": sha})
    if facts["checking"]:
        plan.changes.append(f"delete {CHECKING} (a check left by a setup that stopped)")
        plan.ops.append({"op": "remove", "path": CHECKING})
    return plan


def read(ctx: Context, host: Host):
    ops = [{"op": "read", "path": RESTRICT}, {"op": "read", "path": READER}, {"op": "read", "path": SUDOERS},
           {"op": "stat", "paths": [PYTHON, SUDO, CHECKING, *DRIVER, *ROOT_ONLY]}]
    results, failure = read_ops(ctx, host, ops, root=True)
    if failure:
        return None, failure
    restrict, reader, sudoers, stats = results
    python = stats[PYTHON]
    return {
        "restrict": (restrict.get("text") or "").strip() if restrict.get("exists") else None,
        "reader_sha": reader.get("sha256") if reader.get("exists") else None,
        "sudoers_sha": sudoers.get("sha256") if sudoers.get("exists") else None,
        "python": bool(python.get("exists") and python.get("uid") == 0),
        "sudo": bool(stats[SUDO].get("exists")),
        "checking": bool(stats[CHECKING].get("exists")),
        "driver": any(stats[p].get("exists") for p in DRIVER),
        "unsafe": next((p for p in ROOT_ONLY if _unsafe(stats[p], p == READER)), None),
    }, None


def _unsafe(st: dict, is_reader: bool) -> bool:
    """Whether a path sudo's rule depends on may be changed by someone else than root: not root's, or writable by a
    group or others (a link's own mode means nothing; the reader itself is never a link)."""
    if not st.get("exists"):
        return False
    if st.get("uid") != 0 or (is_reader and st.get("is_link")):
        return True
    return not st.get("is_link") and bool((st.get("mode") or 0) & 0o022)


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, read, lambda facts: {n: plan_host(f, params["users"]) for n, f in facts.items()}, root=True)


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, read, lambda facts: {n: plan_undo(f, params["users"]) for n, f in facts.items()}, root=True)
