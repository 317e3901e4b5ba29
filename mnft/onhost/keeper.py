"""The run's keeper (mnft.onhost.agent `keep`): the session leader of the run, which runs its command, holds its
leases, watches its GPUs and records its end. Standard library only.
"""

import json
import os
import signal
import time

from .containers import _make_mounts, remove_container
from .procs import RUN_ID_VAR
from .runfiles import LEASE_FDS_VAR, TAG_VAR, _expand, _once, _path, _read, _write
from .runleases import keeper_usage, relock
from .runprocs import _signal_tagged, run_pids
from .watches import _collision_watch, _idle_watch


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
