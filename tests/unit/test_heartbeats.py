"""Heartbeats over real HTTP on loopback: the wire format, the secret, and the worker's reporter."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from worker import wire
from worker.reporter import Reporter, ReporterConfig


@pytest.fixture
def server():
    points: list = []
    store = HealthStore(time.monotonic, on_points=lambda task, attempt, p: points.extend(p))
    store.reset(0, ["worker-0"])
    srv = HeartbeatServer(store, "right-token").start()
    yield srv, store, points
    srv.close()


def post(url: str, body: bytes, token: str | None) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[wire.TOKEN_HEADER] = token
    conn.request("POST", wire.HEARTBEAT_PATH, body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def hb(**kw) -> bytes:
    return wire.Heartbeat(
        **{"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 1.0, "pid": 7, **kw}
    ).to_bytes()


def test_request_without_or_with_wrong_token_is_rejected(server):
    srv, store, _ = server
    assert post(srv.url, hb(step=3), None) == 401
    assert post(srv.url, hb(step=3), "wrong") == 401
    assert store.snapshot()["worker-0"].last_heartbeat_at is None
    assert post(srv.url, hb(step=3), "right-token") == 200
    assert store.snapshot()["worker-0"].step == 3


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"task": "worker-0"}).encode(),
        json.dumps({"task": 1, "attempt": 0, "seq": 1, "sent_at": 0, "pid": 1}).encode(),
        *(
            json.dumps(
                {"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 0, "pid": 1, "restored": r}
            ).encode()
            for r in (
                {"step": "75", "fingerprint": "ab"},
                {"step": 75},
                {"step": 75, "fingerprint": "x" * 1000},
                {"step": 75, "fingerprint": "ab", "source": 3},
                [75],
            )
        ),
    ],
)
def test_malformed_heartbeat_is_400_and_server_survives(server, body):
    srv, store, _ = server
    assert post(srv.url, body, "right-token") == 400
    assert post(srv.url, hb(), "right-token") == 200


def test_a_restore_report_reaches_the_store_and_stays_for_the_attempt(server):
    srv, store, _ = server
    start = wire.Restored(
        step=75, fingerprint="a1b2c3d4e5f60718", source="/h/ckpt-75", epoch=2, step_in_epoch=5
    )
    assert post(srv.url, hb(seq=1, restored=start), "right-token") == 200
    assert post(srv.url, hb(seq=2, step=76), "right-token") == 200  # later heartbeats need not repeat it
    assert store.snapshot()["worker-0"].restored == start


def test_unknown_task_and_stale_attempt(server):
    srv, store, _ = server
    assert post(srv.url, hb(task="worker-9"), "right-token") == 404
    store.reset(1, ["worker-0"])
    assert post(srv.url, hb(attempt=0), "right-token") == wire.STALE_ATTEMPT_STATUS


def test_reporter_batches_every_point_into_heartbeats(server):
    srv, store, points = server
    rep = Reporter(
        ReporterConfig("worker-0", 0, srv.url, "right-token", interval_s=0.05, coordinator_timeout_s=30)
    )
    rep.start()
    for step in range(1, 501):
        rep.report(step, loss=1.0 / step)
    rep.finish()
    assert [p["step"] for p in points] == list(range(1, 501))  # nothing reported is dropped
    health = store.snapshot()["worker-0"]
    assert health.step == 500 and health.ready_at is not None and health.done
    assert health.metrics["loss"] == pytest.approx(1 / 500)


def test_reporter_keeps_points_while_coordinator_is_briefly_away(server):
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, "http://127.0.0.1:1", "right-token", 0.05, 30))
    rep.start()
    rep.report(1, loss=1.0)
    time.sleep(0.3)  # several failed posts
    rep._config = ReporterConfig("worker-0", 0, srv.url, "right-token", 0.05, 30)
    rep.report(2, loss=0.5)
    rep.finish()
    assert [p["step"] for p in points] == [1, 2]


def test_garbage_content_length_and_reset_connections_do_not_break_the_server(server, capfd):
    import socket

    srv, store, _ = server
    host, port = srv.url.removeprefix("http://").split(":")
    for request in (
        b"POST /v1/heartbeat HTTP/1.1\r\nX-Orchestrate-Token: right-token\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 5\r\n",  # cut off mid-headers
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request)
            s.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )  # RST on close
    time.sleep(0.2)
    assert post(srv.url, hb(step=4), "right-token") == 200
    assert "Traceback" not in capfd.readouterr().err


def test_user_frame_names_the_jobs_own_code_not_libraries(tmp_path):
    import threading

    from worker.reporter import user_frame

    script = tmp_path / "stuck_job.py"
    script.write_text("import time\ndef wait(ev):\n    while not ev.is_set():\n        time.sleep(0.01)\n")
    namespace: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    ev = threading.Event()
    t = threading.Thread(target=namespace["wait"], args=(ev,))
    t.start()
    try:
        time.sleep(0.05)
        where = user_frame()
    finally:
        ev.set()
        t.join()
    # the main thread is inside this package (user_frame itself): skipped; the stuck thread is named
    assert where == "stuck_job.py:4 in wait"


def test_progress_updates_the_task_without_metrics_lines(server):
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, "right-token", 0.05, 30))
    rep.start()
    for step in range(1, 51):
        rep.progress(step, loss=1.0 / step)
    rep.finish()
    assert points == []  # no line in metrics.jsonl
    health = store.snapshot()["worker-0"]
    assert health.step == 50 and health.metrics["loss"] == pytest.approx(1 / 50) and health.done


@pytest.mark.parametrize(
    ("tf_config", "keeps"),
    [
        (None, True),  # a single process
        ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}}, True),
        ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}}, False),
        ({"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "chief", "index": 0}}, True),
        ({"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}}, False),
        ({"cluster": {"evaluator": ["e"]}, "task": {"type": "evaluator", "index": 0}}, True),
        ("not json", True),
    ],
)
def test_one_task_of_a_synchronous_cluster_keeps_the_per_step_record(tf_config, keeps):
    from worker.reporter import keeps_points

    env = (
        {}
        if tf_config is None
        else {"TF_CONFIG": tf_config if isinstance(tf_config, str) else json.dumps(tf_config)}
    )
    assert keeps_points(env) is keeps


def test_log_tailer_follows_files_that_appear_and_grow(tmp_path):
    from orchestrator.logtail import LogTailer

    lines: list[tuple[str, str]] = []
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("before the start\n")  # what was there already is not replayed
    tailer = LogTailer({"a": a, "b": b}, lambda task, line: lines.append((task, line)), interval_s=0.02)
    tailer.start()
    with open(a, "a") as f:
        f.write("one\ntw")
    b.write_text("b appears\n")  # created after the tailer started
    time.sleep(0.2)
    with open(a, "a") as f:
        f.write("o\n")
    time.sleep(0.2)
    tailer.stop()
    assert [x for x in lines if x[0] == "a"] == [("a", "one"), ("a", "two")]
    assert ("b", "b appears") in lines


def test_a_task_cut_off_from_its_coordinator_takes_its_helpers_and_says_why(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from worker.reporter import Reporter, ReporterConfig\n"
        "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(helper.pid, flush=True)\n"
        "Reporter(ReporterConfig('worker-0', 0, 'http://127.0.0.1:1', 't', 0.05, 0.5)).start()\n"
        "time.sleep(60)\n"
    )
    task = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the launchers start a task: leader of its own group
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    helper = int(task.stdout.readline())
    assert task.wait(timeout=10) == wire.EXIT_NO_COORDINATOR  # not "killed by SIGKILL"
    assert "no coordinator reachable" in task.stderr.read()
    assert wait_gone(helper, 5)


def wait_gone(pid: int, timeout_s: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
