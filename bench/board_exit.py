#!/usr/bin/env python3
"""`mnft board` on Ctrl-C (issue 36): how long it takes to end, and what it prints, with pages open and with a host
that hangs. Results in docs/board.md.

Each case starts `mnft board --port 0` as a user does (`python -m invoke board`, a subprocess with this checkout's
mnft), over an inventory of one host, waits for the board's line and `--settle` seconds (the poller's first
question out), opens `--pages` event streams (what an open page holds: /api/events, read as the page reads it),
sends SIGINT and measures the seconds until the process has ended; it reports them with the exit code and whether
the output holds a traceback or uvicorn's "Exception in ASGI application".

The host is either `hang` (a local TCP listener that accepts and never speaks: a host whose sshd is wedged, or a
firewall that answers the SYN) or `down` (a closed port: refused at once).

    python bench/board_exit.py [--repeat 3] [--out /tmp/board-exit.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def hanging_listener() -> tuple[socket.socket, int]:
    """A TCP port that accepts connections and never says a word (they are kept open until the bench ends)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held = []

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return sock, sock.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one(work: Path, port: int, pages: int, connect_timeout: float | None, settle: float) -> dict:
    inventory = work / "lab.yaml"
    inventory.write_text(f"hosts:\n  wedged: {{address: 127.0.0.1, port: {port}, user: nobody}}\n")
    env = dict(os.environ, MNFT_RUNS_DIR=str(work / "runs"), HOME=str(work), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "invoke", "-r", str(REPO), "board", "--hosts", str(inventory), "--port", "0"]
    if connect_timeout is not None:
        argv += ["--connect-timeout", str(connect_timeout)]
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    while not (found := re.search(r"mnft board: http://127\.0\.0\.1:(\d+)/", seen)):
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the board did not start: {seen}")
        seen += line
    board_port = int(found.group(1))
    streams = []
    for _ in range(pages):
        conn = http.client.HTTPConnection("127.0.0.1", board_port, timeout=30)
        conn.request("GET", "/api/events")
        answer = conn.getresponse()
        answer.readline()
        streams.append(conn)
    time.sleep(settle)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - started
    for conn in streams:
        conn.close()
    out = seen + out
    return {"exit_s": round(took, 2), "code": proc.returncode, "traceback": "Traceback" in out,
            "asgi_error": "Exception in ASGI application" in out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between the board's start and Ctrl-C")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    listener, hang_port = hanging_listener()
    cases = [("no page, refused host", closed_port(), 0, None), ("1 page, refused host", closed_port(), 1, None),
             ("3 pages, refused host", closed_port(), 3, None), ("no page, hanging host", hang_port, 0, None),
             ("1 page, hanging host", hang_port, 1, None), ("1 page, hanging host, --connect-timeout 5", hang_port, 1, 5.0)]
    results = []
    with tempfile.TemporaryDirectory(prefix="mnft-board-exit-") as tmp:
        for name, port, pages, timeout in cases:
            runs = [one(Path(tmp), port, pages, timeout, args.settle) for _ in range(args.repeat)]
            times = [r["exit_s"] for r in runs]
            result = {"case": name, "exit_s_median": statistics.median(times), "exit_s_range": [min(times), max(times)],
                      "codes": sorted({r["code"] for r in runs}), "traceback": any(r["traceback"] for r in runs),
                      "asgi_error": any(r["asgi_error"] for r in runs)}
            print(json.dumps(result), flush=True)
            results.append(result)
    listener.close()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
