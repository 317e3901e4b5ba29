#!/usr/bin/env python3
"""mnft host lease, the host side: one operation per host at a time, whoever logs in. Standard library only,
Python 3.8 syntax; shipped to hosts with mnft.hosts.pyrun (mnft.hosts.leases is the controller's side).

    hold    read the holder (one JSON line) from stdin; take the lease, or say who holds it; then keep it until
            stdin closes (the controller released it, or its SSH channel is gone) or no line came for the
            holder's "deadman" seconds (a controller that vanished without closing its connection). While it
            holds the lease it also runs the operation's own host scripts: `run N` and N bytes of JSON
            (source, argv, stdin) on stdin runs that standard-library script in a forked child (no new SSH
            session, no new interpreter) and answers one line, {"ran": exit status, "out": its stdout}.
            A holder with a "scope" ({"gpus": G or null for all, "workdir": path}) takes devices and a workdir
            instead of the host (see "devices" below); with "wait" it waits in the host's line for them, a
            {"waiting": …} line each time its place or what holds the devices changes, until they are taken
    show    who holds the host's lease now, if anyone
    lab     the host for `mnft lab`: its lease, every device and who holds or uses it, workdirs held, the line
    rundirs RUN   the run directories of the keepers that hold RUN's leases (root's stop of another user's run)

The lease is machine-wide: one file for every login user of the host, mnft-lease.json in the lease directory:
$MNFT_LEASE_DIR if set (an absolute path, the same for every user: tests, or a lab that wants it elsewhere),
else /run/lock when it is a sticky, world-writable directory of root's (Debian, Ubuntu: a tmpfs, never aged),
else /tmp (Fedora, RHEL, whose /run/lock is root's alone). What it holds names the last holder: its operation
id, command (train, sync, provision, setup), run id, the controller's host, user and pid, when it started, and
the login user on this host (login, uid) that took it. It is *held* while a process holds a flock on it: the
`hold` process the controller started (it lives as long as the controller's channel), and a run's keeper
(mnft.run.agent opens it for the keeper, so a detached run holds its host to its end). A lease nobody holds a
flock on, and whose run (if any) has no process left carrying its run id, is free: its holder is gone, and it is
taken over (the reply says from whom, unless that holder released it). The run's processes are seen only when
this user may read their environment (its own, or every one as root): between two login users the flock is
what tells, and a keeper holds it to its run's end.

Taking is one critical section under mnft-lease.lock (flock): an exclusive flock on the lease is tried without
waiting (granted: nobody holds it), the new holder is written and a shared flock kept. Releasing, under the lock
too, marks the lease released only if nobody else holds it (a detached run's keeper may).

Both files live where any user may plant anything, and root writes there, so a file is used only as mnft makes
it: an existing one is opened without O_CREAT (fs.protected_regular refuses that for another user's file in a
sticky directory) and never through a link (O_NOFOLLOW); a new one is created with O_EXCL and given its mode
past the umask (lease 0666: every user writes the holder it takes it as; lock 0644: a flock needs only a
read-only descriptor). What is opened must be a regular file with one link (a hard link planted to /etc/shadow
is never truncated), and the lease is written only over a lease (empty or mnft's JSON). Anything else is
refused with one line naming the path, its owner and what to do (`Refused`).
"""

import errno
import fcntl
import io
import itertools
import json
import os
import pwd
import select
import signal
import stat
import sys
import time

# hashlib, shutil and subprocess are imported where a take of devices needs them: a hold of the host's lease alone
# (setup, provision, every sync's tree hash) does not pay their ~15 ms of start-up on every host

RUN_ID_VAR = "MNFT_RUN_ID"  # as mnft.run.agent sets it on every process of a run (an attempt's is <run id>-a<k>)
LEASE_DIR_VAR = "MNFT_LEASE_DIR"
SHARED_DIRS = ("/run/lock", "/tmp")  # the first that is a sticky world-writable directory of root's; else the last
LEASE_NAME, MUTEX_NAME = "mnft-lease.json", "mnft-lease.lock"
LEASE_MODE, MUTEX_MODE = 0o666, 0o644
MUTEX_WAIT = 10.0  # seconds to wait for another controller's critical section (it lasts milliseconds)
MAX_LEASE_BYTES = 65536
MAX_RUN_BYTES = 64 << 20  # a run request: a script, its arguments and its stdin
MAX_OUT_BYTES = 1 << 30  # what a run may print (a tree hash lists every file)


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


def user_name(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "uid %d" % uid


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
    """A descriptor on the lease or lock file as mnft makes it (see the module docstring), created if missing."""
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
    """Live processes whose environment carries the run's id (any attempt of it). Only the environments this user
    may read are seen: its own processes, or every one as root; another login's run is told by its flock. Inside
    one take (or look) /proc is read once for every run id asked (_RUNS)."""
    if not run_id or not isinstance(run_id, str):
        return []
    runs = _RUNS if _RUNS is not None else _scan_runs()
    found = []
    for value, pids in runs.items():
        if value == run_id or value.startswith(run_id + "-a") and value[len(run_id) + 2:].isdigit():
            found += pids
    return sorted(found)


_RUNS = None  # run id (as in the environment) -> live pids, while one take or look lasts


def _scan_runs():
    """MNFT_RUN_ID value -> pids, of every live process whose environment this user may read."""
    key = (RUN_ID_VAR + "=").encode()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        for entry in _environ(int(name)):
            if entry.startswith(key):
                if not _zombie(int(name)):
                    out.setdefault(entry[len(key):].decode("utf-8", "replace"), []).append(int(name))
                break
    return out


class _one_look(object):
    """Within the block, /proc is read once for the processes of every run (a take weighs several leases)."""

    def __enter__(self):
        global _RUNS
        _RUNS = _scan_runs()

    def __exit__(self, *exc):
        global _RUNS
        _RUNS = None


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


# ------------------------------------------------------------------------------------------------ devices
# A run takes devices, not the host: each device (a GPU by its nvidia-smi index; on a host without nvidia-smi the
# host's CPUs as one device, "cpu") has a lease file of its own, mnft-dev-<key>.json, and the run's workdir one,
# mnft-work-<hash of its path>.json, both taken, held and let go exactly as the host's (same files rules, same
# flocks, same critical section). The host's lease is for operations that change the whole host (setup,
# provision): taken only while no device or workdir lease is held, and while it is held no device is taken.

DEVICE_PREFIX, WORK_PREFIX, TICKET_PREFIX = "mnft-dev-", "mnft-work-", "mnft-wait-"
SMI_QUERY = "index,uuid,name,memory.total,memory.used,utilization.gpu"
SMI_APPS = "gpu_uuid,pid,used_memory"
SMI_TIMEOUT = 5.0  # nvidia-smi can hang on a wedged driver
MAX_SMI_BYTES = 1 << 20
MAX_COMBINATIONS = 20000  # device sets weighed for their links; beyond, the lowest free indices
WAIT_POLL = 1.0  # seconds between two looks of a waiting run at its host's devices


def device_key(device):
    return "cpu" if device.get("index") is None else "gpu%d" % device["index"]


def device_name(device):
    return DEVICE_PREFIX + device_key(device) + ".json"


def work_name(workdir):
    """The workdir's lease file: one per directory of the host, whoever syncs or runs there."""
    import hashlib

    path = os.path.abspath(os.path.expanduser(workdir))
    return WORK_PREFIX + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16] + ".json"


def _number(text):
    text = text.strip().split(" ")[0]
    try:
        return int(float(text))
    except ValueError:
        return None


def parse_devices(text):
    """nvidia-smi --query-gpu=SMI_QUERY --format=csv,noheader,nounits: one dict per device."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or _number(parts[0]) is None:
            continue
        found.append({"index": _number(parts[0]), "uuid": parts[1], "name": ", ".join(parts[2:-3]), "memory_total_mib": _number(parts[-3]),
                      "memory_used_mib": _number(parts[-2]), "utilization": _number(parts[-1]), "processes": []})
    return found


def parse_apps(text):
    """nvidia-smi --query-compute-apps=SMI_APPS: (uuid, pid, used MiB) per compute process."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and _number(parts[1]) is not None:
            found.append((parts[0], _number(parts[1]), _number(parts[2])))
    return found


LINKS = (("NV", 100), ("PIX", 50), ("PXB", 40), ("PHB", 30), ("NODE", 20), ("SYS", 10))


def link_score(word):
    """How fast a link of `nvidia-smi topo -m` is, higher faster: NV<n> (n bonded NVLinks) > PIX > PXB > PHB > NODE > SYS."""
    word = word.strip()
    if word.startswith("NV") and word[2:].isdigit():
        return 100 + int(word[2:])
    return dict(LINKS[1:]).get(word, 0)


def parse_topology(text):
    """{(i, j): score} for every pair of GPUs `nvidia-smi topo -m` prints a link for."""
    links, columns = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("\t")]
        if columns is None:
            if any(c.startswith("GPU") for c in cells):
                columns = [int(c[3:]) if c.startswith("GPU") and c[3:].isdigit() else None for c in cells]
            continue
        if not cells or not cells[0].startswith("GPU") or not cells[0][3:].isdigit():
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row = int(cells[0][3:])
        for column, cell in zip(columns[1:], cells[1:]):
            if column is not None and column != row:
                links[(row, column)] = link_score(cell)
    return links


def pick(free, want, links):
    """The `want` devices of `free` (indices) whose slowest link between two of them is fastest (then the fastest
    links in all, then the lowest indices): two GPUs of one NVLink pair rather than two across sockets. None when
    fewer are free."""
    free = sorted(free)
    if want > len(free):
        return None
    if want <= 1 or want == len(free) or not links:
        return free[:want]
    best = None
    for n, combo in enumerate(itertools.combinations(free, want)):
        if n >= MAX_COMBINATIONS:
            break
        scores = [links.get((a, b), links.get((b, a), 0)) for a, b in itertools.combinations(combo, 2)]
        key = (min(scores), sum(scores))
        if best is None or key > best[0]:
            best = (key, list(combo))
    return best[1]


def _spawn_smi(argv):
    import subprocess

    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _smi_output(proc, deadline):
    import subprocess

    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise StalledRead(stalled_line("nvidia-smi", SMI_TIMEOUT))
    text = out[:MAX_SMI_BYTES].decode("utf-8", "replace")
    if proc.returncode != 0 and not (proc.returncode == LOST_EXIT and LOST_MARK in text):  # a lost GPU: the others answered
        raise OSError("nvidia-smi exited %d" % proc.returncode)
    return text


IDLE_MIB = 0  # memory.used of a GPU no process uses: a compute process's CUDA context alone takes tens of MiB or more


def may_have_processes(devices):
    """Whether `nvidia-smi --query-compute-apps` may list anything, from the devices just read: some GPU in service
    reports memory in use (above IDLE_MIB), or no memory figure, or runs MIG (its slices' use is theirs). False only
    when every answering GPU says 0 MiB used: no process has a context on any of them, so the question is not asked
    (a lost GPU is not asked about either way: nvidia-smi cannot reach it)."""
    for d in devices:
        h = d.get("health") or {}
        if h.get("lost"):
            continue
        used = d.get("memory_used_mib")
        if not isinstance(used, int) or isinstance(used, bool) or used > IDLE_MIB or h.get("mig"):
            return True
    return False


def _process_owner(pid):
    try:
        return user_name(os.stat("/proc/%d" % pid).st_uid)
    except OSError:
        return None


def read_devices(topology=False, live=True):
    """(devices, links): the host's GPUs (index, uuid, name, bus id, memory, utilisation, their health: see "GPU
    health" below, and the compute processes on each: pid, user, MiB), and their links when asked; ([{"index":
    None, "name": "cpu"}], {}) on a host without nvidia-smi (its CPUs are one device). OSError when the GPUs do
    not answer (StalledRead: not within SMI_TIMEOUT).

    Through NVML where the driver's library is there (no process at all), else nvidia-smi: the devices and their
    health, then the compute processes only when some GPU may have one (may_have_processes: on a host whose GPUs
    are all idle, one nvidia-smi instead of two). The links (`nvidia-smi topo -m`) do not change
    while the machine is up: kept per boot and nvidia-smi in the user's cache (load_static, save_static) by a take
    (live=False), which asks them the first time."""
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [{"index": None, "uuid": None, "name": "cpu", "processes": []}], {}
    fmt = "--format=csv,noheader,nounits"
    cached = load_static(exe) if topology or not live else None
    devices, how = None, "nvidia-smi"
    if os.environ.get("MNFT_NVML", "1") != "0":
        try:
            devices, how = read_nvml(), "nvml"
        except StalledRead:
            raise
        except (OSError, AttributeError):
            devices = None  # no libnvidia-ml here, or one that fails: nvidia-smi answers
    topo = (topology or not live) and cached is None  # a take asks the links too, to cache them
    deadline = time.time() + SMI_TIMEOUT
    procs = [_spawn_smi([exe, "topo", "-m"])] if topo else []
    apps = topo_text = ""
    try:
        if devices is None:
            devices = smi_gpus(exe)
            if may_have_processes(devices):  # the compute processes, within what is left of the same bound
                procs.append(_spawn_smi([exe, "--query-compute-apps=" + SMI_APPS, fmt]))
                apps = _smi_output(procs[-1], deadline)
        if topo:
            topo_text = _smi_output(procs[0], deadline)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if how == "nvml":
        for d in devices:
            d["processes"] = [{"pid": pid, "user": _process_owner(pid), "used_mib": mib} for pid, mib in d.get("processes") or []]
    else:
        by_uuid = dict((d["uuid"], d) for d in devices if d.get("uuid"))
        for uuid, pid, mib in parse_apps(apps):
            if uuid in by_uuid:
                by_uuid[uuid]["processes"].append({"pid": pid, "user": _process_owner(pid), "used_mib": mib})
    if cached is not None:
        links = dict(((a, b), score) for a, b, score in cached["links"])
    else:
        links = parse_topology(topo_text) if (topology or not live) else {}
        if not live or topology:
            save_static(exe, [d for d in devices if d.get("uuid")], links)
    xids, why = read_xids()
    for d in devices:
        d["read"] = how
    devices = add_health(devices, xids, why, remember_seen(devices))
    return devices, (links if topology else {})


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return "".join(c for c in fh.read(64) if c.isalnum() or c == "-")
    except OSError:
        return None


def static_path(exe):
    """This user's cache of the GPUs for this boot and this nvidia-smi (a driver installed since is another)."""
    try:
        st = os.stat(exe)
    except OSError:
        return None
    import hashlib

    key = "%s %s %d %d" % (boot_id(), os.path.realpath(exe), st.st_ino, st.st_mtime_ns)
    return os.path.expanduser("~/.cache/mnft/gpus-%s.json" % hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16])


def load_static(exe):
    """This boot's GPUs and links, as this user's cache holds them (None: not cached, or not this boot's)."""
    path = static_path(exe) if boot_id() is not None else None
    if path is None:
        return None
    try:
        with open(path) as fh:
            data = json.loads(fh.read(MAX_LEASE_BYTES))
        devices = [dict((k, d[k]) for k in ("index", "uuid", "name", "memory_total_mib")) for d in data["devices"]]
        links = [(int(a), int(b), int(score)) for a, b, score in data["links"]]
        return {"devices": devices, "links": links} if devices else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_static(exe, devices, links):
    """Keep what does not change until the next boot (best effort: a home that cannot be written keeps nothing)."""
    path = static_path(exe) if boot_id() is not None else None
    if path is None or not devices:
        return
    save_private(path, {"devices": [dict((k, d.get(k)) for k in ("index", "uuid", "name", "memory_total_mib")) for d in devices],
                        "links": [[a, b, score] for (a, b), score in sorted(links.items())]})


def save_private(path, data):
    """A JSON cache of this user's (0600 in a 0700 directory), written whole (another name, then renamed), never
    through a link; best effort: one that cannot be written only costs time."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = "%s.%d" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


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


def _held_by(name, op=None):
    """(held, holder, lockers) of a lease file without keeping anything: held when somebody holds its flock (or its
    run's processes live), unless `op` holds it (this operation, through another name for the machine)."""
    fd = _existing(name)
    if fd is None:
        return False, None, []
    try:
        holder = _read(fd)
        if _free(fd, holder):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False, holder, []
        return not (op and holder and holder.get("op") == op), holder, lockers(fd)
    finally:
        os.close(fd)


def held_leases(prefixes=(DEVICE_PREFIX, WORK_PREFIX), op=None):
    """[(file name, holder, lockers)] of every device and workdir lease held now (whole-host operations wait for none)."""
    try:
        names = sorted(n for n in os.listdir(lease_dir()) if n.startswith(prefixes) and n.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        held, holder, who = _held_by(name, op)
        if held:
            found.append((name, holder, who))
    return found


def tickets(skip=None):
    """The line of waiting runs on this host, first come first: [(order, holder)] of every ticket whose waiter
    still holds its flock (a ticket left by a waiter that is gone is no one's place in line)."""
    try:
        names = [n for n in os.listdir(lease_dir()) if n.startswith(TICKET_PREFIX) and n.endswith(".json") and n != skip]
    except OSError:
        return []
    line = []
    for name in names:
        fd = _existing(name)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            continue  # nobody waits on it
        except BlockingIOError:
            holder = _read(fd) or {}
        finally:
            os.close(fd)
        line.append((order(holder), holder))
    return sorted(line, key=lambda item: item[0])


def order(holder):
    """A waiting run's place: when its controller queued it (the same on every host of the run), then its ticket."""
    queued = holder.get("queued")
    return (queued if isinstance(queued, (int, float)) and not isinstance(queued, bool) else float("inf"), str(holder.get("ticket") or ""))


def device_states(devices, op=None):
    """Each device with its lease's state: "free", "held" (holder, lockers: what /proc/locks says), "outside" (free
    of leases but a compute process uses it: someone ran a program by hand), "drained" (an admin took it out of
    service: its mark in "drain") or "unhealthy" (its health breaks runs: why in "broken"). Drained and unhealthy
    devices are never taken; a held one stays held (its run goes on), its drain mark and health shown beside."""
    marks, _ = drain_marks()
    out = []
    for device in devices:
        state = dict(device)
        held, holder, who = _held_by(device_name(device), op)
        mark, why = drain_of(marks, device), broken(device)
        if mark:
            state["drain"] = mark
        if why:
            state["broken"] = why
        if held:
            state.update(state="held", holder=holder, lockers=who)
        elif device.get("processes"):
            state.update(state="outside")
        elif mark:
            state.update(state="drained")
        elif why:
            state.update(state="unhealthy")
        else:
            state.update(state="free")
        out.append(state)
    return out


def _take_file(name, holder, extra=None):
    """Take one lease file (the caller holds the critical section and knows it is free): (fd with a shared flock,
    the holder it named before, unless released), or (None, its holder) when it is held after all."""
    path = os.path.join(lease_dir(), name)
    fd = open_shared(path, True, LEASE_MODE)
    try:
        previous = _read(fd)
        if not _free(fd, previous, holder.get("op")):
            os.close(fd)
            return None, previous
        _check_lease(fd, path)
    except BaseException:
        os.close(fd)
        raise
    _write(fd, dict(holder, taken=time.time(), **dict(_login(), **(extra or {}))))
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd, (previous if previous and not previous.get("released") else None)


def take_devices(holder, devices, links):
    """Take what a run (or a sync: no devices) asks of this host, all or nothing: ({"taken": True, "devices": [the
    ones taken], "paths": [every lease file held]}, fds) or ({"busy": True, ...why}, [])."""
    scope = holder.get("scope") or {}
    want = scope.get("gpus")  # None: every device (a run without --gpus); 0: none (a sync)
    host_held, host_holder, _ = _held_by(LEASE_NAME)
    if host_held:
        same = isinstance(host_holder, dict) and host_holder.get("uid") == os.getuid()
        return {"busy": True, "what": "host", "holder": host_holder, "same_login": same}, []
    workdir = scope.get("workdir")
    if workdir:
        held, previous, who = _held_by(work_name(workdir), holder.get("op"))
        if held:
            return {"busy": True, "what": "workdir", "workdir": workdir, "holder": previous, "lockers": who,
                    "run_processes": len(run_processes(_text(previous, "run_id")))}, []
    chosen = []
    if want != 0:
        mine = order(holder) if holder.get("ticket") else (float("inf"), "")
        ahead = [h for o, h in tickets(ticket_name(holder) if holder.get("ticket") else None) if o < mine]
        states = device_states(devices, holder.get("op"))
        free = [s for s in states if s["state"] == "free"]
        out = [s for s in states if s["state"] in ("drained", "unhealthy")]
        if want is None and out or want is not None and len(states) - len(out) < want and devices and devices[0].get("index") is not None:
            # never to be had by waiting: a device out of service (drained, or its health breaks runs)
            return {"busy": True, "what": "unavailable", "want": want, "devices": states, "count": len(states)}, []
        if want is None:
            picked = [s["index"] for s in states] if len(free) == len(states) else None
        elif devices and devices[0].get("index") is None:
            return {"busy": True, "what": "no-gpus", "want": want}, []
        else:
            picked = pick([s["index"] for s in free], want, links)
        if picked is None or ahead:
            return {"busy": True, "what": "devices", "want": want, "devices": states, "ahead": ahead, "count": len(states)}, []
        chosen = [s for s in states if s["index"] in picked]
    fds, took_over, paths = [], [], []
    try:
        names = [(device_name(s), {"device": {"index": s["index"], "uuid": s.get("uuid"), "name": s.get("name")}}) for s in chosen]
        if workdir:
            names.append((work_name(workdir), {"workdir": workdir}))
        for name, extra in names:
            fd, previous = _take_file(name, holder, extra)
            if fd is None:  # held after all (a keeper sharing it without the critical section): let go of the rest
                for other in fds:
                    os.close(other)
                return {"busy": True, "what": "devices", "want": want, "devices": device_states(devices, holder.get("op")), "ahead": []}, []
            fds.append(fd)
            paths.append(os.path.join(lease_dir(), name))
            if previous:
                took_over.append(previous)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    taken = [{"index": s["index"], "uuid": s.get("uuid"), "name": s.get("name")} for s in chosen]
    return {"taken": True, "devices": taken, "count": len(devices), "paths": paths, "took_over": took_over[0] if took_over else None}, fds


def ticket_name(holder):
    ticket = "".join(c for c in str(holder.get("ticket") or "") if c.isalnum())[:32]
    return TICKET_PREFIX + ticket + ".json"


def make_ticket(holder):
    """This run's place in the host's line: a ticket file it holds an exclusive flock on while it waits."""
    path = os.path.join(lease_dir(), ticket_name(holder))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.fchmod(fd, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _write(fd, dict(holder, **_login()))
    return fd, path


def take(holder, devices=None, links=None):
    """(reply, fds): the lease taken (each fd keeps its shared flock) or who holds it (no fds). A holder with a
    "scope" takes devices and a workdir (take_devices, with the devices read before); without one, the host."""
    mutex = _lock_mutex()
    try:
        with _one_look():
            if holder.get("scope") is not None:
                return take_devices(holder, devices or [], links or {})
            return _take_host(holder)
    finally:
        os.close(mutex)


def _take_host(holder):
    path = lease_path()
    fd = open_shared(path, True, LEASE_MODE)
    try:
        previous = _read(fd)
        if not _free(fd, previous, holder.get("op")):
            if previous and previous.get("op") == holder.get("op"):  # the same operation through another name
                fcntl.flock(fd, fcntl.LOCK_SH)
                return {"taken": True, "shared": True, "path": path, "paths": [path]}, [fd]
            os.close(fd)
            alive = run_processes(_text(previous, "run_id"))
            same = isinstance(previous, dict) and previous.get("uid") == os.getuid()
            return {"busy": True, "holder": previous, "run_processes": len(alive), "same_login": same, "path": path}, []
        runs = held_leases(op=holder.get("op"))
        if runs:  # a run holds devices (or a sync a workdir) here: the whole host is not to be changed under it
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return {"busy": True, "what": "runs", "held": [dict(h or {}, file=n, lockers=w) for n, h, w in runs], "path": path}, []
        _check_lease(fd, path)
    except BaseException:
        os.close(fd)
        raise
    took_over = previous if previous and not previous.get("released") else None
    _write(fd, dict(holder, taken=time.time(), **_login()))
    fcntl.flock(fd, fcntl.LOCK_SH)  # others may share it (a run's keeper), nobody may take it
    return {"taken": True, "took_over": took_over, "path": path, "paths": [path]}, [fd]


def release(fd, holder):
    """Let go of the lease; marked released only if nobody else holds it (a detached run's keeper may)."""
    try:
        mutex = _lock_mutex()
    except (OSError, Refused):
        os.close(fd)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            current = _read(fd)
            if current and current.get("op") == holder.get("op"):
                _write(fd, dict(current, released=time.time()))
                os.close(fd)
                return current  # the last holder let go: the lease ended (its usage line is this one's to write)
        except BlockingIOError:
            pass
        os.close(fd)
    finally:
        os.close(mutex)
    return None


def show():
    """Who holds the lease now: {"held": bool, "holder": {...} or None, "path": ...}."""
    path = lease_path()
    if not os.path.lexists(path):
        return {"held": False, "holder": None, "path": path}
    mutex = _lock_mutex()
    try:
        fd = open_shared(path, False, LEASE_MODE)
        try:
            holder = _read(fd)
            free = _free(fd, holder)
            return {"held": not free, "holder": holder, "path": path}
        finally:
            os.close(fd)
    finally:
        os.close(mutex)


def lab():
    """The host as `mnft lab` shows it: the host's lease, each device with its state (free, held by whom as the
    lease names it and as /proc/locks proves it, in use outside mnft), the workdirs held and the line of waiting
    runs."""
    out = {"host": os.uname()[1], "now": time.time()}
    try:
        devices, _ = read_devices()
    except OSError as exc:
        devices, out["devices_error"] = [], str(exc)
    out.update(show())
    mutex = _lock_mutex()
    try:
        if out.get("held"):
            fd = _existing(LEASE_NAME)
            if fd is not None:
                out["lockers"] = lockers(fd)
                os.close(fd)
        with _one_look():
            out["devices"] = device_states(devices)
            out["drain"], problem = drain_marks()
            if problem:
                out["drain_problem"] = problem
            out["workdirs"] = [dict(h or {}, lockers=w) for n, h, w in held_leases((WORK_PREFIX,))]
            out["line"] = [h for _, h in tickets()]
            for device in out["devices"]:
                if device.get("state") == "held" and device.get("processes"):
                    device["collisions"] = collisions(device)
    finally:
        os.close(mutex)
    return out


# ------------------------------------------------------------------------------------------------ collisions
# A compute process on a GPU that a run or session holds, and that is not of that run (someone ignored
# CUDA_VISIBLE_DEVICES), is a collision. The same judgment (`foreign`, a copy in mnft.run.agent: each host script
# is one file; tests hold the two to the same answers) serves `mnft lab` here and the holder's keeper there.

MAX_ANCESTORS = 64


def process_facts(pid):
    """What tells whose a process is: its MNFT_RUN_ID ("run", "" when it has none) where its environment is
    readable ("readable": its own user's, or root's look), and its ancestors' pids (/proc/<pid>/stat, readable by
    every user)."""
    facts = {"pid": pid, "readable": False, "run": None, "ancestors": []}
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            entries = fh.read().split(b"\0")
        key = (RUN_ID_VAR + "=").encode()
        facts["readable"] = True
        facts["run"] = next((e[len(key):].decode("utf-8", "replace") for e in entries if e.startswith(key)), "")
    except OSError:
        pass
    current = pid
    for _ in range(MAX_ANCESTORS):
        try:
            with open("/proc/%d/stat" % current) as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        if parent <= 1:
            break
        facts["ancestors"].append(parent)
        current = parent
    return facts


def foreign(facts, run_id, keepers, in_image=False):
    """Whether a compute process on a held GPU is not of the holder's run: True (a collision), False (the run's),
    None (cannot be told). Its environment, where readable, decides: the run's tag (MNFT_RUN_ID, any attempt of it)
    or not. Else its descent: a process below one of the lease's lockers (the run's keeper, the controller's
    hold) is the run's. A process neither readable nor below them is another's, except beside a run in a container
    image, whose processes a container engine starts outside the keeper's tree: then it cannot be told."""
    if facts.get("readable") and run_id:
        tag = facts.get("run") or ""
        ours = tag == run_id or tag.startswith(run_id + "-a") and tag[len(run_id) + 2:].isdigit()
        return not ours
    if set(facts.get("ancestors") or []) & set(keepers) or facts.get("pid") in set(keepers):
        return False
    return None if in_image else True


def locker_pids(who):
    """The pids of lockers' "user pid N" words."""
    out = []
    for word in who or []:
        tail = str(word).rpartition(" pid ")[2]
        if tail.isdigit():
            out.append(int(tail))
    return out


def collisions(device, facts_of=process_facts):
    """The processes on a held device that are not of its holder's run: [{"pid", "user", "used_mib"}]."""
    holder = device.get("holder") or {}
    run_id = holder.get("run_id") if isinstance(holder.get("run_id"), str) else None
    keepers = locker_pids(device.get("lockers"))
    found = []
    for proc in device.get("processes") or []:
        pid = proc.get("pid")
        if isinstance(pid, int) and foreign(facts_of(pid), run_id, keepers, bool(holder.get("image"))):
            found.append(dict(proc))
    return found


def run_dirs(run_id):
    """The run directories of the keepers holding the run's leases here (a keeper works in its run directory):
    those processes are the run's (their environment carries its id), found through /proc/locks, not by name."""
    found = []
    for name, holder, who in held_leases((DEVICE_PREFIX, WORK_PREFIX, LEASE_NAME[:-5])):
        named = _text(holder, "run_id")
        if not named or not (run_id == named or run_id.startswith(named + "-a")):
            continue
        for locker in who:
            pid = int(locker.rsplit(" ", 1)[1])
            if not any(e.startswith((RUN_ID_VAR + "=" + named).encode()) for e in _environ(pid)):
                continue
            try:
                cwd = os.readlink("/proc/%d/cwd" % pid)
            except OSError:
                continue
            if os.path.isfile(os.path.join(cwd, "spec.json")) and cwd not in found:
                found.append(cwd)
    return found


def _failure(exc):
    """The reply for a lease that could not be taken or read: refused (a file mnft will not use) or an error."""
    try:
        path = lease_path()
    except OSError:
        path = None
    if isinstance(exc, Refused):
        return {"refused": str(exc), "path": path}
    return {"error": str(exc), "path": path}


def _take_now(holder):
    """take, with the devices read first (outside the critical section: nvidia-smi may take a second)."""
    scope = holder.get("scope")
    if scope is None or scope.get("gpus") == 0:
        return take(holder)
    devices, links = read_devices(topology=scope.get("gpus") is not None, live=False)
    return take(holder, devices, links)


def _brief(holder):
    holder = holder if isinstance(holder, dict) else {}
    return dict((k, holder.get(k)) for k in ("command", "run_id", "user", "login", "controller", "pid", "started", "taken", "queued", "want"))


def waiting_reply(reply):
    """What a waiting run is told of its place: its position in the host's line, the runs ahead, and what holds the
    devices now (only what changes the picture: a new line is printed when it does)."""
    devices = [dict(index=d.get("index"), state=d.get("state"), holder=_brief(d.get("holder")), processes=d.get("processes") or [])
               for d in reply.get("devices") or [] if d.get("state") != "free"]
    return {"waiting": True, "what": reply.get("what"), "position": len(reply.get("ahead") or []) + 1,
            "ahead": [_brief(h) for h in reply.get("ahead") or []], "devices": devices, "holder": _brief(reply.get("holder")),
            "want": reply.get("want"), "count": reply.get("count")}


def wait_in_line(holder, stdin, reply):
    """Wait for the devices in the host's line (a ticket held while waiting, first come first served): (reply, fds)
    once taken, (None, []) when the controller let go or went silent (the ticket goes with the wait)."""
    ticket, path = make_ticket(holder)
    deadman = float(holder.get("deadman") or 25)
    last = time.time()
    said = None
    try:
        while True:
            now = waiting_reply(reply)
            if now != said:
                print(json.dumps(now), flush=True)
                said = now
            look = time.time() + WAIT_POLL
            while time.time() < look:
                ready, _, _ = select.select([stdin], [], [], max(0.0, look - time.time()))
                if ready:
                    data = os.read(stdin.fileno(), 1 << 16)
                    if not data or b"release" in data:
                        return None, []
                    last = time.time()
                if time.time() - last > deadman:
                    return None, []
            reply, fds = _take_now(holder)
            if fds or not reply.get("busy") or reply.get("what") not in ("devices", "workdir", "host"):
                return reply, fds
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(ticket)


def hold():
    line = sys.stdin.buffer.readline(MAX_LEASE_BYTES)  # the holder; then the raw stream: heartbeats, EOF
    if not line.endswith(b"\n"):
        return 2
    holder = json.loads(line.decode("utf-8"))
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    try:
        reply, fds = _take_now(holder)
        if reply.get("busy") and holder.get("wait") and reply.get("what") in ("devices", "workdir", "host"):
            reply, fds = wait_in_line(holder, stdin, reply)
            if reply is None:
                return 0
    except (OSError, Refused) as exc:
        print(json.dumps(_failure(exc)), flush=True)
        return 1
    print(json.dumps(reply), flush=True)
    if not fds:
        return 0
    deadman = float(holder.get("deadman") or 25)
    last = time.time()
    pending = b""
    child = None  # the run in progress: [pid, its stdout's read end, what it printed so far, bytes]
    try:
        while time.time() - last < deadman:
            ready, _, _ = select.select([stdin] + ([child[1]] if child else []), [], [], 1.0)
            if child and child[1] in ready:
                data = os.read(child[1], 1 << 16)
                child[2].append(data)
                child[3] += len(data)
                if not data or child[3] > MAX_OUT_BYTES:
                    _answer(child, data == b"")
                    child = None
            if stdin in ready:
                data = os.read(stdin.fileno(), 1 << 16)
                if not data:
                    break
                last = time.time()
                pending += data
                request, pending, stop = _next_request(pending)
                if stop:
                    break
                if request is not None:
                    child = _answer_now(request, fds) if child is None else _busy(child, request)
    finally:
        if child:  # released (or the controller is gone) mid-run: the run ends with the lease
            os.kill(child[0], signal.SIGKILL)
            os.waitpid(child[0], 0)
        ended = [release(fd, holder) for fd in fds]
        log_usage(usage_line([e for e in ended if e]))
    return 0


def _next_request(pending):
    """(the JSON of a complete `run N` request or None, what is left, whether to stop): heartbeats and other
    lines are consumed, `release` (or a malformed request) stops."""
    while b"\n" in pending:
        line, rest = pending.split(b"\n", 1)
        if line.startswith(b"run "):
            try:
                size = int(line[4:])
            except ValueError:
                return None, b"", True
            if not 0 < size <= MAX_RUN_BYTES:
                return None, b"", True
            if len(rest) < size:
                return None, pending, False  # the rest of the request is still on its way
            return rest[:size], rest[size:], False
        if line.strip() == b"release":
            return None, b"", True
        pending = rest
    return None, pending, False


def _answer_now(request, lease_fds):
    """Start the run (a forked child); a request that cannot start is answered at once."""
    try:
        return _spawn(json.loads(request.decode("utf-8")), lease_fds)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        print(json.dumps({"ran": 2, "out": "", "error": "the run request: %s" % exc}), flush=True)
        return None


def _busy(child, request):
    print(json.dumps({"ran": 2, "out": "", "error": "a run is in progress: one at a time"}), flush=True)
    return child


def _spawn(request, lease_fds):
    """Fork; the child runs the script as `python -c` would with sys.argv[1:] = argv and stdin = the given text
    (the lease's channel is not its stdin), its stdout to a pipe the holder reads. It does not keep the lease's
    descriptor: a run left behind by a killed holder never holds the lease."""
    source, argv, text = str(request["source"]), [str(a) for a in request["argv"]], str(request.get("stdin") or "")
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read_end)
            for fd in lease_fds:
                os.close(fd)
            os.dup2(write_end, 1)
            os.close(write_end)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="surrogateescape")
            sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode("utf-8", "surrogateescape")), encoding="utf-8")
            sys.argv = ["-c"] + argv
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                exec(compile(source, "mnft-script", "exec"), {"__name__": "__main__", "__source__": source.encode()})
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - its traceback on stderr, as python would print it
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
            finally:
                os._exit(code)
    os.close(write_end)
    return [pid, read_end, [], 0]


def _answer(child, complete):
    os.close(child[1])
    if not complete:
        os.kill(child[0], signal.SIGKILL)
    _, status = os.waitpid(child[0], 0)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    reply = {"ran": code, "out": b"".join(child[2]).decode("utf-8", "surrogateescape")}
    if not complete:
        reply["error"] = "printed more than %d bytes" % MAX_OUT_BYTES
    print(json.dumps(reply), flush=True)


# ------------------------------------------------------------------------------------------------ GPU health
# What a GPU server gets wrong, read once per look (mnft lab, a take of devices) and judged here, so that the host
# never leases a GPU that breaks runs and every reader (lab, check, the board, refusals) says the same:
#   the devices and their health from one `nvidia-smi --query-gpu=GPU_READ` (or NVML, where the host has the
#   driver's library: read_nvml), every read bounded by SMI_TIMEOUT and a hung one named (StalledRead);
#   a GPU fallen off the bus ("Unable to determine the device handle for GPU …", exit 15) kept in its place, lost;
#   a GPU seen earlier this boot and gone from the list (this user's record of the boot: seen_path);
#   Xid errors since boot from the kernel log (/dev/kmsg, where this user may read it: read_xids).
# Judged by health_problems (pure): "broken" (never leased: lost, gone, uncorrectable ECC since boot, a pending
# retirement or row remap, a failed remap, an Xid NVIDIA documents as needing a reset) or "warning" (throttled,
# persistence off, MIG on, an Xid of the application's kind, ECC errors of the GPU's past).

GPU_READ = ("index,uuid,pci.bus_id,memory.total,memory.used,utilization.gpu,persistence_mode,mig.mode.current,"
            "ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total,retired_pages.pending,"
            "remapped_rows.pending,remapped_rows.failure,clocks_throttle_reasons.hw_slowdown,"
            "clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.sw_thermal_slowdown,"
            "clocks_throttle_reasons.hw_power_brake_slowdown,name")
GPU_READ_BASIC = "index,uuid,pci.bus_id,memory.total,memory.used,utilization.gpu,name"  # a driver that lacks a field above
THROTTLES = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")
THROTTLE_NAMES = {"hw_slowdown": "HW slowdown", "hw_thermal_slowdown": "HW thermal slowdown",
                  "sw_thermal_slowdown": "SW thermal slowdown", "hw_power_brake_slowdown": "power brake"}
LOST_EXIT = 15  # nvidia-smi: "GPU has fallen off the bus or has otherwise become inaccessible"
LOST_MARK = "Unable to determine the device handle for"
KMSG, KMSG_VAR = "/dev/kmsg", "MNFT_KERNEL_LOG"  # the kernel log; $MNFT_KERNEL_LOG another (a saved one; tests)
MAX_KMSG_BYTES = 8 << 20
# Xids NVIDIA's catalogue says need the GPU reset (or the host rebooted); the rest are the application's or passing
RESET_XIDS = {48: "double-bit ECC error", 62: "internal micro-controller halt", 64: "row remapping failure",
              74: "NVLink error", 79: "fallen off the bus", 92: "high single-bit ECC error rate", 95: "uncontained ECC error",
              109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error"}
RESET_FIX = "drain it (mnft drain HOST:GPU --reason …) and reset it (nvidia-smi -r -i GPU, with nothing on it) or reboot the host"


class StalledRead(OSError):
    """A GPU read that did not answer within its bound: the message names what hung and its likely causes."""


def stalled_line(what, seconds):
    return "%s did not answer in %g s: is persistence mode off? a wedged driver?" % (what, seconds)


def bus_key(bus_id):
    """"00000000:3B:00.0" (nvidia-smi), "0000:3b:00" (the kernel's Xid line) -> "3b:00": the same GPU."""
    parts = str(bus_id or "").lower().split(".")[0].split(":")
    return ":".join(p.lstrip("0").rjust(2, "0") for p in parts[-2:]) if len(parts) >= 2 else None


def _value(text):
    """One cell of nvidia-smi's csv,nounits: an int, True/False for Enabled/Yes/Active, None for [N/A]."""
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported"):
        return None
    if text in ("Enabled", "Yes", "Active"):
        return True
    if text in ("Disabled", "No", "Not Active"):
        return False
    number = _number(text)
    return number if number is not None else text


def parse_gpu_read(text, query=GPU_READ):
    """nvidia-smi --query-gpu=GPU_READ --format=csv,noheader,nounits (stdout and stderr together): one dict per
    device in index order, a lost one ({"health": {"lost": its line}}) in its place."""
    fields = query.split(",")
    found = []
    for line in text.splitlines():
        if LOST_MARK in line:
            bus = line.split(LOST_MARK, 1)[1].strip()  # "GPU 0000:3B:00.0: Unknown Error" (or "GPU0000:…")
            bus = (bus[3:] if bus.lower().startswith("gpu") else bus).strip().split(" ")[0].rstrip(":")
            found.append({"index": None, "uuid": None, "name": None, "bus_id": bus, "processes": [], "health": {"lost": line.strip()[:300]}})
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(fields) or _number(parts[0]) is None:
            continue
        cells = dict(zip(fields[:-1], parts[:len(fields) - 1]))
        name = ", ".join(parts[len(fields) - 1:])
        health = {"persistence": _value(cells.get("persistence_mode", "")), "mig": _value(cells.get("mig.mode.current", "")),
                  "ecc_volatile": _value(cells.get("ecc.errors.uncorrected.volatile.total", "")),
                  "ecc_aggregate": _value(cells.get("ecc.errors.uncorrected.aggregate.total", "")),
                  "retired_pending": _value(cells.get("retired_pages.pending", "")),
                  "remap_pending": _value(cells.get("remapped_rows.pending", "")),
                  "remap_failed": _value(cells.get("remapped_rows.failure", "")),
                  "throttle": [t for t in THROTTLES if _value(cells.get("clocks_throttle_reasons." + t, "")) is True]}
        found.append({"index": _number(parts[0]), "uuid": parts[1], "name": name, "bus_id": parts[2],
                      "memory_total_mib": _number(parts[3]), "memory_used_mib": _number(parts[4]), "utilization": _number(parts[5]),
                      "processes": [], "health": dict((k, v) for k, v in health.items() if v is not None)})
    for position, device in enumerate(found):  # nvidia-smi lists by index: a lost device's index is its place
        if device["index"] is None:
            device["index"] = position
    return found


def run_bounded(argv, seconds=None, what="nvidia-smi"):
    """(exit status, stdout and stderr) of a command, StalledRead when it did not answer within `seconds` (it is
    killed with its process group)."""
    import subprocess

    seconds = SMI_TIMEOUT if seconds is None else seconds
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise StalledRead(stalled_line(what, seconds))
    return proc.returncode, out[:MAX_SMI_BYTES].decode("utf-8", "replace")


def smi_gpus(exe, seconds=None):
    """The devices and their health through nvidia-smi; OSError when it fails for another reason than a lost GPU."""
    code, out = run_bounded([exe, "--query-gpu=" + GPU_READ, "--format=csv,noheader,nounits"], seconds)
    query = GPU_READ
    if code == 2 and "is not a valid field" in out:  # an older driver: the devices without their health
        code, out = run_bounded([exe, "--query-gpu=" + GPU_READ_BASIC, "--format=csv,noheader,nounits"], seconds)
        query = GPU_READ_BASIC
    if code not in (0, LOST_EXIT) or code == LOST_EXIT and LOST_MARK not in out:
        raise OSError("nvidia-smi exited %d: %s" % (code, " ".join(out.split())[:300]))
    return parse_gpu_read(out, query)


def read_kmsg(path=None):
    """The kernel log's lines (its records' text, "usec;message"): ([(usec since boot, message)], None) or
    ([], why not readable). /dev/kmsg answers one record per read and EAGAIN at its end; a plain file (the test
    bed's stand-in) is read to its end."""
    path = path or os.environ.get(KMSG_VAR) or KMSG
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            return [], ("the kernel log (%s) is not readable by %s (kernel.dmesg_restrict=1?): Xid errors are not seen; "
                        "look as root, or sysctl kernel.dmesg_restrict=0" % (path, user_name(os.geteuid())))
        return [], "the kernel log (%s): %s" % (path, exc.strerror)
    chunks, size = [], 0
    try:
        while size < MAX_KMSG_BYTES:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while we read: go on from the next
                    continue
                if exc.errno == errno.EINVAL:
                    break
                raise
            if not data:
                break
            chunks.append(data if data.endswith(b"\n") else data + b"\n")
            size += len(data)
    finally:
        os.close(fd)
    records = []
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        head, sep, message = line.partition(";")
        fields = head.split(",")
        if sep and len(fields) >= 3 and fields[2].isdigit():
            records.append((int(fields[2]), message))
    return records, None


def read_xids(path=None):
    """({bus key: [{"xid", "at" (wall time), "text"}]}, why not readable or None) of every Xid line since boot."""
    import re

    records, why = read_kmsg(path)
    try:
        with open("/proc/uptime") as fh:
            booted = time.time() - float(fh.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        booted = 0.0
    found = {}
    pattern = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),?\s*(.*)")
    for usec, message in records:
        match = pattern.search(message)
        if match:
            found.setdefault(bus_key(match.group(1)), []).append(
                {"xid": int(match.group(2)), "at": round(booted + usec / 1e6, 3), "text": match.group(3)[:200]})
    return found, why


def seen_path():
    """This user's record of the GPUs the host had at its last look this boot (by UUID): a GPU gone since is seen."""
    boot = boot_id()
    return os.path.expanduser("~/.cache/mnft/gpus-seen-%s.json" % boot) if boot else None


def remember_seen(devices):
    """{uuid: device} of this boot's earlier looks, updated with this one's (best effort)."""
    path = seen_path()
    if path is None:
        return {}
    try:
        with open(path) as fh:
            seen = json.loads(fh.read(MAX_LEASE_BYTES))
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    before = dict(seen)
    for d in devices:
        if d.get("uuid"):
            seen[d["uuid"]] = {"index": d.get("index"), "bus_id": d.get("bus_id"), "name": d.get("name")}
    if seen != before:
        save_private(path, seen)
    return before


def add_health(devices, xids, kmsg_error=None, seen=None):
    """The devices of one read with what the host knows beside them: each GPU's Xids (by its bus), a lost GPU's
    UUID and name from this boot's earlier looks, and a GPU seen earlier this boot and missing now (gone)."""
    seen = seen or {}
    by_bus = dict((bus_key(v.get("bus_id")), (uuid, v)) for uuid, v in seen.items())
    for d in devices:
        health = d.setdefault("health", {})
        if health.get("lost") and not d.get("uuid") and bus_key(d.get("bus_id")) in by_bus:
            uuid, known = by_bus[bus_key(d.get("bus_id"))]
            d.update(uuid=uuid, name=known.get("name"))
        found = xids.get(bus_key(d.get("bus_id"))) or []
        if found:
            health["xids"] = found[-20:]
        if kmsg_error:
            health["kmsg"] = kmsg_error
    present = set(d.get("uuid") for d in devices)
    buses = set(bus_key(d.get("bus_id")) for d in devices)
    indices = set(d.get("index") for d in devices)
    for uuid, known in sorted(seen.items(), key=lambda item: str(item[1].get("index"))):
        if uuid in present or bus_key(known.get("bus_id")) in buses or known.get("index") in indices:
            continue
        devices.append({"index": known.get("index"), "uuid": uuid, "name": known.get("name"), "bus_id": known.get("bus_id"),
                        "processes": [], "health": {"gone": True}})
    devices.sort(key=lambda d: (d.get("index") is None, d.get("index") or 0))
    return devices


def read_health(exe, seconds=None):
    """The host's GPUs with their health, as one look reads them: NVML where the driver's library is there, else
    nvidia-smi; the kernel log's Xids; this boot's earlier looks. OSError (StalledRead) when the GPUs did not answer."""
    devices, how = None, "nvidia-smi"
    if os.environ.get("MNFT_NVML", "1") != "0":
        try:
            devices, how = read_nvml(seconds), "nvml"
        except StalledRead:
            raise
        except (OSError, AttributeError):
            devices = None  # no libnvidia-ml here, or an older one: nvidia-smi reads them
    if devices is None:
        if exe is None:
            raise OSError("no nvidia-smi")
        devices = smi_gpus(exe, seconds)
    xids, why = read_xids()
    seen = remember_seen(devices)
    for d in devices:
        d["read"] = how
    return add_health(devices, xids, why, seen)


def health_problems(device):
    """What is wrong with one GPU, judged from its health: [{"level": "broken"|"warning", "what", "fix"}]. A
    "broken" GPU is never leased (it breaks runs); a warning is said (lab, check) and the GPU still leased."""
    h = device.get("health") or {}
    out = []

    def say(level, what, fix):
        out.append({"level": level, "what": what, "fix": fix})

    if h.get("lost"):
        say("broken", "lost from the bus (%s)" % h["lost"], RESET_FIX)
    if h.get("gone"):
        say("broken", "gone: the host had it earlier this boot (%s), nvidia-smi no longer lists it" % (device.get("uuid") or "?"), RESET_FIX)
    volatile, aggregate = h.get("ecc_volatile"), h.get("ecc_aggregate")
    if isinstance(volatile, int) and volatile > 0:
        say("broken", "%d uncorrectable ECC error(s) since the driver loaded" % volatile, RESET_FIX)
    elif isinstance(aggregate, int) and aggregate > 0:
        say("warning", "%d uncorrectable ECC error(s) in its life (none since boot)" % aggregate,
            "watch it (nvidia-smi -q -d ECC); a count that grows: have it serviced")
    if h.get("remap_failed"):
        say("broken", "row remapping failed", "drain it and have it serviced (RMA): its memory cannot be repaired")
    if h.get("remap_pending") or h.get("retired_pending"):
        say("broken", "a %s is pending" % ("row remap" if h.get("remap_pending") else "page retirement"), RESET_FIX)
    reset = [x for x in h.get("xids") or [] if x.get("xid") in RESET_XIDS]
    if reset:
        x = reset[-1]
        say("broken", "Xid %d (%s) at %s" % (x["xid"], RESET_XIDS[x["xid"]], time.strftime("%H:%M:%S", time.localtime(x.get("at") or 0))), RESET_FIX)
    other = [x for x in h.get("xids") or [] if x.get("xid") not in RESET_XIDS]
    if other:
        say("warning", "Xid %s in the kernel log since boot" % ", ".join(sorted(set(str(x["xid"]) for x in other))),
            "usually the application's fault (a bad address, an illegal instruction): see dmesg; drain it if it recurs")
    if h.get("throttle"):
        say("warning", "clocks throttled (%s): the likely straggler of any gang it joins" % ", ".join(THROTTLE_NAMES.get(t, t) for t in h["throttle"]),
            "check its cooling and power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER)")
    if h.get("persistence") is False:
        say("warning", "persistence mode off: every CUDA or nvidia-smi start re-initialises the driver (seconds on NVSwitch servers)",
            "nvidia-smi -pm 1, or enable nvidia-persistenced")
    if h.get("mig"):
        say("warning", "MIG mode on: CUDA sees only the MIG instances, a run takes whole GPUs",
            "nvidia-smi -i GPU -mig 0 (and reset it) for whole-GPU runs")
    return out


def broken(device):
    """Why the GPU is never leased (its broken health problems' words, joined), or None."""
    words = [p["what"] for p in health_problems(device) if p["level"] == "broken"]
    return "; ".join(words) or None


# NVML, the driver's own library (libnvidia-ml.so.1), through ctypes: the same facts as nvidia-smi without a
# process per question. Every call runs in a thread the read waits for at most SMI_TIMEOUT: a wedged driver hangs
# that thread, not the look (StalledRead names it, and NVML is not asked again by this process).
NVML_LIB = "libnvidia-ml.so.1"
NVML_LOST, NVML_INSUFFICIENT = 15, 7
_NVML = {}


def read_nvml(seconds=None):
    """The devices, their health and compute processes through NVML; OSError when the library is not there (or
    fails), StalledRead when it does not answer."""
    import threading

    seconds = SMI_TIMEOUT if seconds is None else seconds
    if _NVML.get("hung"):
        raise StalledRead(stalled_line("NVML (%s)" % NVML_LIB, seconds))
    box = {}

    def work():
        try:
            box["devices"] = _nvml_devices()
        except BaseException as exc:  # noqa: BLE001 - given to the reader
            box["error"] = exc

    thread = threading.Thread(target=work, name="nvml")
    thread.daemon = True
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _NVML["hung"] = True
        raise StalledRead(stalled_line("NVML (%s)" % NVML_LIB, seconds))
    if "error" in box:
        raise box["error"]
    return box["devices"]


def _nvml():
    import ctypes

    lib = _NVML.get("lib")
    if lib is None:
        lib = ctypes.CDLL(NVML_LIB)  # OSError where the driver's library is not installed
        lib.nvmlErrorString.restype = ctypes.c_char_p
        code = lib.nvmlInit_v2()
        if code:
            raise OSError("NVML did not start: %s" % lib.nvmlErrorString(code).decode("utf-8", "replace"))
        _NVML["lib"] = lib
    return lib


def _nvml_devices():
    import ctypes

    lib = _nvml()
    uint, ull = ctypes.c_uint, ctypes.c_ulonglong

    class Memory(ctypes.Structure):
        _fields_ = [("total", ull), ("free", ull), ("used", ull)]

    class Utilization(ctypes.Structure):
        _fields_ = [("gpu", uint), ("memory", uint)]

    class Pci(ctypes.Structure):
        _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", uint), ("bus", uint), ("device", uint), ("pciDeviceId", uint),
                    ("pciSubSystemId", uint), ("busId", ctypes.c_char * 32)]

    def ask(name, *args):
        """The call's status: 0 answered; a function this driver lacks counts as not supported (3)."""
        function = getattr(lib, name, None)
        return 3 if function is None else function(*args)

    count = uint(0)
    code = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    if code:
        raise OSError("NVML: %s" % lib.nvmlErrorString(code).decode("utf-8", "replace"))
    devices = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        code = lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        if code:
            devices.append({"index": index, "uuid": None, "name": None, "bus_id": None, "processes": [],
                            "health": {"lost": "NVML: GPU %d: %s" % (index, lib.nvmlErrorString(code).decode("utf-8", "replace"))}})
            continue
        text = ctypes.create_string_buffer(96)
        device = {"index": index, "processes": []}
        device["uuid"] = text.value.decode() if ask("nvmlDeviceGetUUID", handle, text, 96) == 0 else None
        device["name"] = text.value.decode() if ask("nvmlDeviceGetName", handle, text, 96) == 0 else None
        pci = Pci()
        device["bus_id"] = pci.busId.decode() if ask("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci)) == 0 else None
        memory = Memory()
        if ask("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory)) == 0:
            device.update(memory_total_mib=int(memory.total >> 20), memory_used_mib=int(memory.used >> 20))
        util = Utilization()
        device["utilization"] = int(util.gpu) if ask("nvmlDeviceGetUtilizationRates", handle, ctypes.byref(util)) == 0 else None
        health = {}
        a, b, c, d = uint(0), uint(0), uint(0), uint(0)
        if ask("nvmlDeviceGetPersistenceMode", handle, ctypes.byref(a)) == 0:
            health["persistence"] = a.value == 1
        if ask("nvmlDeviceGetMigMode", handle, ctypes.byref(a), ctypes.byref(b)) == 0:
            health["mig"] = a.value == 1
        for key, counter in (("ecc_volatile", 0), ("ecc_aggregate", 1)):
            value = ull(0)
            if ask("nvmlDeviceGetTotalEccErrors", handle, 1, counter, ctypes.byref(value)) == 0:  # uncorrected
                health[key] = int(value.value)
        if ask("nvmlDeviceGetRetiredPagesPendingStatus", handle, ctypes.byref(a)) == 0:
            health["retired_pending"] = a.value == 1
        if ask("nvmlDeviceGetRemappedRows", handle, ctypes.byref(a), ctypes.byref(b), ctypes.byref(c), ctypes.byref(d)) == 0:
            health["remap_pending"], health["remap_failed"] = c.value != 0, d.value != 0
        reasons = ull(0)
        if ask("nvmlDeviceGetCurrentClocksThrottleReasons", handle, ctypes.byref(reasons)) == 0:
            bits = {"hw_slowdown": 0x8, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}
            health["throttle"] = [t for t in THROTTLES if reasons.value & bits[t]]
        device["health"] = health
        device["processes"] = _nvml_processes(lib, ask, handle)
        devices.append(device)
    return devices


def _nvml_processes(lib, ask, handle):
    """[(pid, used MiB)] of the GPU's compute processes, through the newest call the driver offers (_v3, _v2, the
    first: their records differ)."""
    import ctypes

    uint, ull = ctypes.c_uint, ctypes.c_ulonglong

    class V1(ctypes.Structure):
        _fields_ = [("pid", uint), ("usedGpuMemory", ull)]

    class V2(ctypes.Structure):
        _fields_ = [("pid", uint), ("usedGpuMemory", ull), ("gpuInstanceId", uint), ("computeInstanceId", uint)]

    for name, record in (("nvmlDeviceGetComputeRunningProcesses_v3", V2), ("nvmlDeviceGetComputeRunningProcesses_v2", V2),
                         ("nvmlDeviceGetComputeRunningProcesses", V1)):
        if getattr(lib, name, None) is None:
            continue
        for _ in range(3):  # a process may start between asking the count and the list
            count = uint(0)
            code = ask(name, handle, ctypes.byref(count), None)
            if code not in (0, NVML_INSUFFICIENT):
                return []
            size = count.value + 8
            found = (record * size)()
            count = uint(size)
            code = ask(name, handle, ctypes.byref(count), found)
            if code == 0:
                return [(int(p.pid), int(p.usedGpuMemory >> 20) if p.usedGpuMemory < (1 << 62) else None) for p in found[:count.value]]
            if code != NVML_INSUFFICIENT:
                return []
        return []
    return []


# ------------------------------------------------------------------------------------------------ drain
# An admin marks a host, or single GPUs of it, out of service: mnft-drain.json in the lease directory names who
# (the login that wrote it, as this host knows it), when and why. A drained GPU is never leased; runs holding it
# go on to their end; only undrain clears the mark. Admins: root, or members of the group this host names in a
# file only root can have written (ADMIN_FILES, or mnft-admin-group in the lease directory: root's, not writable
# by group or others), never a controller's inventory. The mark itself is honoured only when root or such an
# admin wrote it (its owner), so a user of the shared lease directory can neither plant nor clear one.

DRAIN_NAME, ADMIN_NAME = "mnft-drain.json", "mnft-admin-group"
ADMIN_FILES = ("/etc/mnft/admin-group",)


def _root_text(path):
    """The text of a file only root can have written (root's, a regular file, not writable by group or others,
    not reached through a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return None
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def admin_group():
    """(group name, gid, where it is named) of the host's mnft admins, or None when the host names none."""
    import grp

    for path in ADMIN_FILES + (os.path.join(lease_dir(), ADMIN_NAME),):
        text = _root_text(path)
        names = [w.strip() for w in (text or "").splitlines() if w.strip() and not w.strip().startswith("#")]
        if names:
            try:
                return names[0], grp.getgrnam(names[0]).gr_gid, path
            except KeyError:
                continue
    return None


def _in_group(uid, gid):
    import grp

    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def is_admin():
    if os.geteuid() == 0:
        return True
    group = admin_group()
    return bool(group) and (group[1] in os.getgroups() or group[1] == os.getegid())


def _trusted_mark(st):
    """Whether root or an admin wrote the drain file (and nobody else may write it: the admins' group at most)."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_mode & 0o002:
        return False
    group = admin_group()
    if st.st_mode & 0o020 and not (group and st.st_gid == group[1]):
        return False
    return st.st_uid == 0 or bool(group) and _in_group(st.st_uid, group[1])


def drain_marks():
    """({"host": mark or None, "gpus": {"0": mark, …}}, a problem with the file or None). A mark is {"login", "at",
    "reason", "by"}."""
    empty = {"host": None, "gpus": {}}
    path = os.path.join(lease_dir(), DRAIN_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        return empty, (None if exc.errno == errno.ENOENT else "%s: %s" % (path, exc.strerror))
    try:
        st = os.fstat(fd)
        if not _trusted_mark(st):
            return empty, refusal(path, st, "was not written by root or an admin of this host, and is ignored")
        marks = _read(fd) or {}
    finally:
        os.close(fd)
    gpus = marks.get("gpus") if isinstance(marks.get("gpus"), dict) else {}
    return {"host": marks.get("host") if isinstance(marks.get("host"), dict) else None,
            "gpus": dict((str(k), v) for k, v in gpus.items() if isinstance(v, dict))}, None


def drain_of(marks, device):
    """The mark that drains a device (the host's, else its own), or None."""
    if marks.get("host"):
        return dict(marks["host"], scope="host")
    key = "cpu" if device.get("index") is None else str(device.get("index"))
    mark = (marks.get("gpus") or {}).get(key)
    return dict(mark, scope="gpu") if mark else None


def set_drain(request):
    """Drain or undrain ({"gpus": [indices] or null for the host, "reason", "by", "undrain": bool}) as an admin:
    ({"drained": marks}) or Refused naming who may."""
    if not is_admin():
        group = admin_group()
        who = ("root or a member of group %s (named in %s)" % (group[0], group[2]) if group else
               "root (this host names no admin group: root writes one group's name to %s or %s)" % (ADMIN_FILES[0], os.path.join(lease_dir(), ADMIN_NAME)))
        raise Refused("%s may not %s: only %s may" % (user_name(os.getuid()), "undrain" if request.get("undrain") else "drain", who))
    reason = " ".join(str(request.get("reason") or "").split())[:500]
    if not request.get("undrain") and not reason:
        raise Refused("drain needs --reason TEXT: what is wrong, for whoever finds it drained")
    mutex = _lock_mutex()
    try:
        path = os.path.join(lease_dir(), DRAIN_NAME)
        fd = _open_drain(path)
        try:
            marks = _read(fd) or {}
            marks = {"host": marks.get("host") if isinstance(marks.get("host"), dict) else None,
                     "gpus": marks.get("gpus") if isinstance(marks.get("gpus"), dict) else {}}
            gpus = request.get("gpus")
            mark = {"login": user_name(os.getuid()), "uid": os.getuid(), "at": time.time(), "reason": reason,
                    "by": str(request.get("by") or "")[:200]}
            if request.get("undrain"):
                if gpus is None:
                    marks = {"host": None, "gpus": {}}
                for index in gpus or []:
                    marks["gpus"].pop(str(index), None)
            elif gpus is None:
                marks["host"] = mark
            else:
                for index in gpus:
                    marks["gpus"][str(index)] = mark
            _write(fd, marks)
        finally:
            os.close(fd)
    finally:
        os.close(mutex)
    return {"drained": marks}


def _open_drain(path):
    """The drain file for writing: an existing one only if root or an admin wrote it (root replaces another);
    a new one the admins' group may write."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    group = admin_group()
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        if os.geteuid() != 0:
            raise Refused("%s: %s (remove it as root)" % (path, exc.strerror))
        fd = None
        os.unlink(path)
    if fd is not None:
        st = os.fstat(fd)
        if _trusted_mark(st):
            return fd
        os.close(fd)
        if os.geteuid() != 0:
            raise Refused(refusal(path, st, "was not written by root or an admin of this host"))
        os.unlink(path)  # planted: root makes its own
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    if group:
        os.fchown(fd, -1, group[1])
        os.fchmod(fd, 0o664)
    else:
        os.fchmod(fd, 0o644)
    return fd
# ------------------------------------------------------------------------------------------------ usage
# Every lease that ends leaves one line in its user's usage log in the lease directory, mnft-usage-<uid>.jsonl: a
# file of that user's (0644, created O_EXCL, never through a link), so no other user can erase or forge its lines
# without root, and its owner is who the lines are counted for (`usage` believes the file's owner, not its words).
# Bounded: past USAGE_BYTES it becomes mnft-usage-<uid>.old.jsonl (the one before is dropped) and a new one begins.
# The run's keeper writes the same line when it is the last to let go (mnft.run.agent.log_usage: a copy).

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


def usage_path(uid=None):
    return os.path.join(lease_dir(), "%s%d.jsonl" % (USAGE_PREFIX, os.getuid() if uid is None else uid))


def log_usage(line):
    """Append the line to this user's usage log (best effort: a lease's end is never failed by its log)."""
    if not line:
        return
    path = usage_path()
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


def main(argv):
    mode = argv[0] if argv else ""
    if mode == "hold":
        return hold()
    if mode == "rundirs" and len(argv) == 2:
        try:
            print(json.dumps({"run_dirs": run_dirs(argv[1])}))
        except (OSError, Refused) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode in ("drain", "undrain"):
        try:
            request = json.loads(sys.stdin.readline(MAX_LEASE_BYTES) or "{}")
            print(json.dumps(set_drain(dict(request, undrain=mode == "undrain"))))
        except (OSError, Refused, ValueError) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode == "usage" and len(argv) == 2:
        try:
            print(json.dumps(usage(float(argv[1]))))
        except (OSError, ValueError) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode in ("show", "lab"):
        try:
            print(json.dumps(show() if mode == "show" else lab()))
        except (OSError, Refused) as exc:
            print(json.dumps(_failure(exc)))
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
