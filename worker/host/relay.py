"""The per-host heartbeat relay (ssh backend).

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

Each task posts with its own credential, which the relay checks with its host's key (it can check
its own host's tasks' credentials, not sign any): a task speaks for itself only, here as at the
coordinator, which takes from this relay (its own credential) heartbeats of this host's tasks only.

Run over an SSH channel as `PYTHON -S WORKDIR/cache/<sha256>` (standard library only, imports
nothing of this package). stdin, one line: JSON {upstream: "http://host:port", token (its own
credential), key (its host's, hex), interval_s, give_up_s, http_module}; stdout, one line once
listening: JSON {"event": "listening", "port": N}.
`http_module` is the absolute path of worker/wire/http1.py in the same cache (the HTTP/1.1 the coordinator
speaks too), loaded by its path; without it, the http1.py beside this file (the source tree).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time the module is loaded by its path (load_http1)
    from worker.wire.http1 import Answer, HttpProtocol

# As worker/wire/__init__.py (this file runs on its own; tests/unit/test_wire.py keeps them equal)
HEARTBEAT_PATH = b"/v1/heartbeat"
BATCH_PATH = b"/v1/heartbeats"
TOKEN_HEADER = b"X-Orchestrate-Token"
FLUSH_HEADER = b"x-orchestrate-flush"  # lower-case, as http1.parse_head gives names
POST_IN_HEADER = b"X-Orchestrate-Post-In"
OK_STATUS = 200
BAD_REQUEST_STATUS = 400
FORBIDDEN_STATUS = 403
NOT_FOUND_STATUS = 404
UNREACHABLE_STATUS = 503  # the relay's own: the coordinator is unreachable from here
MAX_HEARTBEAT_BYTES = 1024 * 1024
MAX_BATCH_BYTES = 8 * 1024 * 1024

_HTTP1_NAME = "orchestrate_http1"


def load_http1(path: str | None = None) -> ModuleType:
    """worker/wire/http1.py, loaded by its path: `path` in the host's cache (named by its SHA-256, like
    this file), or the wire room's file when run from the source tree."""
    file = path or str(Path(__file__).parents[1] / "wire" / "http1.py")
    loader = importlib.machinery.SourceFileLoader(_HTTP1_NAME, file)  # any file name, not just *.py
    spec = importlib.util.spec_from_file_location(_HTTP1_NAME, file, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_HTTP1_NAME] = module
    loader.exec_module(module)
    return module


class Relay:
    """Collects the heartbeats of one host's tasks and forwards them in batches."""

    def __init__(self, upstream: str, token: str, interval_s: float, give_up_s: float):
        url = urllib.parse.urlsplit(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self._token = token
        self.interval_s = interval_s
        self._give_up_s = give_up_s
        # The tasks' own request timeout (worker/task/reporter.py): the coordinator gets as long to
        # answer the relay as it would a task. A task waiting on an urgent heartbeat hears from
        # the relay well before its own timeout (`_urgent_s`), while the flush carries on: on a
        # busy machine (tasks importing TensorFlow on every core, the answer coming back through
        # an SSH tunnel) an upstream answer can take longer than that, and giving up on it then,
        # and on the connection with it, made every retry slower still.
        self._timeout_s = max(1.0, min(5.0, 2 * interval_s))
        self._urgent_s = 0.4 * self._timeout_s
        self._unreachable_since: float | None = None
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
        if not self._reachable:
            return UNREACHABLE_STATUS, b"coordinator unreachable from the relay"
        try:
            raw = json.loads(body)
            key = (raw["task"], raw["attempt"], raw["pid"])
            if type(key[2]) is not int:
                raise TypeError("pid")
        except (ValueError, TypeError, KeyError, RecursionError):
            return BAD_REQUEST_STATUS, b"not a heartbeat"
        if key[:2] != conn.client:
            return FORBIDDEN_STATUS, b"a task speaks for itself only"
        self._pending.append((body, key))
        if headers.get(FLUSH_HEADER) == b"1":
            return self._flush_for(key)
        return self._verdicts.get(key, OK_STATUS), b"", self._post_in()

    async def _flush_for(self, key: tuple[Any, ...]) -> Answer:
        flush = asyncio.ensure_future(self.flush())
        try:
            await asyncio.wait_for(asyncio.shield(flush), self._urgent_s)
        except asyncio.TimeoutError:  # still on its way: the task tries again (and is told then)
            return UNREACHABLE_STATUS, b"the coordinator is slow to answer the relay"
        if not self._reachable:
            return UNREACHABLE_STATUS, b"coordinator unreachable from the relay"
        return self._verdicts.get(key, OK_STATUS), b"", self._post_in()

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
            batch: list[tuple[bytes, tuple[Any, ...]]] = []
            size = 2
            for body, key in self._pending:  # as many as one request may carry; the rest next time
                size += len(body) + 1
                if batch and size > MAX_BATCH_BYTES:
                    break
                batch.append((body, key))
            del self._pending[: len(batch)]
            if not batch and self._reachable and time.monotonic() - self._last_ok < self._give_up_s / 2:
                # no task talking: an empty batch now and then tells us the coordinator is there;
                # and while it seems away, one every tick tells us as soon as it is back
                return
            statuses, why = await self._post(b"[" + b",".join(body for body, _ in batch) + b"]")
            if statuses is not None and len(statuses) != len(batch):
                why = f"{len(statuses)} answers to {len(batch)} heartbeats"
                statuses = None
            now = time.monotonic()
            if statuses is None:
                self._pending[:0] = batch  # sent again next time; the tasks were told 503 meanwhile
                self._reachable = False
                if self._unreachable_since is None:
                    self._unreachable_since = now
                    say(f"the coordinator did not answer ({why}); trying again every tick")
                if now - self._last_ok > self._give_up_s:
                    self.gave_up.set()
                return
            if self._unreachable_since is not None:
                say(f"the coordinator answers again, after {now - self._unreachable_since:.1f} s")
                self._unreachable_since = None
            self._reachable = True
            self._last_ok = now
            for (_, key), status in zip(batch, statuses, strict=True):
                self._verdicts[key] = int(status)

    async def _post(self, body: bytes) -> tuple[list[Any] | None, str]:
        """The coordinator's answer to a batch, or None and why not."""
        head = (
            b"POST %s HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
            b"%s: %s\r\nContent-Length: %d\r\n\r\n"
        ) % (BATCH_PATH, TOKEN_HEADER, self._token.encode(), len(body))
        try:
            return await asyncio.wait_for(self._exchange(head + body), self._timeout_s), ""
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            if self._streams is not None:
                self._streams[1].close()
            self._streams = None
            if isinstance(exc, asyncio.TimeoutError):
                return None, f"no answer within {self._timeout_s:g} s"
            return None, str(exc) or type(exc).__name__

    async def _exchange(self, request: bytes) -> list[Any]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(*self._upstream)
        reader, writer = self._streams
        writer.write(request)
        status, body = await read_response(reader)
        if not status.startswith(b"HTTP/1.1 %d" % OK_STATUS):
            raise ValueError(status.decode(errors="replace").strip())
        answer = json.loads(body)
        if not isinstance(answer, list):
            raise ValueError("the coordinator's answer is not a list")
        return answer


def say(line: str) -> None:
    """A line for the coordinator's log (it reads the relay's stderr)."""
    print(f"relay: {line}", file=sys.stderr, flush=True)


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


async def serve(config: dict[str, Any], stop: asyncio.Event, http1: ModuleType) -> int:
    relay = Relay(
        config["upstream"], config["token"], float(config["interval_s"]), float(config["give_up_s"])
    )
    key = bytes.fromhex(config["key"])

    def task_credential(token: bytes) -> tuple[str, int] | None:
        who = http1.verify(key, token)
        return http1.task_of(who) if who is not None else None  # (task, attempt)

    connections = http1.Connections(
        http1.Limits(max_body={HEARTBEAT_PATH: MAX_HEARTBEAT_BYTES}, max_connections=_connection_cap())
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: http1.HttpProtocol(task_credential, relay.handle, connections), "127.0.0.1", 0, backlog=1024
    )
    connections.sweep()
    port = server.sockets[0].getsockname()[1]
    os.write(1, (json.dumps({"event": "listening", "port": port}) + "\n").encode())
    ticker = asyncio.ensure_future(relay.tick())
    waits = [asyncio.ensure_future(relay.gave_up.wait()), asyncio.ensure_future(stop.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    server.close()
    for task in (ticker, *waits):  # a task's last word (done, error) was forwarded when it was said
        task.cancel()
    if relay.gave_up.is_set():
        say(f"no coordinator for {config['give_up_s']} s; exiting")
        return 1
    return 0


def _connection_cap() -> int:
    """Connections from the host's tasks the relay takes: what its open-files limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 64))


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    config = json.loads(line)
    sys.dont_write_bytecode = True  # the host's cache holds files named by checksum, nothing else
    try:
        http1 = load_http1(config.get("http_module"))
    except (OSError, ImportError, SyntaxError) as exc:
        say(f"cannot load the HTTP module: {exc}")
        return 2
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def watch_stdin() -> None:  # the channel closing (coordinator gone, run over) ends the relay
        while sys.stdin.buffer.read(4096):
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    return loop.run_until_complete(serve(config, stop, http1))


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the stdin reader thread would block interpreter shutdown
