"""mnft link agent: TCP round-trip time and throughput between two hosts, with the standard library only.

The controller ships this file to every host (mnft.hosts.pyrun) and keeps one agent per host for the whole link
matrix. An agent serves peers on an ephemeral port of its cluster address and, on command, measures its link to
another agent. Throughput is always counted by the receiver (bytes between its first byte and the sender's
end), so a socket buffer filling up never counts as bandwidth.

    serve --bind ADDR [--lifetime SECONDS]

prints {"ok": true, "addr": ADDR, "port": N} (or {"ok": false, "error": …}), then reads JSON commands on stdin,
one per line, and answers each with one JSON line:

    {"op": "measure", "id": K, "peer": ADDR, "port": N, "seconds": S, "pings": P}
      -> {"id": K, "ok": true, "rtt_ms": median, "rtt_min_ms": …, "tx_gbps": this→peer, "rx_gbps": peer→this,
          "tx_bytes": …, "rx_bytes": …, "error": null}

It stops when stdin closes (the controller is done or gone) or after --lifetime seconds. Connections from
peers start with one byte naming what they want: b"E" echo (RTT), b"S" sink (the peer sends, this agent counts
and answers {"bytes", "seconds"}), b"T" + 8-byte milliseconds: source (this agent sends that long).

Python >= 3.8, stdlib only; never raises: a failed measurement is {"ok": false, "error": "…"}.
"""

from __future__ import annotations

import json
import os
import select
import socket
import statistics
import struct
import sys
import threading
import time

CHUNK = 256 * 1024  # per send call: small enough that a slow link overshoots the duration by little
RECV = 4 * 1024 * 1024
SLACK = 5.0  # seconds a peer may be late before a socket gives up
REPLY_BYTES = 65536  # a peer's reply line read at most (it is ~40 bytes): a longer one is not JSON
USAGE = "usage: linkagent.py serve --bind ADDR [--lifetime SECONDS]"


def _emit(obj: dict) -> None:
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def _message(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return "%s: %s" % (type(exc).__name__, exc)


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ------------------------------------------------------------------------------------------------ serving


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed early")
        data += chunk
    return data


def _sink(sock: socket.socket) -> tuple[int, float]:
    """Receive until EOF: (bytes, seconds from the first byte to EOF)."""
    buf = bytearray(RECV)
    view = memoryview(buf)
    total, first = 0, None
    while True:
        n = sock.recv_into(view)
        if not n:
            break
        if first is None:
            first = time.perf_counter()
        total += n
    return total, (time.perf_counter() - first) if first is not None else 0.0


def _source(sock: socket.socket, seconds: float) -> None:
    chunk = b"\0" * CHUNK
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)


def _serve_one(conn: socket.socket) -> None:
    try:
        conn.settimeout(SLACK + 60)
        _nodelay(conn)
        mode = _recv_exact(conn, 1)
        if mode == b"E":
            while True:
                data = conn.recv(64)
                if not data:
                    break
                conn.sendall(data)
        elif mode == b"S":
            total, seconds = _sink(conn)
            conn.sendall((json.dumps({"bytes": total, "seconds": seconds}) + "\n").encode())
        elif mode == b"T":
            (millis,) = struct.unpack("!Q", _recv_exact(conn, 8))
            _source(conn, min(millis, 60000) / 1000.0)
    except (OSError, ConnectionError, ValueError):
        pass  # the measuring side reports the failure
    finally:
        conn.close()


def _accept_loop(server: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


# ------------------------------------------------------------------------------------------------ measuring


def _connect(peer: str, port: int, bind: str, timeout: float) -> socket.socket:
    sock = socket.create_connection((peer, port), timeout=timeout, source_address=(bind, 0))
    _nodelay(sock)
    return sock


def measure(peer: str, port: int, bind: str, seconds: float, pings: int) -> dict:
    """RTT (median of `pings` 1-byte round trips after one warm-up), then this→peer, then peer→this."""
    result = {"ok": False, "rtt_ms": None, "rtt_min_ms": None, "tx_gbps": None, "rx_gbps": None,
              "tx_bytes": None, "rx_bytes": None, "error": None}
    timeout = seconds + SLACK
    step = "connect"
    try:
        with _connect(peer, port, bind, timeout) as sock:
            step = "rtt"
            sock.sendall(b"E")
            rtts = []
            for i in range(pings + 1):
                start = time.perf_counter()
                sock.sendall(b"x")
                _recv_exact(sock, 1)
                if i:
                    rtts.append((time.perf_counter() - start) * 1000)
            result["rtt_ms"] = round(statistics.median(rtts), 4) if rtts else None
            result["rtt_min_ms"] = round(min(rtts), 4) if rtts else None
        step = "send"
        with _connect(peer, port, bind, timeout) as sock:
            sock.sendall(b"S")
            _source(sock, seconds)
            reply = json.loads(sock.makefile("rb").readline(REPLY_BYTES) or b"{}")  # the peer's one line (its sink's count)
            result["tx_bytes"] = reply.get("bytes")
            if reply.get("seconds"):
                result["tx_gbps"] = round(reply["bytes"] * 8 / reply["seconds"] / 1e9, 4)
        step = "receive"
        with _connect(peer, port, bind, timeout) as sock:
            sock.sendall(b"T" + struct.pack("!Q", int(seconds * 1000)))
            total, elapsed = _sink(sock)
            result["rx_bytes"] = total
            if elapsed > 0:
                result["rx_gbps"] = round(total * 8 / elapsed / 1e9, 4)
        result["ok"] = result["tx_gbps"] is not None and result["rx_gbps"] is not None
        if not result["ok"]:
            result["error"] = "no data arrived"
    except Exception as exc:  # noqa: BLE001 - one failed link is a result, not the end of the agent
        result["error"] = "%s: %s" % (step, _message(exc))
    return result


# ------------------------------------------------------------------------------------------------ main


def serve(bind: str, lifetime: float) -> None:
    try:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((bind, 0))
        server.listen(64)
        server.settimeout(0.2)
    except Exception as exc:  # noqa: BLE001
        _emit({"ok": False, "error": "cannot listen on %s: %s" % (bind, _message(exc))})
        return
    stop = threading.Event()
    threading.Thread(target=_accept_loop, args=(server, stop), daemon=True).start()
    _emit({"ok": True, "addr": bind, "port": server.getsockname()[1]})
    deadline = time.monotonic() + lifetime
    pending = b""
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([0], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if not readable:
                continue
            data = os.read(0, 65536)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _command(line, bind)
    finally:
        stop.set()
        server.close()


def _command(line: bytes, bind: str) -> None:
    cmd = {}
    try:
        cmd = json.loads(line)
        if not isinstance(cmd, dict) or cmd.get("op") != "measure":
            raise ValueError("expected {\"op\": \"measure\", …}")
        out = measure(str(cmd["peer"]), int(cmd["port"]), bind, float(cmd["seconds"]), int(cmd.get("pings", 10)))
    except (ValueError, KeyError, TypeError) as exc:
        out = {"ok": False, "error": "bad command: %s" % exc}
    out["id"] = cmd.get("id") if isinstance(cmd, dict) else None
    _emit(out)


def main(argv: list) -> int:
    if len(argv) < 3 or argv[0] != "serve" or argv[1] != "--bind":
        sys.stderr.write(USAGE + "\n")
        return 2
    lifetime = 600.0
    if len(argv) == 5 and argv[3] == "--lifetime":
        try:
            lifetime = float(argv[4])
        except ValueError:
            sys.stderr.write(USAGE + "\n")
            return 2
    elif len(argv) != 3:
        sys.stderr.write(USAGE + "\n")
        return 2
    serve(argv[2], lifetime)
    return 0
