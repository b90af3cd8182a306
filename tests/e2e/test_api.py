"""End to end: the Python API (orchestrator.up / orchestrator.start) from threads that are not the
main one, with real task processes (a script that reports steps without TensorFlow: what is
tested here is the coordinator's side, at a fraction of the cost)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import orchestrator
from orchestrator.record.schemas import Event, Metrics, Status
from tests.conftest import run_processes, wait_until

pytestmark = pytest.mark.e2e

SCRIPT = """\
import os, sys, time
import worker

steps = int(sys.argv[1])
worker.set_total_steps(steps)
for i in range(1, steps + 1):
    time.sleep(0.05)
    worker.report(step=i, loss=1.0 / i, accuracy=i / steps)
print("trained", os.environ["ORCHESTRATE_TASK"], flush=True)
"""


def spec(tmp_path: Path, steps: int) -> dict[str, Any]:
    (tmp_path / "job.py").write_text(SCRIPT)
    return {
        "name": "api",
        "hosts": [{"address": "127.0.0.1", "tasks": {"worker": 2}}],
        "job": {"script": "job.py", "args": [str(steps)]},
        "health": {"startup_timeout_s": 60},
    }


def test_up_from_a_thread_with_a_dict_spec_and_an_event_callback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[dict[str, Any]] = []
    results: list[Any] = []

    def main() -> None:
        results.append(
            orchestrator.up(
                spec(tmp_path, 80),  # 4 s of steps: progress lines (status news comes once a second)
                run_dir=tmp_path / "run",
                base_dir=tmp_path,
                on_event=events.append,
                view="plain",
                progress_every_s=0.2,
            )
        )

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    (result,) = results
    assert result.ok and result.exit_code == 0 and result.state.value == "SUCCEEDED"
    assert result.run_dir == tmp_path / "run"
    assert result.metrics["loss"] == pytest.approx(1 / 80) and result.metrics["accuracy"] == 1.0
    assert [e["new"] for e in events if e["kind"] == "run"] == [
        "LAUNCHING",
        "RUNNING",
        "STOPPING",
        "SUCCEEDED",
    ]
    # what the callback got is what the record holds, and every document follows its schema
    written = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert written == events
    for line in written:
        Event.model_validate(line)
    for line in (result.run_dir / "metrics.jsonl").read_text().splitlines():
        Metrics.model_validate_json(line)
    status = Status.model_validate_json((result.run_dir / "status.json").read_text())
    assert status.exit_code == 0 and status.run_id == result.run_id
    assert "job:" in (result.run_dir / "spec.yaml").read_text()
    out = capsys.readouterr().out
    assert "[worker-1] trained worker-1" in out and "orchestrate: api SUCCEEDED" in out
    assert "orchestrate: progress step " in out and "/80 (" in out
    assert run_processes(result.run_id) == []


def test_start_streams_events_and_stop_ends_the_run_cleanly(tmp_path: Path) -> None:
    run = orchestrator.start(spec(tmp_path, 100_000), run_dir=tmp_path / "run", base_dir=tmp_path)
    seen = []
    for event in run.events(timeout_s=60):
        seen.append(event)
        if event["kind"] == "run" and event["new"] == "RUNNING":
            break
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert wait_until(lambda: len(run_processes(status["run_id"])) >= 2, 10)
    stopped_at = time.monotonic()
    run.stop()
    result = run.result(timeout_s=60)
    assert time.monotonic() - stopped_at < 15
    assert result.state.value == "INTERRUPTED" and result.exit_code == 130
    assert "stopped by the caller" in result.reason
    rest = list(run.events(timeout_s=10))
    assert [e["new"] for e in rest if e["kind"] == "run"][-1] == "INTERRUPTED"
    assert run.done and run_processes(result.run_id) == []


def test_a_bad_spec_raises_with_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bad = spec(tmp_path, 1)
    bad["hosts"][0]["taks"] = bad["hosts"][0].pop("tasks")
    with pytest.raises(orchestrator.SpecError) as info:
        orchestrator.up(bad, base_dir=tmp_path)
    assert "hosts[0].taks: unknown key; did you mean `tasks`?" in str(info.value)
    assert not (tmp_path / "runs").exists()
