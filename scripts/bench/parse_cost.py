"""P6, HTTP parsing alone: the CPU one heartbeat request costs the coordinator's endpoint protocol,
worker/wire/http1.py's `HttpProtocol` against httptools (`HttptoolsProtocol`, scripts/bench/
httptools_protocol.py), with nothing else around it: no sockets, no event loop, no store (the
handler answers 200 at once), a fake transport. One keep-alive connection per variant, as a task's.

Requests are the product's, byte for byte (scripts/bench/capacity.py builds them): a task's
heartbeat as worker/task/reporter.py sends it (http.client: its head and its body in a send() each, so
the server mostly reads them apart: `task, 2 reads`; `task, 1 read` when they arrive together), and
a relay's batch of 8 heartbeats (worker/host/relay.py, one send). Each request is checked with a real
credential (orchestrator/health/credentials.py; a connection checks it once, then compares).

Reported per variant: µs of CPU per request (process time, the best of `--repeats`: the machine
is shared), both parsers, and their ratio. And, for reference, the parsing proper of one request
read whole, outside any protocol (`parse_only`): http1.parse_head with the body sliced out, against
httptools' parser with callbacks that keep the URL, the headers (names lower-cased) and the body.
One core, a few seconds.

    .venv/bin/python scripts/bench/parse_cost.py [--requests 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httptools  # noqa: E402
from capacity import TASKS_PER_HOST, batch_request, heartbeat_body, task_request  # noqa: E402
from httptools_protocol import HttptoolsProtocol  # noqa: E402

from orchestrator.health.credentials import Credentials  # noqa: E402
from worker import wire  # noqa: E402
from worker.wire.http1 import Connections, HttpProtocol, Limits, parse_head  # noqa: E402


class _Transport(asyncio.Transport):
    """Takes what the protocol writes and forgets it (counting the answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.answers += 1

    def close(self) -> None:
        raise AssertionError("the connection was closed")

    def abort(self) -> None:
        raise AssertionError("the connection was dropped")

    def is_closing(self) -> bool:
        return False


def _reads(variant: str, credentials: Credentials) -> tuple[list[bytes], int, int]:
    """One request's reads as the server gets them, its size, and the heartbeats it carries."""
    if variant.startswith("task"):
        sends = task_request("127.0.0.1", 43210, credentials.task_token("worker-1", 0), heartbeat_body(1, 7))
        reads = sends if variant == "task, 2 reads" else [b"".join(sends)]
        return reads, sum(map(len, reads)), 1
    bodies = [heartbeat_body(i, 7) for i in range(1, TASKS_PER_HOST + 1)]
    reads = batch_request(credentials.relay_token(0), bodies)
    return reads, sum(map(len, reads)), TASKS_PER_HOST


def _run(protocol: type[HttpProtocol], reads: list[bytes], requests: int, credentials: Credentials) -> float:
    """CPU seconds for `requests` requests on one connection."""
    limits = Limits(max_body={wire.HEARTBEAT_PATH.encode(): 1 << 20, wire.BATCH_PATH.encode(): 8 << 20})
    handled = 0

    def handle(path: bytes, body: bytes, headers: dict[bytes, bytes], conn: HttpProtocol) -> Any:
        nonlocal handled
        handled += 1
        return wire.OK_STATUS, b""

    conn = protocol(credentials.check, handle, Connections(limits))
    transport = _Transport()
    conn.connection_made(transport)
    feed = conn.data_received
    started = time.process_time()
    for _ in range(requests):
        for data in reads:
            feed(data)
    spent = time.process_time() - started
    assert handled == transport.answers == requests, (handled, transport.answers, requests)
    return spent


class _Collect:
    """httptools callbacks that keep what a handler needs, and nothing more."""

    def __init__(self) -> None:
        self.url, self.headers, self.body, self.messages = b"", {}, b"", 0

    def on_message_begin(self) -> None:
        self.url, self.headers = b"", {}

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body = body

    def on_message_complete(self) -> None:
        self.messages += 1


def _parse_only(name: str, request: bytes, requests: int) -> float:
    """CPU seconds to parse `request` (read whole) `requests` times."""
    if name == "http1":
        started = time.process_time()
        for _ in range(requests):
            end = request.find(b"\r\n\r\n")
            _, _, headers = parse_head(request[:end])
            body = request[end + 4 : end + 4 + int(headers[b"content-length"])]
        spent = time.process_time() - started
        assert len(body) == int(headers[b"content-length"])
        return spent
    sink = _Collect()
    parser = httptools.HttpRequestParser(sink)
    feed = parser.feed_data
    started = time.process_time()
    for _ in range(requests):
        feed(request)
    spent = time.process_time() - started
    assert sink.messages == requests
    return spent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000, help="per variant (a batch: an eighth)")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    credentials = Credentials()
    credentials.place({f"worker-{i}": 0 for i in range(TASKS_PER_HOST + 1)})
    results = []
    for variant in ("task, 2 reads", "task, 1 read", "relay batch of 8, 1 read"):
        reads, size, heartbeats = _reads(variant, credentials)
        requests = ns.requests if heartbeats == 1 else max(1, ns.requests // heartbeats)
        row: dict[str, Any] = {"variant": variant, "request_bytes": size, "requests": requests}
        for name, protocol in (("http1", HttpProtocol), ("httptools", HttptoolsProtocol)):
            best = min(_run(protocol, reads, requests, credentials) for _ in range(ns.repeats))
            row[f"{name}_us_per_request"] = round(1e6 * best / requests, 2)
        row["httptools_over_http1"] = round(row["httptools_us_per_request"] / row["http1_us_per_request"], 3)
        if variant != "task, 2 reads":  # the same bytes read whole as "task, 1 read"
            parse: dict[str, float] = {}
            for name in ("http1", "httptools"):
                best = min(_parse_only(name, b"".join(reads), requests) for _ in range(ns.repeats))
                parse[f"{name}_us"] = round(1e6 * best / requests, 2)
            row["parse_only"] = parse
        results.append(row)
    print(json.dumps({"metric": "P6 HTTP parsing, CPU per request", "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
