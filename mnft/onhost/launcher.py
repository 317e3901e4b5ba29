"""A run's launch (mnft.onhost.agent `launch`): read a JSON spec line from stdin, start the run under a keeper, then
(attached) stream events as JSON lines and obey the controller: "hb" lines keep it alive, "stop" or EOF or no
heartbeat for `deadman` seconds tears the run's process group down. Standard library only.
"""

import json
import os
import select
import sys
import time

from .follow import _Tail
from .procs import RUN_ID_VAR
from .runfiles import LEASE_FDS_VAR, TAG_VAR, _own_argv, _own_payload, _path, _read, _write, done_ranks, emit, stopped_by
from .runleases import lease_fds
from .runprocs import start_time, terminate
from .samples import SAMPLE_EVERY, Sampler


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
        own = _own_payload(run_dir)
        if wrapper:
            _write(os.path.join(run_dir, "entry.py"), wrapper, 0o644)
        log = open(os.path.join(run_dir, "output.log"), "ab")
        env = dict(os.environ)
        env[RUN_ID_VAR] = spec["run_id"]
        env[TAG_VAR] = spec["tag"]
        held = lease_fds(spec["run_id"], spec.get("leases"))
        env[LEASE_FDS_VAR] = ",".join(str(fd) for fd in held)
        keeper = subprocess.Popen(
            _own_argv(own, "keep", run_dir),
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


def forward_lines(run_dir, out, metrics, said):
    """New output lines and metrics since the last call, as events. The mark of `mnft stop` (mnft.onhost.runfiles.
    mark_stop) is looked for after the lines are read: it is written before the first signal, so a line the signal
    made is never sent before the `stopping` event that says what it is. said: the mark once said (a list)."""
    lines = out.lines()
    if not said:
        by = stopped_by(run_dir)
        if by is not None:
            said.append(by)
            emit("stopping", by=by)
    for line in lines:
        emit("line", text=line)
    for line in metrics.lines() if metrics is not None else ():
        emit("mline", text=line)  # the controller parses it with the job's metrics format


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

    said = []  # `mnft stop` marked the run: said once

    def forward():
        forward_lines(run_dir, out, metrics, said)

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
