"""Health layer: the HTTP endpoint where tasks post heartbeats (one per interval, batched progress).

Every request must carry the run's secret token; anything else is rejected before it is parsed.

An asyncio protocol on a thread of its own, with just the HTTP/1.1 a heartbeat needs (POST with
Content-Length, keep-alive, pipelining; worker/http1.py, shared with the per-host relay): one
connection per task costs a socket, not a thread (P6: the stdlib ThreadingHTTPServer spent 39% of a
core on 1,000 tasks at 1 Hz, mostly parsing headers and switching threads). A task alone on its
host posts here itself; on a host with several, a relay posts their heartbeats as one batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

from orchestrator.health.store import HealthStore
from worker import wire
from worker.http1 import Answer, HttpProtocol

log = logging.getLogger("orchestrator.health")

_PATH = wire.HEARTBEAT_PATH.encode()
_BATCH_PATH = wire.BATCH_PATH.encode()


class HeartbeatServer:
    """Serves POST /v1/heartbeat on `host` (an ephemeral port unless given) until `close()`."""

    def __init__(self, store: HealthStore, token: str, host: str = "127.0.0.1", port: int = 0):
        self._store = store
        self._token = token.encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(1024)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._serve, name="heartbeat-server", daemon=True)
        self._ready = threading.Event()
        self._handler = _Handler(store)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def requests(self) -> int:
        """Requests answered so far (past the token check)."""
        return self._handler.requests

    @property
    def url(self) -> str:
        host = self._sock.getsockname()[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> HeartbeatServer:
        self._thread.start()
        self._ready.wait(timeout=10)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        handler = self._handler

        async def open_server() -> None:
            self._server = await self._loop.create_server(
                lambda: HttpProtocol(self._token, handler), sock=self._sock
            )

        self._loop.run_until_complete(open_server())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            if self._server is not None:
                self._server.close()
            self._loop.close()


class _Handler:
    """Answers `POST /v1/heartbeat` (one task) and `POST /v1/heartbeats` (a host's relay: a JSON
    list of heartbeats, answered with the list of their statuses)."""

    def __init__(self, store: HealthStore):
        self._store = store
        self.requests = 0  # answered with a token that was right (for tests and benchmarks)

    def __call__(self, path: bytes, body: bytes, headers: dict[bytes, bytes], conn: HttpProtocol) -> Answer:
        self.requests += 1
        if path == _PATH:
            try:
                return self._store.ingest(wire.Heartbeat.from_bytes(body)), b""
            except ValueError as exc:
                return wire.BAD_REQUEST_STATUS, str(exc).encode()
        if path == _BATCH_PATH:
            try:
                items = wire.loads(body)
            except ValueError as exc:
                return wire.BAD_REQUEST_STATUS, str(exc).encode()
            if not isinstance(items, list):
                return wire.BAD_REQUEST_STATUS, b"a batch is a JSON list of heartbeats"
            return wire.OK_STATUS, json.dumps([self._one(item) for item in items]).encode()
        return wire.NOT_FOUND_STATUS, b"unknown path"

    def _one(self, item: object) -> int:
        try:
            return self._store.ingest(wire.Heartbeat.from_dict(item))
        except ValueError:
            return wire.BAD_REQUEST_STATUS
