"""The lease files of a host, as mnft makes and reads them: the lease directory (shared_dir, lease_dir), a file
opened only as mnft makes it (open_shared) or refused in one line (Refused, refusal), who holds a flock on one
(lockers), a lease's holder read and written, whether a lease is free (_free), and the critical section's lock (the
mutex). The lease model and these files' rules: mnft.onhost.leasehost's docstring. Standard library only, Python 3.8
syntax.
"""

import errno
import fcntl
import json
import os
import stat
import time

from .procs import user_name
from .runs import run_processes

LEASE_DIR_VAR = "MNFT_LEASE_DIR"
SHARED_DIRS = ("/run/lock", "/tmp")  # the first that is a sticky world-writable directory of root's; else the last
LEASE_NAME, MUTEX_NAME = "mnft-lease.json", "mnft-lease.lock"
LEASE_MODE, MUTEX_MODE = 0o666, 0o644
MUTEX_WAIT = 10.0  # seconds to wait for another controller's critical section (it lasts milliseconds)
MAX_LEASE_BYTES = 65536


class Refused(Exception):
    """A lease or lock file mnft must not use (a link, not a regular file, another user's file it may not open,
    not a lease) or a lock held too long: the message names the path, its owner and what to do."""


def shared_dir(path, stat_of=os.stat):
    """Whether path is a directory every user may create files in and nobody may remove another's (sticky,
    world-writable, root's: /tmp as it should be)."""
    try:
        st = stat_of(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o1002 == 0o1002


def lease_dir(environ=None, stat_of=os.stat):
    """$MNFT_LEASE_DIR, else the first of SHARED_DIRS that is shared (shared_dir), else the last."""
    chosen = (os.environ if environ is None else environ).get(LEASE_DIR_VAR)
    if chosen:
        if not os.path.isabs(chosen):
            raise OSError("%s=%s: not an absolute path (it must name one directory for every user of the host)" % (LEASE_DIR_VAR, chosen))
        return chosen
    for candidate in SHARED_DIRS[:-1]:
        if shared_dir(candidate, stat_of):
            return candidate
    return SHARED_DIRS[-1]


def lease_path():
    return os.path.join(lease_dir(), LEASE_NAME)


def mutex_path():
    return os.path.join(lease_dir(), MUTEX_NAME)


def _owner(path, st=None):
    try:
        return user_name((st or os.lstat(path)).st_uid)
    except OSError:
        return "?"


KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
         (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symbolic link"))


def refusal(path, st, problem=None):
    """The one line for a file mnft will not use (st: its lstat or fstat; problem: what is wrong, else told from st)."""
    owner = _owner(path, st)
    tail = ""
    if problem is None:
        kind = next((name for test, name in KINDS if test(st.st_mode)), None)
        if kind == "a symbolic link":
            problem = "is a symbolic link, never followed by mnft"
        elif kind:
            problem = "is %s, not a lease file" % kind
        else:
            problem = "has %d hard links: it may be another file's name, and mnft writes only a file of its own" % st.st_nlink
            tail = " (the file it links to stays)"
    remove = "remove it (as root)" if owner in ("root", "?") else "remove it (as %s or root)" % owner
    return "%s %s (owner %s): %s when no mnft runs on this host%s" % (path, problem, owner, remove, tail)


def open_shared(path, write, mode):
    """A descriptor on the lease or lock file as mnft makes it (see mnft.onhost.leasehost's docstring), created if missing."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    for _ in range(10):
        try:
            fd = os.open(path, flags)  # never O_CREAT on an existing file: fs.protected_regular refuses it for root too
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                continue  # another user made it just now: open theirs
            except FileNotFoundError:
                raise OSError("the lease directory %s does not exist" % os.path.dirname(path))
            os.fchmod(fd, mode)  # past the umask: every user of the host can use it
        except OSError as exc:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # gone meanwhile: try again
            except OSError:
                raise exc from None  # the directory itself (not searchable, say): as the open said
            if exc.errno in (errno.EACCES, errno.EPERM):
                how = "writable" if write else "readable"
                raise Refused(refusal(path, st, "is not %s by %s (mode %04o; mnft makes it %04o)" % (
                    how, user_name(os.geteuid()), stat.S_IMODE(st.st_mode), mode)))
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) or not stat.S_ISREG(st.st_mode):
                raise Refused(refusal(path, st))
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            if st.st_nlink == 0:
                continue  # removed between open and fstat
            raise Refused(refusal(path, st))
        return fd
    raise OSError("%s keeps appearing and vanishing: something on this host removes it" % path)


def _same_file(fd, path):
    """Whether path still names the file fd is open on (nobody removed or replaced it meanwhile)."""
    try:
        now, ours = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)


def lockers(fd):
    """'user pid N' of each process /proc/locks names as holding a flock on fd's file (its pid as taken)."""
    st = os.fstat(fd)
    key = "%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    found = []
    try:
        with open("/proc/locks") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key and parts[4].isdigit():
            try:
                uid = int(os.stat("/proc/%s" % parts[4]).st_uid)
                found.append("%s pid %s" % (user_name(uid), parts[4]))
            except OSError:
                pass
    return found


def _text(holder, key):
    value = (holder or {}).get(key)
    return value if isinstance(value, str) else None


def _read(fd):
    """The holder a lease file names (None: empty, or not a lease)."""
    try:
        data = os.pread(fd, MAX_LEASE_BYTES, 0)
        holder = json.loads(data.decode("utf-8")) if data.strip(b" \t\r\n\0") else None
    except (OSError, ValueError, RecursionError):  # anyone may write it: "[[[[…" too
        return None
    return holder if isinstance(holder, dict) else None


def _check_lease(fd, path):
    """Refused unless the file is a lease, empty or mnft's JSON: never write over anything else."""
    st = os.fstat(fd)
    data = os.pread(fd, MAX_LEASE_BYTES + 1, 0)
    if st.st_size > MAX_LEASE_BYTES or data.strip(b" \t\r\n\0") and _read(fd) is None:
        raise Refused(refusal(path, st, "holds %d bytes that are not an mnft lease" % st.st_size))


def _write(fd, holder):
    data = json.dumps(holder, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def update_in_place(fd, changes):
    """The lease's holder with `changes`, written over the old bytes and padded with spaces, never truncated first:
    a reader never finds it empty (no lock needed: the keeper's idle marks and a run's progress are written so).
    Whether it was written (not a lease, or an I/O error: not)."""
    try:
        old = os.pread(fd, MAX_LEASE_BYTES, 0)
        holder = json.loads(old.decode("utf-8"))
        if not isinstance(holder, dict) or holder.get("released"):
            return False
        holder.update(changes)
        data = json.dumps(holder, sort_keys=True).encode()
        os.pwrite(fd, data + b" " * max(0, len(old) - len(data)), 0)
        return True
    except (OSError, ValueError, RecursionError):
        return False


def _lock_mutex():
    """The critical section's lock, taken (its descriptor); Refused if held past MUTEX_WAIT."""
    path = mutex_path()
    deadline = time.time() + MUTEX_WAIT
    while True:
        mutex = open_shared(path, False, MUTEX_MODE)
        while True:
            try:
                fcntl.flock(mutex, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    who = ", ".join(lockers(mutex)) or "a process /proc/locks does not show"
                    os.close(mutex)
                    raise Refused("the lease's lock %s has been held for over %gs by %s: another mnft is stuck there, or a "
                                  "user holds it; wait, or ask its user" % (path, MUTEX_WAIT, who))
                time.sleep(0.05)
        if _same_file(mutex, path):
            return mutex
        os.close(mutex)  # removed or replaced while we waited: lock the one that is there now
        if time.time() > deadline:  # a user who keeps replacing it: the same bound as a user who holds it
            raise Refused("the lease's lock %s keeps being replaced: a user of this host is at it; ask them" % path)


def _free(fd, previous, op=None):
    """Whether nobody holds the lease (an exclusive flock granted at once, and no process of its run alive).
    On True the caller holds the exclusive flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    if previous and previous.get("op") != op and run_processes(_text(previous, "run_id")):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def _login():
    uid = os.getuid()
    return {"login": user_name(uid), "uid": uid}


def _existing(name):
    """A read-only descriptor on an existing lease file of the lease directory, never created, never through a
    link (None: there is none, or it is not a file mnft would use: whoever planted it holds nothing by it)."""
    try:
        fd = os.open(os.path.join(lease_dir(), name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        return None
    return fd


def _failure(exc):
    """The reply for a lease that could not be taken or read: refused (a file mnft will not use) or an error."""
    try:
        path = lease_path()
    except OSError:
        path = None
    if isinstance(exc, Refused):
        return {"refused": str(exc), "path": path}
    return {"error": str(exc), "path": path}
