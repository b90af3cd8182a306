"""CLI output layer (orchestrator/cli/view.py): the progress a person reads (step/total, ETA, steps/s,
examples/s, every metric, heartbeat ages), the events kept on screen with their causes, the plain
progress line, and a view that fits 60 columns."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from orchestrator.cli.view import LiveView, PlainView, metric_names, render_status
from orchestrator.record.progress import (
    age_text,
    duration_text,
    event_text,
    notices,
    progress_of,
    recent_events,
)
from orchestrator.record.quiet import console_writes_anything

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def iso(t: float) -> str:
    import datetime as dt

    return (
        dt.datetime.fromtimestamp(t, dt.timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def task(name: str, role: str, state: str = "RUNNING", **kw: Any) -> dict[str, Any]:
    return {
        "task": name,
        "role": role,
        "index": int(name.rsplit("-", 1)[1]),
        "host": "127.0.0.1",
        "state": state,
        "reason": "",
        "restarts": 0,
        "last_step": None,
        "total_steps": None,
        "metrics": {},
        "steps_per_s": None,
        "rss_bytes": 300 * 2**20,
        "last_heartbeat_at": iso(NOW - 2),
        **kw,
    }


def status(*tasks: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        "name": "digits",
        "state": "RUNNING",
        "attempt": 1,
        "restarts": 1,
        "reason": "every task's distribution strategy is up",
        "started_at": iso(NOW - 95),
        "ended_at": None,
        "examples_per_step": None,
        "tasks": list(tasks),
        **kw,
    }


TRAINING = status(
    task(
        "chief-0",
        "chief",
        last_step=120,
        total_steps=400,
        steps_per_s=10.0,
        metrics={"loss": 0.3125, "accuracy": 0.91},
    ),
    task(
        "worker-0",
        "worker",
        last_step=119,
        total_steps=400,
        steps_per_s=10.0,
        metrics={"loss": 0.3125},
        busy="validating",
    ),
    task("ps-0", "ps", last_heartbeat_at=iso(NOW - 7)),
    task(
        "evaluator-0",
        "evaluator",
        last_step=100,
        steps_per_s=0.5,
        metrics={"eval_loss": 0.4, "eval_accuracy": 0.875},
    ),
    examples_per_step=64,
)


def test_ages_and_durations_read_as_people_say_them() -> None:
    assert [age_text(s) for s in (0.4, 59, 61, 3599, 7200, 200000)] == [
        "0 s",
        "59 s",
        "1 min",
        "59 min",
        "2 h",
        "2 d",
    ]
    assert [duration_text(s) for s in (42, 725, 3723)] == ["0:42", "12:05", "1:02:03"]


def test_progress_of_a_training_run() -> None:
    p = progress_of(TRAINING, NOW)
    assert (p.step, p.total, p.steps_per_s, p.examples_per_s) == (120, 400, 10.0, 640.0)
    assert p.eta_s == pytest.approx(28.0)
    assert p.metrics == {"loss": 0.3125, "accuracy": 0.91}  # the chief's
    assert p.eval_metrics == {"eval_loss": 0.4, "eval_accuracy": 0.875}
    assert p.oldest_heartbeat_s == pytest.approx(7, abs=0.01)
    assert p.parts() == [
        "step 120/400 (30%)",
        "ETA 0:28",
        "10 steps/s",
        "640 examples/s",
        "loss 0.3125",
        "accuracy 0.91",
        "eval_loss 0.4",
        "eval_accuracy 0.875",
    ]
    assert p.parts(ended=True)[:2] == ["step 120/400 (30%)", "loss 0.3125"]


def test_examples_per_second_from_the_batch_the_job_reported() -> None:
    s = status(task("worker-0", "worker", last_step=9, steps_per_s=4.0, examples_per_step=32))
    assert progress_of(s, NOW).examples_per_s == 128.0
    assert progress_of({**s, "examples_per_step": 64}, NOW).examples_per_s == 128.0  # the job's own first


def test_progress_without_a_chief_follows_the_furthest_worker_and_without_a_total_has_no_eta() -> None:
    s = status(
        task("worker-0", "worker", last_step=7, steps_per_s=2.0, metrics={"loss": 1.0}),
        task("worker-1", "worker", last_step=9, steps_per_s=3.0, metrics={"loss": 0.5}),
    )
    p = progress_of(s, NOW)
    assert (p.step, p.total, p.eta_s, p.examples_per_s, p.metrics) == (9, None, None, None, {"loss": 0.5})
    assert p.parts()[:2] == ["step 9", "3 steps/s"]


def test_metric_columns_follow_what_is_reported_loss_first_eval_last() -> None:
    assert metric_names(TRAINING["tasks"]) == ["loss", "accuracy", "eval_loss", "eval_accuracy"]


def lines_of(renderable: Any, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_the_view_shows_every_metric_on_its_row_and_heartbeat_ages() -> None:
    events = ["08:00:01 worker-1 FAILED: was killed by SIGKILL (exit code -9)"]
    out = lines_of(render_status(TRAINING, events, width=120, now=NOW), 120)
    text = "\n".join(out)
    assert out[0] == "digits RUNNING · attempt 1 · restarts 1 · 1:35"
    assert "step 120/400 (30%)\nETA 0:28 · 10 steps/s · 640 examples/s · loss 0.3125" in text
    header = next(line for line in out if line.startswith("task"))
    assert header.split() == [
        "task",
        "state",
        "step",
        "loss",
        "accuracy",
        "eval_loss",
        "eval_accuracy",
        "heartbeat",
        "steps/s",
        "RSS",
        "host",
    ]
    evaluator = next(line for line in out if line.startswith("evaluator-0"))
    assert "0.875" in evaluator and "0.5" not in evaluator.split()  # no steps/s for the evaluator
    assert "validating" in next(line for line in out if line.startswith("worker-0"))
    ps = next(line for line in out if line.startswith("ps-0"))
    assert "7 s" in ps
    assert "events:" in text and "worker-1 FAILED: was killed by SIGKILL" in text


@pytest.mark.parametrize("width", [60, 80])
def test_the_view_fits_a_narrow_terminal(width: int) -> None:
    events = ["08:00:01 worker-1 FAILED: " + "a long reason " * 20]
    out = lines_of(render_status(TRAINING, events, width=width, now=NOW), width)
    assert all(len(line) <= width for line in out), "\n".join(out)
    text = "\n".join(out)
    for name in ("chief-0", "worker-0", "ps-0", "evaluator-0", "RUNNING", "loss", "worker-1 FAILED"):
        assert name in text
    header = next(line for line in out if line.startswith("task")).split()
    assert header[:4] == ["task", "state", "step", "loss"] and "heartbeat" in header  # kept first
    assert "━━━━" in text  # the bar; metrics left out of the table are above it, or counted there
    assert "accuracy 0.91" in text or re.search(r"\+\d+ more metrics?", text), text
    assert "step 120/400" in text


def test_many_tasks_are_summed_up_below_the_rows_shown() -> None:
    many = status(*[task(f"worker-{i}", "worker", last_step=3) for i in range(40)])
    text = "\n".join(lines_of(render_status(many, width=100, now=NOW), 100))
    assert "worker-15" in text and "worker-16 " not in text
    assert "… and 24 more: 24 RUNNING" in text


def test_restart_causes_and_the_end_are_the_events_kept() -> None:
    events = [
        {
            "time": "2026-12-01T12:00:00.000Z",
            "kind": "task",
            "task": "worker-0",
            "new": "RUNNING",
            "reason": "up",
        },
        {
            "time": "2026-12-01T12:00:01.000Z",
            "kind": "task",
            "task": "worker-1",
            "new": "FAILED",
            "reason": "was killed by SIGKILL\nmore",
        },
        {
            "time": "2026-12-01T12:00:01.100Z",
            "kind": "run",
            "new": "STOPPING",
            "reason": "worker-1 was killed by SIGKILL",
        },
        {
            "time": "2026-12-01T12:00:02.000Z",
            "kind": "run",
            "new": "RESTARTING",
            "reason": "restarting the job (1 of 3), in 2 s",
        },
        {"time": "2026-12-01T12:00:04.000Z", "kind": "run", "new": "LAUNCHING", "reason": "attempt 1"},
    ]
    assert recent_events(events) == [
        "12:00:01 worker-1 FAILED: was killed by SIGKILL",
        "12:00:01 STOPPING: worker-1 was killed by SIGKILL",
        "12:00:02 RESTARTING: restarting the job (1 of 3), in 2 s",
    ]
    assert event_text({"kind": "task_restart", "task": "worker-1", "reason": "x"}, with_time=False) == (
        "worker-1 restarting alone: x"
    )


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_plain_view_prints_progress_every_interval_while_training() -> None:
    out, clock = io.StringIO(), Clock()
    view = PlainView(out, progress_every_s=10, clock=clock, width=200)
    view.update(TRAINING)
    first = out.getvalue()
    assert "orchestrate: digits RUNNING" in first and "progress" not in first
    clock.t = 5
    view.update(TRAINING)
    assert "progress" not in out.getvalue()
    clock.t = 10
    view.update(TRAINING)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("orchestrate: progress step 120/400 (30%) · ETA ")
    assert "640 examples/s" in line and "eval_accuracy 0.875" in line and "heartbeats ≤ " in line
    clock.t = 15
    view.update(TRAINING)
    assert out.getvalue().count("progress") == 1
    view.event({"kind": "task_restart", "task": "worker-1", "reason": "restarting it alone, in 1 s"})
    assert (
        out.getvalue().splitlines()[-1]
        == "orchestrate: worker-1 restarting alone: restarting it alone, in 1 s"
    )


@pytest.mark.parametrize("width", [80, 120])
def test_a_progress_line_of_63_metrics_fits_the_terminal_and_counts_the_rest(width: int) -> None:
    """A job reporting 63 metrics made a ~1 KB progress line; it fits the width, the first
    metrics shown (loss first), then how many more."""
    out, clock = io.StringIO(), Clock()
    view = PlainView(out, progress_every_s=1, clock=clock, width=width)
    metrics = {"loss": 0.25, **{f"metric_{i}": i / 7 for i in range(62)}}
    many = {**TRAINING, "tasks": [{**t, "metrics": metrics} for t in TRAINING["tasks"]]}
    view.update(many)
    clock.t = 2
    view.update(many)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("orchestrate: progress step 120/400") and len(line) <= width, line
    shown = re.findall(r" · (\w+) [-\d.]+(?= ·|$)", line)
    more = int(re.search(r"\+(\d+) more metrics", line).group(1))  # type: ignore[union-attr]
    assert shown[:1] == (["loss"] if width > 80 else []) and len(shown) + more == 63, line
    assert ("heartbeats ≤ " in line) == (width > 80) and "10 steps/s" in line, line  # the rate first


def test_plain_view_with_progress_off_prints_only_changes() -> None:
    out, clock = io.StringIO(), Clock()
    view = PlainView(out, progress_every_s=0, clock=clock)
    for t in range(0, 100, 5):
        clock.t = t
        view.update(TRAINING)
    assert "progress" not in out.getvalue()


def test_live_view_keeps_the_cause_of_a_restart_on_screen() -> None:
    console = Console(width=60, record=True, file=io.StringIO(), force_terminal=True, color_system=None)
    view = LiveView(console)
    try:
        view.update(TRAINING)
        view.event(
            {
                "time": "2026-12-01T12:00:01.000Z",
                "kind": "run",
                "new": "STOPPING",
                "reason": "worker-1 was killed by SIGKILL",
            }
        )
        for i in range(10):  # later news does not push it off
            view.event(
                {
                    "time": "2026-12-01T12:00:02.000Z",
                    "kind": "task",
                    "task": f"worker-{i}",
                    "new": "RUNNING",
                    "reason": "up",
                }
            )
        view.update(TRAINING)
    finally:
        view.close()
    assert "STOPPING: worker-1 was killed by SIGKILL" in console.export_text()


def test_an_ended_run_shows_no_eta_or_rates() -> None:
    ended = {**TRAINING, "state": "SUCCEEDED", "ended_at": iso(NOW)}
    text = "\n".join(lines_of(render_status(ended, width=100, now=NOW), 100))
    assert "step 120/400 (30%)" in text and "ETA" not in text and "steps/s ·" not in text


def test_nan_and_infinity_are_shown_as_such_from_memory_and_from_a_document() -> None:
    for nan, inf in ((float("nan"), float("-inf")), ("NaN", "-Infinity")):  # the supervisor's, status.json's
        doc = status(task("worker-0", "worker", last_step=7, metrics={"loss": nan, "grad": inf, "損失": 0.5}))
        assert "loss NaN · grad -inf · 損失 0.5" in " · ".join(progress_of(doc, NOW).parts())
        console = Console(file=io.StringIO(), width=100, force_terminal=False)
        console.print(render_status(doc, [], width=100, now=NOW))
        row = next(line for line in console.file.getvalue().splitlines() if line.startswith("worker-0"))
        assert "NaN" in row and "-inf" in row


def test_a_console_that_writes_ascii_only_writes_whatever_a_job_reports() -> None:
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    console_writes_anything(out)
    view = PlainView(out, progress_every_s=1, clock=Clock())
    doc = status(
        task("worker-0", "worker", last_step=7, metrics={"損失": 0.5, "bad\\ud800name": float("nan")})
    )
    view.update(doc)
    view._clock.t = 2  # type: ignore[attr-defined]
    view.update(doc)
    view.log_line("worker-0", "エポック 1/2 \u202e done")
    out.flush()
    text = out.buffer.getvalue().decode("ascii")
    assert "\\u640d\\u5931 0.5" in text and "bad\\ud800name NaN" in text  # as escapes, nothing raised
    assert "\\u30a8\\u30dd\\u30c3\\u30af 1/2 \\u202e done" in text


def test_what_runs_degraded_and_the_metric_names_dropped_stay_in_sight() -> None:
    """status.json's `degraded` and the tasks' `metrics_dropped`, one line each (the task dropping
    the most named, the others counted), in the live view and `orchestrate status` alike."""
    metrics = {f"m{i}": 1.0 for i in range(64)}
    dropped = {"count": 2936, "first": "loss_64", "why": "over 64 metric names"}
    st = status(
        task("worker-0", "worker", last_step=5, metrics=metrics, metrics_dropped=dropped),
        task("worker-1", "worker", last_step=5, metrics=metrics, metrics_dropped={**dropped, "count": 7}),
        degraded=[
            {
                "what": "names",
                "where": "this machine",
                "said": "names are not resolved in this run",
                "fix": "a resolver",
                "since": None,
            }
        ],
    )
    assert notices(st) == [
        "degraded: names are not resolved in this run (hint: a resolver)",
        "worker-0: 64 of 3,000 metric names kept, the rest dropped: first dropped `loss_64` (over 64 metric "
        "names) (and 1 other task)",
    ]
    text = "\n".join(lines_of(render_status(st, [], width=200, now=NOW), 200))
    assert all(n in text for n in notices(st))
    assert notices(status(task("worker-0", "worker"))) == []
