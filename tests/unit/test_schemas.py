"""Run record layer (orchestrator/record/schemas.py): every document the coordinator writes — status.json
from a real supervisor through a restart, a task restarted alone and the end, events and metrics
lines from a real record — holds to its published JSON Schema model, with no field undocumented."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.record.schemas import SCHEMAS, Event, Metrics, Status
from orchestrator.record.write import SCHEMA_VERSION, RunRecord
from orchestrator.states import ClusterState
from tests.unit.test_supervisor import beat, make, make_ps, ps_running, start_running
from worker.wire import TaskError


def test_the_models_follow_the_records_schema_version() -> None:
    for model in SCHEMAS.values():
        assert typing.get_args(model.model_fields["schema_version"].annotation) == (SCHEMA_VERSION,)


def test_status_of_a_run_through_a_restart_and_its_end(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=1)
    start_running(sup, launcher, store, clock)
    beat(store, "worker-0", step=5, total_steps=20, metrics={"loss": 0.5, "accuracy": 0.75})
    sup.step()
    running = Status.model_validate(sup.status())
    assert running.exit_code is None and running.failures == []
    assert running.tasks[0].metrics == {"loss": 0.5, "accuracy": 0.75}
    launcher.handles["worker-1"].code = -9
    sup.step()
    sup.step()
    assert sup.state is ClusterState.RESTARTING
    restarting = Status.model_validate(sup.status())
    assert [(f.kind.value, f.tasks, f.attempt) for f in restarting.failures] == [("exit", ["worker-1"], 0)]
    assert "SIGKILL" in restarting.failures[0].reason and restarting.failures[0].exit_code == -9
    clock.advance(1.01)
    start_running(sup, launcher, store, clock, attempt=1)
    beat(store, "worker-0", attempt=1, error=TaskError("ValueError", "boom", "Traceback…"))
    launcher.handles["worker-0"].code = 1  # the budget of one restart is spent
    sup.step()
    sup.step()
    ended = Status.model_validate(sup.status())
    assert ended.state is ClusterState.FAILED and ended.exit_code == 1
    assert [f.attempt for f in ended.failures] == [0, 1]
    assert ended.tasks[0].error is not None and ended.tasks[0].error.type == "ValueError"
    assert json.loads(json.dumps(sup.status())) == sup.status()  # plain JSON, as written


def test_status_counts_a_task_restarted_alone(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    launcher.handles["worker-1"].code = -9
    sup.step()
    clock.advance(1.0)
    sup.step()
    status = Status.model_validate(sup.status())
    assert status.failures == [] and status.restarts == 0
    assert [(f.tasks, f.kind.value) for f in status.task_restarts] == [(["worker-1"], "exit")]
    assert {t.task: t.restarts for t in status.tasks}["worker-1"] == 1


def test_a_field_the_schema_does_not_document_is_refused(tmp_path: Path) -> None:
    sup, *_ = make(tmp_path)
    doc = sup.status()
    doc["tasks"][0]["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        Status.model_validate(doc)


def test_event_and_metrics_lines_of_a_real_record(tmp_path: Path) -> None:
    rec = RunRecord(tmp_path / "run")
    rec.event(kind="task", task="worker-0", attempt=0, old="PENDING", new="STARTING", reason="pid 1")
    rec.metrics("worker-0", 0, [{"time": 1.0, "step": 3, "loss": 0.25, "eval_accuracy": 0.5}])
    rec.close()
    event = json.loads((tmp_path / "run" / "events.jsonl").read_text())
    assert Event.model_validate(event).new == "STARTING"
    point = Metrics.model_validate(json.loads((tmp_path / "run" / "metrics.jsonl").read_text()))
    assert point.step == 3 and point.model_extra == {"loss": 0.25, "eval_accuracy": 0.5}


@pytest.mark.parametrize("name", ["status", "event", "metrics"])
def test_orchestrate_schema_prints_each_documents_json_schema(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["schema", name]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    assert "time" in schema["properties"] or "tasks" in schema["properties"]
