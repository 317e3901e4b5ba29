"""Interactive sessions (`mnft shell`) on this host (mnft.onhost.agent `session-prepare`, `session`, `watch`): see
below. Standard library only.
"""

import json
import os
import select
import signal
import sys
import time

from .containers import _make_mounts, remove_container
from .procs import RUN_ID_VAR
from .runfiles import (PAYLOAD_NAME, TAG_VAR, _duration, _expand, _once, _own_argv, _own_payload, _path, _read, _write,
                       emit)
from .runleases import keeper_usage, lease_fds
from .runprocs import _after_kill, _signal_group, _signal_tagged, run_pids, start_time, terminate
from .watches import _collision_watch, _idle_watch


# ---------------------------------------------------------------------------------------------------- sessions
# An interactive session (`mnft shell`): `session-prepare` writes its run directory (spec.json, agent.payload) from a
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
    own = _own_payload(run_dir)
    print(json.dumps({"run_dir": run_dir, "argv": _own_argv(own, "session", run_dir), "note": note, "hostname": os.uname()[1]}))
    return 0


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


PATH_FIRST_VAR = "MNFT_PATH_FIRST"  # the directory a session's login shell puts first on PATH once its profile has run


def session(run_dir):
    """The keeper of an interactive session (see above); its exit status is the program's."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json")))
    tag, run_id = spec["tag"], spec["run_id"]
    if os.environ.get(TAG_VAR) != tag:  # once more with the tag in its own environment: the session is found by it
        env = dict(os.environ)
        env[RUN_ID_VAR], env[TAG_VAR] = run_id, tag
        os.execve(sys.executable, _own_argv(os.path.join(run_dir, PAYLOAD_NAME), "session", run_dir), env)
    env = dict(os.environ)
    env.update({k: _expand(v) for k, v in (spec.get("env") or {}).items()})
    first = spec.get("path_first")
    if first:  # the environment a run gets, first on PATH: for a command at once, for a login shell after its profile
        first = _expand(first)
        env["PATH"] = first + os.pathsep + env.get("PATH", "")
        env[PATH_FIRST_VAR] = first
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
    os.chdir(run_dir)  # the keeper works in its run directory: root's stop finds it there (leases.run_dirs)
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
