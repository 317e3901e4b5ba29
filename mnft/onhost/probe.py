"""mnft host probe: read one host's facts, or test its network, in one SSH round-trip.

The controller ships this module (its payload: mnft.hosts.payload) to each host's Python and reads exactly one JSON
object from stdout (its modes, the payload's command line: `python -c BOOTSTRAP MODE ...`).

    facts [--workdir PATH] [--modules A,B]  what the host has: OS, Python, torch/CUDA/NCCL, GPUs, memory, disk, NICs;
                                            with --modules, which of those top-level modules this Python resolves
    python [--modules A,B]                  only what this Python has (torch/CUDA/NCCL, distributions, the modules):
                                            the probe inside a container image, where the job's Python is
    image-facts [--workdir PATH]            with an image: the image's facts (imagehost's, from this payload; the
                                            controller's request on stdin), the host's facts without its Python's
                                            packages, and each command the controller sends meanwhile (the probe
                                            inside the image): one line each, as each is ready
    session [--workdir PATH] [--modules A,B]
                                            the facts at once ({"facts": …}), then each request the controller sends on
                                            stdin, one JSON line each, answered with one line: a host script to run
                                            (check's code hash and marks), listen, connect; until stdin ends. check's
                                            one command per host
    listen PORT SECONDS [--bind ADDR]       accept TCP connections (reply b"mnft\\n") until SECONDS pass or stdin closes
    connect HOST PORT TIMEOUT [--bind ADDR] connect (from source address ADDR) and read the listener's reply
    free-port PORT [--bind ADDR]            can PORT be bound right now (SO_REUSEADDR off)?

Constraints, because this runs on hosts mnft does not control:
- Python >= 3.8 and the standard library only.
- Never imports torch (that costs seconds): its version comes from the installed distribution's metadata and
  its CUDA version from torch/version.py parsed as text.
- Never raises: a sub-probe that fails yields null plus an entry in "errors" ({"field": "message"}).
- Exit status 0, except 2 for a malformed command line (message on stderr, nothing on stdout).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time

from .facts import PROBE_VERSION, facts, python_facts
from .nettest import HANGUP_GRACE, _listening, _serve, connect, free_port, listen
from .probeout import _emit, _message

# Imported where used, not here: ast, re, shlex, shutil, subprocess, tempfile, threading. A `connect` or
# `listen` starts without them (a third of its start-up); `facts` needs most of them and imports them then.

USAGE = """usage: probe.py facts [--workdir PATH] [--modules A,B]
       probe.py python [--modules A,B]
       probe.py image-facts [--workdir PATH]
       probe.py session [--workdir PATH] [--modules A,B]
       probe.py listen PORT SECONDS [--bind ADDR]
       probe.py connect HOST PORT TIMEOUT [--bind ADDR]
       probe.py free-port PORT [--bind ADDR]"""


# ------------------------------------------------------------------------------------------------ an image

REQUEST_BYTES = 16 << 20  # one request line of the controller's, at most (a script's source is in it)
STDOUT_KEPT = 4 << 20  # a command's stdout kept (its end: its reply is its last line)
STDERR_KEPT = 65536  # a command's stderr kept (its end)


def _request():
    """The controller's next request: one JSON object on a line of stdin; None at its end."""
    line = sys.stdin.buffer.readline(REQUEST_BYTES + 1)
    if not line.strip():
        return None
    if len(line) > REQUEST_BYTES:
        raise ValueError("a request longer than %d bytes" % REQUEST_BYTES)
    request = json.loads(line.decode("utf-8"))
    if not isinstance(request, dict):
        raise ValueError("a request that is not a JSON object")
    return request


def _image_host_facts(request: dict) -> dict:
    """imagehost's facts (the runtime setting and the image come in the request), computed in this process."""
    from . import imagehost

    return imagehost.facts(request["runtime"], request["image"])


def _end(f, kept: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - kept))
    return f.read(kept).decode("utf-8", "replace")


def run_command(request: dict) -> dict:
    """A command the controller sent: `argv` (run as it is, no shell), `payload` (base64: a host entry's, the probe
    inside an image) then `input` on its stdin, `timeout` seconds. Its exit code (None: it did not end or could not
    start, `error` says why) and the ends of its output."""
    import binascii
    import subprocess
    import tempfile

    start = time.monotonic()
    argv = [str(a) for a in request.get("argv") or []]
    timeout = float(request.get("timeout") or 60)
    out = {"exit_code": None, "stdout": "", "stderr": "", "error": None, "seconds": None}
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        try:
            given = binascii.a2b_base64(request.get("payload") or "") + (request.get("input") or "").encode("utf-8")
            out["exit_code"] = subprocess.run(argv, input=given, stdout=stdout,
                                              stderr=stderr, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out["error"] = "no answer within %gs" % timeout
        except (OSError, ValueError) as exc:  # ValueError: an empty argv
            out["error"] = "%s: %s" % (argv[0] if argv else "no command", _message(exc))
        out["stdout"] = _end(stdout, STDOUT_KEPT)
        out["stderr"] = _end(stderr, STDERR_KEPT)
    out["seconds"] = round(time.monotonic() - start, 4)
    return out


def _image_side(request: dict, emit) -> None:
    """The image's facts as soon as they are known (one line), then each command the controller sends (the probe
    inside the image, whose command line it builds from those facts), one line each, until stdin ends: all while
    the host's own facts are still being read."""
    try:
        emit({"container": _image_host_facts(request), "container_error": None})
    except Exception as exc:  # noqa: BLE001 - the probe never raises
        emit({"container": None, "container_error": _message(exc)})
    while True:
        try:
            request = _request()
        except Exception as exc:  # noqa: BLE001
            emit({"ran": {"exit_code": None, "error": "a request the probe cannot read: %s" % _message(exc)}})
            return
        if request is None:
            return
        emit({"ran": run_command(request)})


def image_facts(workdir: str) -> None:
    """With an image, three lines in the order they are ready: the image's facts (imagehost's, read in a thread of
    this process), the host's facts without its Python's packages (its clock read last, as `facts` does), and the
    result of the command the controller sends once it has the image's facts (the probe inside the image). Ends
    when stdin ends."""
    import threading

    start = time.monotonic()
    request = _request() or {}
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        with lock:
            _emit(obj)

    side = threading.Thread(target=_image_side, args=(request, emit), name="image", daemon=True)
    side.start()
    host = facts(workdir, packages=False)
    host["clock"] = time.time()
    host["timings"]["total_s"] = round(time.monotonic() - start, 4)
    emit({"facts": host})
    side.join()  # until stdin ends (the controller closes it, or its connection goes)


# ------------------------------------------------------------------------------------------------ a session

RUN_STDOUT_CHARS = 128 << 20  # what a script run in a session may print (a tree hash lists every file); past it, an error


def run_script(request: dict) -> dict:
    """A host entry the controller sent (mnft.hosts.pyrun.run_request: a payload, base64), run in this process as
    the bootstrap runs one (mnft.onhost.boot.run): sys.argv[1:] = `argv`, `stdin` as its standard input. Its exit
    code (None: it could not be run, `error` says why; 1 and `error`: it raised), what it printed and how long it
    took. It runs after the facts are out, with stdin, stdout and stderr its own while it runs (nothing else of the
    probe prints then)."""
    import binascii
    import io

    from . import boot

    start = time.monotonic()
    out = {"exit_code": None, "stdout": "", "stderr": "", "error": None, "seconds": None}
    stdout, stderr = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    try:
        raw, argv = request["payload"], request.get("argv") or []
        if not isinstance(raw, str) or not isinstance(argv, list):
            raise ValueError("a run needs a payload and an argv list")
        raw = binascii.a2b_base64(raw)
        sys.stdin = io.StringIO(str(request.get("stdin") or ""))
        sys.stdout, sys.stderr = stdout, stderr
        try:
            out["exit_code"] = boot.exit_code(boot.run(raw, [str(a) for a in argv]))
        except SystemExit as exc:
            out["exit_code"] = boot.exit_code(exc.code)
        except Exception as exc:  # noqa: BLE001 - the script's fault: exit 1, as python would
            out["exit_code"], out["error"] = 1, _message(exc)
    except Exception as exc:  # noqa: BLE001 - not even started: a request the probe cannot run
        out["error"] = "the run request: %s" % _message(exc)
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
    out["stdout"] = stdout.getvalue()
    if len(out["stdout"]) > RUN_STDOUT_CHARS:
        out["stdout"], out["error"] = "", "printed more than %d characters" % RUN_STDOUT_CHARS
    out["stderr"] = stderr.getvalue()[-STDERR_KEPT:]
    out["seconds"] = round(time.monotonic() - start, 4)
    return out


class _Listener:
    """A session's listener: `listen` served in a thread, until its seconds pass or the session ends."""

    def __init__(self):
        self.thread = None
        self.stop_fd = None  # the write end of the pipe _serve watches: closed, it stops
        self.port = None

    def start(self, port: int, seconds: float, bind: str) -> dict:
        import threading

        if self.thread is not None and self.thread.is_alive():
            return {"ok": False, "error": "already listening on port %d" % self.port}
        self.stop()
        server, why = _listening(port, bind)
        if server is None:
            return {"ok": False, "error": why}
        self.port = server.getsockname()[1]
        read_fd, self.stop_fd = os.pipe()
        self.thread = threading.Thread(target=self._run, args=(server, time.monotonic() + seconds, read_fd), name="listen", daemon=True)
        self.thread.start()
        return {"ok": True, "port": self.port}

    @staticmethod
    def _run(server: socket.socket, deadline: float, read_fd: int) -> None:
        try:
            _serve(server, deadline, read_fd)
        finally:
            os.close(read_fd)

    def stop(self) -> None:
        if self.stop_fd is not None:
            os.close(self.stop_fd)
            self.stop_fd = None
        if self.thread is not None:
            self.thread.join(HANGUP_GRACE + 1.0)
            self.thread = None


def _field(body: dict, name: str, kind, low, high=None):
    """A number of a request (as `_number` judges a command line's)."""
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Usage("%s must be a number, not %r" % (name, value))
    return _number(str(value), name, kind, low, high)


def _bind_of(body: dict):
    bind = body.get("bind")
    if bind is not None and not isinstance(bind, str):
        raise _Usage("bind must be an address, not %r" % (bind,))
    return bind


def answer(request: dict, listener: _Listener) -> dict:
    """One request of a session, answered: {"run": …} -> {"ran": …}; {"listen": {"port", "seconds", "bind"}} ->
    {"listen": {"ok", "port" | "error"}}; {"connect": {"host", "port", "timeout", "bind"}} -> {"connect": …}."""
    kinds = [k for k in ("run", "listen", "connect") if k in request]
    if len(kinds) != 1 or not isinstance(request[kinds[0]], dict):
        return {"error": "a request names one of run, listen, connect, with an object"}
    kind, body = kinds[0], request[kinds[0]]
    if kind == "run":
        return {"ran": run_script(body)}
    try:
        if kind == "listen":
            port, seconds = _field(body, "port", int, 0, 65535), _field(body, "seconds", float, 0.001)
            return {"listen": listener.start(port, seconds, _bind_of(body) or "0.0.0.0")}
        host = body.get("host")
        if not isinstance(host, str) or not host:
            raise _Usage("host must be an address, not %r" % (host,))
        port, timeout = _field(body, "port", int, 1, 65535), _field(body, "timeout", float, 0.001)
        return {"connect": connect(host, port, timeout, _bind_of(body))}
    except _Usage as exc:
        return {kind: {"ok": False, "error": "a bad request: %s" % exc}}


def session(workdir: str, wanted: list) -> None:
    """The facts at once (one line {"facts": …}, its clock read last, as `facts` does), then each request the
    controller sends on stdin, one JSON line each (`answer`), each answered with one line, in order, until stdin
    ends; a listener then stops with it. check's one command per host: its facts, its code hash and marks (a run
    of the tree-hash script), the listener on the master and every host's connect, in one interpreter."""
    listener = _Listener()
    try:
        try:
            out = facts(workdir, wanted)
        except Exception as exc:  # noqa: BLE001 - a bug: the facts are its report, as in `facts` mode
            import traceback

            traceback.print_exc()
            out = {"probe_version": PROBE_VERSION, "errors": {"probe": _message(exc)}}
        _emit({"facts": out})
        while True:
            try:
                request = _request()
            except Exception as exc:  # noqa: BLE001
                _emit({"error": "a request the probe cannot read: %s" % _message(exc)})
                return
            if request is None:
                return
            _emit(answer(request, listener))
    finally:
        listener.stop()


# ------------------------------------------------------------------------------------------------ command line


class _Usage(Exception):
    pass


def _number(text: str, what: str, kind, low, high=None):
    try:
        value = kind(text)
    except ValueError:
        raise _Usage("%s must be a number, not %r" % (what, text)) from None
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise _Usage("%s out of range: %r" % (what, text))
    return value


MODES = {  # mode -> (positional names, options)
    "facts": ((), ("--workdir", "--modules")),
    "python": ((), ("--modules",)),
    "image-facts": ((), ("--workdir",)),
    "session": ((), ("--workdir", "--modules")),
    "listen": (("PORT", "SECONDS"), ("--bind",)),
    "connect": (("HOST", "PORT", "TIMEOUT"), ("--bind",)),
    "free-port": (("PORT",), ("--bind",)),
}


def _parse(argv: list) -> tuple:
    if not argv or argv[0] not in MODES:
        raise _Usage("unknown mode %r" % argv[0] if argv else "no mode given")
    mode, rest = argv[0], list(argv[1:])
    names, allowed = MODES[mode]
    positional, options = [], {}
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if name not in allowed:
                raise _Usage("%s does not take %s" % (mode, name))
            if not eq:
                if not rest:
                    raise _Usage("%s needs a value" % name)
                value = rest.pop(0)
            options[name] = value
        else:
            positional.append(arg)
    if len(positional) != len(names):
        raise _Usage("%s takes %s" % (mode, " ".join(names) or "no positional arguments"))
    values = dict(zip(names, positional))
    if "PORT" in values:
        values["PORT"] = _number(values["PORT"], "PORT", int, 1 if mode == "connect" else 0, 65535)
    for name in ("SECONDS", "TIMEOUT"):
        if name in values:
            values[name] = _number(values[name], name, float, 0.001)
    return mode, values, options


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        mode, values, options = _parse(argv)
    except _Usage as exc:
        sys.stderr.write("probe: %s\n%s\n" % (exc, USAGE))
        return 2
    bind = options.get("--bind")
    try:
        if mode == "facts":
            wanted = [m for m in options.get("--modules", "").split(",") if m]
            _emit(facts(options.get("--workdir", "~"), wanted))
        elif mode == "python":
            _emit(python_facts([m for m in options.get("--modules", "").split(",") if m]))
        elif mode == "image-facts":
            image_facts(options.get("--workdir", "~"))
        elif mode == "session":
            session(options.get("--workdir", "~"), [m for m in options.get("--modules", "").split(",") if m])
        elif mode == "listen":
            listen(values["PORT"], values["SECONDS"], bind or "0.0.0.0")
        elif mode == "connect":
            _emit(connect(values["HOST"], values["PORT"], values["TIMEOUT"], bind))
        else:
            _emit(free_port(values["PORT"], bind or "0.0.0.0"))
    except Exception as exc:  # noqa: BLE001 - a bug: still one JSON object (listen may have printed already)
        import traceback

        traceback.print_exc()
        if mode not in ("listen", "session"):
            _emit({"probe_version": PROBE_VERSION, "errors": {"probe": _message(exc)}})
    return 0


def leave(code: int) -> None:
    """End the process at once once every line is out: no interpreter teardown (freeing every module and object:
    ~8 ms of CPU, on every host, each check). Nothing is left to do then: each line was flushed as it was written,
    a listener and its clients are closed, no file is open for writing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone
            pass
    os._exit(code)
