"""A run's leases on this host (mnft.onhost.agent). Standard library only.

The keeper holds the run's leases (mnft.onhost.leasehost: its devices and workdir, named in the spec's "leases";
else the host's) when they name its run: the agent opens and share-locks them and hands them to the keeper, so they
stay the run's to its end. The keeper that lets go of them last writes their usage line.
"""

import json
import os
import time

from . import leasefiles
from .usage import log_usage, usage_line


def lease_path(environ=None, stat_of=os.stat):
    """The host's lease file, as the lease script names it (leasefiles.lease_dir): None where $MNFT_LEASE_DIR is not
    absolute (the lease script refused to take a lease there: there is none to hold)."""
    try:
        return os.path.join(leasefiles.lease_dir(environ, stat_of), leasefiles.LEASE_NAME)
    except OSError:
        return None


def lease_fds(run_id, paths=None):
    """The run's leases on this host (the files the controller took: its devices and workdir; else the host's),
    each opened and share-locked for the keeper when it names this run: a run holds them to its end, detached or
    not, so nobody takes its devices or changes its workdir under it."""
    found = []
    for path in paths or [lease_path()]:
        fd = lease_fd(run_id, path)
        if fd is not None:
            found.append(fd)
    return found


def lease_fd(run_id, path=None):
    """A lease file (default the host's), opened and share-locked for the keeper, when it names this run (any
    attempt of it)."""
    import fcntl
    import stat

    try:
        path = path or lease_path()
        if path is None:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)  # anyone may plant it
    except OSError:
        return None
    try:
        holder = json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "{}") if stat.S_ISREG(os.fstat(fd).st_mode) else None
        named = holder.get("run_id") if isinstance(holder, dict) else None
        ours = isinstance(named, str) and named and (run_id == named or run_id.startswith(named + "-a"))
        if ours:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
    except (OSError, ValueError, RecursionError):
        pass
    os.close(fd)
    return None


def relock(fds):
    """The keeper's own flocks on the run's leases (fds: the descriptors the agent passed, "5,6"): each file opened
    anew and share-locked by the keeper before the agent's descriptor is let go, so that /proc/locks names the
    keeper, a live process of the run's user, as the holder (a lock keeps the pid of the process that took it, and
    the agent exits). Returns the keeper's descriptors."""
    import fcntl

    held = []
    for word in fds.split(","):
        if not word.isdigit():
            continue
        fd = int(word)
        try:
            mine = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            if (os.fstat(mine).st_dev, os.fstat(mine).st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                fcntl.flock(mine, fcntl.LOCK_SH)
                held.append(mine)
                os.close(fd)
            else:
                os.close(mine)
        except OSError:
            pass  # kept as the agent passed it
    return held


# The usage line of a lease whose last holder is the keeper (a detached run, a session whose controller is gone):
# the same line, in the same file, as the lease script's `hold` writes (mnft.onhost.usage's usage_line and log_usage,
# shared by both).


def last_out(run_id, paths):
    """The leases of the run nobody else holds any more (the keeper let go last): each marked released, as
    leases.release marks it; returns what each named."""
    import fcntl

    ended = []
    for path in paths or []:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder = leasefiles._read(fd)  # the lease script's reader and writer: one form of a lease file
            named = holder.get("run_id") if holder else None
            if isinstance(named, str) and named and (run_id == named or run_id.startswith(named + "-a")) and not holder.get("released"):
                holder["released"] = time.time()
                leasefiles._write(fd, holder)
                ended.append(holder)
        except OSError:
            pass
        finally:
            os.close(fd)
    return ended


def keeper_usage(spec):
    """The keeper let go of the run's leases: if nobody else holds them, their usage line is its to write."""
    paths = spec.get("leases") or []
    ended = last_out(spec.get("run_id") or "", paths)
    if ended and paths:
        log_usage(usage_line(ended), os.path.dirname(paths[0]))
