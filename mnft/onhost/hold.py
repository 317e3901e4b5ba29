"""`hold`: the process that takes a lease for a controller (waiting in the host's line for devices when asked),
keeps it while the controller's channel lives (its heartbeats, its deadman), runs the operation's `run N` requests
in a forked child (mnft.onhost.boot.run) meanwhile, and lets go. Standard library only, Python 3.8 syntax.
"""

import io
import json
import os
import select
import signal
import sys
import time

from . import boot
from .gpuread import read_devices
from .leasefiles import MAX_LEASE_BYTES, Refused, _failure, lease_dir
from .leases import note_progress, progress_of, release, take
from .line import join_line, waiting_reply
from .usage import log_usage, usage_line

MAX_RUN_BYTES = 64 << 20  # a run request: a script, its arguments and its stdin
MAX_OUT_BYTES = 1 << 30  # what a run may print (a tree hash lists every file)
WAIT_POLL = 1.0  # seconds between two looks of a waiting run at its host's devices


def _take_now(holder):
    """take, with the devices read first (outside the critical section: nvidia-smi may take a second)."""
    scope = holder.get("scope")
    if scope is None or scope.get("gpus") == 0:
        return take(holder)
    devices, links = read_devices(topology=scope.get("gpus") is not None, live=False)
    return take(holder, devices, links)


def wait_in_line(holder, stdin, reply):
    """Wait for the devices in the host's line (a ticket held while waiting; its place: mnft.onhost.line's fair
    order): (reply, fds) once taken, (None, []) when the controller let go or went silent (the ticket goes with the
    wait), (the line-full reply, []) at once when this user has the lab's max_waiting runs waiting here already."""
    ticket, path, full = join_line(holder)
    if full is not None:
        return full, []
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
                request, pending, stop = _next_request(pending, lambda seen: note_progress(fds, seen))
                if stop:
                    break
                if request is not None:
                    child = _answer_now(request, fds) if child is None else _busy(child, request)
    finally:
        if child:  # released (or the controller is gone) mid-run: the run ends with the lease
            os.kill(child[0], signal.SIGKILL)
            os.waitpid(child[0], 0)
        ended = [release(fd, holder) for fd in fds]
        log_usage(usage_line([e for e in ended if e]), lease_dir())
    return 0


def _next_request(pending, on_progress=None):
    """(the JSON of a complete `run N` request or None, what is left, whether to stop): heartbeats and other
    lines are consumed, a `progress {…}` line (the run's last step) given to on_progress, `release` (or a malformed
    request) stops."""
    while b"\n" in pending:
        line, rest = pending.split(b"\n", 1)
        if line.startswith(b"progress ") and on_progress is not None:
            seen = progress_of(line[9:])
            if seen is not None:
                on_progress(seen)
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
    """Fork; the child runs the payload's entry (mnft.onhost.boot.run) with argv and stdin = the given text
    (the lease's channel is not its stdin), its stdout to a pipe the holder reads. It does not keep the lease's
    descriptor: a run left behind by a killed holder never holds the lease."""
    import binascii

    raw, argv, text = binascii.a2b_base64(request["payload"]), [str(a) for a in request["argv"]], str(request.get("stdin") or "")
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
                code = boot.exit_code(boot.run(raw, argv))
            except SystemExit as exc:
                code = boot.exit_code(exc.code)
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
