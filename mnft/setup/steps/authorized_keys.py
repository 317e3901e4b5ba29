"""Step `authorized_keys`: the controller's public key in every host's ~/.ssh/authorized_keys.

The line is `<type> <key> mnft:controller:<id>` (id: the key's fingerprint prefix, so two controllers never
replace each other's line), appended at the end; lines mnft did not add are never reordered, changed or
deleted. ~/.ssh is made 0700 and the file 0600 (atomic replace). A home directory or ~/.ssh that sshd's
StrictModes would refuse (group/world-writable, or owned by someone else) fails the step with the fix: mnft
does not change a home directory's permissions. A key already authorized by a line someone else wrote is left
alone (ok). Runs as the login user (never through sudo): it is that user's file.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.hosts.settings import Host, Inventory
from mnft.setup.steps import blocks
from mnft.setup.steps.base import Context, Outcome, Param, Plan, first_error, standard, write_op

TAGS = ("trust",)
NEEDS_ROOT = False
PARAMS = {
    "key": Param("str", None, "the controller's public key file (default: each host's identity + .pub, else ~/.ssh/id_ed25519.pub)"),
}

SSH_DIR = "~/.ssh"
AUTHORIZED_KEYS = "~/.ssh/authorized_keys"
KEY_TYPES = ("ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
             "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")


# ---------------------------------------------------------------------------------------------- controller side


def parse_public_key(text: str, where: str) -> tuple[str, str]:
    """(type, base64) of a one-key .pub file, or InputError."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(lines) != 1:
        raise InputError(f"{where}: expected exactly one public key line, found {len(lines)}")
    words = lines[0].split()
    if len(words) < 2 or words[0] not in KEY_TYPES:
        raise InputError(f"{where}: not an OpenSSH public key (expected '<type> <base64> [comment]', type one of {', '.join(KEY_TYPES[:3])}, …)")
    try:
        base64.b64decode(words[1], validate=True)
    except ValueError:
        raise InputError(f"{where}: the key is not valid base64") from None
    return words[0], words[1]


def key_id(blob: str) -> str:
    return hashlib.sha256(base64.b64decode(blob)).hexdigest()[:12]


def key_path_for(host: Host, param: str | None) -> Path:
    if param:
        return Path(param).expanduser()
    if host.identity:
        return Path(os.path.expanduser(host.identity) + ".pub")
    return Path.home() / ".ssh" / "id_ed25519.pub"


def prepare(inventory: Inventory, params: dict) -> dict:
    """Read the controller's public key(s) before any host is contacted: a missing or bad file is bad input."""
    keys = {}
    for host in inventory.hosts:
        path = key_path_for(host, params.get("key"))
        text = limits.text_of(limits.read_bytes(path, limits.PUBLIC_KEY_BYTES, "controller's public key", "the step parameter 'key'"), str(path), "public key")
        keys[host.name] = parse_public_key(text, str(path))
    return {**params, "keys": keys}


def controller_line(key_type: str, blob: str) -> tuple[str, str]:
    """(role, line) of the controller's authorized_keys line."""
    role = f"controller:{key_id(blob)}"
    return role, f"{key_type} {blob} {blocks.MARK}{role}"


# ---------------------------------------------------------------------------------------------- pure planning


def strict_modes_problems(uid: int, home: str, stats: dict) -> list[str]:
    """What sshd's StrictModes would refuse: the file, ~/.ssh and the home directory must be owned by the user
    or root and not writable by group or others. Only fixes mnft makes itself (~/.ssh, the file) are excluded."""
    problems = []
    for label, st in (("home directory " + home, stats.get("~")), ("~/.ssh", stats.get(SSH_DIR)), ("~/.ssh/authorized_keys", stats.get(AUTHORIZED_KEYS))):
        if not st or not st.get("exists"):
            continue
        if st["uid"] not in (uid, 0):
            problems.append(f"{label} is owned by uid {st['uid']}, not the login user (uid {uid}) or root: sshd (StrictModes) ignores the keys; fix: chown")
        elif label.startswith("home") and st["mode"] & 0o022:
            problems.append(f"{label} is writable by group or others (mode {st['mode']:04o}): sshd (StrictModes) ignores the keys; fix: chmod go-w {home}")
    return problems


def ssh_dir_ops(stats: dict) -> tuple[list[str], list[dict]]:
    """Changes that make ~/.ssh exist with mode 0700 (creation happens with the file's write)."""
    st = stats.get(SSH_DIR) or {}
    if st.get("exists") and st.get("mode") != 0o700:
        return [f"chmod 0700 ~/.ssh (was {st['mode']:04o})"], [{"op": "chmod", "path": SSH_DIR, "mode": 0o700}]
    return [], []


def plan_file(current: dict, new_text: str, what: str, stats: dict) -> Plan:
    """Write ~/.ssh/authorized_keys when its text changes; otherwise fix its mode only."""
    plan = Plan()
    plan.changes, plan.ops = ssh_dir_ops(stats)
    old_text = current.get("text", "") if current.get("exists") else ""
    if new_text != old_text:
        plan.changes.append(what)
        plan.ops.append(write_op(AUTHORIZED_KEYS, new_text, mode=0o600, dir_mode=0o700, expect=current.get("sha256") if current.get("exists") else None))
    elif current.get("exists") and current.get("mode") != 0o600:
        plan.changes.append(f"chmod 0600 ~/.ssh/authorized_keys (was {current['mode']:04o})")
        plan.ops.append({"op": "chmod", "path": AUTHORIZED_KEYS, "mode": 0o600})
    return plan


def plan_host(facts: dict, key: tuple[str, str]) -> Plan:
    """Facts of one host (env, stats, authorized_keys) + the controller key -> the plan."""
    key_type, blob = key
    role, line = controller_line(key_type, blob)
    current = facts["file"]
    text = current.get("text", "") if current.get("exists") else ""
    problems = strict_modes_problems(facts["env"]["uid"], facts["env"]["home"], facts["stats"])
    if current.get("exists") and current.get("is_dir"):
        problems.append("~/.ssh/authorized_keys is a directory")
    if problems:
        return Plan(error="; ".join(problems))
    elsewhere = [ln for ln in blocks.split_lines(text) if blocks.line_role(ln) is None and blocks.key_blob(ln) == blob]
    wanted = {} if elsewhere else {role: line}
    new_text = blocks.set_marked_lines(text, wanted, lambda r: r == role)
    plan = plan_file(current, new_text, "add the controller key to ~/.ssh/authorized_keys", facts["stats"])
    if elsewhere:
        plan.notes.append("the controller key is already authorized by a line mnft did not write (left as is)")
    return plan


def plan_undo(facts: dict, key: tuple[str, str]) -> Plan:
    role, _ = controller_line(*key)
    current = facts["file"]
    if not current.get("exists") or current.get("is_dir"):
        return Plan()
    new_text = blocks.set_marked_lines(current["text"], {}, lambda r: r == role)
    if new_text == current["text"]:
        return Plan()
    return Plan(["remove mnft's controller key line from ~/.ssh/authorized_keys" + (" (nothing else in it: file deleted)" if not new_text else "")],
                [blocks.rewrite_or_remove(AUTHORIZED_KEYS, new_text, current["sha256"])])


# ---------------------------------------------------------------------------------------------- remote


def read(ctx: Context, host: Host):
    results, failure = ctx.remote(host, [
        {"op": "env"},
        {"op": "stat", "paths": ["~", SSH_DIR, AUTHORIZED_KEYS]},
        {"op": "read", "path": AUTHORIZED_KEYS},
    ])
    if failure:
        return None, failure
    error = first_error(results)
    if error:
        return None, Outcome("failed", error=error)
    return {"env": results[0], "stats": results[1], "file": results[2]}, None


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, read, lambda facts: {n: plan_host(f, params["keys"][n]) for n, f in facts.items()}, root=False)


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, read, lambda facts: {n: plan_undo(f, params["keys"][n]) for n, f in facts.items()}, root=False)
