"""The per-host heartbeat relay (ssh backend), and the small HTTP/1.1 both it and the coordinator speak.

On a host with several tasks, each posts its heartbeats to the relay on the host's loopback (a
host with one task posts directly: nothing to batch); the relay forwards
them to the coordinator together (`POST /v1/heartbeats`, a JSON list), so the coordinator handles
about one request per host and interval instead of one per task (P6: waking up for a request, not
handling the heartbeat, is most of the cost at 1,000 tasks). Its answers tell each task when to post
next, a quarter interval before its next flush, so a host's heartbeats travel together.
Nothing reported is lost or delayed where it matters:
- a heartbeat that changes the task's phase (first, connecting, ready, done, error) carries the
  flush header: the relay forwards it at once and answers the task with the coordinator's answer,
  so "done"/"error" is known before the task exits, as without a relay;
- the others are answered at once with the coordinator's last verdict for that task process (one
  left behind by a newer attempt still learns 410 at its next heartbeat) and forwarded at the next
  tick;
- while the coordinator is unreachable the relay answers 503 and takes nothing: each task keeps its
  own points and its own give-up clock. The relay itself exits after `give_up_s` without the
  coordinator, or when its SSH channel closes (stdin ends).

Run over an SSH channel as `PYTHON -S WORKDIR/cache/<sha256>` (standard library only, imports
nothing of this package). stdin, one line: JSON {upstream: "http://host:port", token, interval_s,
give_up_s}; stdout, one line once listening: JSON {"event": "listening", "port": N}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

HEARTBEAT_PATH = b"/v1/heartbeat"  # as worker/wire.py (this file is run on its own)
BATCH_PATH = b"/v1/heartbeats"
TOKEN_HEADER = b"x-orchestrate-token"
FLUSH_HEADER = b"x-orchestrate-flush"
POST_IN_HEADER = b"X-Orchestrate-Post-In"
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 410: b"Gone"}
_REASONS.update({413: b"Too Large", 503: b"Service Unavailable"})

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
                    self.answer(413, b"headers too large", close=True)
                return
            method, path, headers = parse_head(self._buffer[:end])
            try:
                length = int(headers.get(b"content-length", b"0"))
            except ValueError:
                length = -1
            if not hmac.compare_digest(headers.get(TOKEN_HEADER, b""), self._token):
                self.answer(401, b"bad or missing token", close=True)
                return
            if method != b"POST":
                self.answer(404, b"unknown path", close=True)
                return
            if not 0 < length <= MAX_BODY_BYTES:
                self.answer(413, b"bad body length", close=True)
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
            _REASONS.get(status, b""),
            len(body),
            extra,
        )
        transport.write(head + (b"Connection: close\r\n\r\n" if close else b"\r\n") + body)
        if close:
            transport.close()
            self._transport = None
            self._buffer = b""


def parse_head(head: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


class Relay:
    """Collects the heartbeats of one host's tasks and forwards them in batches."""

    def __init__(self, upstream: str, token: str, interval_s: float, give_up_s: float):
        url = urllib.parse.urlsplit(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self._token = token
        self.interval_s = interval_s
        self._give_up_s = give_up_s
        # Under the tasks' own request timeout (worker/reporter.py), so that a task waiting on an
        # urgent heartbeat hears from the relay first.
        self._timeout_s = 0.4 * max(1.0, min(5.0, 2 * interval_s))
        self._pending: list[tuple[bytes, tuple[Any, ...]]] = []
        # What the coordinator last said of each task process: (task, attempt, pid) -> status
        self._verdicts: dict[tuple[Any, ...], int] = {}
        self._lock = asyncio.Lock()
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._reachable = True
        self._last_ok = time.monotonic()
        self._next_flush = time.monotonic() + interval_s
        self.gave_up = asyncio.Event()

    def handle(self, path: bytes, body: bytes, headers: dict[bytes, bytes], conn: HttpProtocol) -> Any:
        if path != HEARTBEAT_PATH:
            return 404, b"unknown path"
        if not self._reachable:
            return 503, b"coordinator unreachable from the relay"
        try:
            raw = json.loads(body)
            key = (raw["task"], raw["attempt"], raw["pid"])
        except (ValueError, TypeError, KeyError):
            return 400, b"not a heartbeat"
        self._pending.append((body, key))
        if headers.get(FLUSH_HEADER) == b"1":
            return self._flush_for(key)
        return self._verdicts.get(key, 200), b"", self._post_in()

    async def _flush_for(self, key: tuple[Any, ...]) -> Answer:
        await self.flush()
        if not self._reachable:
            return 503, b"coordinator unreachable from the relay"
        return self._verdicts.get(key, 200), b"", self._post_in()

    def _post_in(self) -> bytes:
        """When the task should post next: a quarter interval before one of our full flushes, so
        all of a host's heartbeats travel together and none waits long (tasks drift, we realign)."""
        interval = self.interval_s
        until = (self._next_flush - interval / 4 - time.monotonic()) % interval
        if until < interval / 2:
            until += interval
        return b"%s: %.3f\r\n" % (POST_IN_HEADER, until)

    async def tick(self) -> None:
        # A full flush every interval, which the tasks post just before (`_post_in`), and one
        # halfway for a heartbeat that came late (none, mostly: an empty batch is not sent). No
        # heartbeat waits here over half an interval, so the gaps the coordinator sees stay well
        # under health.heartbeat_timeout_s (which may be 2 intervals).
        while not self.gave_up.is_set():
            await asyncio.sleep(max(0.0, self._next_flush - self.interval_s / 2 - time.monotonic()))
            await self.flush()
            await asyncio.sleep(max(0.0, self._next_flush - time.monotonic()))
            self._next_flush += self.interval_s
            await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            batch, self._pending = self._pending, []
            if not batch and self._reachable and time.monotonic() - self._last_ok < self._give_up_s / 2:
                # no task talking: an empty batch now and then tells us the coordinator is there;
                # and while it seems away, one every tick tells us as soon as it is back
                return
            statuses = await self._post(b"[" + b",".join(body for body, _ in batch) + b"]")
            if statuses is None or len(statuses) != len(batch):
                self._pending[:0] = batch  # sent again next time; the tasks were told 503 meanwhile
                self._reachable = False
                if time.monotonic() - self._last_ok > self._give_up_s:
                    self.gave_up.set()
                return
            self._reachable = True
            self._last_ok = time.monotonic()
            for (_, key), status in zip(batch, statuses, strict=True):
                self._verdicts[key] = int(status)

    async def _post(self, body: bytes) -> list[Any] | None:
        head = (
            b"POST %s HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
            b"X-Orchestrate-Token: %s\r\nContent-Length: %d\r\n\r\n"
        ) % (BATCH_PATH, self._token.encode(), len(body))
        try:
            return await asyncio.wait_for(self._exchange(head + body), self._timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
            if self._streams is not None:
                self._streams[1].close()
            self._streams = None
            return None

    async def _exchange(self, request: bytes) -> list[Any] | None:
        if self._streams is None:
            self._streams = await asyncio.open_connection(*self._upstream)
        reader, writer = self._streams
        writer.write(request)
        status, body = await read_response(reader)
        if not status.startswith(b"HTTP/1.1 200"):
            raise ValueError(status.decode(errors="replace").strip())
        answer = json.loads(body)
        if not isinstance(answer, list):
            raise ValueError("the coordinator's answer is not a list")
        return answer


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 answer with a Content-Length: its status line and its body."""
    status = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length) if length else b""


async def serve(config: dict[str, Any], stop: asyncio.Event) -> int:
    relay = Relay(
        config["upstream"], config["token"], float(config["interval_s"]), float(config["give_up_s"])
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpProtocol(config["token"].encode(), relay.handle), "127.0.0.1", 0, backlog=1024
    )
    port = server.sockets[0].getsockname()[1]
    os.write(1, (json.dumps({"event": "listening", "port": port}) + "\n").encode())
    ticker = asyncio.ensure_future(relay.tick())
    waits = [asyncio.ensure_future(relay.gave_up.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    server.close()
    for task in (ticker, *waits):  # a task's last word (done, error) was forwarded when it was said
        task.cancel()
    if relay.gave_up.is_set():
        print(f"relay: no coordinator for {config['give_up_s']} s; exiting", file=sys.stderr, flush=True)
        return 1
    return 0


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    config = json.loads(line)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def watch_stdin() -> None:  # the channel closing (coordinator gone, run over) ends the relay
        while sys.stdin.buffer.read(4096):
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    return loop.run_until_complete(serve(config, stop))


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the stdin reader thread would block interpreter shutdown
