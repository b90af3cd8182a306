"""Web layer: the HTTP server of a run's page and metrics (aiohttp, on a thread of its own).

GET /                 the page (shipped in the package: orchestrator/web/static)
GET /api/state        status.json, the events since the client's last, what changed
GET /api/curves       every task's reported values by step (thinned for plotting)
GET /api/logs/TASK    the last lines of a task's log
GET /metrics          Prometheus' text format

Any user of the machine can connect to any port, so every request for the run's data carries the
run's token as `Authorization: Bearer TOKEN`, compared in constant time. The page gets it from
its address once (`?token=`), keeps it in the tab's own storage, which a browser keeps per origin
(scheme, host and port), and takes it out of the address bar. Never a cookie: a browser sends a
cookie to every port of a host, so any other server on 127.0.0.1 would receive it, and two runs'
pages would evict each other's. The page's three files (the same for every run, no data in them)
are served without it. Loopback by default.

What a client can make it hold is bounded: connections (web/guard.py: a connection that has not
shown the token within `hello_s` is closed, and strangers are the first evicted at the cap, so
another user's idle sockets never keep the owner out),
request heads (aiohttp's limits), no request bodies, parameters within their ranges, responses of
bounded size. A request it cannot take gets a 4xx and one log line (at most one a second), never
a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.util
import logging
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.errors import LaunchError
from orchestrator.record.read import has_ended
from orchestrator.web.guard import Complaints, Guard, ProtocolLog
from orchestrator.web.prom import registry
from orchestrator.web.reader import RunReader, state_document
from worker.wire import dumps
from worker.wire.http1 import Connections, Limits

log = logging.getLogger("orchestrator.web")

_STATIC = {"page.js": "text/javascript", "page.css": "text/css"}
_HEADERS = {
    # the page loads only its own files: no inline script, no outside request
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
MAX_LOG_LINES = 200
#: Task rows the page gets (and shows); the others are counted by state.
MAX_ROWS = 50
MAX_STACK_LINES = 5_000  # a task's stacks, as the page shows them (a document is bounded already)
#: The points of a curve the page may ask for.
MAX_CURVE_POINTS = 2000
#: Pages the server remembers (to let each see the run's end before it stops serving).
MAX_PAGES = 64
#: A page that asked within this long is open: the end of the run waits (a little) for it.
PAGE_OPEN_S = 3.0


def tensorboard_note(run_dir: Path) -> dict[str, Any]:
    """What the page says about TensorBoard: the command that shows the run's scalars, and a link
    when the tensorboard package is installed here (`pip install tf-orchestrate[tensorboard]`)."""
    installed = importlib.util.find_spec("tensorboard") is not None
    command = f"tensorboard --logdir {shlex.quote(str(run_dir.resolve() / 'tensorboard'))}"
    return {
        "installed": installed,
        "command": command if installed else "pip install 'tf-orchestrate[tensorboard]', then " + command,
        "url": "http://localhost:6006/" if installed else None,
    }


class WebServer:
    def __init__(
        self,
        reader: RunReader,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        max_connections: int = 64,
        idle_s: float = 30.0,
        hello_s: float = 5.0,
        extra: Callable[[], dict[str, Any]] | None = None,
    ):
        self.reader = reader
        self.token = token or secrets.token_urlsafe(24)
        self._extra = extra or dict
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="web", daemon=True)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._registry = registry(reader.status)
        self._tensorboard = tensorboard_note(reader.dir)
        self.connections = Connections(
            Limits(
                max_connections=max_connections, per_client=max_connections, hello_s=hello_s, idle_s=idle_s
            )
        )
        self._guards: dict[Any, Guard] = {}  # transport -> its connection
        self._pages: dict[str, tuple[float, bool]] = {}  # page id -> (last asked, has seen the end)
        self._complaints = Complaints(log)
        self.requests = 0

    # --- addresses ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def base_url(self) -> str:
        host = self._sock.getsockname()[0]
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def page_url(self) -> str:
        return f"{self.base_url}/?token={self.token}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    # --- life --------------------------------------------------------------------------------

    def start(self) -> WebServer:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("the web server did not start")
        return self

    def linger(self, timeout_s: float = 2.5) -> None:
        """Before the server goes with its run: let every page open now (it asked within
        PAGE_OPEN_S) fetch the run's end, waiting at most `timeout_s`, so an open page shows how
        the run ended rather than its last RUNNING."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            if all(saw_end for asked, saw_end in list(self._pages.values()) if now - asked < PAGE_OPEN_S):
                return
            time.sleep(0.05)

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(middlewares=[self._refuse_bad_input, self._auth], client_max_size=1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/curves", self._curves)
        app.router.add_get("/api/logs/{task}", self._logs)
        app.router.add_get("/api/stacks/{task}", self._stacks)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=15,
            handler_cancellation=True,
            logger=ProtocolLog(self._complaints),
            shutdown_timeout=1.0,  # at the end: the answers on their way are finished, briefly
        )
        await runner.setup()
        factory = runner.server
        assert factory is not None
        server = await self._loop.create_server(
            lambda: Guard(self.connections, self._guards, factory()), sock=self._sock
        )
        self.connections.sweep()  # every second: connections past their deadline are closed
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self.connections.stop()
            server.close()
            await runner.cleanup()  # the answers being written (an open page's last state) go out
            for guard in list(self._guards.values()):
                guard.drop()

    # --- requests ----------------------------------------------------------------------------

    @web.middleware
    async def _refuse_bad_input(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """What no handler takes (a parameter out of its range, bytes that are no text): a 4xx and
        one log line, rate-limited; never a traceback, never a 5xx."""
        try:
            return await handler(request)
        except _BadRequest as exc:
            self._complaints.about(request, 400, str(exc))
            return _text(400, str(exc))
        except (UnicodeError, ValueError, LookupError) as exc:
            self._complaints.about(request, 400, f"{type(exc).__name__}: {exc}")
            return _text(400, "this request cannot be read")

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.requests += 1
        if request.path == "/" or request.path.startswith("/static/"):
            # the page's own files (the same for every run; no data in them): the page must load
            # before it can send the token it finds in its address (a wrong one is said at once)
            given = request.query.get("token")
            if given is not None and not _same(given, self.token):
                return _text(401, "wrong token for this run's page")
            return _secured(await handler(request))
        auth = request.headers.get("Authorization", "")
        if not (auth.startswith("Bearer ") and _same(auth[7:], self.token)):
            return _text(
                401,
                "this run's page needs its token: open the page address the run printed "
                "(status.json: urls.page); a scraper sends `Authorization: Bearer TOKEN`",
            )
        guard = self._guards.get(request.transport)
        if guard is not None:
            guard.known()
        return _secured(await handler(request))

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("page.html"), content_type="text/html", charset="utf-8")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _STATIC:
            return _text(404, "no such file")
        return web.Response(body=_asset(name), content_type=_STATIC[name], charset="utf-8")

    async def _state(self, request: web.Request) -> web.StreamResponse:
        since = _int(request, "events", 0, 0, 1 << 62)
        page = request.query.get("page")
        if page is not None and not (0 < len(page) <= 32 and page.isascii() and page.isalnum()):
            raise _BadRequest("page: up to 32 letters and digits")
        self.reader.poll()
        state = state_document(self.reader, since, MAX_ROWS, self._tensorboard)
        if page is not None:
            self._saw(page, has_ended(state["status"]))
        return _json({**state, **self._extra()})

    async def _curves(self, request: web.Request) -> web.StreamResponse:
        points = _int(request, "points", 300, 2, MAX_CURVE_POINTS)
        self.reader.poll()
        return _json(self.reader.curves.snapshot(points))

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        count = _int(request, "lines", 40, 1, MAX_LOG_LINES)
        self.reader.poll()
        lines = self.reader.log_tail(request.match_info["task"], count)
        if lines is None:
            return _text(404, "no such task in this run")
        return _json({"lines": [line[:2000] for line in lines]})

    async def _stacks(self, request: web.Request) -> web.StreamResponse:
        self.reader.poll()
        lines = self.reader.stacks_text(request.match_info["task"])
        if lines is None:
            return _text(404, "no stacks of such a task were read in this run")
        return _json({"lines": [line[:2000] for line in lines[:MAX_STACK_LINES]]})

    def _saw(self, page: str, ended: bool) -> None:
        """A page asked for the state (and whether what it got is the run's end). Updated in place:
        `linger`, on another thread, never misses a page between two of its requests."""
        _, saw_end = self._pages.get(page, (0.0, False))
        self._pages[page] = (time.monotonic(), saw_end or ended)
        if len(self._pages) > MAX_PAGES:
            del self._pages[min(self._pages, key=lambda p: self._pages[p][0])]  # asked longest ago

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.reader.poll()
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _BadRequest(Exception):
    """A request this server does not take (400, with this text)."""


def serve_run(run_dir: Path, host: str, port: int) -> WebServer:
    """A run directory's page and metrics, served from now on (`up` while the run lives, `show`);
    LaunchError, naming `--web`, when the address cannot be bound."""
    try:
        return WebServer(RunReader(run_dir), host, port).start()
    except OSError as exc:
        raise LaunchError(
            f"cannot serve the run's page on {host}:{port} (--web): {exc.strerror or exc}"
        ) from None


def _same(given: str, token: str) -> bool:
    # a header's bytes that are no UTF-8 come as surrogates: compared as the bytes they were
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """A query parameter's integer, in [low, high]; a _BadRequest naming the range otherwise."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19) or not low <= int(raw) <= high:
        raise _BadRequest(f"{name}: an integer from {low} to {high}")
    return int(raw)


def _json(data: Any) -> web.Response:
    """Strict JSON (a NaN or ±inf value as its string: browsers parse nothing else)."""
    return web.json_response(data, dumps=dumps)


def _secured(response: web.StreamResponse) -> web.StreamResponse:
    response.headers.update(_HEADERS)
    return response


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n", headers=_HEADERS)


def _asset(name: str) -> bytes:
    return resources.files("orchestrator.web").joinpath("static").joinpath(name).read_bytes()
