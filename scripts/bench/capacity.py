"""P6 coordinator capacity: N simulated tasks post heartbeats at 1 Hz each, over real HTTP on
loopback, to the coordinator's real heartbeat server and health store (in a process of its own).

Reported: the coordinator process's CPU share (of one core) over the measured window, and the
p50/p99 ingest latency seen by the tasks (request sent -> answer read, keep-alive connections,
one per task, as the worker runtime does). Goal at 1,000 tasks: <= 10% of a core, p99 <= 5 ms.
The load generator is one asyncio process; at 10,000 tasks it needs most of a core itself, so on
2 cores the figures there include the two competing for CPU.

    .venv/bin/python scripts/bench/capacity.py --tasks 1000 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOKEN = "bench-token"


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(n: int) -> None:
    """The coordinator side: heartbeat server + health store, as `orchestrate up` runs them."""
    _raise_fd_limit()
    from orchestrator.health.server import HeartbeatServer
    from orchestrator.health.store import HealthStore

    points: list[int] = []
    store = HealthStore(time.monotonic, on_points=lambda task, attempt, pts: points.append(len(pts)))
    store.reset(0, [f"task-{i}" for i in range(n)])
    server = HeartbeatServer(store, TOKEN).start()
    print(server.port, flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    server.close()


def _body(i: int, seq: int) -> bytes:
    from worker.wire import Heartbeat

    hb = Heartbeat(
        task=f"task-{i}",
        attempt=0,
        seq=seq,
        sent_at=time.time(),
        pid=10_000 + i,
        rss_bytes=512 * 1024 * 1024,
        cpu_percent=97.5,
        ready=True,
        step=seq * 10,
        total_steps=100_000,
        metrics={"loss": 0.25, "accuracy": 0.9},
        points=[{"step": seq * 10 + k, "loss": 0.25} for k in range(1, 11)],
    )
    return hb.to_bytes()


async def _task(
    i: int, port: int, until: float, measure_from: float, latencies: list[float], errors: list[str]
) -> None:
    await asyncio.sleep(random.random())  # spread the tasks over the second, as real ones drift
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        errors.append(f"connect: {exc}")
        return
    seq = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        seq += 1
        body = _body(i, seq)
        head = (
            f"POST /v1/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Orchestrate-Token: {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        started = time.monotonic()
        try:
            writer.write(head + body)
            status = await reader.readline()
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError) as exc:
            errors.append(f"request: {exc}")
            return
        if not status.startswith(b"HTTP/1.1 200"):
            errors.append(status.decode(errors="replace").strip())
        if started >= measure_from:
            latencies.append(time.monotonic() - started)
        next_at += 1.0
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    writer.close()


async def _load(
    n: int, port: int, warmup_s: float, measure_s: float
) -> tuple[list[float], list[str], float, float]:
    latencies: list[float] = []
    errors: list[str] = []
    start = time.monotonic()
    measure_from = start + warmup_s
    until = measure_from + measure_s
    await asyncio.gather(*(_task(i, port, until, measure_from, latencies, errors) for i in range(n)))
    return latencies, errors, measure_from, until


def measure(n: int, warmup_s: float, measure_s: float) -> dict[str, object]:
    import psutil

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        proc = psutil.Process(server.pid)
        loop = asyncio.new_event_loop()

        async def run() -> tuple[list[float], list[str], float, float]:
            load = asyncio.ensure_future(_load(n, port, warmup_s, measure_s))
            await asyncio.sleep(warmup_s)
            nonlocal cpu_before, wall_before
            cpu_before, wall_before = proc.cpu_times()[:2], time.monotonic()
            await asyncio.sleep(measure_s)
            nonlocal cpu_after, wall_after
            cpu_after, wall_after = proc.cpu_times()[:2], time.monotonic()
            return await load

        cpu_before = cpu_after = (0.0, 0.0)
        wall_before = wall_after = 0.0
        latencies, errors, _, _ = loop.run_until_complete(run())
        loop.close()
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)
    latencies.sort()
    wall = max(1e-9, wall_after - wall_before)
    user, system = ((a - b) / wall for a, b in zip(cpu_after, cpu_before, strict=True))
    share = user + system
    return {
        "tasks": n,
        "heartbeats_per_s": round(len(latencies) / measure_s, 1),
        "coordinator_cpu_share": round(share, 4),
        "of_which_kernel": round(system, 4),
        "p50_ms": round(1000 * statistics.median(latencies), 3) if latencies else None,
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.serve:
        serve(ns.serve)
        return 0
    _raise_fd_limit()
    results = [measure(n, ns.warmup_s, ns.measure_s) for n in ns.tasks]
    print(
        json.dumps(
            {"metric": "P6 coordinator capacity", "results": results, "cores": os.cpu_count()}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
