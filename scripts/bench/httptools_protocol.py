"""The heartbeat endpoint's HTTP/1.1 parsed by httptools (llhttp, Node's parser) instead of
worker/wire/http1.py's own, for the P6 comparison only (scripts/bench/capacity.py --parser httptools,
scripts/bench/parse_cost.py). Not a dependency of the product: `pip install httptools` for the bench.

`HttptoolsProtocol` takes the constructor of `worker.wire.http1.HttpProtocol` and behaves as it does:
the credential is checked on the token header before the body is read (`Auth`), connections join
and leave the `Connections` registry (the cap, strangers and known clients), the hello / request /
idle deadlines are kept the same way, the body's size is bounded per path, keep-alive and
pipelining, answers in order (a handler may answer later: the requests behind it wait, and reading
stops once they hold more than a head's worth), the same `Answer` tuples from the handler. It
subclasses HttpProtocol, so connecting, dropping, the credential check and the answers' bytes are
that class's own code; only reading requests differs.

One difference, of bounds only: httptools holds the header it is reading and does not say where
in a read a request began. A head still arriving is measured by the reads it filled, so it is
refused at the end of the read that takes it over MAX_HEAD_BYTES, as http1.py does; except the
part of the first read that came behind another (pipelined) request, which counts only its whole
headers: there the head may grow by one read (at most 256 KiB) more before it is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import httptools

from worker.wire.http1 import (
    BAD_REQUEST_STATUS,
    BAD_TOKEN_STATUS,
    MAX_HEAD_BYTES,
    NOT_FOUND_STATUS,
    TOKEN_HEADER,
    TOO_LARGE_STATUS,
    Answer,
    Auth,
    Connections,
    Handler,
    HttpProtocol,
)


class _Stop(Exception):
    """Raised from a parser callback: the request is refused, read no further."""


class HttptoolsProtocol(HttpProtocol):
    def __init__(self, auth: Auth, handle: Handler, connections: Connections):
        super().__init__(auth, handle, connections)
        self._parser = httptools.HttpRequestParser(self)
        # the request being read
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._path = b""
        self._close = False
        self._in_message = False  # between its first byte and its last
        self._in_head = False  # ... and before its head is whole
        self._head_began = False  # in the read being parsed
        self._head_known = 0  # bytes of its head seen in the callbacks
        self._head_bytes = 0
        # requests read whole, answered in order: (path, body, headers, close, size), or a refusal
        # (status, why) after which nothing more is read
        self._queue: deque[tuple[Any, ...]] = deque()
        self._queued_bytes = 0
        self._stopped = False

    # --- asyncio.Protocol -------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        if not self._in_message and not self._queue and self.client is not None and not self._waiting:
            self.deadline = time.monotonic() + self._limits.request_s  # a request begins
        self._head_began = False
        alone = not self._in_message  # this read begins with a request's first byte, if any
        queued = len(self._queue)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Stop):
                raise
        except httptools.HttpParserError:  # malformed (or an upgrade): no request of ours
            self._refuse(BAD_REQUEST_STATUS, b"malformed request")
        else:
            if self._in_head:
                if not self._head_began:
                    self._head_bytes += len(data)
                elif alone and len(self._queue) == queued:  # the whole read is this head's
                    self._head_bytes = len(data)
                else:  # it began behind another request: its bytes the callbacks saw
                    self._head_bytes = self._head_known
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(TOO_LARGE_STATUS, b"headers too large")
        self._serve()

    # --- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = self._in_head = self._head_began = True
        self._url, self._headers, self._body, self._head_known = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_known += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value.strip()
        self._head_known += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self._in_head = False
        headers, limits = self._headers, self._limits
        if not self._check_token(headers.get(TOKEN_HEADER, b"")):
            self._refuse(BAD_TOKEN_STATUS, b"bad or missing token")
            raise _Stop
        largest = limits.max_body.get(self._url)
        if self._parser.get_method() != b"POST" or largest is None:
            self._refuse(NOT_FOUND_STATUS, b"unknown path")
            raise _Stop
        raw_length = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not raw_length.isdigit():
            self._refuse(BAD_REQUEST_STATUS, b"a request needs a Content-Length")
            raise _Stop
        if not 0 < int(raw_length) <= largest:
            self._refuse(TOO_LARGE_STATUS, b"bad body length")
            raise _Stop
        self._path = self._url
        self._close = headers.get(b"connection", b"").lower() == b"close"

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        size = len(body) + self._head_known
        self._queue.append((self._path, body, self._headers, self._close, size))
        self._queued_bytes += size

    # --- answering, in order ------------------------------------------------------------------

    def _refuse(self, status: int, why: bytes) -> None:
        self._stopped = True
        self._queue.append((status, why))

    def _serve(self) -> None:
        queue = self._queue
        while queue and self._transport is not None and not self._waiting:
            item = queue.popleft()
            if len(item) == 2:
                self.answer(item[0], item[1], close=True)
                return
            path, body, headers, close, size = item
            self._queued_bytes -= size
            result = self._handle(path, body, headers, self)
            if isinstance(result, tuple):
                self._reply(result, close)
            else:
                self._waiting = True
                self.deadline = float("inf")  # the handler's own wait is bounded
                asyncio.ensure_future(self._later(result, close))
        if self._waiting and not self._paused and self._queued_bytes > MAX_HEAD_BYTES:
            assert self._transport is not None
            self._transport.pause_reading()  # pipelined requests wait in the socket, not here
            self._paused = True

    def _reply(self, answer: Answer, close: bool) -> None:
        status, body, *extra = answer
        self.answer(status, body, extra[0] if extra else b"", close=close)
        if self._transport is not None and not self._waiting:
            self.deadline = time.monotonic() + (
                self._limits.request_s if self._in_message or self._queue else self._limits.idle_s
            )
        elif self._transport is None:
            self._stopped = True
