"""Health layer: the HTTP endpoint where tasks post heartbeats (one per interval, batched progress).

Every request must carry the run's secret token; anything else is rejected before it is parsed.
"""

from __future__ import annotations

import hmac
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from orchestrator.health.store import HealthStore
from worker import wire

log = logging.getLogger("orchestrator.health")


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A task that dies mid-request (killed, or its host cut off) resets its connection: routine
        # here, and no reason to print a traceback on the coordinator's console.
        log.debug("heartbeat connection from %s failed", client_address, exc_info=True)


class HeartbeatServer:
    """Serves POST /v1/heartbeat on `host` (an ephemeral port) until `close()`."""

    def __init__(self, store: HealthStore, token: str, host: str = "127.0.0.1", port: int = 0):
        self._store = store
        self._token = token.encode()
        self._httpd = _QuietServer((host, port), self._handler_class())
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="heartbeat-server",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> HeartbeatServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: one connection per task

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                given = (self.headers.get(wire.TOKEN_HEADER) or "").encode()
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not hmac.compare_digest(given, server._token):
                    self._answer(401, b"bad or missing token", close=True)
                    return
                if self.path != wire.HEARTBEAT_PATH:
                    self._answer(404, b"unknown path", close=True)
                    return
                if not 0 < length <= wire.MAX_BODY_BYTES:
                    self._answer(413, b"bad body length", close=True)
                    return
                try:
                    hb = wire.Heartbeat.from_bytes(self.rfile.read(length))
                except ValueError as exc:
                    self._answer(400, str(exc).encode())
                    return
                self._answer(server._store.ingest(hb), b"")

            def _answer(self, status: int, body: bytes, close: bool = False) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("heartbeat server: " + format, *args)

        return Handler
