"""P11 the run's page against another user of the machine: how many of the owner's requests the page's
server answers while a stranger holds every connection slot it has (64), re-opening each one the
moment it is closed — next to the same owner with no stranger, in the same run.

The server is the product's (`orchestrate show RUN_DIR`, a process of its own, over a run directory
written here); the owner asks `/api/state` with the token, as the page does, one request after
another for `--measure-s`: on one kept-alive connection (a page), and on a new connection per request
(the worst case: every request must win a slot from the stranger). The stranger is one asyncio
process with no token: 64 connections that send nothing, each re-opened as soon as it is closed.

Reported per case: owner requests answered per second, refused or failed, p50/p99 latency, the
slowest; and the ratio to the no-stranger baseline.

    .venv/bin/python scripts/bench/web_strangers.py [--measure-s 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SLOTS = 64  # the page server's connection cap (orchestrator/web/server.py)


def fabricate(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "logs").mkdir()
    task = {"role": "worker", "index": 0, "host": "127.0.0.1", "state": "RUNNING", "reason": "training"}
    status = {
        "schema_version": 1,
        "name": "strangers",
        "run_id": "strangers-1",
        "state": "SUCCEEDED",
        "attempt": 0,
        "restarts": 0,
        "reason": "done",
        "started_at": "2026-12-02T12:00:00.000Z",
        "ended_at": "2026-12-02T12:10:00.000Z",
        "failures": [],
        "task_restarts": [],
        "tasks": [
            {**task, "task": f"worker-{i}", "index": i, "last_step": 100, "metrics": {"loss": 0.1}}
            for i in range(2)
        ],
    }
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"schema_version": 1, "time": "t", "task": "worker-0", "attempt": 0, "step": s, "loss": 1 / s}
            )
            + "\n"
            for s in range(1, 200)
        )
    )


def stranger(port: int, stop_at: float) -> None:
    """Holds SLOTS idle connections without a token, each re-opened as soon as it is closed."""

    async def hold() -> None:
        while time.monotonic() < stop_at:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                await asyncio.wait_for(reader.read(1), stop_at - time.monotonic())  # until closed
                writer.close()
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(0.001)

    async def main() -> None:
        await asyncio.gather(*(hold() for _ in range(SLOTS)))

    asyncio.run(main())


async def owner(port: int, token: str, measure_s: float, fresh: bool) -> dict[str, Any]:
    request = (
        f"GET /api/state?events=0 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        + ("Connection: close\r\n" if fresh else "")
        + "\r\n"
    ).encode()
    latencies: list[float] = []
    failed = 0
    streams = None
    end = time.monotonic() + measure_s
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            if streams is None:
                streams = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = streams
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            await asyncio.wait_for(reader.readexactly(length), 5)
            if not head.startswith(b"HTTP/1.1 200"):
                raise ValueError(head.split(b"\r\n")[0])
            latencies.append(time.monotonic() - started)
            if fresh:
                writer.close()
                streams = None
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError, StopIteration):
            failed += 1
            if streams is not None:
                streams[1].close()
            streams = None
    lat = sorted(latencies)
    return {
        "answered_per_s": round(len(lat) / measure_s, 1),
        "failed": failed,
        "p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
        "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2) if lat else None,
        "max_ms": round(1000 * lat[-1], 2) if lat else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure-s", type=float, default=10.0)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="orchestrate-strangers-") as tmp:
        run_dir = Path(tmp) / "run"
        fabricate(run_dir)
        server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "show", str(run_dir), "--web", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip().split(": ", 1)[1]
            parts = urllib.parse.urlsplit(url)
            port, token = int(parts.port or 80), urllib.parse.parse_qs(parts.query)["token"][0]
            results = {}
            for fresh in (False, True):
                way = "a new connection per request" if fresh else "one kept-alive connection"
                results[f"alone, {way}"] = asyncio.run(owner(port, token, ns.measure_s, fresh))
                flood = multiprocessing.Process(
                    target=stranger, args=(port, time.monotonic() + ns.measure_s + 3)
                )
                flood.start()
                time.sleep(2)  # every slot taken
                results[f"{SLOTS} stranger connections held, {way}"] = asyncio.run(
                    owner(port, token, ns.measure_s, fresh)
                )
                flood.join(timeout=ns.measure_s + 10)
                alone, held = results[f"alone, {way}"], results[f"{SLOTS} stranger connections held, {way}"]
                held["ratio_to_alone"] = round(held["answered_per_s"] / max(alone["answered_per_s"], 1e-9), 3)
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(
        json.dumps(
            {
                "metric": "P11 page server vs a stranger holding its slots",
                "results": results,
                "cores": os.cpu_count(),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
