"""Web layer: the HTTP server of a run's page and metrics (aiohttp, on a thread of its own).

GET /                 the page (shipped in the package: orchestrator/web/static)
GET /api/state        status.json, the events since the client's last, what changed
GET /api/curves       every task's reported values by step (thinned for plotting)
GET /api/logs/TASK    the last lines of a task's log
GET /metrics          Prometheus' text format

Any user of the machine can connect to any port, so every request carries the run's token (the
page's URL has it once, `?token=`, which becomes an HttpOnly cookie; a scraper sends
`Authorization: Bearer TOKEN`), compared in constant time. Loopback by default. What a client
can make it hold is bounded: connections (a cap, each one closed after `idle_s` without a byte),
request heads (aiohttp's limits), no request bodies, responses of bounded size.
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
from collections import Counter
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.errors import LaunchError
from orchestrator.view import progress_of
from orchestrator.web.prom import registry
from orchestrator.web.reader import RunReader

log = logging.getLogger("orchestrator.web")

_COOKIE = "orchestrate_token"
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
        extra: Callable[[], dict[str, Any]] | None = None,
    ):
        self.reader = reader
        self.token = token or secrets.token_urlsafe(24)
        self._extra = extra or dict
        self._max_connections, self._idle_s = max_connections, idle_s
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
        self.connections: set[_Guard] = set()
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
        app = web.Application(middlewares=[self._auth], client_max_size=1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/curves", self._curves)
        app.router.add_get("/api/logs/{task}", self._logs)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=15, handler_cancellation=True)
        await runner.setup()
        factory = runner.server
        assert factory is not None
        server = await self._loop.create_server(lambda: _Guard(self, factory()), sock=self._sock)
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    self._sweep()
        finally:
            server.close()
            for guard in list(self.connections):
                guard.close()
            await runner.cleanup()

    def _sweep(self) -> None:
        """Close the connections that sent nothing for `idle_s` (a client holding sockets)."""
        now = time.monotonic()
        for guard in list(self.connections):
            if now - guard.last_data > self._idle_s:
                guard.close()

    # --- requests ----------------------------------------------------------------------------

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.requests += 1
        given = request.query.get("token")
        if request.path == "/" and given is not None:
            if not _same(given, self.token):
                return _text(401, "wrong token for this run's page")
            moved = web.Response(status=303, headers={"Location": "/"})  # the token leaves the address bar
            moved.set_cookie(_COOKIE, self.token, httponly=True, samesite="Strict", path="/")
            return moved
        auth = request.headers.get("Authorization", "")
        sent = auth[7:] if auth.startswith("Bearer ") else request.cookies.get(_COOKIE, "")
        if not _same(sent, self.token):
            return _text(
                401,
                "this run's page needs its token: open the page address the run printed "
                "(status.json: urls.page); a scraper sends `Authorization: Bearer TOKEN`",
            )
        response = await handler(request)
        response.headers.update(_HEADERS)
        return response

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=_asset("page.html"), content_type="text/html", charset="utf-8")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in _STATIC:
            return _text(404, "no such file")
        return web.Response(body=_asset(name), content_type=_STATIC[name], charset="utf-8")

    async def _state(self, request: web.Request) -> web.StreamResponse:
        since = _int(request.query.get("events"), 0)
        self.reader.poll()
        events, count = self.reader.events(since)
        status = self.reader.status()
        tasks = status.get("tasks", [])
        progress = progress_of(status)
        return web.json_response(
            {
                # the rows the page shows, not a thousand tasks' every second (P6 with a page open)
                "status": {**status, "tasks": tasks[:MAX_ROWS]},
                "task_count": len(tasks),
                "task_states": dict(Counter(str(t.get("state")) for t in tasks)),
                "progress": {
                    "step": progress.step,
                    "total": progress.total,
                    "steps_per_s": progress.steps_per_s,
                    "examples_per_s": progress.examples_per_s,
                    "eta_s": progress.eta_s,
                },
                "events": events[-200:],
                "event_count": count,
                "curves_version": self.reader.curves.version,
                "now": time.time(),
                "tensorboard": self._tensorboard,
                **self._extra(),
            }
        )

    async def _curves(self, request: web.Request) -> web.StreamResponse:
        self.reader.poll()
        return web.json_response(self.reader.curves.snapshot(_int(request.query.get("points"), 300, 2000)))

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        self.reader.poll()
        lines = self.reader.log_tail(
            request.match_info["task"], _int(request.query.get("lines"), 40, MAX_LOG_LINES)
        )
        if lines is None:
            return _text(404, "no such task in this run")
        return web.json_response({"lines": [line[:2000] for line in lines]})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.reader.poll()
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Guard(asyncio.Protocol):
    """One connection: counted against the cap (refused past it) and timed for the idle sweep;
    everything else is aiohttp's protocol's."""

    def __init__(self, server: WebServer, inner: Any):
        self._server, self._inner = server, inner
        self._transport: asyncio.Transport | None = None
        self.last_data = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if len(self._server.connections) >= self._server._max_connections:
            transport.abort()
            return
        self._server.connections.add(self)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.last_data = time.monotonic()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return bool(self._inner.eof_received())

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self._server.connections:
            self._server.connections.discard(self)
            self._inner.connection_lost(exc)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


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
    return hmac.compare_digest(given.encode(), token.encode())


def _int(value: str | None, default: int, cap: int = 1 << 62) -> int:
    try:
        return max(0, min(cap, int(value))) if value is not None else default
    except ValueError:
        return default


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text + "\n", headers=_HEADERS)


def _asset(name: str) -> bytes:
    return resources.files("orchestrator.web").joinpath("static").joinpath(name).read_bytes()
