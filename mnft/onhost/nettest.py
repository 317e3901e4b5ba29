"""mnft host probe, the network tests: `listen` (a listener that answers each connection with REPLY), `connect`
(to such a listener, from a given source address) and `free-port`, as the probe's modes and a session's requests
run them (mnft.onhost.probe).
"""

from __future__ import annotations

import math
import os
import select
import socket
import sys
import time

from .probeout import _emit, _message

REPLY = b"mnft\n"
HANGUP_GRACE = 2.0  # listen: how long to wait for a client to close after the reply


# ------------------------------------------------------------------------------------------------ network


def _bound_socket(bind: str, port: int, reuse: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(bind, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1 if reuse else 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _stdin_is_a_channel() -> bool:
    """Can the controller stop us by closing stdin? Not if stdin is already at EOF (`python3 - < probe.py`
    consumed it, or </dev/null): then only SECONDS, or the stdout reader going away, ends `listen`."""
    try:
        readable, _, _ = select.select([0], [], [], 0)
        if not readable:
            return True
        return os.read(0, 65536) != b""
    except (OSError, ValueError):
        return False


LISTEN_BACKLOG = 128  # connections the listener's kernel queue holds before accept(): the check's fan-in limit


def _listening(port: int, bind: str) -> tuple:
    """(a socket listening on PORT, None), or (None, why not)."""
    try:
        server = _bound_socket(bind, port, reuse=True)  # as torch's TCPStore does
    except Exception as exc:  # noqa: BLE001
        return None, _message(exc)
    try:
        server.listen(LISTEN_BACKLOG)
    except Exception as exc:  # noqa: BLE001
        server.close()
        return None, _message(exc)
    return server, None


def listen(port: int, seconds: float, bind: str) -> None:
    """Print {"ok": true, "port": N} at once, then serve until `seconds` pass, stdin reaches EOF or the stdout
    reader hangs up. Each connection gets REPLY; the server then waits for the client to close first, so no
    TIME_WAIT is left on PORT (a rerun, or torchrun right after, can bind it again)."""
    server, why = _listening(port, bind)
    if server is None:
        _emit({"ok": False, "error": why})
        return
    _emit({"ok": True, "port": server.getsockname()[1]})
    _serve(server, time.monotonic() + seconds, 0 if _stdin_is_a_channel() else None)


def _serve(server: socket.socket, deadline: float, stop_fd) -> None:
    """Answer every connection to `server` until `deadline`, until `stop_fd` (stdin, or a session's stop pipe;
    None: none) reaches EOF, or until the stdout reader hangs up; then close it."""
    poller = select.poll()
    poller.register(server.fileno(), select.POLLIN)
    if stop_fd is not None:
        poller.register(stop_fd, select.POLLIN)
    poller.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)  # only reports a vanished reader
    clients = {}  # fd -> (socket, close-by time)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            wake = min([deadline] + [until for _, until in clients.values()])
            for fd, event in poller.poll(max(0, math.ceil((wake - now) * 1000))):
                if event & select.POLLNVAL:
                    poller.unregister(fd)
                elif fd == server.fileno():
                    _accept(server, poller, clients)
                elif fd == stop_fd:
                    if os.read(fd, 65536) == b"":
                        return
                elif fd == sys.stdout.fileno():
                    return
                elif fd in clients:
                    _drain(fd, poller, clients)
            now = time.monotonic()
            for fd in [fd for fd, (_, until) in clients.items() if until <= now]:
                _drop(fd, poller, clients)
    finally:
        for fd in list(clients):
            _drop(fd, poller, clients)
        server.close()


def _accept(server: socket.socket, poller, clients: dict) -> None:
    try:
        conn, _ = server.accept()
    except OSError:
        return
    try:
        conn.settimeout(1.0)
        conn.sendall(REPLY)  # no FIN yet: whoever closes first keeps the TIME_WAIT, so let the client
    except OSError:
        conn.close()
        return
    poller.register(conn.fileno(), select.POLLIN)
    clients[conn.fileno()] = (conn, time.monotonic() + HANGUP_GRACE)


def _drain(fd: int, poller, clients: dict) -> None:
    conn, _ = clients[fd]
    try:
        closed = conn.recv(4096) == b""
    except OSError:
        closed = True
    if closed:
        _drop(fd, poller, clients)


def _drop(fd: int, poller, clients: dict) -> None:
    conn, _ = clients.pop(fd)
    try:
        poller.unregister(fd)
    except (KeyError, ValueError):
        pass
    conn.close()


def connect(host: str, port: int, timeout: float, bind) -> dict:
    """Connect (from source address `bind`) and read the reply, all within `timeout` seconds.

    ok: the TCP connection was established; reply_ok: the peer answered REPLY (an mnft listener);
    local: the source address actually used; seconds: the whole attempt, connect plus reply."""
    start = time.monotonic()
    result = {"ok": False, "seconds": None, "error": None, "reply_ok": False, "local": None}
    conn = None
    try:
        conn = socket.create_connection((host, port), timeout=timeout, source_address=(bind, 0) if bind else None)
        result["ok"] = True
        result["local"] = conn.getsockname()[0]
        data = b""
        while not data.endswith(b"\n") and len(data) < 64:
            conn.settimeout(max(0.001, timeout - (time.monotonic() - start)))
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        result["reply_ok"] = data == REPLY
        if not result["reply_ok"]:
            result["error"] = "unexpected reply %r: not an mnft listener" % data[:32] if data else "no reply"
    except Exception as exc:  # noqa: BLE001
        result["error"] = ("no reply: " if result["ok"] else "") + _message(exc)
    finally:
        if conn is not None:
            conn.close()
    result["seconds"] = round(time.monotonic() - start, 4)
    return result


def free_port(port: int, bind: str) -> dict:
    try:
        _bound_socket(bind, port, reuse=False).close()
    except Exception as exc:  # noqa: BLE001
        return {"free": False, "error": _message(exc)}
    return {"free": True, "error": None}
