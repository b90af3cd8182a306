"""The per-host heartbeat relay (worker/host/relay.py), run as the ssh backend runs it — `python -S` on the
file alone — between real tasks' reporters and the coordinator's real heartbeat server."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from worker import wire
from worker.task.reporter import Reporter, ReporterConfig

WORKER = Path(__file__).resolve().parents[2] / "worker"
RELAY = WORKER / "host" / "relay.py"
TASKS = ["worker-0", "worker-1", "worker-2"]
CREDENTIALS = Credentials(b"relay-tests")
CREDENTIALS.place({**{t: 0 for t in TASKS}, "worker-9": 0, "worker-5": 1})  # 9: not in the store


def token(task: str, attempt: int = 0) -> str:
    return CREDENTIALS.task_token(task, attempt)


@pytest.fixture
def coordinator():
    points: list = []
    store = HealthStore(
        time.monotonic, on_points=lambda task, attempt, p: points.extend((task, q) for q in p)
    )
    store.reset(0, TASKS)
    srv = HeartbeatServer(store, CREDENTIALS).start()
    yield srv, store, points
    srv.close()


class RelayProcess:
    def __init__(
        self,
        upstream: str,
        interval_s: float = 0.2,
        give_up_s: float = 30.0,
        script: Path = RELAY,
        **extra: str,
    ):
        self.proc = subprocess.Popen(
            [sys.executable, "-S", str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        config = {
            "upstream": upstream,
            "token": CREDENTIALS.relay_token(0),
            "key": CREDENTIALS.scope_key(0).hex(),
            "interval_s": interval_s,
            "give_up_s": give_up_s,
        }
        config.update(extra)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(config) + "\n").encode())
        self.proc.stdin.flush()
        event = json.loads(self.proc.stdout.readline())
        assert event["event"] == "listening"
        self.url = f"http://127.0.0.1:{event['port']}"

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the SSH channel closing
        return self.proc.wait(timeout=5)


@pytest.fixture
def relay(coordinator):
    r = RelayProcess(coordinator[0].url)
    yield r
    if r.proc.poll() is None:
        r.close()


def post(url: str, task: str, seq: int, flush: bool = False, as_: str | None = None, **kw) -> int:
    """A task's heartbeat, with its own credential (or `as_`)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    body = wire.Heartbeat(task=task, attempt=0, seq=seq, sent_at=1.0, pid=7, **kw).to_bytes()
    headers = {wire.TOKEN_HEADER: as_ or token(task), **({wire.FLUSH_HEADER: "1"} if flush else {})}
    conn.request("POST", wire.HEARTBEAT_PATH, body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_heartbeats_of_a_host_reach_the_coordinator_in_batches(coordinator, relay):
    srv, store, _ = coordinator
    for seq in range(1, 6):
        for i, task in enumerate(TASKS):
            assert post(relay.url, task, seq, step=10 * seq + i) == 200
    wait_for(lambda: all(h.step is not None and h.step >= 50 for h in store.snapshot().values()))
    assert [store.snapshot()[t].step for t in TASKS] == [50, 51, 52]
    assert srv.requests < 15 / 2  # 15 heartbeats, a fraction of the requests


def test_a_phase_change_is_forwarded_before_the_task_hears_back(coordinator, relay):
    srv, store, _ = coordinator
    relay_slow = RelayProcess(srv.url, interval_s=60.0)  # no tick during this test
    try:
        assert post(relay_slow.url, "worker-0", 1, step=3) == 200
        assert store.snapshot()["worker-0"].step is None  # waits for the tick
        assert post(relay_slow.url, "worker-0", 2, flush=True, done=True, step=4) == 200
        health = store.snapshot()["worker-0"]  # no waiting: known when the task is answered
        assert health.done and health.step == 4
    finally:
        relay_slow.close()


def test_the_coordinators_verdict_reaches_the_task(coordinator, relay):
    srv, store, _ = coordinator
    assert post(relay.url, "worker-9", 1, flush=True) == 404  # not a task of this run
    store.reset(1, TASKS)  # the coordinator moved on to attempt 1
    assert post(relay.url, "worker-0", 1, flush=True) == wire.STALE_ATTEMPT_STATUS
    assert post(relay.url, "worker-0", 2) == wire.STALE_ATTEMPT_STATUS  # and it stays so


def test_wrong_token_is_refused_by_the_relay(coordinator, relay):
    assert post(relay.url, "worker-0", 1, as_="wrong") == 401
    assert post(relay.url, "worker-0", 1, as_=CREDENTIALS.relay_token(0)) == 401  # the relay's own
    assert post(relay.url, "worker-5", 1) == 401  # a task of another host: signed with another key
    assert coordinator[0].requests == 0


def test_through_the_relay_too_a_task_speaks_for_itself_only(coordinator, relay):
    srv, store, _ = coordinator
    assert post(relay.url, "worker-1", 1, flush=True, step=5, as_=token("worker-0")) == 403
    assert post(relay.url, "worker-0", 1, flush=True, step=5, as_=token("worker-0", 1)) == 403
    assert store.snapshot()["worker-1"].step is None and srv.requests == 0


def test_without_a_coordinator_tasks_hear_503_and_the_relay_gives_up(coordinator):
    relay = RelayProcess("http://127.0.0.1:1", interval_s=0.1, give_up_s=1.0)
    assert post(relay.url, "worker-0", 1, flush=True) == 503
    assert post(relay.url, "worker-0", 2) == 503  # taken by nobody: the task keeps its points
    assert relay.proc.wait(timeout=5) == 1
    said = relay.proc.stderr.read().decode()  # type: ignore[union-attr]
    # said once when it happened (the coordinator's log shows it), and again when it gave up
    assert said.count("the coordinator did not answer (") == 1 and "no coordinator for 1.0 s" in said


def test_relay_ends_with_its_channel(relay):
    started = time.monotonic()
    assert relay.close() == 0
    assert time.monotonic() - started < 2


def test_reporters_through_the_relay_lose_no_point_and_repeat_none(coordinator, relay):
    srv, store, points = coordinator
    reporters = [
        Reporter(ReporterConfig(task, 0, relay.url, token(task), interval_s=0.05, coordinator_timeout_s=30))
        for task in TASKS
    ]
    for rep in reporters:
        rep.start()
    for step in range(1, 301):
        for rep in reporters:
            rep.report(step, loss=1.0 / step)
        if step % 50 == 0:
            time.sleep(0.06)
    for rep in reporters:
        rep.finish()  # the final heartbeat (done) is urgent: acknowledged by the coordinator
    for task in TASKS:
        assert [p["step"] for t, p in points if t == task] == list(range(1, 301))
        assert store.snapshot()[task].done and store.snapshot()[task].step == 300


def test_a_batch_is_answered_item_by_item(coordinator):
    srv, store, _ = coordinator
    items = [
        json.loads(wire.Heartbeat(task="worker-0", attempt=0, seq=1, sent_at=1.0, pid=7, step=1).to_bytes()),
        {"task": "worker-1"},  # malformed
        json.loads(wire.Heartbeat(task="worker-7", attempt=0, seq=1, sent_at=1.0, pid=7).to_bytes()),
    ]
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    relay_token = {wire.TOKEN_HEADER: CREDENTIALS.relay_token(0)}
    conn.request("POST", wire.BATCH_PATH, body=json.dumps(items), headers=relay_token)
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == [200, 400, 403]  # 7: no task of its host
    conn.request("POST", wire.BATCH_PATH, body=b'{"not": "a list"}', headers=relay_token)
    assert conn.getresponse().status == 400
    assert store.snapshot()["worker-0"].step == 1


def test_an_idle_relay_without_a_coordinator_exits_by_itself():
    # a host cut off from the coordinator: no task talks to the relay, its channel never closes
    relay = RelayProcess("http://127.0.0.1:1", interval_s=0.1, give_up_s=1.0)
    assert relay.proc.wait(timeout=5) == 1


def test_tasks_align_with_the_relay_one_request_per_interval(coordinator):
    srv, store, _ = coordinator
    interval = 0.2
    relay = RelayProcess(srv.url, interval_s=interval)
    reporters = [
        Reporter(
            ReporterConfig(task, 0, relay.url, token(task), interval_s=interval, coordinator_timeout_s=30)
        )
        for task in TASKS
    ]
    try:
        for i, rep in enumerate(reporters):
            time.sleep(interval * i / len(TASKS))  # start out of phase, as real tasks do
            rep.start()
            rep.report(1)
        time.sleep(3 * interval)  # a few intervals to fall in step
        before, beats_before = srv.requests, sum(store.snapshot()[t].seq for t in TASKS)
        time.sleep(20 * interval)
        requests = srv.requests - before
        beats = sum(store.snapshot()[t].seq for t in TASKS) - beats_before
    finally:
        for rep in reporters:
            rep.finish()
        relay.close()
    assert beats >= 0.8 * 20 * len(TASKS)  # every task still reports once an interval
    assert requests <= 1.3 * 20, requests  # one batch an interval (unaligned: two; direct: one per task)


class SlowUpstream:
    """A TCP proxy in front of the coordinator that holds every answer `delay_s` before passing it
    on: the coordinator behind a busy machine's SSH tunnel."""

    def __init__(self, target: str, delay_s: float):
        host, port = target.removeprefix("http://").split(":")
        self._target, self._delay_s = (host, int(port)), delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._closed = threading.Event()
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(self._target, timeout=5)
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self._delay_s), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        src.settimeout(0.2)
        while not self._closed.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            time.sleep(delay_s)
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            sock.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def test_a_slow_coordinator_is_waited_for_not_given_up_on(coordinator):
    # Answers that take 0.6 s (the relay used to give up after 0.4 s, drop its connection and
    # answer 503 until an empty batch got through: three tasks went unheard for 3 s on a busy
    # machine, and were declared lost).
    srv, store, _ = coordinator
    slow = SlowUpstream(srv.url, delay_s=0.6)
    relay = RelayProcess(slow.url, interval_s=0.2)
    try:
        status = post(relay.url, "worker-0", 1, flush=True, step=1)
        # the task waiting on an urgent heartbeat hears back before its own timeout (1 s) ...
        assert status == 503
        # ... and the heartbeat arrives all the same
        wait_for(lambda: store.snapshot()["worker-0"].step == 1, 3.0)
        for seq in range(2, 12):
            post(relay.url, "worker-0", seq, step=seq)  # the relay's ordinary ticks, one a 0.2 s
            time.sleep(0.2)
        wait_for(lambda: store.snapshot()["worker-0"].step == 11, 3.0)
    finally:
        relay.close()
        slow.close()
    said = relay.proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "did not answer" not in said, said  # slow is not unreachable


def test_relay_runs_alone_from_the_hosts_cache(coordinator, tmp_path):
    # as on a lab host: relay.py and http1.py each named by its SHA-256 in one folder, the
    # protocol module found through the config's `http_module`
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = {}
    for name, room in (("relay.py", "host"), ("http1.py", "wire")):
        data = (WORKER / room / name).read_bytes()
        cached[name] = cache / hashlib.sha256(data).hexdigest()
        cached[name].write_bytes(data)
    srv, store, _ = coordinator
    relay = RelayProcess(srv.url, script=cached["relay.py"], http_module=str(cached["http1.py"]))
    try:
        assert post(relay.url, "worker-0", 1, flush=True, step=7) == 200
        assert store.snapshot()["worker-0"].step == 7
    finally:
        relay.close()
    assert sorted(cache.iterdir()) == sorted(cached.values())  # no bytecode left in the cache


def test_a_relay_without_its_http_module_says_so(tmp_path):
    missing = tmp_path / "cache" / ("0" * 64)
    config = {"upstream": "http://127.0.0.1:1", "token": "t", "key": "00", "interval_s": 1, "give_up_s": 1}
    proc = subprocess.run(
        [sys.executable, "-S", str(RELAY)],
        input=json.dumps({**config, "http_module": str(missing)}) + "\n",
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cannot load the HTTP module" in proc.stderr and str(missing) in proc.stderr
