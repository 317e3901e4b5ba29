#!/usr/bin/env python3
"""mnft run agent: the host side of a training run. Standard library only; shipped to hosts with mnft.hosts.pyrun.

    launch                 read a JSON spec line from stdin, start the run under a keeper, then (attached) stream
                           events as JSON lines and obey the controller: "hb" lines keep it alive, "stop" or EOF
                           or no heartbeat for `deadman` seconds tears the run's process group down
    keep RUN_DIR           (internal) session leader of the run: runs the command, records its exit code
    stop RUN_DIR [GRACE]   kill that run's process group (recorded pgid, its leader verified: see below), then any
                           process still carrying the run id; print what was killed and what remains ("ended":
                           true and nothing killed when nothing of the run is alive)
    status RUN_DIR         state, exit code, last metrics line
    tail RUN_DIR [N] [--follow]   the run's output (follow until stdin closes)
    pack RUN_DIR [PATH…] [--checkpoints=DIR]   the run directory and extra paths (files, directories, globs) as
                           a base64 tar.gz, and the names in the job's checkpoints directory (for invoke logs)
    checkpoints DIR        a checkpoints directory's entries and their files (for a resume)

A run directory holds: spec.json (no secrets), pgid, pgid_start, output.log, exit_code, started, ended, agent.py,
entry.py (the launch wrapper, mnft.run.entry) and done/rank-<R> for each rank whose entry point returned. Secrets
arrive in the spec's "secrets", are written to secrets.json (0600) for the keeper, which deletes it after reading.
Processes are found by the recorded process group and by MNFT_RUN_ID in their environment, never by name.

Only what is provably the run's is signalled. The process group is signalled only while its leader still is the
run's keeper: its start time (/proc/<pid>/stat field 22) is the one recorded in pgid_start at launch, and the run's
tag is in its environment (readable by root and by its own user) or the run directory on its command line; or
while a process carrying the run's tag is still a member of that group (it holds the number: no other group can
have it). Any other process is signalled only if its own environment carries the tag, checked through a pidfd
where the kernel has them (no pid reuse between the check and the signal). A process of another user is never
signalled (and never a PermissionError).

The keeper also holds the run's leases (mnft.hosts.leasehost: its devices and workdir, named in the spec's
"leases"; else the host's) when they name its run: the agent opens and share-locks them and hands them to the
keeper, so they stay the run's to its end.
"""

import glob
import json
import os
import select
import signal
import sys
import time

RUN_ID_VAR = "MNFT_RUN_ID"
TAG_VAR = "MNFT_RUN_TAG"  # run id @ inventory host name: what processes are found (and killed) by
LEASE_FDS_VAR = "MNFT_LEASE_FDS"  # the keeper's inherited lease descriptors (it locks the files anew itself)


def emit(event, **fields):
    fields["event"] = event
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _path(p):
    return os.path.abspath(os.path.expanduser(p))


def done_ranks(run_dir):
    """The ranks whose entry point returned (mnft.run.entry writes done/rank-<R> in the run directory)."""
    try:
        names = os.listdir(os.path.join(run_dir, "done"))
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit())


def _expand(value):
    """`~/x` (or `key=~/x`) means the home directory of the user the run belongs to."""
    if value == "~" or value.startswith("~/"):
        return os.path.expanduser(value)
    key, sep, rest = value.partition("=")
    if sep and (rest == "~" or rest.startswith("~/")):
        return key + "=" + os.path.expanduser(rest)
    return value


def _write(path, text, mode=0o600):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


RUN_FILE_BYTES = 64 << 20  # a file of the run directory read at most (spec.json, pgid, exit_code …): past it, as missing


def _read(path, default=None):
    try:
        with open(path) as fh:
            text = fh.read(RUN_FILE_BYTES + 1)
    except (OSError, ValueError):
        return default
    return text.strip() if len(text) <= RUN_FILE_BYTES else default


# ---------------------------------------------------------------------------------------------------- processes


def _environ_has(pid, tag):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return (TAG_VAR + "=" + tag).encode() in env


def run_pids(tag):
    """Every live process whose environment carries this run id (this agent excluded)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid() and _environ_has(int(name), tag):
            try:
                with open("/proc/%s/stat" % name) as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # a zombie holds nothing
            except OSError:
                continue
            pids.append(int(name))
    return sorted(pids)


def _stat(pid):
    """/proc/<pid>/stat from field 3 (state) on: field N is item N - 3; None if the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid):
    """When the process started (clock ticks after boot: /proc/<pid>/stat field 22), or None if it is gone or a
    zombie. A pid number is reused; a pid and its start time together name one process."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pgid_of(pid):
    fields = _stat(pid)
    try:
        return int(fields[2]) if fields else None
    except (IndexError, ValueError):
        return None


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0")]
    except OSError:
        return []


def is_run_process(pid, start, tag, run_dir=None):
    """Whether pid still is the run's process that started at `start`: the same start time, and the run's tag in
    its environment (readable by root or its own user) or, for the keeper, `keep <run_dir>` on its command line.
    The start time is read again after the rest, so a process that ended meanwhile is not taken for ours."""
    if not pid or pid <= 0 or start is None or start_time(pid) != start:
        return False
    argv = _cmdline(pid)
    named = bool(tag) and _environ_has(pid, tag) or bool(run_dir) and "keep" in argv and run_dir in argv
    return named and start_time(pid) == start


def _recorded_start(run_dir):
    text = _read(os.path.join(run_dir, "pgid_start"))
    return int(text) if text and text.isdigit() else None


def group_is_ours(run_dir, pgid, tag, keeper=None):
    """Whether the process group numbered pgid still is the run's (see the module's docstring)."""
    if not pgid or pgid <= 1:
        return False
    if keeper is not None and keeper.pid == pgid and keeper.returncode is None and keeper.poll() is None:
        return True  # our own child, not reaped: its pid (and so its group's number) cannot have been reused
    if is_run_process(pgid, _recorded_start(run_dir), tag, run_dir):
        return True
    return bool(tag) and any(_pgid_of(pid) == pgid for pid in run_pids(tag))


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_tagged(pid, tag, sig):
    """Signal one process if its environment carries the run's tag. With a pidfd the check and the signal are on
    the same process even if the pid is reused in between."""
    opener = getattr(os, "pidfd_open", None)
    sender = getattr(signal, "pidfd_send_signal", None)
    fd = None
    if opener is not None and sender is not None:
        try:
            fd = opener(pid)
        except OSError:
            fd = None  # gone, or a kernel without pidfds: the plain check below
    try:
        if not _environ_has(pid, tag):
            return False
        if fd is not None:
            sender(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def terminate(run_dir, grace=10.0, keeper=None):
    """SIGTERM the run's process group, SIGKILL after `grace`, then any leftover carrying the run id; each only
    while it is provably the run's. Nothing of the run alive: {"ended": true}, nothing signalled."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    tag = spec.get("tag")
    text = _read(os.path.join(run_dir, "pgid"), "0") or "0"
    pgid = int(text) if text.isdigit() else 0
    killed = []
    seen = run_pids(tag) if tag else []  # the run's processes before the kill: a GPU one of them still holds is ours
    if not seen and not group_is_ours(run_dir, pgid, tag, keeper):
        if keeper is not None:
            keeper.poll()
        remove_container(spec, grace=0)  # a container left behind with nothing of the run in it (created, never started)
        result = {"killed": [], "remaining": [], "ended": True, "exit_code": _read(os.path.join(run_dir, "exit_code"))}
        return dict(result, **gpu_report(gpu_apps(), set()))
    if group_is_ours(run_dir, pgid, tag, keeper) and _signal_group(pgid, signal.SIGTERM):
        killed.append(pgid)
    deadline = time.time() + grace
    while time.time() < deadline:
        if keeper is not None:
            keeper.poll()
        if not (pgid and group_is_ours(run_dir, pgid, tag, keeper) and _group_alive(pgid)) and not (tag and run_pids(tag)):
            break
        time.sleep(0.1)
    if group_is_ours(run_dir, pgid, tag, keeper):
        _signal_group(pgid, signal.SIGKILL)
    if tag:
        for pid in run_pids(tag):
            if _signal_tagged(pid, tag, signal.SIGKILL):
                killed.append(pid)
    remove_container(spec, grace=0)  # podman's/docker's container outlives its client (conmon, the daemon): by its name
    if keeper is not None:
        try:
            keeper.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
    remaining = _after_kill(tag, killed)
    return dict({"killed": killed, "remaining": remaining}, **gpu_report(gpu_apps(), set(killed) | set(remaining) | set(seen)))


KILL_SETTLE = 5.0  # seconds a SIGKILLed process may take to be gone (a loaded host frees a large process slowly)


def _after_kill(tag, killed=None, settle=KILL_SETTLE):
    """The run's processes still alive once SIGKILL has had time to work: a killed process lingers while the
    kernel frees its memory (64 torchrun trees on 2 busy cores took more than the 0.1 s this once allowed, and
    `stop` said they remained although nothing was left a moment later). One the run forked after the kill's
    scan is killed too (by its tag, as every kill here); `killed` collects whom this signalled."""
    if not tag:
        return []
    deadline = time.time() + settle
    while True:
        remaining = run_pids(tag)
        if not remaining or time.time() >= deadline:
            return remaining
        for pid in remaining:
            if _signal_tagged(pid, tag, signal.SIGKILL) and killed is not None and pid not in killed:
                killed.append(pid)
        time.sleep(0.05)


def parse_compute_apps(text):
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` -> [{pid, memory_mib}]."""
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts or not parts[0].isdigit():
            continue
        memory = parts[1] if len(parts) > 1 else ""
        apps.append({"pid": int(parts[0]), "memory_mib": int(memory) if memory.isdigit() else None})
    return apps


def gpu_apps():
    """The processes holding a GPU on this host ([] without nvidia-smi), or None if nvidia-smi failed."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001
        return None
    return parse_compute_apps(done.stdout) if done.returncode == 0 else None


def gpu_report(apps, run_pids_seen, owner=None):
    """Split GPU holders into the run's (a failed stop) and this user's others (a warning: a leftover keeps GPUs
    from the next run). Another user's processes are their work on a shared host, not this stop's business."""
    if apps is None:
        return {"gpus_held": [], "gpus_other": [], "gpu_error": "nvidia-smi failed"}
    mine = set(run_pids_seen)
    owner = owner or _uid_of

    def show(app):
        return "pid %d (%s MiB)" % (app["pid"], app["memory_mib"] if app["memory_mib"] is not None else "?")

    return {
        "gpus_held": [show(a) for a in apps if a["pid"] in mine],
        "gpus_other": [show(a) for a in apps if a["pid"] not in mine and owner(a["pid"]) == os.getuid()],
    }


def _uid_of(pid):
    try:
        return os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------- keeper


CONTAINER_TIMEOUT = 60.0  # seconds a runtime's `rm --force` may take (it waits for the container's processes)


def remove_container(spec, grace=None):
    """Remove the run's container on this host by the name mnft gave it (spec "container": its runtime's teardown
    command, mnft.image.runtime.teardown_argv), if it still exists: nothing of a run outlives its end. Returns
    None when the run has no container (or the runtime needs no removal), else whether the runtime succeeded
    or said the container was already gone."""
    import subprocess

    container = spec.get("container") or {}
    argv = list(container.get("teardown") or ())
    if not argv:
        return None
    if grace is not None and "--time" in argv:
        argv[argv.index("--time") + 1] = str(int(grace))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=CONTAINER_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    said = done.stderr[-4096:].decode("utf-8", "replace").lower()
    return done.returncode == 0 or "no such container" in said or "no container with name" in said


def container_state(spec):
    """The run's container on this host, for `status`: its name, image and whether the runtime still has it."""
    import subprocess

    container = spec.get("container") or {}
    if not container:
        return None
    out = {"name": container.get("name"), "image": container.get("image"), "runtime": container.get("runtime")}
    path, kind, name = container.get("path"), container.get("runtime"), container.get("name")
    if kind in ("podman", "docker") and path and name:
        argv = [path, "container", "exists", name] if kind == "podman" else [path, "container", "inspect", "--format", "{{.Id}}", name]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
            out["present"] = done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            out["present"] = None
    return out


def _make_mounts(spec):
    """The run's container mounts its directories at the same paths: each must exist before the runtime starts
    (a data_dir or checkpoints directory the job has not made yet)."""
    for path in (spec.get("container") or {}).get("mounts") or ():
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as exc:
            print("mnft: cannot make %s for the container: %s" % (path, exc), flush=True)


def _reap_group(tag, grace=5.0):
    """After the command ended: its workers may live on (torchrun killed with SIGKILL leaves them). End them."""
    try:
        os.killpg(os.getpgid(0), signal.SIGTERM)  # our own SIGTERM handler ignores it
    except ProcessLookupError:
        pass
    deadline = time.time() + grace
    while run_pids(tag) and time.time() < deadline:
        time.sleep(0.1)
    for pid in run_pids(tag):
        _signal_tagged(pid, tag, signal.SIGKILL)


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


def keep(run_dir):
    """Session leader of the run (pgid = our pid): run the command, record its exit code."""
    import subprocess

    spec = json.loads(_read(os.path.join(run_dir, "spec.json")))
    env = dict(os.environ)
    env.update({k: _expand(v) for k, v in (spec.get("env") or {}).items()})
    secrets_file = os.path.join(run_dir, "secrets.json")
    in_container = bool(spec.get("container"))
    if os.path.exists(secrets_file) and not (spec.get("container") or {}).get("secrets_file"):
        try:
            with open(secrets_file) as fh:
                env.update(json.load(fh))
        finally:
            os.unlink(secrets_file)
    # else the container's launch wrapper reads and deletes it (entry.py --secrets): never in the container's config
    env[RUN_ID_VAR] = spec["run_id"]
    env[TAG_VAR] = spec["tag"]
    held = relock(env.pop(LEASE_FDS_VAR, ""))
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for the command; we record its end
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _write(os.path.join(run_dir, "started"), "%f\n" % time.time(), 0o644)
    if in_container:
        _make_mounts(spec)
    idle = _idle_watch(spec, lambda text: print("mnft: %s" % text, flush=True))
    crowd = _collision_watch(spec, lambda text: print("mnft: %s" % text, flush=True))
    try:
        child = subprocess.Popen([_expand(a) for a in spec["argv"]], cwd=_path(spec.get("cwd") or "~"), env=env, stdin=subprocess.DEVNULL)
        code = child.wait() if idle is None and crowd is None else _wait_busy(child, idle, run_dir, spec, crowd)
    except OSError as exc:
        print("mnft: cannot start %s: %s" % (spec["argv"][0], exc), flush=True)
        code = 127
    if code < 0:
        code = 128 - code
    _reap_group(spec["tag"])
    if in_container:
        remove_container(spec)  # normally gone already (--rm): a client killed before its container was not
        if os.path.exists(secrets_file):  # the container never started: the file is not left behind
            os.unlink(secrets_file)
    for fd in held:  # the run has ended here: its leases go (before the end is written: whoever reads it finds them free)
        os.close(fd)
    keeper_usage(spec)
    _write(os.path.join(run_dir, "exit_code"), "%d\n" % code, 0o644)
    _write(os.path.join(run_dir, "ended"), "%f\n" % time.time(), 0o644)
    return code


def _wait_busy(child, idle, run_dir, spec, crowd=None):
    """The command's exit code; meanwhile its GPUs sampled (IdleWatch), and the run ended, its reason written and
    said in its output, once they have all been idle for its limit; and a process of another on them said once
    (CollisionWatch)."""
    import subprocess

    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if crowd is not None:
            crowd.check()
        why = idle.check() if idle is not None else None
        if why:
            _once(os.path.join(run_dir, "reason"), why)
            print("mnft: the run ends: %s" % why, flush=True)
            _reap_group(spec["tag"], float(spec.get("grace") or 10))
            return child.wait()


# ---------------------------------------------------------------------------------------------------- samples

SAMPLE_EVERY = 5.0  # seconds between an attached run's samples
WINDOW = 20  # steps per rank a sample's medians are taken over


def _cpu_times():
    """(all jiffies, idle jiffies) of the host from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return sum(values), values[3] + (values[4] if len(values) > 4 else 0)


def _process_ticks(pids):
    """CPU clock ticks (user + system) the processes used so far."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total


def parse_gpu_util(text):
    """`nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits` -> [{index, util, mem_mib}]."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            try:
                out.append({"index": int(parts[0]), "util": float(parts[1]), "mem_mib": float(parts[2])})
            except ValueError:
                continue
    return out


def gpu_util():
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=5)
    except Exception:  # noqa: BLE001
        return []
    return parse_gpu_util(done.stdout) if done.returncode == 0 else []


def _median(values):
    values = sorted(values)
    n = len(values)
    return (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2) if n else None


def rank_window(lines_by_rank):
    """Per rank, the medians of its last steps' timings (the recipes' timings-rank<R>.jsonl lines)."""
    out = {}
    for rank, records in lines_by_rank.items():
        records = list(records)[-WINDOW:]
        if not records:
            continue
        out[str(rank)] = {"step": records[-1].get("step"), "n": len(records),
                          **{k: _median([r[k] for r in records if isinstance(r.get(k), (int, float))]) for k in ("step_s", "compute_s", "comm_s")}}
    return out


def _timing_record(line):
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "step" in data and "compute_s" in data and "rank" in data else None


class Sampler:
    """What straggler detection needs from this host: CPU use (the host's, and the run's share of the CPUs it may
    use), GPU use (nvidia-smi), and each local rank's recent step timings (the recipes' timing files)."""

    def __init__(self, tag, timings=None):
        import collections

        self.tag = tag
        self.pattern = _path(timings) if timings else None
        self.tails = {p: _Tail(p, from_end=True) for p in glob.glob(self.pattern)} if self.pattern else {}
        self.window = collections.defaultdict(lambda: collections.deque(maxlen=WINDOW))
        self.prev = None
        try:
            self.cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = os.cpu_count() or 1

    def _timings(self):
        if self.pattern:
            for path in glob.glob(self.pattern):
                if path not in self.tails:
                    self.tails[path] = _Tail(path)  # a file that appeared after the start: all of it is this run's
            for tail in self.tails.values():
                for line in tail.lines():
                    record = _timing_record(line)
                    if record is not None:
                        self.window[record["rank"]].append(record)
        return rank_window(self.window)

    def sample(self):
        now = time.time()
        out = {"t": now, "cpu": None, "run_cpu": None}
        try:
            total, idle = _cpu_times()
        except (OSError, ValueError, IndexError):
            total = idle = None
        ticks = _process_ticks(run_pids(self.tag)) if self.tag else 0
        if self.prev is not None and total is not None and self.prev[1] is not None:
            then, prev_total, prev_idle, prev_ticks = self.prev
            if total > prev_total:
                out["cpu"] = round(100.0 * (1 - (idle - prev_idle) / float(total - prev_total)), 1)
            if now > then:
                out["run_cpu"] = round(100.0 * (ticks - prev_ticks) / os.sysconf("SC_CLK_TCK") / ((now - then) * self.cpus), 1)
        self.prev = (now, total, idle, ticks)
        out["gpus"] = gpu_util()
        out["ranks"] = self._timings()
        return out


# ---------------------------------------------------------------------------------------------------- launch


TAIL_CHUNK = 4 << 20  # bytes read from a followed file at one poll
MAX_LINE = 64 << 10  # bytes: a longer line is cut (mnft never parses a metrics line this long)


class _Tail:
    """New complete lines of a file. from_end: skip what it holds now (a resumed job appends to its old
    metrics.jsonl: those lines are history, not this run's progress). A file that shrank is read again from 0.
    A path with glob characters follows the newest matching file (torchtune's logs/log_<time>.txt); a file that
    appears only after the start is read from its beginning."""

    def __init__(self, path, from_end=False):
        self.pattern, self.pos, self.buf, self.cutting = path, 0, b"", False
        self.path = self._resolve()
        self.skipped = set()
        if from_end:
            for old in (glob.glob(path) if _is_glob(path) else [path]):
                self.skipped.add(old)
            try:
                self.pos = os.path.getsize(self.path) if self.path else 0
            except OSError:
                pass

    def _resolve(self):
        if not _is_glob(self.pattern):
            return self.pattern
        found = [p for p in glob.glob(self.pattern) if os.path.isfile(p)]
        return max(found, key=lambda p: (os.path.getmtime(p), p)) if found else None

    def lines(self):
        current = self._resolve()
        if current != self.path:  # a newer file of the pattern: read it from its start
            self.path, self.pos, self.buf, self.cutting = current, 0, b"", False
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.pos:
                    self.pos, self.buf = 0, b""
                fh.seek(self.pos)
                data = fh.read(TAIL_CHUNK)  # bounded: a huge write is read over several polls
        except OSError:
            return []
        self.pos += len(data)
        self.buf += data
        if self.cutting:  # the rest of a line already cut: dropped up to its end
            end = self.buf.find(b"\n")
            self.buf, self.cutting = (b"", True) if end < 0 else (self.buf[end + 1:], False)
        *done, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_LINE:  # a line without end: what fits is a line, the rest of it is dropped
            done.append(self.buf[:MAX_LINE] + b" [line cut: longer than %d bytes]" % MAX_LINE)
            self.buf, self.cutting = b"", True
        return [line.decode("utf-8", "replace") for line in done]


def lease_path(environ=None, stat_of=os.stat):
    """The host's lease file, as mnft.hosts.leasehost names it (a copy: each host script is one file; tests hold the
    two to one table): machine-wide, in $MNFT_LEASE_DIR (absolute, else no lease: None), else /run/lock when it is
    a sticky world-writable directory of root's, else /tmp."""
    import stat

    directory = (os.environ if environ is None else environ).get("MNFT_LEASE_DIR")
    if directory and not os.path.isabs(directory):
        return None  # leasehost refused to take a lease there: there is none to hold
    if not directory:
        try:
            st = stat_of("/run/lock")
            shared = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o1002 == 0o1002
        except OSError:
            shared = False
        directory = "/run/lock" if shared else "/tmp"
    return os.path.join(directory, "mnft-lease.json")


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


def _is_glob(path):
    return any(c in path for c in "*?[")


def launch():
    import subprocess

    spec = json.loads(sys.stdin.buffer.readline())
    run_dir = _path(spec["run_dir"])
    secrets = spec.pop("secrets", None) or {}
    wrapper = spec.pop("entry", None)
    if not os.path.isdir(_path(spec.get("cwd") or "~")):
        emit("error", message="working directory %s does not exist (train places a job's code there; with --no-sync, a new job runs what the `sync` task left in the workdir, a resume what its job's directory holds)" % spec.get("cwd"))
        return 2
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    public = dict(spec, run_dir=run_dir)
    _write(os.path.join(run_dir, "spec.json"), json.dumps(public, indent=1))
    secrets_file = os.path.join(run_dir, "secrets.json")
    # rank 0's metrics from their end now, before the run starts (resumed job: the old lines are history)
    metrics = _Tail(_path(spec["metrics"]), from_end=True) if spec.get("metrics") else None
    keeper = None
    try:
        if secrets:
            _write(secrets_file, json.dumps(secrets))
        own = os.path.join(run_dir, "agent.py")
        _write(own, SOURCE, 0o600)
        if wrapper:
            _write(os.path.join(run_dir, "entry.py"), wrapper, 0o644)
        log = open(os.path.join(run_dir, "output.log"), "ab")
        env = dict(os.environ)
        env[RUN_ID_VAR] = spec["run_id"]
        env[TAG_VAR] = spec["tag"]
        held = lease_fds(spec["run_id"], spec.get("leases"))
        env[LEASE_FDS_VAR] = ",".join(str(fd) for fd in held)
        keeper = subprocess.Popen(
            [sys.executable, own, "keep", run_dir],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=run_dir,
            pass_fds=tuple(held),  # the keeper holds the run's leases to the run's end
        )
        for fd in held:
            os.close(fd)
    finally:
        if keeper is None and os.path.exists(secrets_file):
            os.unlink(secrets_file)  # no keeper will read it: never leave a secret behind
    _write(os.path.join(run_dir, "pgid"), "%d\n" % keeper.pid, 0o644)
    _write(os.path.join(run_dir, "pgid_start"), "%s\n" % start_time(keeper.pid), 0o644)  # with the pid: this keeper
    emit("started", pgid=keeper.pid, run_dir=run_dir, hostname=os.uname()[1])
    if spec.get("detach"):
        return 0
    return supervise(spec, run_dir, keeper, metrics)


def supervise(spec, run_dir, keeper, metrics=None):
    out = _Tail(os.path.join(run_dir, "output.log"))
    sampler = Sampler(spec.get("tag"), spec.get("timings"))
    sampler.sample()  # the first reading: CPU use is measured from here
    last_sample = time.time()
    deadman = float(spec.get("deadman") or 15)
    grace = float(spec.get("grace") or 10)
    last_control = last_hb = time.time()
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    pending = b""
    reason = None

    def forward():
        """New output lines and metrics since the last call, as events."""
        for line in out.lines():
            emit("line", text=line)
        for line in metrics.lines() if metrics is not None else ():
            emit("mline", text=line)  # the controller parses it with the job's metrics format

    try:
        while True:
            ready, _, _ = select.select([stdin], [], [], 0.2)
            if ready:
                data = os.read(stdin.fileno(), 4096)
                if not data:
                    reason = "controller closed the connection"
                else:
                    last_control = time.time()
                    pending += data
                    if b"stop" in pending:
                        reason = "stopped by the controller"
                    pending = pending[-16:]
            if reason is None and time.time() - last_control > deadman:
                reason = "no heartbeat from the controller for %gs" % deadman
            forward()
            if reason is not None:
                result = terminate(run_dir, grace, keeper)
                forward()
                emit("stopped", reason=reason, done=done_ranks(run_dir), **result)
                return 0
            code = keeper.poll()
            if code is not None:
                time.sleep(0.1)
                forward()
                recorded = _read(os.path.join(run_dir, "exit_code"))
                why = _read(os.path.join(run_dir, "reason"))  # why its keeper ended it (--idle-stop, the lab's idle_stop)
                emit("exit", code=int(recorded) if recorded else 128 + 9, done=done_ranks(run_dir), **({"reason": why} if why else {}))
                return 0
            if time.time() - last_hb >= 1.0:
                emit("hb", t=time.time())
                last_hb = time.time()
            if time.time() - last_sample >= SAMPLE_EVERY:
                emit("sample", **sampler.sample())
                last_sample = time.time()
    except (BrokenPipeError, OSError):
        # Our stdout is gone: the controller (or the link to it) is lost. Leave nothing running.
        terminate(run_dir, grace, keeper)
        return 0


# ---------------------------------------------------------------------------------------------------- queries


def status(run_dir):
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    if not spec:
        return {"state": "unknown", "error": "no run at %s" % run_dir}
    code = _read(os.path.join(run_dir, "exit_code"))
    alive = run_pids(spec.get("tag") or spec["run_id"])
    state = "exited" if code is not None else ("running" if alive else "killed")
    result = {
        "state": state,
        "exit_code": int(code) if code is not None else None,
        "processes": len(alive),
        "started": float(_read(os.path.join(run_dir, "started"), "0") or 0) or None,
        "ended": float(_read(os.path.join(run_dir, "ended"), "0") or 0) or None,
        # the last lines of the metrics file and of the output: the controller finds the last step in them
        "metric_lines": _last_lines(_Tail(_path(spec["metrics"])).path, STATUS_LINES) if spec.get("metrics") else [],
        "output_lines": _last_lines(os.path.join(run_dir, "output.log"), STATUS_LINES),
        "done": done_ranks(run_dir),
        "reason": _read(os.path.join(run_dir, "reason")),  # why a session (or an idle-stopped run) was ended
    }
    if spec.get("container"):
        result["container"] = container_state(spec)
    if state == "running":
        result["sample"] = status_sample(spec)
    return result


def status_sample(spec, interval=0.5):
    """A sample for `status`: CPU use over a short interval, and each rank's last steps from its timing file."""
    sampler = Sampler(spec.get("tag"))
    sampler.sample()
    time.sleep(interval)
    sample = sampler.sample()
    by_rank = {}
    for path in glob.glob(_path(spec["timings"])) if spec.get("timings") else []:
        for line in _last_lines(path, WINDOW):
            record = _timing_record(line)
            if record is not None:
                by_rank.setdefault(record["rank"], []).append(record)
    sample["ranks"] = rank_window(by_rank)
    return sample


STATUS_LINES = 200


def _last_lines(path, n, chunk=1 << 16):
    """The last n lines of a file, reading only its end."""
    if not path:
        return []
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - chunk * 4))
            data = fh.read(chunk * 4)  # the end as it was: a log written meanwhile is not chased
    except OSError:
        return []
    return [line.decode("utf-8", "replace") for line in data.split(b"\n")[-n - 1:] if line][-n:]


def tail(run_dir, n, follow):
    t = _Tail(os.path.join(run_dir, "output.log"))
    lines = t.lines()
    for line in lines[-n:] if n else lines:
        emit("line", text=line)
    if not follow:
        return 0
    code_file = os.path.join(run_dir, "exit_code")
    tag = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}").get("tag")
    gone = 0  # polls in a row with no process of the run alive
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return 0
        for line in t.lines():
            emit("line", text=line)
        alive = run_pids(tag) if tag else []
        gone = 0 if alive else gone + 1
        ended = os.path.exists(code_file)
        # the keeper records exit_code; a keeper killed with SIGKILL never does: then stop once nothing of the
        # run has been alive for a few polls (not at once: the exit code may be being written)
        if (ended and not alive) or gone >= 4:
            for line in t.lines():
                emit("line", text=line)
            code = _read(code_file)
            emit("exit", code=int(code) if code else None, reason=None if code else "no process of the run remains and it recorded no exit code (its keeper was killed)")
            return 0


LIST_FILES = 100000  # files listed per checkpoint directory at most


def list_checkpoints(root):
    """The top-level entries of a checkpoints directory: for each, whether it is a directory, a link's target,
    and its files with their sizes (relative to the entry; a file entry lists itself as "")."""
    root = _path(root)
    out = {"root": root, "exists": os.path.isdir(root), "entries": {}}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        entry = {"dir": os.path.isdir(full) and not os.path.islink(full), "link": os.readlink(full) if os.path.islink(full) else None, "files": {}}
        if entry["dir"]:
            for base, dirs, files in os.walk(full):
                for f in files:
                    if len(entry["files"]) >= LIST_FILES:
                        break
                    path = os.path.join(base, f)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    entry["files"][os.path.relpath(path, full)] = st.st_size
                    entry["newest"] = max(entry.get("newest") or 0.0, st.st_mtime)  # which save came last (torchtune 0.6.1)
                    if f == "meta.json":  # mnft's recipes: which rank wrote it, in a world of how many
                        meta = _small_json(path)
                        if meta is not None:
                            entry.setdefault("meta", {})[os.path.relpath(path, full)] = meta
        elif os.path.isfile(full) and entry["link"] is None:
            entry["files"][""] = os.path.getsize(full)
        out["entries"][name] = entry
    return out


def _small_json(path, limit=65536):
    try:
        if os.path.getsize(path) > limit:
            return None
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return {k: data[k] for k in ("rank", "world_size", "step") if k in data} if isinstance(data, dict) else None


CHECKPOINT_NAMES = 10000  # entries of a job's checkpoints directory named by pack at most (a count past it is "at least")


def checkpoint_names(root, limit=CHECKPOINT_NAMES):
    """The top-level entries of a job's checkpoints directory with their own modification times (a save's
    directory is changed by the files it writes into it), at most `limit` of them, and this host's clock when it
    listed them: the controller counts the checkpoints a run saved (mnft.run.logs), matching the names by the
    job's layout. Nothing below the entries is read."""
    root = _path(root)
    out = {"root": root, "exists": os.path.isdir(root), "entries": {}, "more": False}
    if out["exists"]:
        try:
            with os.scandir(root) as found:
                for entry in found:
                    if len(out["entries"]) >= limit:
                        out["more"] = True
                        break
                    try:
                        out["entries"][entry.name] = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
        except OSError as exc:
            out["error"] = str(exc)
    out["now"] = time.time()
    return out


PACK_EXTRA_BYTES = 64 << 20  # collected files besides the run directory, at most (they travel base64 in one line)


def _base(pattern):
    """The directory part of a glob before its first glob character: a/b/c-*/x -> a/b."""
    head = pattern
    for c in "*?[":
        head = head.split(c, 1)[0]
    return head.rstrip("/") if head.endswith("/") else os.path.dirname(head)


def _extra_files(pattern):
    """(path, name inside the archive) of a file, every file under a directory, or the files a glob matches."""
    path = _path(pattern)
    if _is_glob(path):
        base = _base(path)
        for found in sorted(glob.glob(path, recursive=True)):
            if os.path.isfile(found):
                yield found, os.path.relpath(found, base)
    elif os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in sorted(files):
                yield os.path.join(root, name), os.path.relpath(os.path.join(root, name), path)
    elif os.path.isfile(path):
        yield path, os.path.basename(path)


CHECKPOINTS_OPTION = "--checkpoints="  # pack's: the job's checkpoints directory, to name its entries


def pack(run_dir, extras, checkpoints=None):
    """The run directory and extra paths (files, directories, globs: the job's metrics) as one base64 tar.gz in a
    JSON line; extra i goes under extra/<i>/. checkpoints: the job's checkpoints directory, whose entries are
    named beside it (checkpoint_names)."""
    import base64
    import io
    import tarfile

    buf = io.BytesIO()
    left_out = []
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def keep(info):
            name = os.path.basename(info.name)
            return None if name in ("agent.py", "secrets.json") else info

        if os.path.isdir(run_dir):
            tar.add(run_dir, arcname="run", filter=keep)
        budget = PACK_EXTRA_BYTES
        for index, extra in enumerate(extras):
            for path, name in _extra_files(extra):
                try:  # a dangling link, or a file the job removed since it was listed, is skipped, not fatal
                    size = os.path.getsize(path)
                    if size > budget:
                        left_out.append(path)
                        continue
                    tar.add(path, arcname="extra/%d/%s" % (index, name))
                except OSError:
                    continue
                budget -= size
    reply = {"tar": base64.b64encode(buf.getvalue()).decode(), "found": os.path.isdir(run_dir), "left_out": left_out}
    if checkpoints:
        reply["checkpoints"] = checkpoint_names(checkpoints)
    print(json.dumps(reply))
    return 0


# ---------------------------------------------------------------------------------------------------- sessions
# An interactive session (`mnft shell`): `session-prepare` writes its run directory (spec.json, agent.py) from a
# spec line on stdin; `session RUN_DIR` is the session's keeper, run on the terminal sshd gave the controller's
# channel (a pty): it holds the session's leases, starts the shell (or the command) in its own process group in
# the foreground of that terminal (so Ctrl-C and Ctrl-Z reach it), ends the session at its time limit (told in the
# terminal SESSION_WARN seconds before) and, whatever ends it (the program's exit, the terminal closed, a stop, the
# time limit, the controller gone as `watch` sees it), ends every process carrying its tag and lets the leases go.
# `watch RUN_DIR` is the dead-man: on a channel of its own it reads the controller's heartbeats and ends the session
# when they stop (no line for the spec's `deadman` seconds, or the channel closed) before the session ended.

SESSION_WARN = 300.0  # seconds before --time ends a session that it is told so in its terminal
SESSION_REAP = 3.0  # seconds between SIGTERM and SIGKILL for what is left of a session


def session_prepare():
    spec = json.loads(sys.stdin.buffer.readline())
    run_dir = _path(spec["run_dir"])
    cwd = _path(spec.get("cwd") or "~")
    note = None
    if spec.get("container"):  # `shell --image`: the workdir is mounted and the container's working directory
        _make_mounts(spec)
    if not os.path.isdir(cwd):  # asked before the run directory (below it) makes it
        note = "%s does not exist (mnft sync makes it): the session opens in the home directory" % spec.get("cwd")
        spec["cwd"] = "~"
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    _write(os.path.join(run_dir, "spec.json"), json.dumps(dict(spec, run_dir=run_dir), indent=1))
    own = os.path.join(run_dir, "agent.py")
    _write(own, SOURCE, 0o600)
    print(json.dumps({"run_dir": run_dir, "agent": own, "python": sys.executable, "note": note, "hostname": os.uname()[1]}))
    return 0


def _once(path, text):
    """Write a file only if it is not there yet (the first reason a session ends is its reason)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
    return True


def _tell(text):
    """A line in the session's terminal (the keeper's own stdout is it); nothing when the terminal is gone."""
    try:
        os.write(1, ("\r\nmnft: %s\r\n" % text).encode("utf-8", "replace"))
    except OSError:
        pass


def _reap_tagged(tag, grace=SESSION_REAP):
    """End every process carrying the tag: SIGTERM, then SIGKILL to what is left after `grace`."""
    for pid in run_pids(tag):
        _signal_tagged(pid, tag, signal.SIGTERM)
    deadline = time.time() + grace
    while run_pids(tag) and time.time() < deadline:
        time.sleep(0.05)
    _after_kill(tag)


def session(run_dir):
    """The keeper of an interactive session (see above); its exit status is the program's."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json")))
    tag, run_id = spec["tag"], spec["run_id"]
    if os.environ.get(TAG_VAR) != tag:  # once more with the tag in its own environment: the session is found by it
        env = dict(os.environ)
        env[RUN_ID_VAR], env[TAG_VAR] = run_id, tag
        os.execve(sys.executable, [sys.executable, "-S", os.path.join(run_dir, "agent.py"), "session", run_dir], env)
    env = dict(os.environ)
    env.update({k: _expand(v) for k, v in (spec.get("env") or {}).items()})
    held = lease_fds(run_id, spec.get("leases"))
    reason = []

    def ended_by(why):
        def handler(*_):
            if not reason:
                reason.append(why)
        return handler

    signal.signal(signal.SIGTERM, ended_by("stopped"))
    signal.signal(signal.SIGHUP, ended_by("the terminal closed (the controller's connection ended)"))
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTOU, signal.SIGTTIN):
        signal.signal(sig, signal.SIG_IGN)  # the terminal's keys are for the program in its foreground
    tty = 0 if os.isatty(0) else None
    _write(os.path.join(run_dir, "pgid"), "%d\n" % os.getpgid(0), 0o644)
    _write(os.path.join(run_dir, "pgid_start"), "%s\n" % start_time(os.getpgid(0)), 0o644)
    started = time.time()
    _write(os.path.join(run_dir, "started"), "%f\n" % started, 0o644)
    argv = [_expand(a) for a in spec["argv"]]
    child = os.fork()
    if child == 0:  # the program: its own process group, the terminal's foreground
        try:
            os.setpgid(0, 0)
            if tty is not None:
                os.tcsetpgrp(tty, os.getpid())
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTOU, signal.SIGTTIN):
                signal.signal(sig, signal.SIG_DFL)
            for fd in held:
                os.close(fd)
            os.chdir(_path(spec.get("cwd") or "~"))
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(2, ("mnft: cannot start %s: %s\r\n" % (argv[0], exc)).encode("utf-8", "replace"))
        os._exit(127)
    try:
        os.setpgid(child, child)
    except OSError:
        pass  # it did so itself, or exec'd already
    if tty is not None:
        try:
            os.tcsetpgrp(tty, child)
        except OSError:
            pass
    os.chdir(run_dir)  # the keeper works in its run directory: root's stop finds it there (leasehost.run_dirs)
    limit = float(spec.get("time") or 0)
    warned = False
    code = None
    idle = _idle_watch(spec, _tell)
    crowd = _collision_watch(spec, _tell)
    while code is None and not reason:
        try:
            pid, status = os.waitpid(child, os.WNOHANG | os.WUNTRACED)
        except ChildProcessError:
            pid, status = child, 0
        if pid == child:
            if os.WIFSTOPPED(status):  # a command run without a shell has no job control: it goes on
                _tell("Ctrl-Z: a session's command goes on (no shell to resume it); Ctrl-C ends it")
                _signal_group(child, signal.SIGCONT)
            else:
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                break
        now = time.time()
        if limit and not warned and now >= started + limit - SESSION_WARN:
            left = max(0, started + limit - now)
            _tell("this session ends in %s (--time %s)" % (_duration(left), _duration(limit)))
            warned = True
        if limit and now >= started + limit:
            reason.append("its time limit (--time %s) was reached" % _duration(limit))
            break
        if idle is not None:
            why = idle.check()
            if why:
                reason.append(why)
                break
        if crowd is not None:
            crowd.check()
        time.sleep(0.2)
    if reason:
        _once(os.path.join(run_dir, "reason"), reason[0])
        _tell("the session ends: %s" % reason[0])
        _signal_group(child, signal.SIGHUP)
        _signal_group(child, signal.SIGCONT)
        _signal_group(child, signal.SIGTERM)
    _reap_tagged(tag)
    remove_container(spec, grace=0)  # `shell --image`: podman's/docker's container outlives its client: by its name
    if code is None:
        try:
            _, status = os.waitpid(child, 0)
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        except ChildProcessError:
            code = 128 + 9
    for fd in held:  # the session has ended: its leases go (before the end is written)
        os.close(fd)
    keeper_usage(spec)
    _write(os.path.join(run_dir, "exit_code"), "%d\n" % code, 0o644)
    _write(os.path.join(run_dir, "ended"), "%f\n" % time.time(), 0o644)
    return code


IDLE_UTIL = 5.0  # % utilisation at or under which a GPU is idle (when its memory use does not change either)
IDLE_MEMORY_MIB = 1.0  # MiB its memory use may move between two samples and still count as not changing
IDLE_SAMPLE = 10.0  # seconds between two samples (shorter for a short --idle-stop: a sixth of it, at least 1 s)


def idle_sample(devices, before, gpus):
    """Whether this sample finds the devices idle: every one at or under IDLE_UTIL and its memory use within
    IDLE_MEMORY_MIB of the previous sample's (gpus: gpu_util()'s answer; before: the previous one). A device not
    answered for, or no previous sample, is not idle: what cannot be told is never idle."""
    if not devices or before is None:
        return False
    now = dict((g["index"], g) for g in gpus)
    then = dict((g["index"], g) for g in before)
    for index in devices:
        if index not in now or index not in then:
            return False
        if now[index]["util"] > IDLE_UTIL or abs(now[index]["mem_mib"] - then[index]["mem_mib"]) > IDLE_MEMORY_MIB:
            return False
    return True


# The lab's rules, set on the host by its admin (never in a user's inventory, which any user writes): the first of
# LAB_FILES and mnft-lab.yaml in the lease directory that only root can have written (root's, a regular file, not
# writable by group or others, not reached through a link), flat `key: value` lines. `idle_stop: 2h` ends every run
# and session whose GPUs have all been idle that long; a user's --idle-stop may lower it, never raise it.

LAB_FILES = ("/etc/mnft/lab.yaml",)
LAB_NAME = "mnft-lab.yaml"
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _root_text(path):
    """The text of a file only root can have written, or None (as mnft.hosts.leasehost reads its admin files)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return None
        return os.read(fd, 65536).decode("utf-8", "replace")
    finally:
        os.close(fd)


def parse_duration(text):
    """`2h`, `90m`, `1h30m`, `45s`, `90` (seconds) -> seconds (> 0), else None (mnft.core.durations' forms)."""
    import re

    value = str(text).strip().strip("\"'").lower()
    if not value or not re.fullmatch(r"(\d+(\.\d+)?[smhd])+|\d+(\.\d+)?", value):
        return None
    total = sum(float(n) * _DURATION_UNITS[u or "s"] for n, _, u in re.findall(r"(\d+(\.\d+)?)([smhd]?)", value))
    return total if total > 0 else None


def lab_policy(paths=None):
    """The lab's rules on this host: {"path": the file, "idle_stop": seconds, "problem": a value it ignores}, or {}."""
    if paths is None:
        where = lease_path()
        paths = LAB_FILES + ((os.path.join(os.path.dirname(where), LAB_NAME),) if where else ())
    for path in paths:
        text = _root_text(path)
        if text is None:
            continue
        values = {}
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if ":" in line:
                key, value = line.split(":", 1)
                values[key.strip()] = value.strip()
        out = {"path": path}
        if values.get("idle_stop"):
            seconds = parse_duration(values["idle_stop"])
            if seconds:
                out["idle_stop"] = seconds
            else:
                out["problem"] = "%s: idle_stop %r is not a duration (2h, 90m …) and is ignored" % (path, values["idle_stop"][:40])
        return out
    return {}


def idle_limit(asked, lab):
    """(seconds or None, how the limit is named in the reason, a note for the run's output or None): the run's
    own --idle-stop, lowered to the lab's idle_stop (which applies alone when it asked none)."""
    lab_s = lab.get("idle_stop")
    if lab_s and (not asked or lab_s < asked):
        said = "the lab's idle_stop %s, %s" % (_duration(lab_s), lab["path"])
        note = ("--idle-stop %s is more than this host allows: " % _duration(asked) if asked else "") + \
            "ended once its GPUs have all been idle for %s (%s)" % (_duration(lab_s), said)
        return lab_s, said, note
    if asked:
        return float(asked), "--idle-stop %s" % _duration(asked), None
    return None, None, None


def devices_of(spec):
    """The GPUs a run holds on this host: the spec's, else those its device leases name (mnft-dev-gpu<N>.json)."""
    import re

    named = [d for d in spec.get("devices") or [] if isinstance(d, int)]
    if named:
        return named
    found = []
    for path in spec.get("leases") or []:
        match = re.fullmatch(r"mnft-dev-gpu(\d+)\.json", os.path.basename(path))
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


class IdleWatch:
    """How long a run's (or session's) GPUs have been idle, sampled by its keeper; with the spec's `idle_stop`
    (seconds), the reason to end it once they have all been idle that long. Each change is written into the
    run's device leases (`idle_since`, `idle_s`: the idle seconds before it), which `mnft lab` shows and the
    usage log counts."""

    def __init__(self, spec, sample=gpu_util, clock=time.time):
        self.devices = [d for d in spec.get("devices") or [] if isinstance(d, int)]
        self.stop_after = float(spec.get("idle_stop") or 0)
        self.said = spec.get("idle_said") or "--idle-stop %s" % _duration(self.stop_after)
        self.every = max(1.0, min(IDLE_SAMPLE, self.stop_after / 6.0)) if self.stop_after else IDLE_SAMPLE
        self.leases = [p for p in spec.get("leases") or [] if "mnft-dev-gpu" in os.path.basename(p)]
        self.sample, self.clock = sample, clock
        self.before, self.sampled, self.next = None, None, 0.0
        self.since, self.total = None, 0.0

    def idle_for(self):
        return 0.0 if self.since is None else self.clock() - self.since

    def idle_seconds(self):
        return self.total + self.idle_for()

    def check(self):
        """Sample when due; the reason to end the run when its GPUs have been idle for idle_stop, else None."""
        now = self.clock()
        if now < self.next or not self.devices:
            return None
        self.next = now + self.every
        gpus = self.sample()
        idle = idle_sample(self.devices, self.before, gpus)
        then = self.sampled
        self.before, self.sampled = gpus or None, now
        if idle and self.since is None:
            self.since = then  # idle from the sample it is compared with
            self.mark()
        elif not idle and self.since is not None:
            self.total += now - self.since
            self.since = None
            self.mark()
        if self.stop_after and self.since is not None and now - self.since >= self.stop_after:
            return ("its GPUs were idle for %s (%s: utilisation at or under %g%% and memory use unchanged)"
                    % (_duration(now - self.since), self.said, IDLE_UTIL))
        return None

    def mark(self):
        """The idle state into each device lease the run holds (written in place, never truncated first: a reader
        never finds it empty)."""
        for path in self.leases:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError:
                continue
            try:
                old = os.pread(fd, 65536, 0)
                holder = json.loads(old.decode("utf-8"))
                if not isinstance(holder, dict):
                    continue
                holder.update(idle_since=self.since, idle_s=round(self.total, 1))
                data = json.dumps(holder, sort_keys=True).encode()
                os.pwrite(fd, data + b" " * max(0, len(old) - len(data)), 0)
            except (OSError, ValueError):
                pass
            finally:
                os.close(fd)


def _idle_watch(spec, say):
    """The keeper's IdleWatch when the run (or session) has an idle limit: its own, lowered to the lab's."""
    lab = lab_policy()
    if lab.get("problem"):
        say("note: %s" % lab["problem"])
    limit, said, note = idle_limit(spec.get("idle_stop"), lab)
    if not limit:
        return None
    if note:
        say(note)
    return IdleWatch(dict(spec, devices=devices_of(spec), idle_stop=limit, idle_said=said))


# ------------------------------------------------------------------------------------------------ collisions
# A compute process on one of the run's GPUs that is not of the run (someone ignored CUDA_VISIBLE_DEVICES): the
# keeper says so once in the run's output. `foreign` and `process_facts` are mnft.hosts.leasehost's (a copy: each
# host script is one file; tests hold the two to the same answers).

COLLISION_EVERY = 5.0  # seconds between two looks at who computes on the run's GPUs
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


def parse_gpu_buses(text):
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` -> {bus id (upper case): index}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out[parts[1].upper()] = int(parts[0])
    return out


def parse_bus_apps(text):
    """`nvidia-smi --query-compute-apps=gpu_bus_id,pid --format=csv,noheader` -> [(bus id, pid)]."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            out.append((parts[0].upper(), int(parts[1])))
    return out


def _smi(query):
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=5)
    except Exception:  # noqa: BLE001
        return ""
    return done.stdout if done.returncode == 0 else ""


def gpu_processes():
    """[(GPU index, pid)] of every compute process on this host's GPUs ([] when nvidia-smi cannot tell)."""
    buses = parse_gpu_buses(_smi("--query-gpu=index,pci.bus_id"))
    return [(buses[bus], pid) for bus, pid in parse_bus_apps(_smi("--query-compute-apps=gpu_bus_id,pid")) if bus in buses]


def _user_of(pid):
    import pwd

    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class CollisionWatch:
    """The keeper's look at its GPUs for a process that is not of its run: each such process said once."""

    def __init__(self, spec, say, keeper=None, processes=gpu_processes, facts=process_facts, user_of=_user_of, clock=time.time):
        self.devices = set(d for d in spec.get("devices") or [] if isinstance(d, int))
        self.run_id = spec.get("run_id")
        self.what = "session" if spec.get("kind") == "session" else "run"
        self.say = say
        self.in_image = bool(spec.get("container"))
        self.keeper = os.getpid() if keeper is None else keeper
        self.processes, self.facts, self.user_of, self.clock = processes, facts, user_of, clock
        self.said, self.next = set(), 0.0

    def check(self):
        """Look when due; say each process on the run's GPUs that is not of the run, once; return what was said."""
        now = self.clock()
        if now < self.next or not self.devices:
            return []
        self.next = now + COLLISION_EVERY
        lines = []
        for index, pid in self.processes():
            if index not in self.devices or (index, pid) in self.said:
                continue
            if foreign(self.facts(pid), self.run_id, [self.keeper], self.in_image):
                self.said.add((index, pid))
                lines.append("GPU %d of this %s is also used by %s pid %d, a process not of this %s (it ignored "
                             "CUDA_VISIBLE_DEVICES): both compete for its memory and time; `mnft lab` names it"
                             % (index, self.what, self.user_of(pid) or "?", pid, self.what))
        for line in lines:
            self.say(line)
        return lines


def _collision_watch(spec, say):
    """The keeper's CollisionWatch when the run (or session) holds GPUs here, else None."""
    devices = devices_of(spec)
    if not devices:
        return None
    return CollisionWatch(dict(spec, devices=devices), say)


# The usage line of a lease whose last holder is the keeper (a detached run, a session whose controller is gone):
# the same line, in the same file, as mnft.hosts.leasehost.usage_line and log_usage write (a copy: each host script
# is one file; tests hold the two to one line).

USAGE_FIELDS = ("run_id", "command", "session", "user", "controller", "image")
USAGE_BYTES = 1 << 20


def last_out(run_id, paths):
    """The leases of the run nobody else holds any more (the keeper let go last): each marked released, as
    leasehost.release marks it; returns what each named."""
    import fcntl

    ended = []
    for path in paths or []:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            old = os.pread(fd, 65536, 0)
            holder = json.loads(old.decode("utf-8"))
            named = holder.get("run_id") if isinstance(holder, dict) else None
            if isinstance(named, str) and named and (run_id == named or run_id.startswith(named + "-a")) and not holder.get("released"):
                holder["released"] = time.time()
                data = json.dumps(holder, sort_keys=True).encode()
                os.pwrite(fd, data + b" " * max(0, len(old) - len(data)), 0)
                ended.append(holder)
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)
    return ended


def usage_line(ended):
    devices = [e for e in ended if isinstance(e.get("device"), dict)]
    if not ended:
        return None
    import pwd

    first, now = ended[0], time.time()
    line = dict((k, first.get(k)) for k in USAGE_FIELDS)
    idle = []
    for e in devices:
        since = e.get("idle_since")
        idle.append(float(e.get("idle_s") or 0) + (now - since if isinstance(since, (int, float)) else 0.0))
    try:
        login = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        login = "uid %d" % os.getuid()
    line.update(host=os.uname()[1], login=login, uid=os.getuid(), devices=[e["device"].get("index") for e in devices],
                start=first.get("taken"), end=now, idle_s=round(min(idle) if idle else 0.0, 1), queued=first.get("queued"))
    return line


def log_usage(line, directory):
    import stat

    if not line or not directory:
        return
    path = os.path.join(directory, "mnft-usage-%d.jsonl" % os.getuid())
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


def keeper_usage(spec):
    """The keeper let go of the run's leases: if nobody else holds them, their usage line is its to write."""
    paths = spec.get("leases") or []
    ended = last_out(spec.get("run_id") or "", paths)
    if ended and paths:
        log_usage(usage_line(ended), os.path.dirname(paths[0]))


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return "%ds" % seconds
    if seconds < 3600:
        return "%dm%s" % (seconds // 60, "%02ds" % (seconds % 60) if seconds % 60 else "")
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


WATCH_SETTLE = 3.0  # seconds a session's watcher waits, once the controller's channel closed, for the keeper's own end


def watch(run_dir):
    """The session's dead-man (see above): ends it when the controller's heartbeats stop before it ended."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    deadman = float(spec.get("deadman") or 25)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    last = time.time()
    reason = None
    while reason is None:
        if os.path.exists(os.path.join(run_dir, "ended")):
            return 0
        ready, _, _ = select.select([stdin], [], [], 0.5)
        if ready:
            if not os.read(stdin.fileno(), 4096):
                reason = "the controller's connection closed"
            else:
                last = time.time()
        if reason is None and time.time() - last > deadman:
            reason = "no heartbeat from the controller for %gs" % deadman
    # the channel also closes when the session ends on the host (stopped, timed out: its terminal closes, then the
    # controller lets go): the keeper's own reason, written a moment later, is the session's, not a lost controller
    settle = time.time() + WATCH_SETTLE
    while time.time() < settle and not any(os.path.exists(os.path.join(run_dir, f)) for f in ("ended", "reason")):
        time.sleep(0.1)
    if os.path.exists(os.path.join(run_dir, "ended")) or os.path.exists(os.path.join(run_dir, "reason")):
        return 0  # it ended by itself meanwhile (the controller lets go of this channel once the session is over)
    _once(os.path.join(run_dir, "reason"), reason)
    result = terminate(run_dir, SESSION_REAP + 2)
    emit("stopped", reason=reason, **result)
    return 0


def main(argv):
    if not argv:
        sys.stderr.write(__doc__)
        return 2
    mode, args = argv[0], argv[1:]
    if mode == "launch":
        return launch()
    if mode == "keep":
        return keep(args[0])
    if mode == "session-prepare":
        return session_prepare()
    if mode == "session":
        return session(_path(args[0]))
    if mode == "watch":
        return watch(_path(args[0]))
    if mode == "stop":
        if len(args) > 2 and args[2] == "session":  # `mnft stop` of a session: its end is this, whichever signal lands first
            _once(os.path.join(_path(args[0]), "reason"), "stopped by mnft stop")
        print(json.dumps(terminate(_path(args[0]), float(args[1]) if len(args) > 1 else 10.0)))
        return 0
    if mode == "status":
        print(json.dumps(status(_path(args[0]))))
        return 0
    if mode == "checkpoints":
        print(json.dumps(list_checkpoints(args[0])))
        return 0
    if mode == "pack":
        named = [a for a in args[1:] if a.startswith(CHECKPOINTS_OPTION)]
        return pack(_path(args[0]), [a for a in args[1:] if not a.startswith(CHECKPOINTS_OPTION)],
                    named[-1][len(CHECKPOINTS_OPTION):] if named else None)
    if mode == "tail":
        follow = "--follow" in args
        rest = [a for a in args if a != "--follow"]
        return tail(_path(rest[0]), int(rest[1]) if len(rest) > 1 else 0, follow)
    sys.stderr.write("unknown mode %r\n" % mode)
    return 2


def source():
    """This script's text: given by mnft.hosts.pyrun's bootstrap when shipped, else read from the file."""
    shipped = globals().get("__source__")
    if shipped:
        return shipped.decode()
    with open(__file__) as fh:
        return fh.read()


SOURCE = source()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
