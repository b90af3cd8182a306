"""Health layer: the HTTP endpoint where tasks post heartbeats (one per interval, batched progress).

Every request must carry a credential of this run (health/credentials.py), checked before its
body is read.

An asyncio protocol on a thread of its own, with just the HTTP/1.1 a heartbeat needs (POST with
Content-Length, keep-alive, pipelining; worker/wire/http1.py, shared with the per-host relay): one
connection per task costs a socket, not a thread (P6: the stdlib ThreadingHTTPServer spent 39% of a
core on 1,000 tasks at 1 Hz, mostly parsing headers and switching threads). A task alone on its
host posts here itself; on a host with several, a relay posts their heartbeats as one batch.

Any user of the machine can connect, so what a client can make the server hold is bounded
(worker/wire/http1.py: deadlines, a connection cap that leaves the coordinator a reserve of file
descriptors for its own record, head and body sizes; worker/wire/__init__.py: what a heartbeat may carry),
and each task's own credential (health/credentials.py) lets it speak for itself only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import threading

from orchestrator.health.credentials import Client, Credentials
from orchestrator.health.store import HealthStore
from worker import wire
from worker.wire.http1 import Answer, Connections, HttpProtocol, Limits

log = logging.getLogger("orchestrator.health")

_PATH = wire.HEARTBEAT_PATH.encode()
_BATCH_PATH = wire.BATCH_PATH.encode()


#: Connections asyncio accepts in one go, before any is looked at (the listen backlog, too).
ACCEPT_BACKLOG = 100
#: File descriptors the coordinator keeps for itself: its record's files, the backend's sockets,
#: pipes and locks, and room for two bursts of accepted connections not yet capped; and per task
#: (a port lock, a log being written and one being tailed, a pipe).
FD_RESERVE, FD_PER_TASK = 128 + 2 * ACCEPT_BACKLOG, 4


def connection_cap(tasks: int, soft_limit: int | None = None) -> int:
    """How many heartbeat connections the coordinator can hold and still write its record."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            soft_limit = 1 << 20
    return soft_limit - FD_RESERVE - FD_PER_TASK * tasks


def connections_needed(tasks: int) -> int:
    """Enough for every task posting directly, each reconnecting once, and a few more."""
    return 2 * tasks + 16


class HeartbeatServer:
    """Serves POST /v1/heartbeat on `host` (an ephemeral port unless given) until `close()`;
    `host` "unix:PATH": on a Unix socket there (local tasks in a network namespace of their own)."""

    def __init__(
        self,
        store: HealthStore,
        credentials: Credentials,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 1024,
        idle_s: float = 120.0,
        hello_s: float = 5.0,
        request_s: float = 10.0,
    ):
        self._store = store
        self._credentials = credentials
        self.connections = Connections(
            Limits(
                max_body={_PATH: wire.MAX_HEARTBEAT_BYTES, _BATCH_PATH: wire.MAX_BATCH_BYTES},
                max_connections=max_connections,
                idle_s=idle_s,
                hello_s=hello_s,
                request_s=request_s,
            )
        )
        self._path = host.removeprefix(wire.UNIX_SCHEME) if host.startswith(wire.UNIX_SCHEME) else None
        family = socket.AF_UNIX if self._path else socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if self._path is not None:  # in a private (0700) folder; the file itself the owner's too
                self._sock.bind(self._path)
                os.chmod(self._path, 0o600)
            else:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._sock.bind((host, port))
            self._sock.listen(ACCEPT_BACKLOG)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._serve, name="heartbeat-server", daemon=True)
        self._ready = threading.Event()
        self._handler = _Handler(store, credentials)

    @property
    def port(self) -> int:
        """The TCP port (0 on a Unix socket)."""
        return 0 if self._path is not None else int(self._sock.getsockname()[1])

    @property
    def requests(self) -> int:
        """Requests answered so far (past the token check)."""
        return self._handler.requests

    @property
    def url(self) -> str:
        if self._path is not None:
            return f"{wire.UNIX_SCHEME}{self._path}"
        host = self._sock.getsockname()[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> HeartbeatServer:
        self._thread.start()
        self._ready.wait(timeout=10)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.connections.stop)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._sock.close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        handler = self._handler

        check, connections = self._credentials.check, self.connections

        async def open_server() -> None:
            self._server = await self._loop.create_server(
                lambda: HttpProtocol(check, handler, connections), sock=self._sock, backlog=ACCEPT_BACKLOG
            )
            connections.sweep()

        self._loop.run_until_complete(open_server())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            if self._server is not None:
                self._server.close()
            self._loop.close()


class _Handler:
    """Answers `POST /v1/heartbeat` (one task, for itself) and `POST /v1/heartbeats` (a host's
    relay: a JSON list of its tasks' heartbeats, answered with the list of their statuses)."""

    def __init__(self, store: HealthStore, credentials: Credentials):
        self._store = store
        self._credentials = credentials
        self.requests = 0  # answered with a valid credential (for tests and benchmarks)

    def __call__(self, path: bytes, body: bytes, headers: dict[bytes, bytes], conn: HttpProtocol) -> Answer:
        self.requests += 1
        client = conn.client
        assert isinstance(client, Client)  # HttpProtocol checked the credential
        if path == _PATH:
            if client.task is None:
                return wire.FORBIDDEN_STATUS, b"a relay posts batches"
            try:
                hb = wire.Heartbeat.from_bytes(body)
            except ValueError as exc:
                return wire.BAD_REQUEST_STATUS, str(exc).encode()
            if hb.task != client.task or hb.attempt != client.attempt:
                return wire.FORBIDDEN_STATUS, b"a task speaks for itself only"
            return self._store.ingest(hb), b""
        # the batch path (HttpProtocol refuses any other)
        if client.task is not None:
            return wire.FORBIDDEN_STATUS, b"a task posts its own heartbeats"
        try:
            items = wire.loads(body)
        except ValueError as exc:
            return wire.BAD_REQUEST_STATUS, str(exc).encode()
        if not isinstance(items, list):
            return wire.BAD_REQUEST_STATUS, b"a batch is a JSON list of heartbeats"
        return wire.OK_STATUS, json.dumps([self._one(item, client.scope) for item in items]).encode()

    def _one(self, item: object, scope: int) -> int:
        try:
            hb = wire.Heartbeat.from_dict(item)
        except ValueError:
            return wire.BAD_REQUEST_STATUS
        if self._credentials.scope_of(hb.task) != scope:
            return wire.FORBIDDEN_STATUS  # a relay speaks for its own host's tasks only
        return self._store.ingest(hb)
