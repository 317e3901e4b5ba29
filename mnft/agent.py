#!/usr/bin/env python3
"""mnft run agent: the host side of a training run. Standard library only; shipped to hosts with mnft.pyrun.

    launch                 read a JSON spec line from stdin, start the run under a keeper, then (attached) stream
                           events as JSON lines and obey the controller: "hb" lines keep it alive, "stop" or EOF
                           or no heartbeat for `deadman` seconds tears the run's process group down
    keep RUN_DIR           (internal) session leader of the run: runs the command, records its exit code
    stop RUN_DIR [GRACE]   kill that run's process group (recorded pgid, verified by run id), then any process
                           still carrying the run id; print what was killed and what remains
    status RUN_DIR         state, exit code, last metrics line
    tail RUN_DIR [N] [--follow]   the run's output (follow until stdin closes)
    pack RUN_DIR [FILE…]   the run directory and extra files as a base64 tar.gz (for invoke logs)

A run directory holds: spec.json (no secrets), pgid, output.log, exit_code, started, ended, agent.py. Secrets
arrive in the spec's "secrets", are written to secrets.json (0600) for the keeper, which deletes it after reading.
Processes are found by the recorded process group and by MNFT_RUN_ID in their environment, never by name.
"""

import json
import os
import select
import signal
import sys
import time

RUN_ID_VAR = "MNFT_RUN_ID"
TAG_VAR = "MNFT_RUN_TAG"  # run id @ inventory host name: what processes are found (and killed) by


def emit(event, **fields):
    fields["event"] = event
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _path(p):
    return os.path.abspath(os.path.expanduser(p))


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


def _read(path, default=None):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return default


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


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def terminate(run_dir, grace=10.0, keeper=None):
    """SIGTERM the run's process group, SIGKILL after `grace`, then any leftover carrying the run id."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    tag = spec.get("tag")
    pgid = int(_read(os.path.join(run_dir, "pgid"), "0") or 0)
    killed = []
    seen = run_pids(tag) if tag else []  # the run's processes before the kill: a GPU one of them still holds is ours
    if pgid and tag and (_environ_has(pgid, tag) or _group_alive(pgid) and keeper is not None):
        try:
            os.killpg(pgid, signal.SIGTERM)
            killed.append(pgid)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while time.time() < deadline:
        if keeper is not None:
            keeper.poll()
        if not (pgid and _group_alive(pgid)) and not (tag and run_pids(tag)):
            break
        time.sleep(0.1)
    if pgid and _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if tag:
        for pid in run_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    if keeper is not None:
        try:
            keeper.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
    time.sleep(0.1)
    remaining = run_pids(tag) if tag else []
    return dict({"killed": killed, "remaining": remaining}, **gpu_report(gpu_apps(), set(killed) | set(remaining) | set(seen)))


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


def gpu_report(apps, run_pids_seen):
    """Split GPU holders into the run's (a failed stop) and others' (a warning: the GPUs are not free)."""
    if apps is None:
        return {"gpus_held": [], "gpus_other": [], "gpu_error": "nvidia-smi failed"}
    mine = set(run_pids_seen)

    def show(app):
        return "pid %d (%s MiB)" % (app["pid"], app["memory_mib"] if app["memory_mib"] is not None else "?")

    return {
        "gpus_held": [show(a) for a in apps if a["pid"] in mine],
        "gpus_other": [show(a) for a in apps if a["pid"] not in mine],
    }


# ---------------------------------------------------------------------------------------------------- keeper


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
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def keep(run_dir):
    """Session leader of the run (pgid = our pid): run the command, record its exit code."""
    import subprocess

    spec = json.loads(_read(os.path.join(run_dir, "spec.json")))
    env = dict(os.environ)
    env.update({k: _expand(v) for k, v in (spec.get("env") or {}).items()})
    secrets_file = os.path.join(run_dir, "secrets.json")
    if os.path.exists(secrets_file):
        try:
            with open(secrets_file) as fh:
                env.update(json.load(fh))
        finally:
            os.unlink(secrets_file)
    env[RUN_ID_VAR] = spec["run_id"]
    env[TAG_VAR] = spec["tag"]
    signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is for the command; we record its end
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _write(os.path.join(run_dir, "started"), "%f\n" % time.time(), 0o644)
    try:
        child = subprocess.Popen([_expand(a) for a in spec["argv"]], cwd=_path(spec.get("cwd") or "~"), env=env, stdin=subprocess.DEVNULL)
        code = child.wait()
    except OSError as exc:
        print("mnft: cannot start %s: %s" % (spec["argv"][0], exc), flush=True)
        code = 127
    if code < 0:
        code = 128 - code
    _reap_group(spec["tag"])
    _write(os.path.join(run_dir, "exit_code"), "%d\n" % code, 0o644)
    _write(os.path.join(run_dir, "ended"), "%f\n" % time.time(), 0o644)
    return code


# ---------------------------------------------------------------------------------------------------- launch


class _Tail:
    """New complete lines of a file. from_end: skip what it holds now (a resumed job appends to its old
    metrics.jsonl: those lines are history, not this run's progress). A file that shrank is read again from 0."""

    def __init__(self, path, from_end=False):
        self.path, self.pos, self.buf = path, 0, b""
        if from_end:
            try:
                self.pos = os.path.getsize(path)
            except OSError:
                pass

    def lines(self):
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.pos:
                    self.pos, self.buf = 0, b""
                fh.seek(self.pos)
                data = fh.read()
        except OSError:
            return []
        self.pos += len(data)
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        return [line.decode("utf-8", "replace") for line in done]


def launch():
    import subprocess

    spec = json.loads(sys.stdin.buffer.readline())
    run_dir = _path(spec["run_dir"])
    secrets = spec.pop("secrets", None) or {}
    if not os.path.isdir(_path(spec.get("cwd") or "~")):
        emit("error", message="working directory %s does not exist (run invoke sync first)" % spec.get("cwd"))
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
        log = open(os.path.join(run_dir, "output.log"), "ab")
        env = dict(os.environ)
        env[RUN_ID_VAR] = spec["run_id"]
        env[TAG_VAR] = spec["tag"]
        keeper = subprocess.Popen(
            [sys.executable, own, "keep", run_dir],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=run_dir,
        )
    finally:
        if keeper is None and os.path.exists(secrets_file):
            os.unlink(secrets_file)  # no keeper will read it: never leave a secret behind
    _write(os.path.join(run_dir, "pgid"), "%d\n" % keeper.pid, 0o644)
    emit("started", pgid=keeper.pid, run_dir=run_dir, hostname=os.uname()[1])
    if spec.get("detach"):
        return 0
    return supervise(spec, run_dir, keeper, metrics)


def supervise(spec, run_dir, keeper, metrics=None):
    out = _Tail(os.path.join(run_dir, "output.log"))
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
            try:
                emit("metric", data=json.loads(line))
            except ValueError:
                pass

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
                emit("stopped", reason=reason, **result)
                return 0
            code = keeper.poll()
            if code is not None:
                time.sleep(0.1)
                forward()
                recorded = _read(os.path.join(run_dir, "exit_code"))
                emit("exit", code=int(recorded) if recorded else 128 + 9)
                return 0
            if time.time() - last_hb >= 1.0:
                emit("hb", t=time.time())
                last_hb = time.time()
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
        "last_metric": None,
    }
    if spec.get("metrics"):
        lines = _Tail(_path(spec["metrics"])).lines()
        for line in reversed(lines):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if "step" in data and "loss" in data:  # a step's line, not the summary or a checkpoint event
                result["last_metric"] = data
                break
    return result


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


def pack(run_dir, extras):
    """The run directory (and extra files, e.g. rank 0's metrics) as one base64 tar.gz in a JSON line."""
    import base64
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def keep(info):
            name = os.path.basename(info.name)
            return None if name in ("agent.py", "secrets.json") else info

        if os.path.isdir(run_dir):
            tar.add(run_dir, arcname="run", filter=keep)
        for extra in extras:
            path = _path(extra)
            if os.path.isfile(path):
                tar.add(path, arcname="extra/" + os.path.basename(path))
    print(json.dumps({"tar": base64.b64encode(buf.getvalue()).decode(), "found": os.path.isdir(run_dir)}))
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
    if mode == "stop":
        print(json.dumps(terminate(_path(args[0]), float(args[1]) if len(args) > 1 else 10.0)))
        return 0
    if mode == "status":
        print(json.dumps(status(_path(args[0]))))
        return 0
    if mode == "pack":
        return pack(_path(args[0]), args[1:])
    if mode == "tail":
        follow = "--follow" in args
        rest = [a for a in args if a != "--follow"]
        return tail(_path(rest[0]), int(rest[1]) if len(rest) > 1 else 0, follow)
    sys.stderr.write("unknown mode %r\n" % mode)
    return 2


def source():
    """This script's text: given by mnft.pyrun's bootstrap when shipped, else read from the file."""
    shipped = globals().get("__source__")
    if shipped:
        return shipped.decode()
    with open(__file__) as fh:
        return fh.read()


SOURCE = source()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
