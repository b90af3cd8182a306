"""Web layer: what a client can make the page's server hold, and what it says of one it refuses.

Any user of the machine can connect: a connection is a stranger's until one of its requests shows
the run's token, and is closed at its deadline (`hello_s`) and first evicted at the cap
(`worker.wire.http1.Connections`, the heartbeat server's rule), so another user's idle sockets never
keep the owner out. A request refused (malformed, bytes that are no text, a parameter out of its
range) is one log line, at most one a second, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from typing import Any

from aiohttp import web

from worker.wire import safe_text
from worker.wire.http1 import Connections

OWNER = "owner"  # whom a valid token speaks for (one credential: the run's)


class Guard(asyncio.Protocol):
    """One connection, as `worker.wire.http1.Connections` caps and times it (a stranger until a request
    shows the token: closed at its deadline, first evicted at the cap); everything else is
    aiohttp's protocol's. `guards`: every open one by its transport (a request finds its own)."""

    def __init__(self, connections: Connections, guards: dict[Any, Guard], inner: Any):
        self._connections, self._guards, self._inner = connections, guards, inner
        self._transport: asyncio.Transport | None = None
        self.client: Hashable | None = None  # OWNER once a request showed the token
        self.deadline = float("inf")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        connections = self._connections
        if not connections.join(self):
            transport.abort()  # every slot is the owner's own
            return
        self.deadline = time.monotonic() + connections.limits.hello_s
        self._guards[transport] = self
        self._inner.connection_made(transport)

    def known(self) -> None:
        """A request on it showed the token: the owner's (kept while it is used)."""
        if self.client is None:
            self.client = OWNER
            self._connections.known(self, OWNER)
        self.deadline = time.monotonic() + self._connections.limits.idle_s

    def data_received(self, data: bytes) -> None:
        if self.client is not None:
            self.deadline = time.monotonic() + self._connections.limits.idle_s
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return bool(self._inner.eof_received())

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.leave(self)
        if self._guards.pop(self._transport, None) is not None:
            self._inner.connection_lost(exc)

    def drop(self) -> None:
        """Close now (its time is up, or a newcomer needs the room)."""
        self.deadline = float("inf")
        self._connections.leave(self)
        if self._transport is not None:
            self._transport.abort()


class Complaints:
    """One log line per refused request, at most one a second (the others counted in the next):
    any user of the machine can send malformed requests, and none fills the console."""

    def __init__(self, logger: logging.Logger, every_s: float = 1.0):
        self.log, self._every_s = logger, every_s
        self._last = -float("inf")
        self._held = 0

    def say(self, what: str, status: int, why: str) -> None:
        now = time.monotonic()
        if now - self._last < self._every_s:
            self._held += 1
            return
        more = f" (and {self._held} more refused since the last said)" if self._held else ""
        self._last, self._held = now, 0
        # a stranger's bytes, as every view shows a job's text (no control reaches the console)
        self.log.warning("web: %d for %s: %s%s", status, safe_text(what[:200]), safe_text(why[:300]), more)

    def about(self, request: web.Request, status: int, why: str) -> None:
        self.say(f"{request.method} {request.path}", status, why)


class ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's logger for its protocol: a request it cannot parse (any bytes a stranger sends)
    is one rate-limited line, never a traceback."""

    def __init__(self, complaints: Complaints):
        super().__init__(complaints.log, {})
        self._complaints = complaints

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        why = f"{type(exc).__name__}: {exc}" if exc is not None else str(msg)
        status = getattr(exc, "code", None)
        self._complaints.say("a request it cannot read", status if isinstance(status, int) else 500, why)
