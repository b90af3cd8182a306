"""P6 coordinator capacity: N simulated tasks send heartbeats at 1 Hz each, over real HTTP on
loopback, to a coordinator in a process of its own.

Two ways heartbeats arrive, as in the product:
- direct: one keep-alive connection per task, one POST per heartbeat (the local backend);
- unix: the same as direct, over the Unix socket of a local run in its own network namespace
  (heartbeat path only: `path:unix:N` against `path:direct:N`, issue 28);
- relayed: tasks of one host post to that host's relay (worker/host/relay.py), which forwards them as
  one `POST /v1/heartbeats` per interval (the ssh backend; the relay tells its tasks when to post
  so that they land just before its flush). Here the load generator sends what the relays would:
  per simulated host of 8 tasks, one batch of 8 heartbeats a second (the relays' own cost is on
  the hosts, not here).

Two coordinators:
- whole: `orchestrate up` itself (coordinator.up: supervisor loop, health store, metrics.jsonl,
  status.json, events) on a spec of N workers, with a backend that starts nothing (the tasks are
  the load generator's). Each task's TF_CONFIG lists the whole cluster, so the plan grows as N²:
  this runs at 1,000 tasks, not 10,000.
- heartbeat path: the heartbeat server, health store and metrics.jsonl writer alone (any N).
And the relay's own cost on its host (`relay:direct:8`): a real worker/host/relay.py with 8 tasks posting
to it one by one; its CPU share is the figure (the coordinator behind it is the heartbeat path).

Every simulated task posts with its own credential (orchestrator/health/credentials.py), the
headers worker/task/reporter.py sends (http.client's); a batch carries its simulated host's relay
credential, the headers worker/host/relay.py sends, and holds that host's tasks only (the whole
coordinator's spec has one host of N workers when direct, as the local backend, and a host per 8
when relayed, so each batch speaks for its own host).

`--parser httptools` (pip install httptools; not a dependency of the product) has the coordinator's
heartbeat endpoint parse HTTP with httptools (scripts/bench/httptools_protocol.py) instead of
worker/wire/http1.py, to weigh the two (issue 13); the relay itself always uses http1.py (it runs with
the standard library only), so for `relay:direct:8` the option changes nothing measured.

Reported: the coordinator process's CPU share (of one core, user + kernel) over the measured
window, p50/p99 request latency seen by the senders, heartbeats taken per second. Goal at 1,000
tasks: <= 10% of a core, p99 <= 5 ms. The load generator is one asyncio process; at 10,000 direct
connections it needs most of a core itself, and on 2 cores the figures include the two competing.

    .venv/bin/python scripts/bench/capacity.py [--cases whole:direct:1000 ...] [--parser httptools]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from worker.host.relay import read_response  # noqa: E402 - the same HTTP the relay reads

TASKS_PER_HOST = 8
DEFAULT_CASES = [
    "whole:direct:1000",
    "whole:relayed:1000",
    "path:relayed:10000",
    "path:direct:10000",
    "relay:direct:8",
]


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the coordinator side (a process of its own) ---------------------------------------------------


def use_parser(parser: str) -> None:
    """The HTTP/1.1 parsing the heartbeat server's connections use (before it starts)."""
    if parser == "httptools":
        from httptools_protocol import HttptoolsProtocol  # scripts/bench, this file's folder

        from orchestrator.health import server

        server.HttpProtocol = HttptoolsProtocol  # type: ignore[misc]


def _parser_in_use() -> str:
    from orchestrator.health import server

    return server.HttpProtocol.__name__


def serve_path(n: int, way: str, folder: Path) -> None:
    """Heartbeat server + health store + metrics.jsonl, as `orchestrate up` wires them."""
    from orchestrator.health.credentials import Credentials
    from orchestrator.health.server import HeartbeatServer, connection_cap
    from orchestrator.health.store import HealthStore
    from orchestrator.record.write import RunRecord

    record = RunRecord(folder)
    store = HealthStore(time.monotonic, on_points=record.metrics)
    tasks = [f"worker-{i}" for i in range(n)]
    store.reset(0, tasks)
    # direct: one host, as the local backend; relayed: a host per TASKS_PER_HOST tasks, a relay each
    scopes = {task: i // TASKS_PER_HOST if way == "relayed" else 0 for i, task in enumerate(tasks)}
    credentials = Credentials()
    credentials.place(scopes)
    # this process holds no task's files: every descriptor but the reserve may be a connection
    # unix: the local backend's tasks in a network namespace of their own post to a Unix socket
    where = f"unix:{folder / 'hb'}" if way == "unix" else "127.0.0.1"
    server = HeartbeatServer(store, credentials, host=where, max_connections=connection_cap(0)).start()
    _announce(
        {
            "url": server.url,
            "attempt": 0,
            "parser": _parser_in_use(),
            "tokens": {task: credentials.task_token(task, 0) for task in tasks},
            "scopes": scopes,
            "relay_tokens": {s: credentials.relay_token(s) for s in set(scopes.values())},
            "relay_keys": {s: credentials.scope_key(s).hex() for s in set(scopes.values())},
        }
    )
    flusher_stop = threading.Event()

    def flush() -> None:  # the supervisor flushes metrics.jsonl once per step
        while not flusher_stop.wait(0.1):
            record.flush()

    threading.Thread(target=flush, daemon=True).start()
    sys.stdin.read()  # until the benchmark closes our stdin
    flusher_stop.set()
    server.close()
    record.close()


def serve_whole(n: int, way: str, folder: Path) -> None:
    """`orchestrate up` on N workers whose processes are the load generator's simulated tasks."""
    from orchestrator import coordinator
    from orchestrator.cli.view import console_view
    from orchestrator.control import UpOptions
    from orchestrator.errors import LaunchError
    from orchestrator.health.credentials import Credentials
    from orchestrator.launch.api import Backend, Heartbeats, ProcessInfo, Sig, TaskHandle
    from orchestrator.launch.local.placement import local_placements
    from orchestrator.plan.launch_plan import TaskPlan
    from orchestrator.plan.placement import Placement
    from orchestrator.spec.load import parse_spec
    from orchestrator.spec.model import ClusterSpec
    from orchestrator.spec.roles import task_slots
    from worker import wire

    class SimHandle(TaskHandle):
        """A simulated task: it runs until the benchmark ends, or until it is signalled."""

        def __init__(self, task: TaskPlan, attempt: int, log_path: Path, pid: int):
            super().__init__(task, attempt, log_path)
            self._info = ProcessInfo(pid, pid, 0.0)
            self._exit_code: int | None = None

        @property
        def process(self) -> ProcessInfo:
            return self._info

        def poll(self) -> int | None:
            return self._exit_code

        def signal(self, sig: Sig) -> None:
            if self._exit_code is None:  # a simulated task ends at once on either signal
                self._exit_code = -(signal.SIGTERM if sig is Sig.TERM else signal.SIGKILL)

        @property
        def exited(self) -> bool:
            return self._exit_code is not None

    class SimBackend(Backend):
        """Places the tasks as the local backend does (with fake ports: nothing listens) and starts
        nothing: the load generator's senders are the tasks."""

        name = "sim"

        def __init__(self, spec: ClusterSpec, run_dir: Path, spec_dir: Path):
            self._spec, self._run_dir, self._spec_dir = spec, run_dir, spec_dir
            self._credentials = Credentials()  # the coordinator's, from open()
            self._announced = False

        def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
            self._credentials = heartbeats.credentials  # for the simulated hosts' relays
            ports = {slot.name: 20_000 + i for i, slot in enumerate(task_slots(self._spec))}
            return local_placements(
                self._spec,
                ports,
                run_dir=self._run_dir.resolve(),
                spec_dir=self._spec_dir,
                coordinator_url=heartbeats.url,
                python=sys.executable,
            )

        def start_all(
            self, tasks: list[TaskPlan], attempt: int, tokens: list[str], log_paths: list[Path]
        ) -> list[TaskHandle | LaunchError]:
            out = super().start_all(tasks, attempt, tokens, log_paths)
            if not self._announced:  # where to post, and each task's own credential, to the senders
                self._announced = True
                scopes = {task.name: task.host_index for task in tasks}
                _announce(
                    {
                        "url": tasks[0].env[wire.ENV_COORDINATOR],
                        "attempt": attempt,
                        "parser": _parser_in_use(),
                        "tokens": {task.name: token for task, token in zip(tasks, tokens, strict=True)},
                        "scopes": scopes,
                        "relay_tokens": {s: self._credentials.relay_token(s) for s in set(scopes.values())},
                    }
                )
            return out

        def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
            with open(log_path, "ab") as log:  # as a real backend does; the log tailer reads it
                log.write(f"===== orchestrate: {task.name} attempt {attempt} (simulated) =====\n".encode())
            return SimHandle(task, attempt, log_path, 100_000 + task.index)

        def record(self) -> dict[str, Any]:
            return {"backend": self.name}

    (folder / "job.py").write_text("# the tasks are simulated\n")
    # direct: one host, as the local backend; relayed: a host per TASKS_PER_HOST tasks, each batch
    # its relay's (a relay speaks for its own host's tasks only)
    per_host = TASKS_PER_HOST if way == "relayed" else n
    hosts = "".join(
        f"  - {{address: 127.0.0.1, tasks: {{worker: {min(per_host, n - first)}}}}}\n"
        for first in range(0, n, per_host)
    )
    text = (
        f"name: capacity\nhosts:\n{hosts}"
        "job:\n  script: job.py\n"
        "health: {heartbeat_timeout_s: 60, stall_timeout_s: 600, startup_timeout_s: 600}\n"
    )
    spec_path = folder / "capacity.yaml"
    spec_path.write_text(text)
    spec = parse_spec(text, file=str(spec_path), base_dir=folder)
    # stdin closing = the benchmark is over: stop the run as Ctrl-C would
    threading.Thread(
        target=lambda: (sys.stdin.read(), os.kill(os.getpid(), signal.SIGINT)), daemon=True
    ).start()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the plain view's lines (every task's states and log lines) go nowhere
    run_dir = folder / "run"
    options = UpOptions(
        run_dir=run_dir,
        view=console_view(False, 15.0),
        backend=SimBackend(spec, run_dir, folder),
        own_process=True,
    )
    coordinator.up(spec, spec_path, options)


def _announce(info: dict[str, Any]) -> None:
    os.write(int(os.environ["BENCH_ANNOUNCE_FD"]), (json.dumps(info) + "\n").encode())


# --- the load generator ------------------------------------------------------------------------


_TEMPLATE: dict[str, Any] = {}


def _heartbeat(i: int, seq: int, attempt: int = 0) -> dict[str, Any]:
    """What a training task of the built-in loop sends each second at 10 steps/s: its step and
    latest loss; worker 0 also the 10 steps since the last as points (metrics.jsonl; numbered, as
    the reporter does, so each is written once), the others report progress only
    (worker/task/reporter.py keeps_points)."""
    if not _TEMPLATE:
        from worker.wire import Heartbeat

        full = Heartbeat(task="", attempt=0, seq=0, sent_at=0.0, pid=0, rss_bytes=512 * 1024 * 1024)
        _TEMPLATE.update(json.loads(full.to_bytes()), cpu_percent=97.5, ready=True, total_steps=100_000)
    now = time.time()
    points = [{"time": now, "step": seq * 10 + k, "loss": 0.25} for k in range(-9, 1)] if i == 0 else []
    return {
        **_TEMPLATE,
        "task": f"worker-{i}",
        "attempt": attempt,
        "seq": seq,
        "sent_at": now,
        "pid": 100_000 + i,
        "step": seq * 10,
        "metrics": {"loss": 0.25},
        "points": points,
        "points_from": (seq - 1) * 10 if i == 0 else 0,
    }


def heartbeat_body(i: int, seq: int, attempt: int = 0) -> bytes:
    """A heartbeat's JSON as wire.Heartbeat.to_bytes() writes it (compact)."""
    return json.dumps(_heartbeat(i, seq, attempt), separators=(",", ":")).encode()


def task_request(host: str, port: int, token: str, body: bytes, flush: bool = False) -> list[bytes]:
    """A task's heartbeat request, byte for byte as worker/task/reporter.py sends it (head and body in
    one write)."""
    flush_line = "X-Orchestrate-Flush: 1\r\n" if flush else ""
    head = (
        f"POST /v1/heartbeat HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nX-Orchestrate-Token: {token}\r\n{flush_line}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return [head + body]


def batch_request(token: str, bodies: list[bytes]) -> list[bytes]:
    """A relay's batch, byte for byte as worker/host/relay.py sends it (in one send())."""
    body = b"[" + b",".join(bodies) + b"]"
    head = (
        b"POST /v1/heartbeats HTTP/1.1\r\nHost: coordinator\r\nContent-Type: application/json\r\n"
        b"X-Orchestrate-Token: %s\r\nContent-Length: %d\r\n\r\n" % (token.encode(), len(body))
    )
    return [head + body]


class _Stats:
    def __init__(self, measure_from: float):
        self.measure_from = measure_from
        self.latencies: list[float] = []
        self.heartbeats = 0
        self.errors: list[str] = []
        self.page_latencies: list[float] = []


async def _sender(
    path: str,
    ids: list[int],
    period_s: float,
    url: str,
    token: str,
    attempt: int,
    until: float,
    stats: _Stats,
) -> None:
    """One connection: every `period_s`, one request with the heartbeats of `ids` (one of them
    when direct, with the task's own credential; a host's due tasks when relayed, with its relay's)."""
    unix = url.startswith("unix:")
    host, port = ("localhost", "80") if unix else url.removeprefix("http://").split(":")
    await asyncio.sleep(random.random() * period_s)  # spread over the period, as real ones drift
    try:
        if unix:
            reader, writer = await asyncio.open_unix_connection(url.removeprefix("unix:"))
        else:
            reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as exc:
        stats.errors.append(f"connect: {exc}")
        return
    seq = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        seq += 1
        bodies = [heartbeat_body(i, seq, attempt) for i in ids]
        if path.endswith("s"):
            sends = batch_request(token, bodies)
        else:  # the reporter's first heartbeat changes its phase: a relay forwards it at once
            sends = task_request(host, int(port), token, bodies[0], flush=seq == 1)
        started = time.monotonic()
        try:
            for data in sends:  # asyncio sends at once what it can (TCP_NODELAY), as send() does
                writer.write(data)
            status, answer = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError) as exc:
            stats.errors.append(f"request: {exc}")
            return
        ok = status.startswith(b"HTTP/1.1 200") and (
            not path.endswith("s") or all(s == 200 for s in json.loads(answer))
        )
        if not ok:
            stats.errors.append(
                status.decode(errors="replace").strip() + " " + answer[:80].decode(errors="replace")
            )
        if started >= stats.measure_from:
            stats.latencies.append(time.monotonic() - started)
            stats.heartbeats += len(ids)
        next_at += period_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    writer.close()


async def _page(status_path: Path, until: float, stats: _Stats) -> None:
    """One open page, as orchestrator/web/static/page.js polls: /api/state every second (the events
    since its last), /api/curves when they changed (at most every 1.5 s), the selected task's log
    every 2 s. Its latencies go to `stats.page_latencies`."""
    page = None
    while page is None:
        try:
            page = json.loads(status_path.read_text())["urls"]["page"]
        except (OSError, ValueError, KeyError):
            await asyncio.sleep(0.2)
    base, token = page.split("/?token=")
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    events, version, curves_at, log_at = 0, -1, 0.0, 0.0

    async def get(path: str) -> bytes:
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\r\n"
        started = time.monotonic()
        writer.write(request.encode())
        status, body = await read_response(reader)
        if started >= stats.measure_from:
            stats.page_latencies.append(time.monotonic() - started)
        if not status.startswith(b"HTTP/1.1 200"):
            stats.errors.append(f"page {path}: {status!r}")
        return body

    while time.monotonic() < until:
        tick = time.monotonic()
        state = json.loads(await get(f"/api/state?events={events}"))
        events = state["event_count"]
        if state["curves_version"] != version and tick - curves_at > 1.5:
            version, curves_at = state["curves_version"], tick
            await get("/api/curves")
        if tick - log_at >= 2:
            log_at = tick
            await get("/api/logs/worker-0?lines=60")
        await asyncio.sleep(max(0.0, tick + 1.0 - time.monotonic()))
    writer.close()


def _senders(way: str, n: int, info: dict[str, Any]) -> list[tuple[str, list[int], float, str]]:
    """(path, the tasks whose heartbeats it carries, period, credential) per connection."""
    tokens, scopes = info["tokens"], info["scopes"]
    if way in ("direct", "unix"):
        return [("/v1/heartbeat", [i], 1.0, tokens[f"worker-{i}"]) for i in range(n)]
    # a relay's tasks post just before its flush (it tells them when), so each flush carries all
    # of them: one batch per host and interval (tests/unit/test_relay.py checks that alignment)
    out = []
    for first in range(0, n, TASKS_PER_HOST):
        ids = list(range(first, min(n, first + TASKS_PER_HOST)))
        scope = scopes[f"worker-{first}"]
        assert all(scopes[f"worker-{i}"] == scope for i in ids), "a batch holds one host's tasks"
        out.append(("/v1/heartbeats", ids, 1.0, info["relay_tokens"][str(scope)]))
    return out


def measure(
    case: str, warmup_s: float, measure_s: float, parser: str = "http1", pages: int = 0
) -> dict[str, Any]:
    import psutil

    kind, way, count = case.split(":")
    n = int(count)
    folder = Path(tempfile.mkdtemp(prefix="orchestrate-capacity-"))
    read_fd, write_fd = os.pipe()
    relay = None
    server = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            "path" if kind == "relay" else kind,
            way,
            str(n),
            str(folder),
            "--parser",
            parser,
        ],
        stdin=subprocess.PIPE,
        env={**os.environ, "BENCH_ANNOUNCE_FD": str(write_fd)},
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as announce:
            info = json.loads(announce.readline())
        proc = psutil.Process(server.pid)
        if kind == "relay":  # the host's side: one relay, its tasks posting to it one by one
            relay = subprocess.Popen(
                [sys.executable, "-S", str(REPO / "worker" / "host" / "relay.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            config = {
                "upstream": info["url"],
                "token": info["relay_tokens"]["0"],  # its host's (all 8 tasks on host 0)
                "key": info["relay_keys"]["0"],  # to check its tasks' own credentials
                "interval_s": 1.0,
                "give_up_s": 30,
            }
            relay.stdin.write((json.dumps(config) + "\n").encode())  # type: ignore[union-attr]
            relay.stdin.flush()  # type: ignore[union-attr]
            port = json.loads(relay.stdout.readline())["port"]  # type: ignore[union-attr]
            info["url"] = f"http://127.0.0.1:{port}"
            proc = psutil.Process(relay.pid)
        loop = asyncio.new_event_loop()
        start = time.monotonic()
        stats = _Stats(start + warmup_s)
        until = stats.measure_from + measure_s
        window: dict[str, Any] = {}

        async def run() -> None:
            senders = [
                _sender(path, ids, period, info["url"], token, info["attempt"], until, stats)
                for path, ids, period, token in _senders(way, n, info)
            ]
            senders += [_page(folder / "run" / "status.json", until, stats) for _ in range(pages)]
            load = asyncio.ensure_future(asyncio.gather(*senders))
            await asyncio.sleep(max(0.0, stats.measure_from - time.monotonic()))
            window["before"] = (proc.cpu_times()[:2], time.monotonic())
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            window["after"] = (proc.cpu_times()[:2], time.monotonic())
            await load

        loop.run_until_complete(run())
        loop.close()
    finally:
        if relay is not None:
            relay.stdin.close()  # type: ignore[union-attr]
            relay.wait(timeout=10)
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=60)
    (cpu_before, wall_before), (cpu_after, wall_after) = window["before"], window["after"]
    wall = max(1e-9, wall_after - wall_before)
    user, system = ((a - b) / wall for a, b in zip(cpu_after, cpu_before, strict=True))
    lat = sorted(stats.latencies)
    return {
        "case": case,
        "coordinator": {
            "whole": "orchestrate up (whole)",
            "path": "heartbeat path",
            "relay": "one host's relay",
        }[kind],
        "arrival": way,
        "tasks": n,
        "parser": info["parser"],  # the coordinator's endpoint's (a relay's own is HttpProtocol)
        "requests_per_s": round(len(lat) / measure_s, 1),
        "heartbeats_per_s": round(stats.heartbeats / measure_s, 1),
        "coordinator_cpu_share": round(user + system, 4),
        "of_which_kernel": round(system, 4),
        "p50_ms": round(1000 * statistics.median(lat), 3) if lat else None,
        "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
        "pages": pages,
        "page_p99_ms": round(
            1000 * sorted(stats.page_latencies)[int(0.99 * (len(stats.page_latencies) - 1))], 3
        )
        if stats.page_latencies
        else None,
        "errors": len(stats.errors),
        "first_error": stats.errors[0] if stats.errors else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="KIND:ARRIVAL:TASKS")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=20.0)
    parser.add_argument(
        "--parser",
        choices=["http1", "httptools"],
        default="http1",
        help="HTTP/1.1 parsing of the coordinator's heartbeat endpoint: worker/wire/http1.py, or httptools "
        "(pip install httptools)",
    )
    parser.add_argument(
        "--pages", type=int, default=0, help="'whole' cases: this many open pages polling as the page does"
    )
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)  # KIND ARRIVAL TASKS FOLDER
    ns = parser.parse_args()
    _raise_fd_limit()
    if ns.serve:
        kind, way, n, folder = ns.serve
        use_parser(ns.parser)
        (serve_whole if kind == "whole" else serve_path)(int(n), way, Path(folder))
        return 0
    results = [measure(case, ns.warmup_s, ns.measure_s, ns.parser, ns.pages) for case in ns.cases]
    print(
        json.dumps(
            {"metric": "P6 coordinator capacity", "results": results, "cores": os.cpu_count()}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
