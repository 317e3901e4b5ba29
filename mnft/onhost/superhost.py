"""A detached run's supervisor, the host side: its bundle of mnft unpacked, the supervisor started in a session of
its own, its state read, its stop asked. Standard library only, Python >= 3.8.

The supervisor is mnft's own supervision loop (mnft.run.supervised) in a process of the run's user on the host the
plan names for it: it lives exactly as long as its run (or its place in line). Nothing here is a daemon: `start`
returns once the supervisor has said it runs, and every other op reads or signals that one process.

    look HASH [RUN_ID]   this host's Python and platform, whether bundle HASH is here, the mesh key, and RUN_ID's state
    unpack HASH          the bundle (a tar.gz, on stdin after the payload) into ~/.mnft/supervisor/HASH, atomically
    prepare RUN_ID       the run's directory (0700) and the files its supervisor reads (JSON on stdin: {name: text})
    start RUN_ID HASH    the supervisor started, then its spec (on stdin, once the code is there) handed to it through
                         a pipe, never written
    state RUN_ID OFFSET [INNER]  alive or not (pid and start time), its exit, its console from OFFSET (bounded), and
                         the state of its run (or of INNER, a point of the sweep it supervises)
    stop RUN_ID BY [INNER]  the run's stop asked (the file its supervisor reads), then SIGINT to that supervisor only
                         (or to INNER's train, a point of the sweep it supervises)
    reach                whether this user's ssh reaches each peer (JSON on stdin: [{name, address, port, user}]) with
                         BatchMode and strict host keys, as the supervisor must (`mnft check`): {name: null or why}

Places: ~/.mnft/supervisor/<hash>/site (mnft and its controller's libraries), ~/.mnft/supervised/<run id>/
(supervisor.json, console.log, exit.json, home/ (its MNFT_HOME), runs/<run id>/ (the run's record), src/ (the code)).
"""

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time

from .meshpeers import MESH_KEY
from .runprocs import start_time

BUNDLES = "~/.mnft/supervisor"
RUNS = "~/.mnft/supervised"
LOG = "console.log"
ME = "supervisor.json"
EXIT = "exit.json"
STOP_REQUESTED = "stop-requested"  # mnft.run.records.STOP_REQUESTED (tests/test_supervisor.py holds them equal)
# Every member is judged in unpack itself, on every Python; where this Python's tarfile also has extraction
# filters (3.11.4 and 3.10.12 up; Debian 12's 3.11.2 has none), its "data" filter is asked for as well
EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
READ_MAX = 256 << 10  # console bytes one `state` returns
START_WAIT = 60.0  # seconds the supervisor may take to say it runs (its imports on a cold disk)
ENV_KEEP = ("HOME", "USER", "LOGNAME", "PATH", "LANG", "LC_ALL", "SHELL", "TMPDIR", "TZ")
BOOT = ("import sys; sys.path[:0] = [sys.argv[1]]; from mnft.run.supervised import main; sys.exit(main(sys.argv[2]))")


def _home(path):
    return os.path.expanduser(path)


def _safe_name(text):
    return bool(text) and len(text) <= 128 and all(c.isalnum() or c in "._-" for c in text) and text[0].isalnum()


def bundle_dir(digest):
    return os.path.join(_home(BUNDLES), digest)


def run_dir(run_id):
    return os.path.join(_home(RUNS), run_id)


def _libc():
    name, version = platform.libc_ver()
    return [name or None, version or None]


RECORD_MAX = 16 << 20  # bytes of a run's record read at most (its facts of 64 hosts fit)


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read(RECORD_MAX))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def state(run_id, offset=0, inner=None):
    """What a run's supervisor is now: its record (pid, start time), alive or not, its exit, its console from offset;
    the state of its run, or of `inner`, a run it supervises (a point of a sweep)."""
    folder = run_dir(run_id)
    me = _read_json(os.path.join(folder, ME))
    alive = False
    if me is not None:
        try:
            alive = start_time(int(me.get("pid"))) == me.get("start")
        except (TypeError, ValueError):
            alive = False
    text, end = "", offset
    try:
        with open(os.path.join(folder, LOG), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if offset > size:
                offset = 0
            fh.seek(offset)
            data = fh.read(READ_MAX)
        cut = data.rfind(b"\n") + 1 if len(data) == READ_MAX else len(data)
        text, end = data[:cut].decode("utf-8", "replace"), offset + cut
    except OSError:
        pass
    record = _read_json(os.path.join(folder, "runs", inner or run_id, "run.json")) or {}
    return {"exists": os.path.isdir(folder), "supervisor": me, "alive": alive, "exit": _read_json(os.path.join(folder, EXIT)),
            "log": text, "offset": end, "run_state": record.get("state"), "reason": record.get("reason")}


def look(digest, run_id=None):
    found = {"python": list(sys.version_info[:3]), "executable": sys.executable, "machine": platform.machine(),
             "system": platform.system(), "libc": _libc(), "bundle": os.path.isfile(os.path.join(bundle_dir(digest), ".complete")),
             "mesh_key": os.path.isfile(_home(MESH_KEY)), "home": _home("~")}
    if run_id:
        found["run"] = state(run_id)
    return found


def unpack(digest, stream):
    final = bundle_dir(digest)
    if os.path.isfile(os.path.join(final, ".complete")):
        return {"unpacked": False}
    parent = os.path.dirname(final)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = os.path.join(parent, ".%s.%d.tmp" % (digest, os.getpid()))
    os.makedirs(tmp, mode=0o700)
    try:
        with tarfile.open(fileobj=stream, mode="r|gz") as tar:
            for member in tar:
                target = os.path.realpath(os.path.join(tmp, member.name))
                if not (member.isfile() or member.isdir()) or os.path.isabs(member.name) or not target.startswith(os.path.realpath(tmp) + os.sep):
                    raise ValueError("the bundle holds %r, which is not a plain file inside it" % member.name)
                member.mode = 0o700 if member.isdir() else (0o700 if member.mode & 0o100 else 0o600)
                tar.extract(member, tmp, **EXTRACT)
        with open(os.path.join(tmp, ".complete"), "w"):
            pass
        try:
            os.rename(tmp, final)
        except OSError:  # another start unpacked the same bundle meanwhile: theirs is as good
            if not os.path.isfile(os.path.join(final, ".complete")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"unpacked": True}


def prepare(run_id, files):
    """The run's directory (0700, refused when it exists: a run id is never reused) and the files it is given."""
    folder = run_dir(run_id)
    os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
    os.mkdir(folder, 0o700)
    for sub in ("home", "runs", "src"):
        os.mkdir(os.path.join(folder, sub), 0o700)
    for name, text in (files or {}).items():
        parts = name.split("/")
        if not all(_safe_name(p) for p in parts):
            raise ValueError("file name %r" % name)
        path = os.path.join(folder, *parts)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    return {"dir": folder}


def start(run_id, digest, read_spec):
    """The supervisor, in a session of its own, its output into console.log; returns once it wrote supervisor.json
    (it runs) or ended (its console's last lines say why). It is started before its spec is read (read_spec: this
    op's stdin, which the controller writes once the run's code is there), so its imports overlap the code's copy."""
    folder = run_dir(run_id)
    site = os.path.join(bundle_dir(digest), "site")
    if not os.path.isdir(site):
        return {"error": "bundle %s is not on this host" % digest}
    if os.path.exists(os.path.join(folder, ME)):
        return {"error": "run %s has a supervisor already" % run_id}
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    with open(os.path.join(folder, LOG), "ab") as log:
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, site, folder], stdin=subprocess.PIPE, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=folder, env=env, close_fds=True)
    spec = read_spec()
    if not spec:  # the controller gave up (its code copy failed, it was interrupted): nothing is left running
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"error": "no spec came: the supervisor was not started"}
    try:
        child.stdin.write(spec)
        child.stdin.close()
    except OSError:
        pass
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        me = _read_json(os.path.join(folder, ME))
        if me is not None and me.get("pid") == child.pid:
            return {"pid": child.pid, "start": me.get("start"), "host": me.get("host")}
        if child.poll() is not None:
            break
        time.sleep(0.05)
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"error": "the supervisor did not start within %ds" % START_WAIT, "log": state(run_id)["log"][-4000:]}
    return {"error": "the supervisor ended at its start (exit %s)" % child.returncode, "log": state(run_id)["log"][-4000:]}


def stop(run_id, by, inner=None):
    """Ask the run to stop (its supervisor reads the request, as an attached one does), then SIGINT the supervisor
    it recorded, proved by its start time: Ctrl-C, as in an attached terminal. `inner`: one point of the sweep it
    supervises instead (that point's train, as the sweep's supervisor recorded it in points/<id>.json)."""
    found = state(run_id)
    me = found["supervisor"] or {}
    if inner:
        me = _read_json(os.path.join(run_dir(run_id), "points", inner + ".json")) or {}
        try:
            found["alive"] = found["alive"] and start_time(int(me.get("pid"))) == me.get("start")
        except (TypeError, ValueError):
            found["alive"] = False
    record = os.path.join(run_dir(run_id), "runs", inner or run_id)
    if os.path.isdir(record):
        with open(os.path.join(record, STOP_REQUESTED), "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"at": time.time(), "by": by}) + "\n")
    signalled = False
    if found["alive"]:
        try:
            os.kill(int(me["pid"]), signal.SIGINT)
            signalled = True
        except OSError:
            pass
    return {"signalled": signalled, "alive": found["alive"]}


REACH_TIMEOUT = 15.0  # seconds one peer's `ssh … true` may take


def reach(peers):
    """`ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -p PORT -l USER ADDRESS true` to each peer, at most 16 at
    once: the keys this user's ssh offers (the mesh key through ~/.ssh/config) accepted, its host key known."""
    import threading

    out, gate = {}, threading.Semaphore(16)

    def one(peer):
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10",
                "-p", str(int(peer.get("port") or 22)), "-l", str(peer["user"]), "--", str(peer["address"]), "true"]
        with gate:
            try:
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=REACH_TIMEOUT)
                why = None if done.returncode == 0 else (done.stderr.decode("utf-8", "replace").strip().splitlines() or ["exit %d" % done.returncode])[-1]
            except (OSError, subprocess.TimeoutExpired) as exc:
                why = "no answer within %ds" % REACH_TIMEOUT if isinstance(exc, subprocess.TimeoutExpired) else str(exc)
        out[peer["name"]] = why[:300] if why else None

    threads = [threading.Thread(target=one, args=(p,)) for p in peers if isinstance(p, dict) and p.get("address") and p.get("user")
               and not str(p["address"]).startswith("-") and not str(p["user"]).startswith("-")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv) -> int:
    ops = {"look": (1, 2), "unpack": (1, 1), "prepare": (1, 1), "start": (2, 2), "state": (2, 3), "stop": (2, 3), "reach": (0, 0)}
    names = argv[1:3] if argv and argv[0] in ("look", "start") else [a for i, a in enumerate(argv[1:4]) if i != 1] if argv and argv[0] in ("state", "stop") else argv[1:2]
    if not argv or argv[0] not in ops or not ops[argv[0]][0] <= len(argv) - 1 <= ops[argv[0]][1] or not all(_safe_name(a) for a in names):
        sys.stderr.write("usage: superhost look HASH [RUN_ID] | unpack HASH | prepare RUN_ID | start RUN_ID HASH | state RUN_ID OFFSET [INNER] | stop RUN_ID BY [INNER] | reach\n")
        return 2
    op, args = argv[0], argv[1:]
    try:
        if op == "look":
            out = look(args[0], args[1] if len(args) > 1 else None)
        elif op == "unpack":
            out = unpack(args[0], sys.stdin.buffer)
        elif op == "prepare":
            out = prepare(args[0], json.loads(sys.stdin.buffer.read(8 << 20).decode("utf-8") or "{}"))
        elif op == "start":
            out = start(args[0], args[1], lambda: sys.stdin.buffer.read(16 << 20))
        elif op == "state":
            out = state(args[0], int(args[1]), args[2] if len(args) > 2 else None)
        elif op == "reach":
            out = {"peers": reach(json.loads(sys.stdin.buffer.read(1 << 20).decode("utf-8") or "[]"))}
        else:
            out = stop(args[0], args[1], args[2] if len(args) > 2 else None)
    except (OSError, ValueError, tarfile.TarError) as exc:
        out = {"error": "%s: %s" % (op, getattr(exc, "strerror", None) or exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0
