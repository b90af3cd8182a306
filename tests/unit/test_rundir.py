"""Run record layer, read side (orchestrator/record/read.py): finding a run directory, reading its
status, its coordinator and its logs, and `down` on a fabricated run with a real process group."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.control import down
from orchestrator.errors import RunDirError
from orchestrator.launch.local.backend import group_alive
from orchestrator.record import read as rundir
from orchestrator.record.read import (
    coordinator_alive,
    follow_logs,
    read_status,
    resolve_run_dir,
    task_names,
    unconfirmed_tasks,
)

GRACE_S = 2.0


def write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def status_doc(
    state: str = "RUNNING", tasks: list[dict[str, Any]] | None = None, **kw: Any
) -> dict[str, Any]:
    return {
        "name": "demo",
        "run_id": "demo-20260101-000000-0badcafe",
        "state": state,
        "attempt": 0,
        "restarts": 0,
        "reason": "a reason",
        "started_at": "2026-01-01T00:00:00.000Z",
        "ended_at": None if state == "RUNNING" else "2026-01-01T00:01:00.000Z",
        "tasks": tasks or [],
        **kw,
    }


def wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


# --- resolve_run_dir ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["status.json", "plan.json"])
def test_an_explicit_run_directory_needs_status_or_plan(tmp_path: Path, name: str) -> None:
    write(tmp_path / name, {})
    assert resolve_run_dir(str(tmp_path)) == tmp_path


def test_an_explicit_path_without_status_or_plan_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="is not a run directory"):
        resolve_run_dir(str(tmp_path))


def test_the_latest_run_by_status_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setattr(rundir, "RUNS_DIR", runs)
    for name, mtime in (("b-old", 1_000), ("a-new", 3_000), ("c-mid", 2_000)):
        os.utime(write(runs / name / "status.json", {}), (mtime, mtime))
    write(runs / "z-plan-only" / "plan.json", {})  # newer, but no status.json yet
    assert resolve_run_dir(None) == runs / "a-new"


def test_no_runs_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "RUNS_DIR", tmp_path / "runs")
    with pytest.raises(RunDirError, match="no runs under"):
        resolve_run_dir(None)  # RUNS_DIR does not exist
    (tmp_path / "runs" / "empty").mkdir(parents=True)
    with pytest.raises(RunDirError, match="give a run directory"):
        resolve_run_dir(None)


# --- read_status ----------------------------------------------------------------------------------


def test_read_status(tmp_path: Path) -> None:
    write(tmp_path / "status.json", status_doc())
    assert read_status(tmp_path) == status_doc()


def test_read_status_missing(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="has no status.json yet"):
        read_status(tmp_path)


def test_read_status_malformed(tmp_path: Path) -> None:
    write(tmp_path / "status.json", '{"name": "demo", ')
    with pytest.raises(RunDirError, match="status.json is unreadable"):
        read_status(tmp_path)


def test_read_status_not_an_object(tmp_path: Path) -> None:
    write(tmp_path / "status.json", "[1, 2]")
    with pytest.raises(RunDirError, match="is not a JSON object"):
        read_status(tmp_path)


# --- coordinator_alive ----------------------------------------------------------------------------


def test_coordinator_alive_our_own_process(tmp_path: Path) -> None:
    me = psutil.Process()
    write(tmp_path / "coordinator.json", {"pid": me.pid, "create_time": me.create_time()})
    assert coordinator_alive(tmp_path) == me.pid


def test_coordinator_with_another_start_time_is_a_recycled_pid(tmp_path: Path) -> None:
    me = psutil.Process()
    write(tmp_path / "coordinator.json", {"pid": me.pid, "create_time": me.create_time() - 5})
    assert coordinator_alive(tmp_path) is None


def test_no_coordinator_file(tmp_path: Path) -> None:
    assert coordinator_alive(tmp_path) is None


@pytest.mark.parametrize("text", ['{"pid": 1', '{"create_time": 1.0}', '{"pid": 1}'])
def test_a_malformed_coordinator_file_means_no_coordinator(tmp_path: Path, text: str) -> None:
    write(tmp_path / "coordinator.json", text)
    assert coordinator_alive(tmp_path) is None


@pytest.mark.parametrize("text", ["[]", '{"pid": "x", "create_time": 1.0}'], ids=["list", "text-pid"])
def test_a_coordinator_file_of_the_wrong_shape_means_no_coordinator(tmp_path: Path, text: str) -> None:
    write(tmp_path / "coordinator.json", text)
    assert coordinator_alive(tmp_path) is None


def test_a_dead_coordinator(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(proc.pid).create_time()
    proc.wait(timeout=10)
    write(tmp_path / "coordinator.json", {"pid": proc.pid, "create_time": created})
    assert coordinator_alive(tmp_path) is None


# --- unconfirmed_tasks, task_names ----------------------------------------------------------------


def test_unconfirmed_tasks_from_the_events(tmp_path: Path) -> None:
    events = [
        json.dumps({"time": "t", "kind": "transition", "tasks": ["worker-9"]}),
        json.dumps({"time": "t", "kind": "unconfirmed", "tasks": ["worker-1"]}),
        '{"time": "t", "kind": "unconfirmed", "tas',  # torn by a crash
        "[1, 2]",
        json.dumps({"time": "t", "kind": "unconfirmed", "tasks": ["worker-2", "ps-0"]}),
        json.dumps({"time": "t", "kind": "unconfirmed"}),
    ]
    write(tmp_path / "events.jsonl", "\n".join(events) + "\n")
    assert unconfirmed_tasks(tmp_path) == ["worker-1", "worker-2", "ps-0"]


def test_unconfirmed_tasks_without_events(tmp_path: Path) -> None:
    assert unconfirmed_tasks(tmp_path) == []


def test_task_names_from_the_plan(tmp_path: Path) -> None:
    write(tmp_path / "plan.json", {"tasks": [{"name": "chief-0"}, {"name": "worker-0"}]})
    assert task_names(tmp_path) == ["chief-0", "worker-0"]


@pytest.mark.parametrize("text", [None, "{not json"], ids=["missing", "malformed"])
def test_task_names_without_a_readable_plan(tmp_path: Path, text: str | None) -> None:
    if text is not None:
        write(tmp_path / "plan.json", text)
    with pytest.raises(RunDirError, match="plan.json is unreadable"):
        task_names(tmp_path)


# --- follow_logs ----------------------------------------------------------------------------------


def test_logs_of_several_tasks_are_prefixed(tmp_path: Path) -> None:
    write(tmp_path / "logs" / "worker-0.log", "a\nb\n")
    write(tmp_path / "logs" / "worker-1.log", "c\nno newline yet")
    out = io.StringIO()
    assert follow_logs(tmp_path, ["worker-0", "worker-1"], follow=False, out=out) == 0
    assert out.getvalue().splitlines() == [
        "[worker-0] a",
        "[worker-0] b",
        "[worker-1] c",
        "[worker-1] no newline yet",
    ]


def test_the_log_of_one_task_is_printed_as_it_is(tmp_path: Path) -> None:
    write(tmp_path / "logs" / "worker-1.log", "===== orchestrate: worker-1 attempt 0 =====\nhello\n")
    out = io.StringIO()
    follow_logs(tmp_path, ["worker-1"], follow=False, out=out)
    assert out.getvalue() == "===== orchestrate: worker-1 attempt 0 =====\nhello\n"


def test_a_missing_log_is_named(tmp_path: Path) -> None:
    write(tmp_path / "logs" / "worker-0.log", "a\n")
    with pytest.raises(RunDirError, match="no log for worker-1, ps-0"):
        follow_logs(tmp_path, ["worker-0", "worker-1", "ps-0"], follow=False, out=io.StringIO())


# --- down -----------------------------------------------------------------------------------------


@pytest.fixture
def group(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process group, as a local task would be: its own session, the run id in its env."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        start_new_session=True,
        env={**os.environ, "ORCHESTRATE_RUN_ID": "demo-20260101-000000-0badcafe"},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    return proc.pid


def fabricate_run(run_dir: Path, proc: subprocess.Popen[bytes], state: str, backend: bool = True) -> None:
    task = {
        "task": "worker-0",
        "role": "worker",
        "index": 0,
        "host": "127.0.0.1",
        "state": "RUNNING" if state == "RUNNING" else "SUCCEEDED",
        "pid": proc.pid,
        "pgid": os.getpgid(proc.pid),
        "create_time": psutil.Process(proc.pid).create_time(),
    }
    write(run_dir / "status.json", status_doc(state, [task]))
    write(run_dir / "coordinator.json", {"pid": dead_pid(), "create_time": 1.0})
    write(run_dir / "plan.json", {"tasks": [{"name": "worker-0", "role": "worker", "index": 0}]})
    if backend:
        write(run_dir / "backend.json", {"backend": "local"})


def test_down_stops_the_group_a_dead_coordinator_left(tmp_path: Path, group: subprocess.Popen[bytes]) -> None:
    fabricate_run(tmp_path, group, "RUNNING")
    assert group_alive(group.pid)
    out = io.StringIO()
    started = time.monotonic()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    assert time.monotonic() - started < GRACE_S + 5
    assert wait_until(lambda: group.poll() is not None, GRACE_S)
    assert group.returncode == -signal.SIGTERM  # it was asked first
    assert not group_alive(group.pid)
    text = out.getvalue()
    assert "coordinator gone; stopping what is left of the run" in text
    assert "stopped 1 task process group(s) the coordinator left (worker-0)" in text
    assert "still running" not in text
    assert text.splitlines()[-1] == "run demo: RUNNING (a reason)"


def test_down_of_a_finished_run_leaves_a_live_group_alone(
    tmp_path: Path, group: subprocess.Popen[bytes]
) -> None:
    fabricate_run(tmp_path, group, "SUCCEEDED")
    out = io.StringIO()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    time.sleep(0.2)  # had it been signalled, the sleeping group would be gone by now
    assert group.poll() is None
    assert group_alive(group.pid)
    assert out.getvalue() == "run demo: SUCCEEDED (a reason)\n"


def test_down_of_a_finished_run_stops_an_unconfirmed_task(
    tmp_path: Path, group: subprocess.Popen[bytes]
) -> None:
    fabricate_run(tmp_path, group, "SUCCEEDED")
    write(
        tmp_path / "events.jsonl",
        json.dumps({"time": "t", "kind": "unconfirmed", "tasks": ["worker-0"]}) + "\n",
    )
    out = io.StringIO()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    assert wait_until(lambda: group.poll() is not None, GRACE_S)
    assert "(worker-0)" in out.getvalue()


def test_down_without_a_backend_record_asks_nothing(tmp_path: Path, group: subprocess.Popen[bytes]) -> None:
    fabricate_run(tmp_path, group, "RUNNING", backend=False)
    out = io.StringIO()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    time.sleep(0.2)
    assert group.poll() is None
    assert "coordinator gone" not in out.getvalue()
    assert out.getvalue() == "run demo: RUNNING (a reason)\n"


def test_down_leaves_a_group_of_another_run_alone(tmp_path: Path, group: subprocess.Popen[bytes]) -> None:
    # status.json names the group, but with another start time and run id: a recycled pid
    fabricate_run(tmp_path, group, "RUNNING")
    doc = json.loads((tmp_path / "status.json").read_text())
    doc["run_id"] = "other-20260101-000000-12345678"
    doc["tasks"][0]["create_time"] -= 100
    write(tmp_path / "status.json", doc)
    out = io.StringIO()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    time.sleep(0.2)
    assert group.poll() is None
    assert "stopped" not in out.getvalue()


def test_down_asks_a_live_coordinator_first(tmp_path: Path, group: subprocess.Popen[bytes]) -> None:
    # the "coordinator" here is the sleeping process: SIGTERM ends it, as the real one ends the run
    fabricate_run(tmp_path, group, "SUCCEEDED")
    write(
        tmp_path / "coordinator.json",
        {"pid": group.pid, "create_time": psutil.Process(group.pid).create_time()},
    )
    assert coordinator_alive(tmp_path) == group.pid
    out = io.StringIO()
    assert down(tmp_path, grace_s=GRACE_S, out=out) == 0
    assert wait_until(lambda: group.poll() is not None, GRACE_S)
    assert out.getvalue().startswith(f"asking the coordinator (pid {group.pid}) to stop the run")


def test_down_of_an_unknown_backend_is_an_error(tmp_path: Path, group: subprocess.Popen[bytes]) -> None:
    fabricate_run(tmp_path, group, "RUNNING")
    write(tmp_path / "backend.json", {"backend": "carrier-pigeon"})
    with pytest.raises(RunDirError, match="unknown backend 'carrier-pigeon'"):
        down(tmp_path, grace_s=GRACE_S, out=io.StringIO())
    assert group.poll() is None
