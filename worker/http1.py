"""The small HTTP/1.1 server side that heartbeats travel over, shared by the coordinator's heartbeat
server (orchestrator/health/server.py) and each host's relay (worker/relay.py).

Just what a heartbeat needs: POST with Content-Length, keep-alive, pipelining, as an asyncio
protocol (one connection per task costs a socket, not a thread). Standard library only, and it
imports nothing of this package: on a lab host the relay runs alone from the file cache and loads
this file by its path. Hence the copies of worker/wire.py's values below (tests/unit/test_wire.py
keeps them equal).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

TOKEN_HEADER = b"x-orchestrate-token"  # as wire.TOKEN_HEADER, lower-case as parse_head gives names
MAX_BODY_BYTES = 8 * 1024 * 1024  # as wire.MAX_BODY_BYTES
MAX_HEAD_BYTES = 16 * 1024
BAD_TOKEN_STATUS = 401  # as wire.BAD_TOKEN_STATUS
NOT_FOUND_STATUS = 404  # as wire.NOT_FOUND_STATUS
TOO_LARGE_STATUS = 413
#: The reason phrase of each status either side answers with.
REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    410: b"Gone",
    413: b"Too Large",
    503: b"Service Unavailable",
}

Answer = tuple[int, bytes] | tuple[int, bytes, bytes]  # status, body[, extra header lines]
#: (path, body, headers with lower-case names, the connection) -> the answer, now or later
Handler = Callable[[bytes, bytes, dict[bytes, bytes], "HttpProtocol"], "Answer | Awaitable[Answer]"]


class HttpProtocol(asyncio.Protocol):
    """One keep-alive connection: POST requests with Content-Length, answered in order.

    The token header is checked before a body is looked at. A handler may answer later (a
    coroutine); the connection then reads no further request until it has.
    """

    def __init__(self, token: bytes, handle: Handler):
        self._token = token
        self._handle = handle
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._waiting = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        # A task that dies mid-request (killed, or its host cut off) resets its connection: routine.
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._serve()

    def _serve(self) -> None:
        while self._transport is not None and not self._waiting:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    self.answer(TOO_LARGE_STATUS, b"headers too large", close=True)
                return
            method, path, headers = parse_head(self._buffer[:end])
            try:
                length = int(headers.get(b"content-length", b"0"))
            except ValueError:
                length = -1
            if not hmac.compare_digest(headers.get(TOKEN_HEADER, b""), self._token):
                self.answer(BAD_TOKEN_STATUS, b"bad or missing token", close=True)
                return
            if method != b"POST":
                self.answer(NOT_FOUND_STATUS, b"unknown path", close=True)
                return
            if not 0 < length <= MAX_BODY_BYTES:
                self.answer(TOO_LARGE_STATUS, b"bad body length", close=True)
                return
            if len(self._buffer) < end + 4 + length:
                return  # the body is still on its way
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            close = headers.get(b"connection", b"").lower() == b"close"
            result = self._handle(path, body, headers, self)
            if isinstance(result, tuple):
                self._reply(result, close)
            else:
                self._waiting = True
                asyncio.ensure_future(self._later(result, close))

    async def _later(self, result: Awaitable[Answer], close: bool) -> None:
        answer = await result
        self._waiting = False
        self._reply(answer, close)
        self._serve()

    def _reply(self, answer: Answer, close: bool) -> None:
        status, body, *extra = answer
        self.answer(status, body, extra[0] if extra else b"", close=close)

    def answer(self, status: int, body: bytes, extra: bytes = b"", close: bool = False) -> None:
        transport = self._transport
        if transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\n%s" % (
            status,
            REASONS.get(status, b""),
            len(body),
            extra,
        )
        transport.write(head + (b"Connection: close\r\n\r\n" if close else b"\r\n") + body)
        if close:
            transport.close()
            self._transport = None
            self._buffer = b""


def parse_head(head: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    """A request's method, path and headers (names lower-cased)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, path, headers
