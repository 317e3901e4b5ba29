"""mnft provision, the host side: read a host's environment facts, build an environment, switch, roll back.

The controller ships this module (its payload: mnft.hosts.payload) to the host's base Python (mnft.hosts.pyrun) and reads one
JSON object from stdout. Standard library only, Python >= 3.8; nothing here imports an installed package.

Layout on the host, for a `venv` of ~/mnft-env:

    ~/mnft-env              a symbolic link to the current environment (replaced atomically: rename(2))
    ~/mnft-env.d/envs/ID/   the environments: the current one and the previous one (for --rollback)
    ~/mnft-env.d/previous   a link to the previous environment
    ~/mnft-env.d/dist/      what the controller (or a peer) sent: uv and wheels/*.whl
    ~/mnft-env.d/cache/     uv's cache (links into the environments, so a rebuild costs little disk)

    facts VENV [--python P]... [--want X.Y]   Pythons, platform, disk, the environment's distributions, the mesh
    prepare VENV [UV_SHA256]                   create the dist directory (before wheels are sent); a held uv that is
                                               not the controller's is removed, so the send delivers it
    install SPEC_JSON                          build a new environment beside the current one, verify, switch
                                               (SPEC_JSON "-": the spec is the next line of stdin)

    rollback VENV                              switch back to the previous environment

The installer (uv) runs in its own session, its process group led by this script's child (a keeper, KEEPER,
that starts uv). While it runs the script watches stdin, which the controller keeps open and writes a heartbeat
to: EOF there (the controller interrupted, killed, or its connection closed), no heartbeat for the spec's
`deadman` seconds (the network gone without a FIN, the controller stopped or hung), a timeout, SIGTERM or SIGHUP
end that group by its number, remove the half-built environment and leave the current one in place. SIGTERM and SIGHUP only note the
signal (_on_signal): the build loop acts on it, so a cleanup or a switch under way is never cut short. When this
script itself is SIGKILLed, the keeper sees the pipe from it end and ends its own group.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .envfacts import RECORD, URL_CREDENTIALS, _emit, canonical, distributions, env_python_version, facts, root_of
from .filehash import sha256_file



# ------------------------------------------------------------------------------------------------ changing


class Failure(Exception):
    pass


def _lock(root: str):
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise Failure("another mnft provision is running on this host (%s/.lock is held)" % root) from None
    return fd


def _switch(link: str, target: str) -> None:
    """Point `link` at `target` atomically: a new link beside it, renamed over it."""
    tmp = "%s.mnft-tmp-%d" % (link, os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _prune(root: str, keep: set) -> list:
    """Remove environments that are neither current nor previous (an interrupted build among them)."""
    removed = []
    keep = {os.path.realpath(p) for p in keep}  # one resolution on both sides: a home reached through a link
    envs = os.path.join(root, "envs")
    for name in sorted(os.listdir(envs)) if os.path.isdir(envs) else []:
        path = os.path.join(envs, name)
        if os.path.realpath(path) not in keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


class Stopped(Failure):
    """The build was stopped from outside (the controller gone, a signal): no wheel is to blame."""


LOST = "the controller's connection was lost before the switch: the previous environment stays"
SILENT = "no heartbeat from the controller for %gs (its network gone, or it hung) before the switch: the previous environment stays"
KILL_GRACE = 2.0  # seconds the installer's group has between SIGTERM and SIGKILL
OUTPUT_KEPT = 65536  # bytes of the installer's output read back for the error message


def _run(argv: list, env: dict, what: str, timeout: float, watch: bool = False) -> None:
    """Run one installer step (uv) in its own session, so in a process group it leads, its output in a file (no
    pipe to fill). While it runs, with `watch`, stdin is watched: EOF there means the controller is gone (killed,
    interrupted, its connection dropped), and the step's whole group is ended; so it is on a timeout or a stop
    signal to this script (noted by _on_signal, acted on here). The group is signalled by its number while its
    leader is this script's unreaped child (its exit is looked at with WNOWAIT), so the number cannot belong to
    anything else; never a process found by name. The leader is a keeper (KEEPER) holding the read end of a pipe
    from this script: if this script is SIGKILLed, the pipe ends and the keeper ends the group itself."""
    _check_stop()
    output = tempfile.TemporaryFile()
    script_end = None
    try:
        keeper, script_end = os.pipe()  # this script holds the write end (not inherited by anything it starts)
        try:
            process = subprocess.Popen(_kept(argv, keeper), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True, pass_fds=(keeper,))
        except OSError as exc:
            raise Failure("%s: %s" % (what, exc.strerror or exc)) from None
        finally:
            os.close(keeper)
        try:
            deadline = time.monotonic() + timeout
            while not _exited(process.pid):
                _check_stop()
                if watch:
                    gone = _controller_gone(0.2)
                    if gone:
                        raise Stopped(gone)
                else:
                    time.sleep(0.2)
                if time.monotonic() > deadline:
                    raise Failure("%s timed out after %ds" % (what, timeout))
        finally:  # a stop signal now is only noted (_on_signal): the group is ended and reaped before anything else
            _end_group(process.pid)
            process.wait()
        if process.returncode != 0:
            output.seek(max(0, output.seek(0, os.SEEK_END) - OUTPUT_KEPT))
            text = output.read().decode("utf-8", "replace")
            lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
            useful = [ln for ln in lines if not ln.startswith(("hint:", "help:"))] or lines
            detail = "; ".join(useful[-3:]) if useful else "exit %d" % process.returncode
            raise Failure("%s failed: %s" % (what, URL_CREDENTIALS.sub("***@", detail)))
    finally:
        if script_end is not None:
            os.close(script_end)
        output.close()


# The installer group's leader: it starts the installer (argv[2:]) in its own group and waits for it, exiting as
# it did (128+N for a signal N). Its SIGTERM handler does nothing (a handler, not SIG_IGN, which the installer
# would inherit): the group's SIGTERM is the installer's to act on, and this script sees the leader exit when the
# installer has. When the pipe from this script ends (argv[1]: this script gone, SIGKILLed), it ends its own
# group: SIGTERM, then SIGKILL (itself included) after the grace. Standard library only, any Python >= 3.8.
KEEPER = """import os,select,signal,subprocess,sys,time
signal.signal(signal.SIGTERM,lambda s,f:None)
script=int(sys.argv[1])
try:
    child=subprocess.Popen(sys.argv[2:])
except OSError as e:
    sys.stderr.write('%%s\\n'%%(e.strerror or e));sys.exit(127)
while child.poll() is None:
    if select.select([script],[],[],0.1)[0] and not os.read(script,1):
        os.killpg(0,signal.SIGTERM);end=time.monotonic()+%r
        while child.poll() is None and time.monotonic()<end:time.sleep(0.05)
        os.killpg(0,signal.SIGKILL)
sys.exit(child.returncode if child.returncode>=0 else 128-child.returncode)
"""


def _kept(argv: list, keeper: int) -> list:
    """argv under the keeper, run by this script's own interpreter (isolated, no site: nothing but the standard
    library); argv as it is when there is no known interpreter to run it."""
    if not sys.executable:
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", KEEPER % KILL_GRACE, str(keeper)] + list(argv)


def _exited(pid: int) -> bool:
    """Whether this script's child has exited, without reaping it (its pid and group number stay its own)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _end_group(pgid: int) -> None:
    """End the process group `pgid`, led by this script's unreaped child: SIGTERM, then SIGKILL for whatever is
    left after KILL_GRACE (a leader that has exited leaves its group's other members: they get both too)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + KILL_GRACE
    while time.monotonic() < deadline and not _exited(pgid):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)  # the leader is unreaped: the group is still the installer's
    except (ProcessLookupError, PermissionError):
        pass


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


_stop_signal = None  # the first stop signal this script got (_on_signal), acted on by the build loop


def _on_signal(signum, frame) -> None:
    """Note a stop signal, nothing more: raising here could cut short the ending of the installer's group (its
    SIGKILL, its reaping), the removal of the half-built environment or the switch. The build acts on it
    (_check_stop); after the switch it changes nothing: the switch is done and its reply is sent."""
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signum


def _check_stop() -> None:
    if _stop_signal is not None:
        raise Stopped("stopped by signal %d before the switch: the previous environment stays" % _stop_signal)


def install(spec: dict) -> dict:
    """Build spec's environment in envs/ID beside the current one; verify its distributions; switch the link.
    Any failure removes the new directory and leaves the link (the current environment) as it was. A stop signal
    (noted by _on_signal when main installed it) stops the build like a lost controller until the links switch;
    one that comes later changes nothing: the switch is never cut in half, its new environment never removed, and
    the reply says it switched."""
    started = time.monotonic()
    venv = os.path.abspath(os.path.expanduser(spec["venv"]))
    root = root_of(spec["venv"])
    if os.path.lexists(venv) and not os.path.islink(venv):
        raise Failure("%s exists and is not mnft's link: move it away (mnft never replaces an environment it did not make)" % venv)
    new = os.path.join(root, "envs", spec["id"])
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec["id"]) or os.path.lexists(new):
        raise Failure("environment id %r is not new on this host" % spec["id"])
    fd = _lock(root)
    dist = os.path.join(root, "dist")
    uv = os.path.join(dist, "uv")
    env = dict(os.environ, UV_CACHE_DIR=os.path.join(root, "cache"), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never", UV_OFFLINE="1",
               UV_NO_PROGRESS="1", UV_LINK_MODE="hardlink")
    env.pop("VIRTUAL_ENV", None)
    if spec.get("uv_sha256") and (not os.path.isfile(uv) or sha256_file(uv) != spec["uv_sha256"]):
        os.close(fd)  # a relay or disk fault (or a tampered file): never run it
        if os.path.isfile(uv):
            os.unlink(uv)
        raise Failure("%s is not the controller's uv (sha256 differs): removed; run provision again to send it" % uv)
    current = os.path.realpath(venv) if os.path.lexists(venv) else None
    previous_link = os.path.join(root, "previous")
    try:
        _prune(root, {p for p in (current, os.path.realpath(previous_link) if os.path.lexists(previous_link) else None) if p})
        os.makedirs(os.path.dirname(new), exist_ok=True)
        if not os.access(uv, os.X_OK):
            os.chmod(uv, 0o755)
        timeout = float(spec.get("timeout", 3600))
        if spec.get("online"):
            env.pop("UV_OFFLINE")
        watch = bool(spec.get("watch_stdin"))
        if watch:
            _heard.update(at=time.monotonic(), deadman=float(spec["deadman"]) if spec.get("deadman") else None)
        _run([uv, "venv", "--quiet", "--python", spec["python"], new], env, "uv venv", timeout, watch)
        requirements = os.path.join(new, "mnft-requirements.txt")
        with open(requirements, "w", encoding="utf-8") as f:
            for wheel in spec["wheels"]:
                hashes = ["sha256:" + wheel["sha256"]] if wheel.get("sha256") else list(wheel.get("hashes") or [])
                f.write("%s==%s%s\n" % (wheel["name"], wheel["version"], "".join(" --hash=" + h for h in hashes)))
        every_hash = all(w.get("sha256") or w.get("hashes") for w in spec["wheels"])
        argv = [uv, "pip", "sync", "--quiet", "--python", os.path.join(new, "bin", "python")] + (["--require-hashes"] if every_hash else [])
        if spec.get("online"):  # straight from the lock's index (and its find-links), still exactly pinned
            if spec.get("no_index"):
                argv.append("--no-index")
            indexes = spec.get("indexes") or []
            if indexes:  # by environment, never on the command line: ps shows it to every user of the host
                env["UV_INDEX_URL"] = indexes[0]
            if indexes[1:]:
                env["UV_EXTRA_INDEX_URL"] = " ".join(indexes[1:])
            for link in spec.get("find_links") or []:
                argv += ["--find-links", link]
        else:
            argv += ["--offline", "--no-index", "--find-links", os.path.join(dist, "wheels")]
        _run(argv + [requirements], env, "uv pip sync", timeout, watch)
        found = distributions(new)
        wanted = {canonical(w["name"]): w.get("installed_version") for w in spec["wheels"]}
        wrong = ["%s %s (lock: %s)" % (n, found[n], v) for n, v in sorted(wanted.items()) if v and n in found and found[n] != v]
        missing = sorted(n for n in wanted if n not in found)
        extra = sorted(n for n in found if n not in wanted)
        if wrong or missing or extra:
            raise Failure("the new environment does not match the lock: " + "; ".join(
                wrong + (["missing: " + ", ".join(missing)] if missing else []) + (["extra: " + ", ".join(extra)] if extra else [])))
        record = {"id": spec["id"], "lock": spec.get("lock"), "python": env_python_version(new), "dists": found, "created": time.time()}
        with open(os.path.join(new, RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        gone = watch and _controller_gone(0)
        if gone:
            raise Stopped(gone)
        _check_stop()  # the last look: a stop signal from here on is only noted
        if current and os.path.isdir(current):
            _switch(previous_link, current)
        _switch(venv, new)
    except BaseException as exc:
        shutil.rmtree(new, ignore_errors=True)
        if isinstance(exc, Failure) and not isinstance(exc, Stopped) and "does not match" not in str(exc):
            _drop_damaged(dist, spec["wheels"])
        if isinstance(exc, OSError):
            raise Failure(_oserror(exc)) from None
        raise
    finally:
        os.close(fd)
    kept = {new}
    if os.path.lexists(previous_link):
        kept.add(os.path.realpath(previous_link))
    removed = [] if _stop_signal is not None else _prune(root, kept)  # stopped after the switch: the next run prunes
    return {"ok": True, "env": new, "previous": current, "removed": removed, "dists": found, "seconds": round(time.monotonic() - started, 3)}


_heard = {"at": 0.0, "deadman": None}  # when the controller was last heard on stdin; its deadman (seconds), if any


def _controller_gone(wait: float):
    """Why the controller is gone, or None: stdin (the SSH channel the controller keeps open after sending this
    script) reached EOF, waiting up to `wait` seconds for it; or nothing came on it (the controller writes a
    heartbeat every few seconds) for the spec's deadman. Whatever comes is read and dropped."""
    import select

    try:
        readable, _, _ = select.select([0], [], [], wait)
        if readable:
            if os.read(0, 65536) == b"":
                return LOST
            _heard["at"] = time.monotonic()
    except (OSError, ValueError):
        return None
    deadman = _heard["deadman"]
    if deadman is not None and time.monotonic() - _heard["at"] > deadman:
        return SILENT % deadman
    return None


def _drop_damaged(dist: str, wheels: list) -> None:
    """After a failed install, delete wheels whose bytes do not match the lock's hash, so the next run sends them."""
    for wheel in wheels:
        path = os.path.join(dist, "wheels", wheel.get("file") or "")
        try:
            if os.path.isfile(path) and sha256_file(path) != wheel["sha256"]:
                os.unlink(path)
        except OSError:
            pass


def _oserror(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on the device (%s)" % (exc.filename or "")
    return "%s: %s" % (exc.filename or "", exc.strerror or exc)


def rollback(venv: str) -> dict:
    venv = os.path.abspath(os.path.expanduser(venv))
    root = venv.rstrip("/") + ".d"
    previous_link = os.path.join(root, "previous")
    if not os.path.lexists(previous_link) or not os.path.isfile(os.path.join(os.path.realpath(previous_link), RECORD)):
        raise Failure("no previous environment to roll back to (%s)" % previous_link)
    if os.path.lexists(venv) and not os.path.islink(venv):
        raise Failure("%s exists and is not mnft's link" % venv)
    fd = _lock(root)
    try:
        target = os.path.realpath(previous_link)
        current = os.path.realpath(venv) if os.path.lexists(venv) else None
        _switch(venv, target)
        if current and os.path.isdir(current):
            _switch(previous_link, current)
    finally:
        os.close(fd)
    return {"ok": True, "env": target, "previous": current, "dists": distributions(target)}


def prepare(venv: str, uv_sha256: str = "") -> dict:
    """The dist directory, ready for the send. rsync's quick check skips a file of the same size and modification
    second: another uv (an upgrade of one size, or one built in the same second) would stay, and the install would
    refuse it; so a held uv whose sha256 is not the controller's is removed here (it is mnft's own copy)."""
    root = root_of(venv)
    os.makedirs(os.path.join(root, "dist", "wheels"), exist_ok=True)
    uv = os.path.join(root, "dist", "uv")
    if uv_sha256 and os.path.isfile(uv) and not os.path.islink(uv) and sha256_file(uv) != uv_sha256:
        os.unlink(uv)
    return {"ok": True, "root": root}


def main(argv: list) -> int:
    if not argv or argv[0] not in ("facts", "prepare", "install", "rollback"):
        sys.stderr.write("usage: envhost.py facts|prepare|install|rollback ...\n")
        return 2
    mode = argv[0]
    try:
        if mode == "facts":
            pythons, want, rest = [], None, list(argv[2:])
            while rest:
                flag = rest.pop(0)
                if flag == "--python" and rest:
                    pythons.append(rest.pop(0))
                elif flag == "--want" and rest:
                    want = rest.pop(0)
                else:
                    sys.stderr.write("envhost: unknown argument %r\n" % flag)
                    return 2
            _emit(facts(argv[1], pythons, want))
        elif mode == "prepare":
            _emit(prepare(argv[1], argv[2] if len(argv) > 2 else ""))
        elif mode == "install":  # the spec on stdin, after the script: never on a command line (it may hold a token)
            for sig in STOP_SIGNALS:
                signal.signal(sig, _on_signal)
            try:
                try:
                    reply = install(json.loads(sys.stdin.buffer.readline() if argv[1:] == ["-"] else argv[1]))
                except Failure as exc:
                    reply = {"ok": False, "error": str(exc)}
                except OSError as exc:
                    reply = {"ok": False, "error": _oserror(exc)}
                _emit(reply)
            finally:  # only once the reply is out: a stop signal noted after the switch must not cost its reply
                for sig in STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
        else:
            _emit(rollback(argv[1]))
    except Failure as exc:
        _emit({"ok": False, "error": str(exc)})
    except OSError as exc:
        _emit({"ok": False, "error": _oserror(exc)})
    return 0
