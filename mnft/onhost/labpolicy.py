"""The lab's rules on this host, set by its admin (lab_policy): read alike by the lease script (the line's limits) and
a run's keeper (idle_stop). Standard library only, Python 3.8 syntax.

Never in a user's inventory, which any user writes: the first of LAB_FILES and mnft-lab.yaml in the lease directory
that only root can have written (root's, a regular file, not writable by group or others, not reached through a
link: rootfiles.root_text), flat `key: value` lines, `#` comments:

    idle_stop: 2h                      every run and session whose GPUs have all been idle that long ends (a user's
                                       --idle-stop may lower it, never raise it)
    max_gpus_while_others_wait: 4      a user holding this many GPUs here waits behind every other user's run in line
    max_waiting: 3                     the most runs one user may have waiting in this host's line

A value that does not read is ignored and said (`problem`), the others still count.
"""

import os

from .leasefiles import lease_dir
from .rootfiles import parse_duration, root_text

LAB_FILES = ("/etc/mnft/lab.yaml",)
LAB_NAME = "mnft-lab.yaml"
COUNTS = ("max_gpus_while_others_wait", "max_waiting")  # whole numbers >= 1
MAX_COUNT = 1 << 20


def policy_paths():
    """Where the lab's rules are looked for: /etc/mnft/lab.yaml, then mnft-lab.yaml in the lease directory (none
    there where $MNFT_LEASE_DIR is not absolute: the lease script takes no lease there either)."""
    try:
        where = lease_dir()
    except OSError:
        return LAB_FILES
    return LAB_FILES + (os.path.join(where, LAB_NAME),)


def whole_number(text):
    """`3` -> 3; anything but a whole number from 1 up -> None."""
    value = str(text).strip().strip("\"'")
    return int(value) if value.isdigit() and 1 <= int(value) <= MAX_COUNT else None


def lab_policy(paths=None):
    """The lab's rules on this host: {"path": the file, "idle_stop": seconds, "max_gpus_while_others_wait": N,
    "max_waiting": N, "problem": the values it ignores}, each key only when set; {} without such a file."""
    for path in policy_paths() if paths is None else paths:
        text = root_text(path)
        if text is None:
            continue
        values = {}
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if ":" in line:
                key, value = line.split(":", 1)
                values[key.strip()] = value.strip()
        out, problems = {"path": path}, []
        if values.get("idle_stop"):
            seconds = parse_duration(values["idle_stop"])
            if seconds:
                out["idle_stop"] = seconds
            else:
                problems.append("%s: idle_stop %r is not a duration (2h, 90m …) and is ignored" % (path, values["idle_stop"][:40]))
        for key in COUNTS:
            if values.get(key):
                number = whole_number(values[key])
                if number:
                    out[key] = number
                else:
                    problems.append("%s: %s %r is not a whole number from 1 up and is ignored" % (path, key, values[key][:40]))
        if problems:
            out["problem"] = "; ".join(problems)
        return out
    return {}
