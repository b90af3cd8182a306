"""Health layer: the HTTP endpoint where tasks post heartbeats (one per interval, batched progress).

Every request must carry the run's secret token; anything else is rejected before it is parsed.

An asyncio protocol on a thread of its own, with just the HTTP/1.1 a heartbeat needs (POST with
Content-Length, keep-alive, pipelining): one connection per task costs a socket, not a thread, and
a request costs tens of microseconds (P6: 1,000 tasks at 1 Hz; the stdlib ThreadingHTTPServer
spent 39% of a core there, mostly parsing headers and switching threads).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading

from orchestrator.health.store import HealthStore
from worker import wire

log = logging.getLogger("orchestrator.health")

_MAX_HEAD_BYTES = 16 * 1024
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    410: b"Gone",
    413: b"Too Large",
}
_TOKEN = wire.TOKEN_HEADER.lower().encode()
_PATH = wire.HEARTBEAT_PATH.encode()


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

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

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

        async def open_server() -> None:
            self._server = await self._loop.create_server(
                lambda: _HeartbeatProtocol(self._store, self._token), sock=self._sock
            )

        self._loop.run_until_complete(open_server())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            if self._server is not None:
                self._server.close()
            self._loop.close()


class _HeartbeatProtocol(asyncio.Protocol):
    """One task's keep-alive connection: requests parsed as bytes arrive, answered in order."""

    def __init__(self, store: HealthStore, token: bytes):
        self._store = store
        self._token = token
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        # A task that dies mid-request (killed, or its host cut off) resets its connection: routine.
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._transport is not None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    self._answer(413, b"headers too large", close=True)
                return
            head = self._buffer[:end]
            method, path, headers = _parse_head(head)
            try:
                length = int(headers.get(b"content-length", b"0"))
            except ValueError:
                length = -1
            if not hmac.compare_digest(headers.get(_TOKEN, b""), self._token):
                self._answer(401, b"bad or missing token", close=True)
                return
            if method != b"POST" or path != _PATH:
                self._answer(404, b"unknown path", close=True)
                return
            if not 0 < length <= wire.MAX_BODY_BYTES:
                self._answer(413, b"bad body length", close=True)
                return
            if len(self._buffer) < end + 4 + length:
                return  # the body is still on its way
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            try:
                hb = wire.Heartbeat.from_bytes(body)
            except ValueError as exc:
                self._answer(400, str(exc).encode())
                continue
            self._answer(
                self._store.ingest(hb), b"", close=headers.get(b"connection", b"").lower() == b"close"
            )

    def _answer(self, status: int, body: bytes, close: bool = False) -> None:
        transport = self._transport
        if transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\n" % (status, _REASONS.get(status, b""), len(body))
        transport.write(head + (b"Connection: close\r\n\r\n" if close else b"\r\n") + body)
        if close:
            transport.close()
            self._transport = None
            self._buffer = b""


def _parse_head(head: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, path, headers
