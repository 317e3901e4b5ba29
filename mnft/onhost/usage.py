"""The usage log: one line per lease that ended, per user, in the lease directory (mnft-usage-<uid>.jsonl, 0644,
rotated past USAGE_BYTES), written by whoever let go of the leases last: the lease script's `hold` or a run's
keeper, and read by the lease script's `usage` (usage). Standard library only.
"""

import json
import os
import stat
import time

from .procs import user_name

USAGE_PREFIX = "mnft-usage-"
USAGE_BYTES = 1 << 20
USAGE_FIELDS = ("run_id", "command", "session", "user", "controller", "image")


def usage_line(ended):
    """One line for the leases of one holder that ended now (their last holder's words in each file): who, what,
    which devices, from when to when, how long idle, how long it waited in line."""
    devices = [e for e in ended if isinstance(e.get("device"), dict)]
    if not ended:
        return None
    first, now = ended[0], time.time()
    line = dict((k, first.get(k)) for k in USAGE_FIELDS)
    idle = []
    for e in devices:
        since = e.get("idle_since")
        idle.append(float(e.get("idle_s") or 0) + (now - since if isinstance(since, (int, float)) else 0.0))
    line.update(host=os.uname()[1], login=user_name(os.getuid()), uid=os.getuid(), devices=[e["device"].get("index") for e in devices],
                start=first.get("taken"), end=now, idle_s=round(min(idle) if idle else 0.0, 1), queued=first.get("queued"))
    return line


def usage_path(directory, uid=None):
    return os.path.join(directory, "%s%d.jsonl" % (USAGE_PREFIX, os.getuid() if uid is None else uid))


def log_usage(line, directory):
    """Append the line to this user's usage log in `directory` (best effort: a lease's end is never failed by its log)."""
    if not line or not directory:
        return
    path = usage_path(directory)
    try:
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size > USAGE_BYTES:
                os.replace(path, path[:-6] + ".old.jsonl")
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            os.fchmod(fd, 0o644)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink == 1:
                os.write(fd, (json.dumps(line, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass
