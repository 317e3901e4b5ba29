"""The board's web server: a Starlette app under uvicorn, read-only, for this machine's browser (or an `ssh -L`).

Routes, GET (and HEAD) only; any other method is refused with 405 before routing, whatever the path:

    /                       the page (static/index.html); it draws everything itself from the JSON below
    /static/…               board.js, board.css, uPlot (vendored: no CDN, works without internet)
    /api/lab                the lab: `mnft lab --json`'s devices, each host's last answer (mnft.board.state)
    /api/usage              the last week's GPU-hours per user and host, idle share (`mnft lab --usage --json`'s)
    /api/runs               every run's row: this controller's runs/ and the other controllers' runs the lab shows;
                            a sweep one row (kind sweep), its points' rows under it
    /api/runs/{id}          a run's page: curve, where the time went, hosts, last lines, first failure; a sweep's id:
                            the sweep's page (its points' table, every point's curve of its metric, the best point)
    /api/events[?run=ID]    server-sent events: `lab`, `runs` (and `run` for ID) each time one changes; each stream
                            ends when the server shuts down (Ctrl-C), so no open page holds the board's exit up

Who may read it (`Origins`): a request must name this board in its Host header (a loopback name at any port: an
`ssh -L` picks its own; else the address it listens on and this machine's names at its port), so a page of
another site whose name an attacker points at this address (DNS rebinding) is refused; a request whose Origin is
not the board's own, or that the browser says comes from another site (Sec-Fetch-Site), is refused for the API
and the events. No CORS header is ever sent. Every answer carries a Content-Security-Policy that allows only the
board's own scripts, styles and connections (no inline script), no framing, no form.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mnft.board.state import Board
from mnft.run import records

STATIC = Path(__file__).resolve().parent / "static"
METHODS = ("GET", "HEAD")
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; font-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = (
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-resource-policy", "same-origin"),
    ("cross-origin-opener-policy", "same-origin"),
    ("permissions-policy", "camera=(), microphone=(), geolocation=()"),
)
TICK = 0.25  # seconds between two looks at what changed, per open event stream
KEEPALIVE = 15.0  # seconds of silence before an event stream sends a comment (proxies and ssh -L keep it open)


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header -> (name, port or None), the name lower case without a trailing dot; None when malformed."""
    value = value.strip()
    if value.startswith("["):
        name, close, rest = value[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] or None
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    elif ":" in value:
        return None
    else:
        name, port = value, None
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        return None
    name = name.rstrip(".").lower()
    if not name or any(c.isspace() or c in "/\\@" for c in name):
        return None
    return name, int(port) if port is not None else None


@dataclass(frozen=True)
class Origins:
    """Who the board answers: the names it is served under (besides loopback ones, at any port) and its port."""

    names: frozenset[str]
    port: int

    @classmethod
    def serving(cls, listen: str, port: int) -> "Origins":
        """The names of a board listening on `listen`: the address itself, and, on an address other than a loopback
        one, this machine's names (and every address of its interfaces when it listens on all of them)."""
        names = {listen.strip("[]").lower()}
        if not loopback(listen):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
            if unspecified(listen):
                import psutil

                names |= {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs
                          if a.family in (socket.AF_INET, socket.AF_INET6)}
        return cls(frozenset(n for n in names if n), port)

    def host_ok(self, header: str | None) -> bool:
        parsed = split_host(header) if header else None
        if parsed is None:
            return False
        name, port = parsed
        return name in LOOPBACK or (name in self.names and (port or 80) == self.port)

    def refuse(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, why) when the request is refused, else None."""
        if method not in METHODS:
            return 405, "the board is read-only: it answers GET only\n"
        host = headers.get("host")
        if not self.host_ok(host):
            return 403, "this is not the board's address (Host); open it as http://127.0.0.1:PORT/ through ssh -L\n"
        origin = headers.get("origin")
        if origin is not None and origin.lower() != f"http://{host}".lower():
            return 403, "another site's page may not read the board (Origin)\n"
        if path.startswith("/api/") and headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            return 403, "another site's page may not read the board (Sec-Fetch-Site)\n"
        return None


def loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address.lower() == "localhost"


def unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:
        return False


class Guard:
    """ASGI middleware: refuses what `Origins.refuse` refuses (before any route runs) and adds the security headers
    to every answer."""

    def __init__(self, app, origins: Origins) -> None:
        self.app = app
        self.origins = origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # the board has none
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for key, value in scope.get("headers") or []:
            name = key.decode("latin-1").lower()
            if name in headers and name in ("host", "origin", "sec-fetch-site"):
                headers[name] = "\0"  # the same header twice: refused
            else:
                headers[name] = value.decode("latin-1")
        refused = self.origins.refuse(scope["method"], scope["path"], headers)

        async def secured(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *((k.encode(), v.encode()) for k, v in HEADERS)])
            await send(message)

        if refused is not None:
            status, why = refused
            extra = {"allow": ", ".join(METHODS)} if status == 405 else {}
            await PlainTextResponse(why, status, headers={"cache-control": "no-store", **extra})(scope, receive, secured)
            return
        await self.app(scope, receive, secured)


def _json(text: str) -> Response:
    return Response(text, media_type="application/json", headers={"cache-control": "no-store"})


def _run_id(value: str | None) -> str | None:
    """A run id as the board takes it from a URL: a name inside runs/ (mnft.run.records.RUN_ID), or None."""
    return value if isinstance(value, str) and records.RUN_ID.fullmatch(value) else None


def create_app(board: Board, origins: Origins) -> Starlette:
    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    async def lab(request: Request) -> Response:
        return _json(board.lab.text)

    async def runs(request: Request) -> Response:
        return _json(board.runs.text)

    async def usage(request: Request) -> Response:
        return _json(board.usage.text)

    async def run(request: Request) -> Response:
        run_id = _run_id(request.path_params["run_id"])
        if run_id is None:
            return PlainTextResponse("not a run id\n", 404)
        page = await asyncio.to_thread(board.detail, run_id)
        return _json(page.text)

    async def events(request: Request) -> Response:
        run_id = _run_id(request.query_params.get("run"))

        async def stream():
            board.watch(run_id, +1)
            sent: dict[str, int] = {}
            quiet = 0.0
            try:
                yield "retry: 2000\n\n"
                while not board.stopping:  # the server is shutting down: the stream ends, the page reconnects to the next board
                    documents = [("lab", board.lab), ("runs", board.runs), ("usage", board.usage)]
                    if run_id is not None:
                        documents.append(("run", await asyncio.to_thread(board.detail, run_id)))
                    for name, document in documents:
                        if sent.get(name) != document.version:
                            sent[name] = document.version
                            quiet = 0.0
                            yield f"event: {name}\ndata: {document.text}\n\n"
                    await asyncio.sleep(TICK)
                    quiet += TICK
                    if quiet >= KEEPALIVE:
                        quiet = 0.0
                        yield ": still here\n\n"
            finally:
                board.watch(run_id, -1)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/api/lab", lab, methods=["GET"]),
        Route("/api/runs", runs, methods=["GET"]),
        Route("/api/usage", usage, methods=["GET"]),
        Route("/api/runs/{run_id}", run, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(Guard, origins=origins)])


def bind(listen: str, port: int) -> socket.socket:
    """The board's listening socket (port 0: a free one), or a one-line InputError."""
    from mnft.core.errors import InputError

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"--port {port!r}: a TCP port from 1 to 65535 (0: a free one)")
    try:
        infos = socket.getaddrinfo(listen.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError(f"--listen {listen!r}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InputError(f"cannot listen on {listen} port {port}: {exc.strerror} (another --port, or stop what holds it: ss -ltnp)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url(listen: str, port: int) -> str:
    host = "127.0.0.1" if unspecified(listen) and ":" not in listen else "[::1]" if unspecified(listen) else listen
    return f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{port}/"


def server(app: Starlette, on_shutdown: Callable[[], None]):
    """uvicorn's server for the app; `on_shutdown` is called as its shutdown begins (Ctrl-C), before it waits for the
    open connections: the board stops (Board.stop), so every event stream ends within a tick and its connection
    closes, instead of being cancelled after the grace period with a traceback per open page."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            on_shutdown()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", ws="none", proxy_headers=False,
                            server_header=False, timeout_graceful_shutdown=2, timeout_keep_alive=30)
    return Server(config)


def serve(board: Board, listen: str, port: int, say) -> int:
    """Serve the board until Ctrl-C: the poller asks the hosts, every page open reads what it found."""
    sock = bind(listen, port)
    actual = sock.getsockname()[1]
    origins = Origins.serving(listen, actual)
    if not loopback(listen):
        say(f"warning: the board listens on {listen}: anyone who can reach this machine's port {actual} sees the lab, its users and their "
            f"runs' logs (no login); the default, 127.0.0.1 with `ssh -L {actual}:127.0.0.1:{actual} THIS-HOST`, shows it only to you", "bold yellow")
    say(f"mnft board: {url(listen, actual)} (read-only; Ctrl-C to stop)" + (f"; from your laptop: ssh -L {actual}:127.0.0.1:{actual} "
        f"{socket.gethostname()}, then open http://127.0.0.1:{actual}/" if loopback(listen) else ""), "")
    board.start()
    try:
        server(create_app(board, origins), board.stop).run(sockets=[sock])
    finally:
        board.close()
        sock.close()
    return 0
