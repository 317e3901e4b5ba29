#!/usr/bin/env python3
"""mnft host lease, the host side: one operation per host at a time. Standard library only, Python 3.8 syntax;
shipped to hosts with mnft.hosts.pyrun (mnft.hosts.leases is the controller's side).

    hold    read the holder (one JSON line) from stdin; take the lease, or say who holds it; then keep it until
            stdin closes (the controller released it, or its SSH channel is gone) or no line came for the
            holder's "deadman" seconds (a controller that vanished without closing its connection)
    show    who holds the lease now, if anyone

The lease is the file $MNFT_HOME/lease.json of the login user on the host (default ~/.mnft/lease.json). What it
holds names the last holder: its operation id, command (train, sync, provision, setup), run id, the controller's
host, user and pid, and when it started. It is *held* while a process holds a flock on it: the `hold` process the
controller started (it lives as long as the controller's channel), and a run's keeper (mnft.run.agent opens it
for the keeper, so a detached run holds its host to its end). A lease nobody holds a flock on, and whose run (if
any) has no process left carrying its run id, is free: its holder is gone, and it is taken over (the reply says
from whom, unless that holder released it).

Taking is one critical section under lease.lock (flock): an exclusive flock on lease.json is tried without
waiting (granted: nobody holds it), the new holder is written and a shared flock kept. Releasing, under
lease.lock too, marks the lease released only if nobody else holds it (a detached run's keeper may).
"""

import fcntl
import json
import os
import select
import sys
import time

RUN_ID_VAR = "MNFT_RUN_ID"  # as mnft.run.agent sets it on every process of a run (an attempt's is <run id>-a<k>)
MUTEX_WAIT = 10.0  # seconds to wait for another controller's critical section (it lasts milliseconds)
MAX_LEASE_BYTES = 65536


def state_dir():
    """mnft's directory on this host for this user: $MNFT_HOME, else ~/.mnft (as on a controller)."""
    return os.environ.get("MNFT_HOME") or os.path.join(os.path.expanduser("~"), ".mnft")


def lease_path():
    return os.path.join(state_dir(), "lease.json")


def _read(fd):
    """The holder a lease file names (None: empty or not JSON)."""
    try:
        data = os.pread(fd, MAX_LEASE_BYTES, 0)
        holder = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _write(fd, holder):
    data = json.dumps(holder, sort_keys=True).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def run_processes(run_id):
    """Live processes whose environment carries the run's id (any attempt of it): readable as root or the user."""
    if not run_id:
        return []
    exact = (RUN_ID_VAR + "=" + run_id).encode()
    attempt = exact + b"-a"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        env = _environ(int(name))
        if any(e == exact or e.startswith(attempt) and e[len(attempt):].isdigit() for e in env) and not _zombie(int(name)):
            found.append(int(name))
    return found


def _lock_mutex():
    directory = state_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    mutex = os.open(os.path.join(directory, "lease.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.time() + MUTEX_WAIT
    while True:
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return mutex
        except BlockingIOError:
            if time.time() > deadline:
                os.close(mutex)
                raise OSError("%s is locked by another mnft for more than %gs" % (os.path.join(directory, "lease.lock"), MUTEX_WAIT))
            time.sleep(0.05)


def _open_lease():
    return os.open(lease_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)


def _free(fd, previous, op=None):
    """Whether nobody holds the lease (an exclusive flock granted at once, and no process of its run alive).
    On True the caller holds the exclusive flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    if previous and previous.get("op") != op and run_processes(previous.get("run_id")):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def take(holder):
    """(reply, fd): the lease taken (fd keeps its shared flock) or who holds it (fd None)."""
    mutex = _lock_mutex()
    try:
        fd = _open_lease()
        previous = _read(fd)
        if not _free(fd, previous, holder.get("op")):
            if previous and previous.get("op") == holder.get("op"):  # the same operation through another name
                fcntl.flock(fd, fcntl.LOCK_SH)
                return {"taken": True, "shared": True, "path": lease_path()}, fd
            os.close(fd)
            alive = run_processes((previous or {}).get("run_id"))
            return {"busy": True, "holder": previous, "run_processes": len(alive), "path": lease_path()}, None
        took_over = previous if previous and not previous.get("released") else None
        _write(fd, dict(holder, taken=time.time()))
        fcntl.flock(fd, fcntl.LOCK_SH)  # others may share it (a run's keeper), nobody may take it
        return {"taken": True, "took_over": took_over, "path": lease_path()}, fd
    finally:
        os.close(mutex)


def release(fd, holder):
    """Let go of the lease; marked released only if nobody else holds it (a detached run's keeper may)."""
    try:
        mutex = _lock_mutex()
    except OSError:
        os.close(fd)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            current = _read(fd)
            if current and current.get("op") == holder.get("op"):
                _write(fd, dict(current, released=time.time()))
        except BlockingIOError:
            pass
        os.close(fd)
    finally:
        os.close(mutex)


def show():
    """Who holds the lease now: {"held": bool, "holder": {...} or None, "path": ...}."""
    path = lease_path()
    if not os.path.exists(path):
        return {"held": False, "holder": None, "path": path}
    mutex = _lock_mutex()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            holder = _read(fd)
            free = _free(fd, holder)
            return {"held": not free, "holder": holder, "path": path}
        finally:
            os.close(fd)
    finally:
        os.close(mutex)


def hold():
    line = sys.stdin.buffer.readline(MAX_LEASE_BYTES)  # the holder; then the raw stream: heartbeats, EOF
    if not line.endswith(b"\n"):
        return 2
    holder = json.loads(line.decode("utf-8"))
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    try:
        reply, fd = take(holder)
    except OSError as exc:
        print(json.dumps({"error": str(exc), "path": lease_path()}), flush=True)
        return 1
    print(json.dumps(reply), flush=True)
    if fd is None:
        return 0
    deadman = float(holder.get("deadman") or 25)
    last = time.time()
    try:
        while time.time() - last < deadman:
            ready, _, _ = select.select([stdin], [], [], 1.0)
            if ready:
                data = os.read(stdin.fileno(), 4096)
                if not data or b"release" in data:
                    break
                last = time.time()
    finally:
        release(fd, holder)
    return 0


def main(argv):
    mode = argv[0] if argv else ""
    if mode == "hold":
        return hold()
    if mode == "show":
        try:
            print(json.dumps(show()))
        except OSError as exc:
            print(json.dumps({"error": str(exc), "path": lease_path()}))
        return 0
    sys.stderr.write(__doc__)
    return 2


def source():
    """This script's text: given by mnft.hosts.pyrun's bootstrap when shipped, else read from the file."""
    shipped = globals().get("__source__")
    if shipped:
        return shipped.decode()
    with open(__file__) as fh:
        return fh.read()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
