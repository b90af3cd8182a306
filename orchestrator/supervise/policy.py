"""Supervision layer: what went wrong (Failure), which failure is the root cause, and what to do
about every failure (policy). The supervisor executes; this module only decides.

`decide` takes the failures one supervisor iteration found and a frozen snapshot of the run (its
budget, its history, each task's role policy and own restarts), and answers each failure with a
Decision: restart that task alone, ignore it, or — for the rest, through their root cause —
restart the whole job or fail it (Ray Train v2's `make_decision(poll_status)` is the model).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.launch.api import QUICK_GRACE_S
from orchestrator.spec.model import AtEnd, OnFailure
from orchestrator.stacks.where import Where
from orchestrator.states import FailureKind
from worker import wire
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


@dataclass(frozen=True)
class Failure:
    tasks: tuple[str, ...]  # the task that failed (several: a start-up deadline, a diverged start)
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
        return self.kind is FailureKind.EXIT and self.exit_code == wire.EXIT_PREEMPTED

    def describe(self) -> str:
        who = f"{', '.join(self.tasks)} " if self.tasks else ""
        return f"{who}{self.detail}"


def root_cause(failures: Sequence[Failure]) -> Failure:
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
    RESTART_JOB = "restart_job"  # stop every task, start them all again from the last checkpoint
    RESTART_TASK = "restart_task"  # stop that task, start it again alone; the others go on
    IGNORE = "ignore"  # report it, go on
    FAIL = "fail"  # stop every task; the run ends FAILED


@dataclass(frozen=True)
class Decision:
    action: Action
    failure: Failure
    reason: str

    @property
    def stops_job(self) -> bool:
        return self.action in (Action.RESTART_JOB, Action.FAIL)


@dataclass(frozen=True)
class Snapshot:
    """What the policy knows of the run when it decides (frozen, taken once per iteration)."""

    attempt: int
    first_attempt: bool  # the run's first (not a --resume's)
    restarts_used: int  # whole-job restarts so far (preemptions are not counted)
    max_restarts: int
    history: tuple[Failure, ...] = ()  # the root causes of the earlier attempts
    on_failure: Mapping[str, OnFailure] = field(default_factory=dict)  # per task, its role's policy
    task_restarts: Mapping[str, int] = field(default_factory=dict)  # per task, its restarts alone
    #: The attempt learned checkpoint folders of the job's own: the next one keeps them the same
    #: on every host first (something changes: a diverged start may not diverge again).
    learned_folders: bool = False
    progressed: bool = False  # a training task of this attempt reported a step past its first one
    idle_in_a_row: int = 0  # the failed attempts just before this one that advanced no step
    in_doubt: bool = False  # the stop could not confirm every task's exit (a host cut off)


def decide(failures: Sequence[Failure], snap: Snapshot) -> list[Decision]:
    """One decision per failure. A failure of a role whose policy restarts the task alone (while
    its own budget lasts) or ignores it is answered so; the others stop the job: their root cause
    decides between a whole-job restart and failing, listed first, the rest follow it."""
    out: list[Decision] = []
    job: list[Failure] = []
    for f in failures:
        task = f.tasks[0] if len(f.tasks) == 1 else None
        rule = snap.on_failure.get(task, OnFailure.RESTART_JOB) if task else OnFailure.RESTART_JOB
        used = snap.task_restarts.get(task, 0) if task else 0
        if rule is OnFailure.IGNORE:
            out.append(Decision(Action.IGNORE, f, f"{f.describe()} (ignored)"))
        elif rule is OnFailure.RESTART_TASK and used < snap.max_restarts:
            out.append(
                Decision(
                    Action.RESTART_TASK,
                    f,
                    f"{f.describe()}; restarting it alone (restart {used + 1} of {snap.max_restarts}; "
                    "the others go on)",
                )
            )
        elif rule is OnFailure.RESTART_TASK:
            exhausted = (
                f"{f.detail}; its own restart budget is exhausted ({used} of "
                f"restart.max_restarts = {snap.max_restarts})"
            )
            job.append(Failure(f.tasks, f.kind, f.attempt, exhausted, f.exit_code, f.error, f.step, f.where))
        else:
            job.append(f)
    if job:
        root = root_cause(job)
        first = job_decision(root, snap)
        out.append(first)
        out += [
            Decision(first.action, f, f"{f.describe()} (after {root.describe()})")
            for f in job
            if f is not root
        ]
    return out


def job_decision(failure: Failure, snap: Snapshot) -> Decision:
    """Whole-job restart (MultiWorkerMirroredStrategy has no elasticity) while the budget lasts.

    An exception in the job's code is permanent on the run's first attempt, or when it repeats at
    the step where an earlier attempt failed the same way: the same code on the same data fails
    the same way. One that first appears after a restart gets the benefit of the doubt. So does
    a launch failure after a restart (a host that was cut off may be back by the next attempt).
    A preemption (exit 42: TF saved a checkpoint) restarts outside the budget.
    """
    first_attempt = snap.first_attempt
    if failure.kind is FailureKind.LAUNCH and first_attempt:
        return Decision(Action.FAIL, failure, f"could not launch: {failure.describe()}")
    if failure.kind is FailureKind.NO_STRATEGY and first_attempt:
        # the job's code runs but never creates its strategy: a restart runs the same code again
        return Decision(Action.FAIL, failure, f"{failure.describe()}; not restarted (it would wait again)")
    if failure.kind is FailureKind.DIVERGED and not (
        snap.learned_folders and snap.restarts_used < snap.max_restarts
    ):
        # never silent, never trained on: a restart would meet the same folders again
        return Decision(Action.FAIL, failure, f"{failure.describe()}; not restarted")
    if failure.kind is FailureKind.DIVERGED:
        why = (
            "the folders the job checkpoints to, learned this attempt, are made the same on every host first"
        )
        used = snap.restarts_used
        return Decision(
            Action.RESTART_JOB,
            failure,
            f"{failure.describe()}; restart {used + 1} of {snap.max_restarts}: {why}",
        )
    if failure.is_preemption:
        return Decision(
            Action.RESTART_JOB,
            failure,
            f"{failure.describe()}; preempted, restarting (not counted as a restart)",
        )
    if failure.kind is FailureKind.EXCEPTION and not failure.is_peer_loss:
        repeated = any(
            f.kind is FailureKind.EXCEPTION
            and f.error is not None
            and failure.error is not None
            and f.error.type == failure.error.type
            and f.step == failure.step
            for f in snap.history
        )
        if first_attempt or repeated:
            why = "on the first attempt" if first_attempt else f"again at step {failure.step}"
            return Decision(
                Action.FAIL,
                failure,
                f"{failure.describe()} — an error in the job's code {why}; "
                "not restarted (it would fail again)",
            )
    used, budget = snap.restarts_used, snap.max_restarts
    if used >= budget:
        return Decision(
            Action.FAIL,
            failure,
            f"{failure.describe()}; restart budget exhausted "
            f"({used} of restart.max_restarts = {budget} used)",
        )
    return Decision(Action.RESTART_JOB, failure, f"{failure.describe()}; restart {used + 1} of {budget}")


def backoff_s(base_s: float, in_a_row: int, cap_s: float = 60.0) -> float:
    """Wait before a restart that follows `in_a_row` earlier ones in a row: base, 2×base, 4×base,
    … up to cap_s."""
    return min(cap_s, base_s * 2.0 ** min(in_a_row, 64))  # a task restarted alone 1,024 times


# --- what the supervisor does around a decision: who is blamed, how long a stop waits, what a
# restart costs, when a job whose training is done ends -------------------------------------------


def blame_frozen_peer(decision: Decision, frozen: Failure | None, snap: Snapshot) -> Decision:
    """A job stopped for a peer-loss error (the survivors raise it a moment after a peer froze or
    vanished): a peer found frozen then (detect.frozen_peer) is the cause, and decides instead."""
    if not decision.failure.is_peer_loss or frozen is None:
        return decision
    return job_decision(frozen, snap)


def blame_by_stacks(decision: Decision, wheres: Sequence[Where], training: Collection[str]) -> Decision:
    """A hung job's stacks, read before its stop, say whom the others wait for: a task in its own
    code or stopped. Named by the decision already: its place is added. Every task it names read
    and waiting (in TensorFlow, for its cluster) while a training task (of `training`) is the one:
    that one is named instead, the others said as waiting for it; a task not read (its host cut
    off) or gone keeps the blame. The action stands (the stop is the same); only who and why."""
    failure = decision.failure
    by_task = {w.task: w for w in wheres}
    named = [by_task[t] for t in failure.tasks if t in by_task]
    culprits = [w for w in wheres if w.culprit and w.task in training]
    all_waiting = len(named) == len(failure.tasks) and all(w.kind in ("tensorflow", "cluster") for w in named)
    if culprits and all_waiting:
        one = culprits[0]
        detail = f"{one.line} (its stacks): {', '.join(failure.tasks)} waited for it ({failure.detail})"
        new = dataclasses.replace(failure, tasks=(one.task,), detail=detail, where=one.line, step=None)
    elif failure.where is not None and all(w.kind == "own" for w in named):
        return decision  # its heartbeat said as much already
    elif named:
        places = "; ".join(w.line if len(named) == 1 else f"{w.task} {w.line}" for w in named)
        new = dataclasses.replace(failure, detail=f"{failure.detail}; its stacks: {places}")
    else:
        return decision
    return Decision(decision.action, new, decision.reason.replace(failure.describe(), new.describe(), 1))


def stop_grace_s(failed: bool, failure: Failure | None, stop_grace_s: float, failure_grace_s: float) -> float:
    """The grace of a whole-job stop: the spec's (a final checkpoint) when asked for or done. After
    a failure the tasks left save only where the job can still agree on a step: a preemption (they
    save as they exit), a lost task (a frozen one is continued with the SIGTERM, and the whole job
    may save), the coordinator's own trouble (`failure` None): at most `failure_grace_s`. After any
    other failure a task of the job is gone, stuck or never came up: its collectives are broken,
    nothing can be saved, and the tasks left are stopped at once (SIGKILL)."""
    if not failed:
        return stop_grace_s
    if failure is None or failure.is_preemption or failure.kind is FailureKind.LOST:
        return min(stop_grace_s, failure_grace_s)
    return 0.0


def task_stop_grace_s(at_end: AtEnd, failure_grace_s: float) -> float:
    """The grace of one task stopped alone to be restarted: a server (stopped at the end, it saves
    nothing) gets QUICK_GRACE_S at most."""
    return min(failure_grace_s, QUICK_GRACE_S) if at_end is AtEnd.STOP else failure_grace_s


@dataclass(frozen=True)
class JobRestart:
    wait_s: float  # before the next attempt
    counted: bool  # against restart.max_restarts (a preemption is not)


def job_restart(decision: Decision, snap: Snapshot, base_backoff_s: float) -> JobRestart:
    """What restarting the job costs: no wait after an attempt that advanced (a failure after
    progress is not a failure in a loop), unless the stop left a task's exit in doubt (its host
    cut off: the next attempt would meet it at once; the backoff gives it time to come back); else
    the backoff for the attempts in a row that did not advance; and whether it counts."""
    at_once = snap.progressed and not snap.in_doubt
    wait_s = 0.0 if at_once else backoff_s(base_backoff_s, snap.idle_in_a_row)
    return JobRestart(wait_s, not decision.failure.is_preemption)


@dataclass(frozen=True)
class EndOfTraining:
    """The deciding tasks are done: wait (until `deadline`) for the tasks that end by themselves, or
    stop the job now as succeeded."""

    done: str  # what ended, for the run's reason
    stop: bool
    deadline: float | None = None  # waiting until then
    note: str | None = None  # said once, as the wait begins


def end_of_training(
    now: float,
    deciders: Sequence[str],
    training: Sequence[str],
    waiting: Sequence[str],
    deadline: float | None,
    final_wait_s: float,
) -> EndOfTraining:
    """`deciders` exited 0 (of the `training` tasks); `waiting`: those of a role that ends by
    itself (the evaluator) still running; `deadline`: the wait begun earlier, if any."""
    done = (
        "every training task exited 0"
        if set(deciders) == set(training)
        else f"{', '.join(deciders)} exited 0"
    )
    if not waiting:
        return EndOfTraining(done, stop=True)
    names = ", ".join(waiting)
    note = None
    if deadline is None:
        deadline = now + final_wait_s
        note = f"{done}; waiting up to {final_wait_s:g} s for {names} to finish"
    if now < deadline:
        return EndOfTraining(done, stop=False, deadline=deadline, note=note)
    late = f"{done}; {names} still running after health.final_wait_s = {final_wait_s:g}"
    return EndOfTraining(late, stop=True, deadline=deadline, note=note)
