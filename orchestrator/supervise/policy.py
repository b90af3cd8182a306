"""Supervision layer: what went wrong (Failure), which failure is the root cause, and whether to
restart the whole job (policy). The supervisor executes; this module only decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from worker.wire import TaskError

# A peer that vanished makes every other MWMS task raise one of these a moment later: they are
# consequences, never the root cause when something else failed too.
PEER_LOSS_ERRORS = (
    "UnavailableError",
    "DeadlineExceededError",
    "AbortedError",
    "CancelledError",
    "InternalError",
)


PREEMPTED_EXIT_CODE = 42


class FailureKind(str, enum.Enum):
    LAUNCH = "launch"  # the process could not be started
    EXIT = "exit"  # exited non-zero (or killed by a signal)
    EXCEPTION = "exception"  # the user's code raised (reported by the worker runtime)
    LOST = "lost"  # no heartbeat for heartbeat_timeout_s (frozen process, cut-off host)
    STALLED = "stalled"  # alive, but its step did not advance for stall_timeout_s
    STARTUP_TIMEOUT = "startup_timeout"  # not up within startup_timeout_s
    DIVERGED = "diverged"  # training tasks of one attempt restored different states


@dataclass(frozen=True)
class Failure:
    task: str | None
    kind: FailureKind
    attempt: int
    detail: str
    exit_code: int | None = None
    error: TaskError | None = None
    step: int | None = None  # the failing task's last reported step
    where: str | None = None  # a stalled task busy in the job's own code: where

    @property
    def is_peer_loss(self) -> bool:
        return self.error is not None and self.error.type.rsplit(".", 1)[-1] in PEER_LOSS_ERRORS

    @property
    def is_preemption(self) -> bool:
        """TF's PreemptionCheckpointHandler saved a checkpoint and exited with 42 (SIGTERM, maintenance)."""
        return self.kind is FailureKind.EXIT and self.exit_code == PREEMPTED_EXIT_CODE

    def describe(self) -> str:
        who = f"{self.task} " if self.task else ""
        return f"{who}{self.detail}"


def root_cause(failures: list[Failure]) -> Failure:
    """The failure most likely to have caused the others seen in the same instant.

    Order: external deaths (a signal, a lost task, one stalled in its own code, a launch or start-up
    failure) first, then exceptions in user code, then plain non-zero exits and tasks stalled
    inside TensorFlow (waiting on a peer), and last the errors TensorFlow raises in the survivors
    when a peer vanishes.
    """

    def rank(f: Failure) -> int:
        if f.kind is FailureKind.EXCEPTION:
            return 3 if f.is_peer_loss else 1
        if f.kind is FailureKind.STALLED and f.where is None:
            return 2  # stalled inside TensorFlow: most likely waiting for the one stuck in its own code
        if f.kind is FailureKind.EXIT:
            return 0 if (f.exit_code or 0) < 0 else 2
        return 0

    return min(failures, key=rank)


class Action(str, enum.Enum):
    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(
    failure: Failure,
    *,
    restarts_used: int,
    max_restarts: int,
    first_attempt: bool = True,
    history: tuple[Failure, ...] = (),
) -> Decision:
    """Whole-job restart (MultiWorkerMirroredStrategy has no elasticity) while the budget lasts.

    An exception in the job's code is permanent on the run's first attempt, or when it repeats at
    the step where an earlier attempt failed the same way: the same code on the same data fails
    the same way. One that first appears after a restart gets the benefit of the doubt. So does
    a launch failure after a restart (a host that was cut off may be back by the next attempt).
    """
    if failure.kind is FailureKind.LAUNCH and first_attempt:
        return Decision(Action.FAIL, f"could not launch: {failure.describe()}")
    if failure.kind is FailureKind.DIVERGED:
        # never silent, never trained on: a restart would meet the same folders again
        return Decision(Action.FAIL, f"{failure.describe()}; not restarted")
    if failure.is_preemption:
        return Decision(
            Action.RESTART, f"{failure.describe()}; preempted, restarting (not counted as a restart)"
        )
    if failure.kind is FailureKind.EXCEPTION and not failure.is_peer_loss:
        repeated = any(
            f.kind is FailureKind.EXCEPTION
            and f.error is not None
            and failure.error is not None
            and f.error.type == failure.error.type
            and f.step == failure.step
            for f in history
        )
        if first_attempt or repeated:
            why = "on the first attempt" if first_attempt else f"again at step {failure.step}"
            return Decision(
                Action.FAIL,
                f"{failure.describe()} — an error in the job's code {why}; "
                "not restarted (it would fail again)",
            )
    if restarts_used >= max_restarts:
        return Decision(
            Action.FAIL,
            f"{failure.describe()}; restart budget exhausted ({restarts_used} of restart.max_restarts = "
            f"{max_restarts} used)",
        )
    return Decision(Action.RESTART, f"{failure.describe()}; restart {restarts_used + 1} of {max_restarts}")


def backoff_s(base_s: float, restarts_used: int, cap_s: float = 60.0) -> float:
    """Wait before restart number `restarts_used + 1`: base, 2×base, 4×base, … up to cap_s."""
    return min(cap_s, base_s * (2**restarts_used))
