"""Supervision layer: the supervisor's records of a run — one task's live view, the run's outcome —
and how they read in status.json (docs/architecture.md §5).
"""

from __future__ import annotations

import dataclasses
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LAUNCH, EXIT_OK
from orchestrator.health.store import TaskHealth
from orchestrator.launch.api import TaskHandle
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.record.write import SCHEMA_VERSION, iso_time
from orchestrator.spec.roles import RolePolicy
from orchestrator.states import ClusterState, FailureKind, TaskState
from orchestrator.supervise.policy import Failure
from worker import wire


class EventSink(Protocol):
    def event(self, **fields: Any) -> None: ...

    def log_path(self, log_name: str) -> Any: ...


@dataclass
class TaskRecord:
    """The supervisor's own view of one task (mutated only by the control loop)."""

    plan: TaskPlan
    policy: RolePolicy
    state: TaskState = TaskState.PENDING
    handle: TaskHandle | None = None
    launched_at: float | None = None
    exit_code: int | None = None
    reason: str = ""
    health: TaskHealth | None = None
    restarts: int = 0  # restarts of this task alone (role policy restart_task), over the whole run
    restart_at: float | None = None  # when this task alone is due to start again
    stopping: Future[Any] | None = None  # its stop before that restart, running on its own thread


@dataclass(frozen=True)
class SupervisorResult:
    state: ClusterState
    reason: str
    attempt: int
    restarts: int
    root_cause: Failure | None
    started_at: str
    ended_at: str
    ignored: tuple[Failure, ...] = ()  # failures of roles whose policy is `ignore` (the evaluator)
    task_restarts: tuple[Failure, ...] = ()  # failures answered by restarting that task alone
    failures: tuple[Failure, ...] = ()  # the root cause of every failed attempt, in order
    unconfirmed: tuple[str, ...] = ()  # tasks whose exit no stop could confirm (a host cut off)

    @classmethod
    def of(cls, sup: Any) -> SupervisorResult:
        """A supervisor's outcome, as it stands."""
        return cls(
            sup.state,
            sup.reason,
            sup.attempt,
            sup.restarts,
            sup.root_cause,
            sup.started_at,
            sup.ended_at or "",
            tuple(sup.ignored),
            tuple(sup.task_failures),
            tuple(sup.failures),
            tuple(sup.unconfirmed),
        )

    @property
    def failed_tasks(self) -> tuple[str, ...]:
        """The tasks the run's first failure names (their logs tell why)."""
        return self.root_cause.tasks if self.root_cause is not None else ()

    @property
    def exit_code(self) -> int | None:
        """`orchestrate up`'s exit code for this outcome (None while the run goes on)."""
        return run_exit_code(self.state, self.root_cause)


def run_exit_code(state: ClusterState, root_cause: Failure | None) -> int | None:
    """0 succeeded · 1 the job failed · 3 it could not be launched · 130 interrupted
    (docs/architecture.md §2)."""
    if not state.is_terminal:
        return None
    if state is ClusterState.SUCCEEDED:
        return EXIT_OK
    if state is ClusterState.INTERRUPTED:
        return EXIT_INTERRUPTED
    if root_cause is not None and root_cause.kind is FailureKind.LAUNCH:
        return EXIT_LAUNCH
    return EXIT_FAILED


def failure_status(f: Failure) -> dict[str, Any]:
    """One failure as status.json lists it (`failures`: the cause of every failed attempt)."""
    return {
        "attempt": f.attempt,
        "kind": f.kind.value,
        "tasks": list(f.tasks),
        "reason": f.describe(),
        "exit_code": f.exit_code,
    }


def task_status(rec: TaskRecord) -> dict[str, Any]:
    h = rec.health
    proc = rec.handle.process if rec.handle is not None else None
    return {
        "task": rec.plan.name,
        "role": rec.plan.role.value,
        "index": rec.plan.index,
        "host": rec.plan.host,
        "state": rec.state.value,
        "reason": rec.reason,
        "pid": proc.pid if proc else None,
        "pgid": proc.pgid if proc else None,
        "create_time": proc.create_time if proc else None,
        "exit_code": rec.exit_code,
        "restarts": rec.restarts,
        "last_step": h.step if h else None,
        "total_steps": h.total_steps if h else None,
        "examples_per_step": h.examples_per_step if h else None,
        "metrics": dict(h.metrics) if h else {},
        "steps_per_s": round(h.steps_per_s, 3) if h and h.steps_per_s is not None else None,
        "busy": h.busy if h else None,
        "rss_bytes": h.rss_bytes if h else None,
        "last_heartbeat_at": iso_time(h.last_heartbeat_wall) if h and h.last_heartbeat_wall else None,
        "error": None if h is None or h.error is None else {"type": h.error.type, "message": h.error.message},
        "restored": None if h is None or h.restored is None else dataclasses.asdict(h.restored),
        "metrics_dropped": None if h is None or h.dropped is None else dataclasses.asdict(h.dropped),
    }


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    if code == wire.EXIT_NO_COORDINATOR:
        return f"stopped itself, cut off from the coordinator (exit code {code}; its log says more)"
    return f"exited with code {code}"


def status_document(sup: Any) -> dict[str, Any]:
    """The status.json document of a supervisor (docs/architecture.md §5; its JSON Schema:
    `orchestrate schema status`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": sup.plan.name,
        "run_id": sup.plan.run_id,
        "state": sup.state.value,
        "attempt": sup.attempt,
        "restarts": sup.restarts,
        "reason": sup.reason,
        "started_at": sup.started_at,
        "ended_at": sup.ended_at,
        "exit_code": run_exit_code(sup.state, sup.root_cause),
        "examples_per_step": sup.plan.examples_per_step,
        "failures": [failure_status(f) for f in sup.failures],
        "task_restarts": [failure_status(f) for f in sup.task_failures],
        "tasks": [task_status(r) for r in sup.tasks.values()],
        "checkpoint_folders": sorted(sup.job_folders.folders),
        "recoveries": sup.timeline.status(),
        "machines": sup.machine_rows,
        "attempts": [
            {"attempt": n, "workers": workers, "changes": list(sup.changes.get(n, []))}
            for n, workers in sorted(sup.workers.items())
        ],
        "standbys": sup.standby_rows(),
        "degraded": [d.to_json() for d in sup.degraded],
    }
