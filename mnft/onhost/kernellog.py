"""The NVIDIA driver's Xid lines since boot, read wherever this user may read them: /dev/kmsg (root, or any user
where kernel.dmesg_restrict=0); else mnft's root-owned reader of Xid lines only, through sudo (installed by an
admin's `mnft setup --only kernel_log`); else the journal (`journalctl -k`, for members of the groups that may read
it: systemd-journal, adm); else why not, with the fix. Standard library only, Python 3.8 syntax.
"""

import os
import re
import shutil
import subprocess
import time

from .health import bus_key
from .procs import user_name
from .xidreader import KMSG, MAX_BYTES, XID_MARK, kmsg_records, parse_records

KMSG_VAR = "MNFT_KERNEL_LOG"  # another kernel log than /dev/kmsg (a saved one; tests)
READER = "/usr/local/libexec/mnft-kernel-xids"  # where `mnft setup`'s kernel_log step installs xidreader
READER_VAR = "MNFT_XID_READER"  # another place of the reader (tests)
SETUP_FIX = "an admin's `mnft setup --only kernel_log` lets every user read the driver's Xid lines (nothing else of the log)"
READ_TIMEOUT = 10.0
JOURNAL_LINES = 50000  # the kernel's last lines this boot: far more than a boot's Xids, bounded
DENIED = ("insufficient permissions", "not seeing messages from other users", "No journal files were")


def _run(argv, seconds=None):
    """(exit status, stdout, stderr) of a command within `seconds` (killed past it: exit None), stdout at most
    MAX_BYTES; None when it cannot be started."""
    seconds = READ_TIMEOUT if seconds is None else seconds
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError:
        return None
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        try:
            proc.kill()  # sudo's front end may not be ours to signal: then its pipes are closed and it is left
            proc.communicate(timeout=1.0)
        except (OSError, subprocess.TimeoutExpired):
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        return None, "", "did not answer in %g s" % seconds
    return proc.returncode, out[:MAX_BYTES].decode("utf-8", "replace"), err[:4096].decode("utf-8", "replace")


def _through_reader(reader):
    """([(usec, message)], None) from mnft's reader through `sudo -n`, or (None, why it did not run)."""
    sudo = shutil.which("sudo")
    if sudo is None:
        return None, "sudo is not installed"
    done = _run([sudo, "-n", reader])
    if done is None:
        return None, "sudo could not be started"
    code, out, err = done
    if code != 0:
        return None, " ".join((err or out).split())[:200] or "exit %s" % code
    return [(usec, message) for usec, message, _ in parse_records(out)], None


def _through_journal():
    """([(usec, message)], None) of the kernel's lines this boot in the journal, or (None, why not)."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        return None, "no journalctl"
    done = _run([journalctl, "-k", "-b", "0", "--no-pager", "-o", "short-monotonic", "-n", str(JOURNAL_LINES)])
    if done is None:
        return None, "journalctl could not be started"
    code, out, err = done
    if code != 0 or any(word in err for word in DENIED):
        return None, " ".join(err.split())[:200] or "exit %s" % code
    records = []
    for line in out.splitlines():
        match = re.match(r"\[\s*(\d+)\.(\d{6})\]\s+\S+\s+kernel:\s(.*)", line)  # "[    5.250000] h1 kernel: MESSAGE"
        if match:
            records.append((int(match.group(1)) * 1000000 + int(match.group(2)), match.group(3)))
    return records, None


KEEP_S = 5.0  # a look's answer, kept for the looks that follow within these seconds (a wait in line looks every second)
_kept = {}


def read_log():
    """([(usec since boot, message)], None), or ([], why not readable: the one line every reader shows, with the
    fix). The first of /dev/kmsg, mnft's reader, the journal that answers; a look through sudo or the journal is
    kept KEEP_S seconds (no sudo nor journal read every second while a run waits in line)."""
    path = os.environ.get(KMSG_VAR) or KMSG
    try:
        return [(usec, message) for usec, message, _ in kmsg_records(path)], None
    except OSError as exc:
        if exc.errno not in (1, 13):  # EPERM (kernel.dmesg_restrict=1), EACCES
            return [], "the kernel log (%s): %s" % (path, exc.strerror)
    reader = os.environ.get(READER_VAR) or READER
    key = (path, reader)
    kept = _kept.get(key)
    if kept is not None and time.monotonic() - kept[0] < KEEP_S:
        return kept[1]
    answer = _not_kmsg(path, reader)
    _kept[key] = (time.monotonic(), answer)
    return answer


def _not_kmsg(path, reader):
    user = user_name(os.geteuid())
    failed = None
    if os.path.isfile(reader):
        records, failed = _through_reader(reader)
        if records is not None:
            return records, None
    records, _ = _through_journal()  # a member of the journal's groups whom the reader's rule leaves out
    if records is not None:
        return records, None
    if failed is not None:
        return [], "mnft's reader of Xid lines (%s) did not run for %s: %s; an admin re-runs `mnft setup --only kernel_log`" % (reader, user, failed)
    return [], ("the kernel log (%s) is not readable by %s (kernel.dmesg_restrict=1): Xid errors are not seen; %s, "
                "or add %s to the systemd-journal group" % (path, user, SETUP_FIX, user))


def read_xids():
    """({bus key: [{"xid", "at" (wall time), "text"}]}, why not readable or None) of every Xid line since boot."""
    records, why = read_log()
    try:
        with open("/proc/uptime") as fh:
            booted = time.time() - float(fh.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        booted = 0.0
    found = {}
    pattern = re.compile(re.escape(XID_MARK) + r"([0-9A-Fa-f:.]+)\): (\d+),?\s*(.*)")
    for usec, message in records:
        match = pattern.match(message)  # the driver's line begins so: one that only holds the words is not an Xid
        if match:
            found.setdefault(bus_key(match.group(1)), []).append(
                {"xid": int(match.group(2)), "at": round(booted + usec / 1e6, 3), "text": match.group(3)[:200]})
    return found, why
