"""CLI room: the end of `orchestrate up` — how the run ended and why, what it took, every
restart's cause, the final metrics, where the results are; for a failure, the first one with its
traceback, what to do about it, and the last lines of its log."""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.cli.hints import hints
from orchestrator.control import RunResult
from orchestrator.record.logtail import tail_lines
from orchestrator.record.progress import duration_text, elapsed_s, notices, progress_of
from orchestrator.record.quiet import collapse_redraws, job_traceback, noise
from orchestrator.record.read import diverged, resume_command, spec_path
from orchestrator.stacks import record as stacks
from orchestrator.states import ClusterState
from orchestrator.supervise.policy import Failure


def summarize(outcome: RunResult) -> int:
    """Print the summary; the run's exit code."""
    r = outcome.result
    print(f"\norchestrate: {outcome.plan.name} {r.state.value} — {r.reason}")
    took = elapsed_s({"started_at": r.started_at, "ended_at": r.ended_at})
    took_text = f"took {duration_text(took)} · " if took is not None else ""
    print(f"  {took_text}attempts {r.attempt + 1} · restarts {r.restarts}")
    recoveries = {r.get("attempt"): r.get("line") for r in outcome.status.get("recoveries") or []}
    attempts = {a["attempt"]: a for a in outcome.status.get("attempts") or []}
    sizes = [
        f"attempt {n} on {a['workers']} worker{'s' if a['workers'] != 1 else ''}" for n, a in attempts.items()
    ]
    if len({a["workers"] for a in attempts.values()}) > 1:  # the job shrank (or grew back)
        print(f"  {' · '.join(sizes)}")
    listed = len(r.failures) > 1 or (r.failures and r.state is ClusterState.SUCCEEDED)
    for f in r.failures:  # each restart's cause (one alone is the first failure, below)...
        if listed:
            print(f"  attempt {f.attempt} ended: {f.describe()}")
            _places(outcome.run_dir, f.attempt)
        for line in attempts.get(f.attempt + 1, {}).get("changes", []):  # ...the hosts it moved to
            print(f"  {line}")
        if f.attempt + 1 in recoveries:  # ...and its timeline
            print(f"  {recoveries[f.attempt + 1]}")
    for f in r.task_restarts:
        print(f"  restarted alone: {f.describe()}")
    for f in r.ignored:
        print(f"  reported, did not stop the job: {f.describe()}")
    _results(outcome)
    for line in notices(outcome.status):  # what ran degraded, with its fix; the metric names dropped
        print(f"  {line}")
    if r.state is not ClusterState.SUCCEEDED and r.root_cause is not None:
        _first_failure(outcome, r.root_cause)
    if r.state is not ClusterState.SUCCEEDED and not diverged(outcome.status):
        again = resume_command(outcome.run_dir)
        if again is not None:
            print(f"  continue it from its checkpoints: {again}")
    code = r.exit_code
    assert code is not None  # `up` returns an ended run
    return code


def _results(outcome: RunResult) -> None:
    """The final metrics, the model, the record, what came home."""
    width = shutil.get_terminal_size((120, 24)).columns - len("  final: ")  # the rest: status.json
    final = progress_of(outcome.status).parts(ended=True, width=width)
    if final:
        print(f"  final: {' · '.join(final)}")
    model = outcome.run_dir / "model"
    if model.is_dir():
        saved = sorted(model.glob("*.keras")) or [model]
        print(f"  model: {saved[0]}")
    print(f"  run record: {outcome.run_dir}")
    if outcome.hidden_lines:
        print(
            f"  ({outcome.hidden_lines} lines of TensorFlow start-up output and traceback frames were left "
            f"off the console: `orchestrate logs {outcome.run_dir}` has them)"
        )
    if outcome.brought_home:
        print(f"  brought home from the hosts into {outcome.run_dir}:")
        for line in outcome.brought_home:
            print(f"    {line}")


def _first_failure(outcome: RunResult, cause: Failure) -> None:
    """The run's first failure: why, its traceback, the hints, the last lines of its tasks' logs."""
    r = outcome.result
    print(f"  first failure: {cause.describe()}")
    if len(r.failures) <= 1:  # else said with its attempt, above
        _places(outcome.run_dir, cause.attempt)
    if cause.exit_code is not None:
        print(f"  exit code: {cause.exit_code}")
    if cause.error is not None and cause.error.traceback:
        print("  traceback:")
        for line in job_traceback(cause.error.traceback):
            print(f"    {line}")
    for hint in hints(r.failures, outcome.plan, outcome.run_dir, spec_path(outcome.run_dir) or "spec.yaml"):
        print(f"  {hint}")
    shown_tb = cause.error is not None and bool(cause.error.traceback)
    for name in r.failed_tasks:
        _log_tail(outcome.run_dir / "logs" / f"{name}.log", before_traceback=shown_tb)


def _places(run_dir: Path, attempt: int) -> None:
    """Where each task was when the attempt was stopped, from the stacks read before (a hang)."""
    lines = stacks.places(run_dir, attempt)
    if lines:
        print(f"  where each task was (its stacks: `orchestrate stacks {run_dir}`):")
        for line in lines:
            print(f"    {line}")


def _log_tail(log_path: Path, before_traceback: bool) -> None:
    # filtered as the console is: TensorFlow's start-up chatter never hides the job's last words
    lines = [collapse_redraws(line) for line in tail_lines(log_path, 100) if not noise(line)]
    if before_traceback:  # the traceback is above: the lines that led to it
        tb = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
        lines = lines[: tb[-1]] if tb else lines
    lines = lines[-20:]
    if lines:
        print(f"  last lines of {log_path}{' before the traceback' if before_traceback else ''}:")
        for line in lines:
            print(f"    | {line}")
