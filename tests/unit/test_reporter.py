"""The worker's reporter (worker/task/reporter.py) against a real heartbeat server: batching, keeping
points while the coordinator is away, progress, and its guard when the coordinator is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.health.credentials import Credentials
from worker import wire
from worker.task.reporter import Reporter, ReporterConfig

CREDENTIALS = Credentials(b"unit-tests-secret")  # conftest.SECRET: the server fixture's
CREDENTIALS.place({"worker-0": 0})
TOKEN = CREDENTIALS.task_token("worker-0", 0)


def test_reporter_batches_every_point_into_heartbeats(server):
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, interval_s=0.05, coordinator_timeout_s=30))
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
    rep = Reporter(ReporterConfig("worker-0", 0, "http://127.0.0.1:1", TOKEN, 0.05, 30))
    rep.start()
    rep.report(1, loss=1.0)
    time.sleep(0.3)  # several failed posts
    rep._config = ReporterConfig("worker-0", 0, srv.url, TOKEN, 0.05, 30)
    rep.report(2, loss=0.5)
    rep.finish()
    assert [p["step"] for p in points] == [1, 2]


def test_user_frame_names_the_jobs_own_code_not_libraries(tmp_path):
    import threading

    from worker.task.process import user_frame

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
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, 0.05, 30))
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
    from worker.task.process import keeps_points

    env = (
        {}
        if tf_config is None
        else {"TF_CONFIG": tf_config if isinstance(tf_config, str) else json.dumps(tf_config)}
    )
    assert keeps_points(env) is keeps


def test_a_task_cut_off_from_its_coordinator_takes_its_helpers_and_says_why(tmp_path):
    script = tmp_path / "task.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from worker.task.reporter import Reporter, ReporterConfig\n"
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


def test_what_a_task_reports_stays_within_what_a_heartbeat_may_carry(server, caplog):
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, interval_s=0.05, coordinator_timeout_s=30))
    # before the thread starts: 2,500 points wait, more than one heartbeat may carry
    for step in range(1, 2501):
        rep.report(step, loss=0.5, task=1.0, **{"x" * 101: 1.0})
    for i in range(wire.MAX_METRICS + 5):
        rep.progress(**{f"m{i}": float(i)})
    rep.start()
    rep.finish()
    assert [p["step"] for p in points] == list(range(1, 2501))  # in three heartbeats, each point once
    assert all("task" not in p and "x" * 101 not in p for p in points)
    kept = store.snapshot()["worker-0"].metrics
    assert len(kept) == wire.MAX_METRICS and "loss" in kept and "m0" in kept
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 3  # task, the long name, the first name past 64: each reason said once
    dropped = store.snapshot()["worker-0"].dropped
    assert dropped == wire.Dropped(2 + 6, "task", "a name the record uses itself")  # every one counted


def test_a_new_metric_name_every_step_is_one_line_and_a_count(server, caplog):
    """A job reporting a new name each step (2,938 warning lines in 30 s before): one line in its
    log; the coordinator has the count, which the console, the page and status.json show."""
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, interval_s=0.05, coordinator_timeout_s=30))
    rep.start()
    for step in range(1, 3001):
        rep.report(step, loss=1.0, **{f"loss_{step}": 0.5})
    rep.finish()
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert said == [
        "worker.report(): metric 'loss_64' dropped: over 64 metric names (names dropped for this reason "
        "from now on are counted, not said: the coordinator shows how many)"
    ]
    health = store.snapshot()["worker-0"]
    assert len(health.metrics) == wire.MAX_METRICS and health.dropped == wire.Dropped(
        3000 - 63, "loss_64", "over 64 metric names"
    )


def test_a_name_no_view_shows_as_it_is_is_reported_as_its_escape_said_once(server, caplog):
    srv, store, points = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, interval_s=0.05, coordinator_timeout_s=30))
    rep.start()
    for step in range(1, 4):
        rep.report(step, **{"bad\ud800name": float("nan"), "rev\u202eesrever": 1.0, "損失": float("inf")})
    rep.finish()
    kept = store.snapshot()["worker-0"].metrics
    assert set(kept) == {"bad\\ud800name", "rev\\u202eesrever", "損失"}
    assert kept["損失"] == float("inf") and kept["bad\\ud800name"] != kept["bad\\ud800name"]  # NaN
    assert [sorted(p) for p in points] == [
        ["bad\\ud800name", "rev\\u202eesrever", "step", "time", "損失"]
    ] * 3
    said = [r.getMessage() for r in caplog.records if "is shown as" in r.getMessage()]
    assert len(said) == 2 and "'bad\\\\ud800name'" in said[0]  # once per name, in the task's log


def test_the_first_step_after_the_strategy_came_up_is_said_at_once(server):
    """A restart's timeline ends at the first step: it must not wait for the next heartbeat."""
    srv, store, _ = server
    rep = Reporter(ReporterConfig("worker-0", 0, srv.url, TOKEN, interval_s=30, coordinator_timeout_s=60))
    rep.start()
    try:
        rep.mark_ready()
        deadline = time.monotonic() + 10
        while store.snapshot()["worker-0"].ready_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        rep.progress(7)
        while store.snapshot()["worker-0"].step is None and time.monotonic() < deadline:
            time.sleep(0.01)
        said = store.snapshot()["worker-0"]
        assert said.step == 7 and said.first_step == 7 and said.first_step_at is not None
        assert time.monotonic() < deadline - 5  # far sooner than the 30 s interval
    finally:
        rep.finish()
