"""The one state vocabulary of a run and its tasks, the kinds of failure, what runs degraded
(`Degraded`), and the allowed transitions: every layer speaks it (the supervisor moves the
states; the record writes them; the console and the page show them), so it sits at the bottom
beside errors.py.

Every state change goes through `check_transition()`, which checks the table and logs `A → B`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("orchestrator.supervise")


class ClusterState(str, enum.Enum):
    PENDING = "PENDING"
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    STOPPING = "STOPPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_CLUSTER


class TaskState(str, enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    LOST = "LOST"
    STOPPED = "STOPPED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_TASK  # a set: asked of every task on every supervisor step


@dataclass(frozen=True)
class Degraded:
    """A fallback: something of the run that works less well than the spec or the README
    promise, while the run goes on (names not resolved in the run, its outgoing network gone, a
    host's standbys without their page copy). Said once, where the user looks — an event on the
    console, status.json's `degraded`, the page, `orchestrate status`, the summary — with its fix.
    One that passed (`lasting` False: pasta started again) is said as an event alone."""

    what: str  # the promise: "network", "outbound", "names", "page_copy"
    where: str  # "this machine", a host, a task
    said: str  # what happened and why, in the kernel's or the tool's words
    fix: str  # what makes it whole again
    since: str | None = None  # UTC, where it began mid-run
    lasting: bool = True

    @property
    def line(self) -> str:
        return f"{self.said} (hint: {self.fix})" if self.fix else self.said

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["lasting"]
        return out


class FailureKind(str, enum.Enum):
    """Why a task failed (a Failure's kind, orchestrator/supervise/policy.py), as the record says it."""

    LAUNCH = "launch"  # the process could not be started
    EXIT = "exit"  # exited non-zero (or killed by a signal)
    EXCEPTION = "exception"  # the user's code raised (reported by the worker runtime)
    LOST = "lost"  # no heartbeat for heartbeat_timeout_s (frozen process, cut-off host)
    STALLED = "stalled"  # alive, but its step did not advance for stall_timeout_s
    STARTUP_TIMEOUT = "startup_timeout"  # not up within startup_timeout_s
    NO_STRATEGY = "no_strategy"  # alive at the start-up deadline, but no task began creating a strategy
    DIVERGED = "diverged"  # training tasks of one attempt restored different states


_TERMINAL_CLUSTER = frozenset({ClusterState.SUCCEEDED, ClusterState.FAILED, ClusterState.INTERRUPTED})
_TERMINAL_TASK = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.LOST, TaskState.STOPPED})

_C = ClusterState
CLUSTER_TRANSITIONS: dict[ClusterState, frozenset[ClusterState]] = {
    _C.PENDING: frozenset({_C.LAUNCHING, _C.STOPPING}),
    _C.LAUNCHING: frozenset({_C.RUNNING, _C.STOPPING}),
    _C.RUNNING: frozenset({_C.STOPPING}),
    # STOPPING tears every task down, then the outcome decides where the run goes.
    _C.STOPPING: frozenset({_C.RESTARTING, _C.SUCCEEDED, _C.FAILED, _C.INTERRUPTED}),
    _C.RESTARTING: frozenset({_C.LAUNCHING, _C.STOPPING}),
    _C.SUCCEEDED: frozenset(),
    _C.FAILED: frozenset(),
    _C.INTERRUPTED: frozenset(),
}

_T = TaskState
TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    _T.PENDING: frozenset({_T.STARTING, _T.FAILED, _T.STOPPED}),
    _T.STARTING: frozenset({_T.RUNNING, _T.SUCCEEDED, _T.FAILED, _T.LOST, _T.STOPPED}),
    _T.RUNNING: frozenset({_T.SUCCEEDED, _T.FAILED, _T.LOST, _T.STOPPED}),
    # A new attempt starts every task again.
    _T.SUCCEEDED: frozenset({_T.STARTING}),
    _T.FAILED: frozenset({_T.STARTING}),
    _T.LOST: frozenset({_T.STARTING, _T.STOPPED}),
    _T.STOPPED: frozenset({_T.STARTING}),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(
    table: dict[ClusterState, frozenset[ClusterState]] | dict[TaskState, frozenset[TaskState]],
    old: ClusterState | TaskState,
    new: ClusterState | TaskState,
    what: str,
) -> None:
    if new not in table[old]:  # type: ignore[index]
        raise IllegalTransition(f"{what}: {old.value} → {new.value} is not an allowed transition")
    log.info("%s: %s → %s", what, old.value, new.value)
