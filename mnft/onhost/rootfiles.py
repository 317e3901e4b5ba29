"""What an admin wrote on a host: a file only root can have written, and the durations it holds (the lab's policy,
the admins' group), read alike by the lease script, a run's keeper and the controller. Standard library only.
"""

import os
import re
import stat

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
ROOT_TEXT_BYTES = 65536


def root_text(path, limit=ROOT_TEXT_BYTES):
    """The text of a file only root can have written (root's, a regular file, not writable by group or others,
    not reached through a link), at most `limit` bytes of it, or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


def parse_duration(text):
    """`2h`, `90m`, `1h30m`, `45s`, `90` (seconds) -> seconds (> 0), else None (mnft.core.durations' forms)."""
    value = str(text).strip().strip("\"'").lower()
    if not value or not re.fullmatch(r"(\d+(\.\d+)?[smhd])+|\d+(\.\d+)?", value):
        return None
    total = sum(float(n) * DURATION_UNITS[u or "s"] for n, _, u in re.findall(r"(\d+(\.\d+)?)([smhd]?)", value))
    return total if total > 0 else None
