"""Run a shipped torchrun entry script on a host, bounded by the controller's connection.

    torchlaunch.py torchrun [--hold] TORCHRUN_ARG... -- SCRIPT_ARG...
    torchlaunch.py direct [--hold] --nnodes N --nproc-per-node G --node-rank I --master-addr A --master-port P -- SCRIPT_ARG...

Reads the entry script on stdin (a decimal length, a newline, the source: what mnft.hosts.pyrun.payload makes),
writes it into a private temporary directory and runs it:

- torchrun: `python -m torch.distributed.run TORCHRUN_ARG... SCRIPT SCRIPT_ARG...`, as training does;
- direct: G processes `python SCRIPT SCRIPT_ARG...` with the environment torchrun gives its workers under static
  rendezvous (RANK = I·G + LOCAL_RANK, WORLD_SIZE = N·G, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
  MASTER_PORT; OMP_NUM_THREADS=1 when G > 1 and it is unset, as torchrun does). One Python + torch start per rank
  instead of two: the perf check's cost on a CPU-bound test bed. When one rank fails the others are stopped.

With --hold the script also gets `--hold FILE` (FILE in that directory): its ranks start, import torch, say they
are ready and wait; a line "go" on stdin creates FILE and releases them. The controller starts the ranks early and
releases them when it is ready to measure.

Each child runs in its own process group with stdout/stderr inherited. When stdin closes before they are done (the
controller gave up or its connection dropped), every group gets SIGTERM, then SIGKILL after 5 s: nothing is left
behind. Exits with the first non-zero exit code (2 for a malformed command line). Stdlib only, Python >= 3.8.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

GRACE = 5.0
SCRIPT_NAME = "mnft_perf_entry.py"


def _read_payload() -> bytes:
    stdin = sys.stdin.buffer
    size = int(stdin.readline())
    return stdin.read(size)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, GRACE)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


USAGE = ("usage: torchlaunch.py torchrun [--hold] TORCHRUN_ARG... -- SCRIPT_ARG...\n"
         "       torchlaunch.py direct [--hold] --nnodes N --nproc-per-node G --node-rank I --master-addr A --master-port P -- SCRIPT_ARG...\n")
GO_NAME = "go"
DIRECT_OPTIONS = ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port", "--max-restarts")


def direct_envs(args: list, environ: dict) -> list:
    """The environment of each local rank, as torchrun's static rendezvous sets it; ValueError on bad args."""
    values = {}
    rest = list(args)
    while rest:
        name = rest.pop(0)
        if name not in DIRECT_OPTIONS or not rest:
            raise ValueError("unexpected argument %r" % name)
        values[name] = rest.pop(0)
    nnodes, nproc, node = (int(values.get(k, "1")) for k in ("--nnodes", "--nproc-per-node", "--node-rank"))
    if nnodes < 1 or nproc < 1 or not 0 <= node < nnodes or "--master-addr" not in values or "--master-port" not in values:
        raise ValueError("need --nnodes N ≥ 1, --nproc-per-node G ≥ 1, 0 ≤ --node-rank < N, --master-addr, --master-port")
    envs = []
    for local in range(nproc):
        env = dict(environ, RANK=str(node * nproc + local), WORLD_SIZE=str(nnodes * nproc), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node), NODE_RANK=str(node),
                   MASTER_ADDR=values["--master-addr"], MASTER_PORT=values["--master-port"])
        if nproc > 1 and "OMP_NUM_THREADS" not in environ:
            env["OMP_NUM_THREADS"] = "1"
        envs.append(env)
    return envs


def main(argv: list) -> int:
    if len(argv) < 2 or argv[0] not in ("torchrun", "direct") or "--" not in argv:
        sys.stderr.write(USAGE)
        return 2
    mode, cut = argv[0], argv.index("--")
    launch_args, script_args = argv[1:cut], argv[cut + 1:]
    held = launch_args[:1] == ["--hold"]
    if held:
        launch_args = launch_args[1:]
    envs = None
    if mode == "direct":
        try:
            envs = direct_envs(launch_args, dict(os.environ))
        except ValueError as exc:
            sys.stderr.write("torchlaunch: %s\n%s" % (exc, USAGE))
            return 2
    source = _read_payload()
    workdir = tempfile.mkdtemp(prefix="mnft-perf-")
    procs = []
    done = threading.Event()

    def stop_all() -> None:
        for proc in procs:
            _kill_group(proc)

    go = os.path.join(workdir, GO_NAME)

    def watch_stdin() -> None:
        try:  # the same buffered stream the payload came from: a line it read ahead is not lost
            for line in iter(sys.stdin.buffer.readline, b""):
                if held and line.strip() == b"go" and not os.path.exists(go):
                    with open(go + ".tmp", "wb"):
                        pass
                    os.rename(go + ".tmp", go)
        except (OSError, ValueError):
            pass
        if not done.is_set():  # the controller is gone: nothing may outlive it
            stop_all()

    try:
        script = os.path.join(workdir, SCRIPT_NAME)
        with open(script, "wb") as f:
            f.write(source)
        if held:
            script_args = [*script_args, "--hold", go]
        if envs is None:
            argvs = [([sys.executable, "-m", "torch.distributed.run", *launch_args, script, *script_args], None)]
        else:
            argvs = [([sys.executable, script, *script_args], env) for env in envs]
        for child, env in argvs:
            procs.append(subprocess.Popen(child, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        threading.Thread(target=watch_stdin, daemon=True).start()
        code = 0
        try:
            pending = list(procs)
            while pending:
                for proc in list(pending):
                    try:
                        rc = proc.wait(timeout=0.1)
                    except subprocess.TimeoutExpired:
                        continue
                    pending.remove(proc)
                    if rc and not code:
                        code = rc
                        stop_all()  # a rank failed: the others would wait for it until their timeout
        except KeyboardInterrupt:
            stop_all()
            code = 130
        done.set()
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # workers torchrun left behind, if any
            except (ProcessLookupError, PermissionError):
                pass
        return code
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def leave(code: int) -> None:
    """Exit without the interpreter's shutdown: the stdin watcher may be blocked in a read of the buffered stdin,
    whose lock would make the shutdown abort."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
