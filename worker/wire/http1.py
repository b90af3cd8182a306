"""The small HTTP/1.1 server side that heartbeats travel over, shared by the coordinator's heartbeat
server (orchestrator/health/server.py) and each host's relay (worker/host/relay.py), and the credentials
that guard it.

Just what a heartbeat needs: POST with Content-Length, keep-alive, pipelining, as an asyncio
protocol (one connection per task costs a socket, not a thread). Standard library only, and it
imports nothing of this package: on a lab host the relay runs alone from the file cache and loads
this file by its path. Hence the copies of worker/wire/__init__.py's values below (tests/unit/test_wire.py
keeps them equal).

The endpoint is open to every user of the machine (and of the network, with a coordinator
address), so everything a client can make it hold is bounded (`Limits`, `Connections`): a
connection must present a valid credential with its first request within `hello_s`, a request must
arrive whole within `request_s`, a known client may idle `idle_s` between requests; the number of
connections is capped (a stranger's oldest connection makes room for a new one; known clients hold
at most `per_client` each), and so are a request's head and body.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

TOKEN_HEADER = b"x-orchestrate-token"  # as wire.TOKEN_HEADER, lower-case as parse_head gives names
MAX_HEAD_BYTES = 16 * 1024
OK_STATUS = 200
BAD_REQUEST_STATUS = 400  # as wire.BAD_REQUEST_STATUS
BAD_TOKEN_STATUS = 401  # as wire.BAD_TOKEN_STATUS
NOT_FOUND_STATUS = 404  # as wire.NOT_FOUND_STATUS
TOO_LARGE_STATUS = 413
BUSY_STATUS = 503
#: The reason phrase of each status either side answers with.
REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    409: b"Conflict",
    410: b"Gone",
    413: b"Too Large",
    503: b"Service Unavailable",
}
_MAC_CHARS = 40  # hex digits of HMAC-SHA256 kept in a credential (160 bits)
_MAX_TOKEN_BYTES = 256

Answer = tuple[int, bytes] | tuple[int, bytes, bytes]  # status, body[, extra header lines]
#: (path, body, headers with lower-case names, the connection) -> the answer, now or later
Handler = Callable[[bytes, bytes, dict[bytes, bytes], "HttpProtocol"], "Answer | Awaitable[Answer]"]
#: A token header's value -> whom it speaks for (compared by equality), or None: not a credential.
Auth = Callable[[bytes], "Hashable | None"]


def sign(key: bytes, who: str) -> str:
    """A credential: whom it is for, then a MAC of that under `key` (`who:mac`)."""
    return f"{who}:{hmac.new(key, who.encode(), hashlib.sha256).hexdigest()[:_MAC_CHARS]}"


def claimed(token: bytes) -> str | None:
    """Whom a token says it is for (unchecked): the part before its MAC."""
    who, sep, mac = token.rpartition(b":")
    if not sep or len(mac) != _MAC_CHARS or len(token) > _MAX_TOKEN_BYTES or not who.isascii():
        return None
    return who.decode()


def verify(key: bytes, token: bytes) -> str | None:
    """Whom `token` is for, when `key` signed it; None otherwise."""
    who = claimed(token)
    if who is None or not hmac.compare_digest(sign(key, who).encode(), token):
        return None
    return who


RELAY = "relay"  # a credential for `relay/<scope>` is a host's relay's


def task_of(who: str) -> tuple[str, int] | None:
    """The task and attempt a credential's `who` names (`worker-1/3`), or None (a relay's)."""
    name, sep, attempt = who.rpartition("/")
    if not sep or not name or name == RELAY or not attempt.isdigit() or len(attempt) > 9:
        return None
    return name, int(attempt)


@dataclass(frozen=True)
class Limits:
    """What one endpoint lets its clients hold."""

    #: path -> the largest body a request to it may carry; any other path is refused
    max_body: Mapping[bytes, int] = field(default_factory=dict)
    max_connections: int = 1024
    per_client: int = 4  # connections one credential may hold (a reconnecting task needs two)
    hello_s: float = 5.0  # connect to a first request, head complete and credential checked
    request_s: float = 10.0  # a request begun to the whole of it
    idle_s: float = 120.0  # a known client's keep-alive connection between requests


class Connection(Protocol):
    """What `Connections` needs of a connection (this module's HttpProtocol, the run page's)."""

    client: Hashable | None  # whom it speaks for, once a credential was checked
    deadline: float  # closed by the sweep past this (time.monotonic())

    def drop(self) -> None: ...


class Connections:
    """Every open connection of one endpoint, to cap them and to close the ones past their time.

    Strangers (no valid credential yet) are kept in arrival order: at the cap, the oldest of them
    makes room for a newcomer, so a flood of idle connections cannot keep a task out (its own is
    new, and authenticated with its first request). When every connection is a known client's, a
    newcomer is refused."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._strangers: dict[Connection, None] = {}
        self._known: dict[Connection, None] = {}
        self._by_client: dict[Hashable, dict[Connection, None]] = {}
        self.refused = 0  # connections turned away at the cap
        self.evicted = 0  # strangers' connections closed to make room
        self.expired = 0  # connections closed for their time
        self._sweeper: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._strangers) + len(self._known)

    def join(self, conn: Connection) -> bool:
        if len(self) >= self.limits.max_connections:
            if not self._strangers:
                self.refused += 1
                return False
            oldest = next(iter(self._strangers))
            self.evicted += 1
            oldest.drop()
        self._strangers[conn] = None
        return True

    def known(self, conn: Connection, client: Hashable) -> None:
        self._strangers.pop(conn, None)
        self._known[conn] = None
        mine = self._by_client.setdefault(client, {})
        mine[conn] = None
        if len(mine) > self.limits.per_client:
            next(iter(mine)).drop()  # its oldest: a connection it abandoned, most likely

    def leave(self, conn: Connection) -> None:
        """Forget a connection (again: harmless)."""
        self._strangers.pop(conn, None)
        if conn not in self._known:
            return
        del self._known[conn]
        mine = self._by_client.get(conn.client)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._by_client[conn.client]

    def sweep(self) -> None:
        """Close every connection past its deadline; again in a second (call once, in the loop)."""
        now = time.monotonic()
        for conn in [c for group in (self._strangers, self._known) for c in group if c.deadline < now]:
            self.expired += 1
            conn.drop()
        self._sweeper = asyncio.get_running_loop().call_later(1.0, self._sweep_again)

    def _sweep_again(self) -> None:
        self.sweep()

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()


class HttpProtocol(asyncio.Protocol):
    """One keep-alive connection: POST requests with Content-Length, answered in order.

    The credential is checked before a body is read. A handler may answer later (a coroutine); the
    connection then reads no further request until it has (and stops reading from the socket once
    it holds a request's worth more)."""

    def __init__(self, auth: Auth, handle: Handler, connections: Connections):
        self._auth = auth
        self._handle = handle
        self._connections = connections
        self._limits = connections.limits
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._waiting = False
        self._paused = False
        self._head: tuple[int, bytes, dict[bytes, bytes]] | None = None  # read, its body not yet here
        self._token = b""  # the last credential checked on this connection
        self.client: Hashable | None = None  # whom it speaks for, once a credential was checked
        self.deadline = float("inf")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._connections.join(self):
            self.answer(BUSY_STATUS, b"too many connections", close=True)
            return
        self.deadline = time.monotonic() + self._limits.hello_s

    def connection_lost(self, exc: Exception | None) -> None:
        # A task that dies mid-request (killed, or its host cut off) resets its connection: routine.
        self._transport = None
        self._connections.leave(self)

    def drop(self) -> None:
        """Close now, without an answer (its time is up, or room is needed)."""
        self.deadline = float("inf")
        self._connections.leave(self)  # at once: the room is needed now
        if self._transport is not None:
            self._transport.abort()
            self._transport = None

    def data_received(self, data: bytes) -> None:
        if not self._buffer and self.client is not None and not self._waiting:
            self.deadline = time.monotonic() + self._limits.request_s  # a request begins
        self._buffer += data
        self._serve()

    def _serve(self) -> None:
        while self._transport is not None and not self._waiting:
            head = self._head or self._read_head()
            if head is None:
                return
            size, path, headers = head
            if len(self._buffer) < size:
                self._head = head  # the body is still on its way (the head is not read again)
                return
            self._head = None
            body = bytes(self._buffer[size - int(headers[b"content-length"]) : size])
            del self._buffer[:size]
            close = headers.get(b"connection", b"").lower() == b"close"
            result = self._handle(path, body, headers, self)
            if isinstance(result, tuple):
                self._reply(result, close)
            else:
                self._waiting = True
                self.deadline = float("inf")  # the handler's own wait is bounded
                asyncio.ensure_future(self._later(result, close))
        if self._waiting and not self._paused and len(self._buffer) > MAX_HEAD_BYTES:
            assert self._transport is not None
            self._transport.pause_reading()  # pipelined requests wait in the socket, not here
            self._paused = True

    def _read_head(self) -> tuple[int, bytes, dict[bytes, bytes]] | None:
        """The next request's head, checked: (its size with the body's, path, headers); None when
        it is not all here yet, or was refused (the connection then closed)."""
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                self.answer(TOO_LARGE_STATUS, b"headers too large", close=True)
            return None
        method, path, headers = parse_head(bytes(self._buffer[:end]))
        if not self._check_token(headers.get(TOKEN_HEADER, b"")):
            self.answer(BAD_TOKEN_STATUS, b"bad or missing token", close=True)
            return None
        largest = self._limits.max_body.get(path)
        if method != b"POST" or largest is None:
            self.answer(NOT_FOUND_STATUS, b"unknown path", close=True)
            return None
        raw_length = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not raw_length.isdigit():
            self.answer(BAD_REQUEST_STATUS, b"a request needs a Content-Length", close=True)
            return None
        length = int(raw_length)
        if not 0 < length <= largest:
            self.answer(TOO_LARGE_STATUS, b"bad body length", close=True)
            return None
        return end + 4 + length, path, headers

    def _check_token(self, token: bytes) -> bool:
        if self.client is not None and token == self._token:
            return True
        who = self._auth(token) if token else None
        if who is None or (self.client is not None and who != self.client):
            return False  # a connection speaks for one client
        if self.client is None:
            self.client, self._token = who, token
            self._connections.known(self, who)
            self.deadline = time.monotonic() + self._limits.request_s  # its request may be long
        return True

    async def _later(self, result: Awaitable[Answer], close: bool) -> None:
        answer = await result
        self._waiting = False
        if self._paused and self._transport is not None:
            self._transport.resume_reading()
        self._paused = False
        self._reply(answer, close)
        self._serve()

    def _reply(self, answer: Answer, close: bool) -> None:
        status, body, *extra = answer
        self.answer(status, body, extra[0] if extra else b"", close=close)
        if self._transport is not None and not self._waiting:
            self.deadline = time.monotonic() + (
                self._limits.request_s if self._buffer else self._limits.idle_s
            )

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
            self._buffer.clear()


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
