"""`mnft lab --usage`'s host side: every user's usage log in the lease directory read, its owner believed, not its
words (mnft.onhost.usage writes the lines). Standard library only.
"""

import json
import os
import time

from .leasefiles import _existing, lease_dir
from .procs import user_name
from .usage import USAGE_BYTES, USAGE_PREFIX

# ------------------------------------------------------------------------------------------------ usage
# Every lease that ends leaves one line in its user's usage log in the lease directory, mnft-usage-<uid>.jsonl: a
# file of that user's (0644, created O_EXCL, never through a link), so no other user can erase or forge its lines
# without root, and its owner is who the lines are counted for (`usage` believes the file's owner, not its words).
# Bounded: past USAGE_BYTES it becomes mnft-usage-<uid>.old.jsonl (the one before is dropped) and a new one begins.
# The run's keeper writes the same line when it is the last to let go (usage.log_usage, the same function).

MAX_USAGE_LINES = 50000


def usage(since):
    """Every user's usage lines of leases that ended at or after `since`, each counted for its file's owner."""
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
    return {"host": os.uname()[1], "now": time.time(), "lines": out, "dropped": dropped}
