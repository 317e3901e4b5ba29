"""`mnft lab --usage`'s host side: every user's usage log in the lease directory read, its owner believed, not its
words (mnft.onhost.usage writes the lines). Standard library only.
"""

import json
import os
import time

from .leasefiles import _existing, lease_dir
from .procs import user_name
from .usage import USAGE_BYTES, USAGE_FIELDS, USAGE_PREFIX

# ------------------------------------------------------------------------------------------------ usage
# Every lease that ends leaves one line in its user's usage log in the lease directory, mnft-usage-<uid>.jsonl: a
# file of that user's (0644, created O_EXCL, never through a link), so no other user can erase or forge its lines
# without root, and its owner is who the lines are counted for (`usage` believes the file's owner, not its words).
# Bounded: past USAGE_BYTES it becomes mnft-usage-<uid>.old.jsonl (the one before is dropped) and a new one begins.
# The run's keeper writes the same line when it is the last to let go (usage.log_usage, the same function).

MAX_USAGE_LINES = 50000


def usage(since):
    """Every user's usage lines of leases that ended at or after `since`, each counted for its file's owner, and the
    GPU leases held now (`running`)."""
    out, dropped = [], 0
    try:
        names = sorted(n for n in os.listdir(lease_dir()) if n.startswith(USAGE_PREFIX) and n.endswith(".jsonl"))
    except OSError:
        names = []
    for name in names[:256]:
        uid_text = name[len(USAGE_PREFIX):].split(".")[0]
        fd = _existing(name)
        if fd is None or not uid_text.isdigit():
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != int(uid_text):
                continue  # planted under another user's name: not believed
            data = os.pread(fd, 2 * USAGE_BYTES, 0).decode("utf-8", "replace")
        finally:
            os.close(fd)
        for text in data.splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if not isinstance(line, dict) or not isinstance(line.get("end"), (int, float)) or line["end"] < since:
                continue
            line["uid"], line["login"] = st.st_uid, user_name(st.st_uid)
            if len(out) < MAX_USAGE_LINES:
                out.append(line)
            else:
                dropped += 1
    now = time.time()
    return {"host": os.uname()[1], "now": now, "lines": out + running(now), "dropped": dropped}


def running(now):
    """The GPU leases held now (runs and sessions still on their devices), one line per holder as its usage line
    will read when it ends, to now, marked "running": counted for the user the kernel says holds the lock (the
    lease file's words are anyone's), never twice (a keeper and a hold both lock it)."""
    from .leases import DEVICE_PREFIX, held_leases

    found = {}
    for name, holder, who in held_leases(prefixes=(DEVICE_PREFIX,)):
        device = holder.get("device") if isinstance(holder, dict) else None
        index = device.get("index") if isinstance(device, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not who:
            continue  # a CPU host's one device is no GPU-hour
        login = str(who[0]).split(" pid ")[0]
        line = found.setdefault(holder.get("op") or name, dict(
            [(k, holder.get(k)) for k in USAGE_FIELDS], host=os.uname()[1], login=login, devices=[], start=holder.get("taken"),
            end=now, queued=holder.get("queued"), running=True, idle=[]))
        since = holder.get("idle_since")
        line["idle"].append(float(holder.get("idle_s") or 0) + (now - since if isinstance(since, (int, float)) else 0.0))
        line["devices"].append(index)
    for line in found.values():
        idle = line.pop("idle")
        line["idle_s"] = round(min(idle) if idle else 0.0, 1)
    return list(found.values())
