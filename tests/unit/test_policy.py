"""Supervision layer, the failure policy (orchestrator/supervise/policy.py): which failure is the
root cause, and what `decide` / `job_decision` answer to each failure over a frozen Snapshot."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.launch.api import QUICK_GRACE_S
from orchestrator.spec.model import AtEnd, OnFailure
from orchestrator.states import FailureKind
from orchestrator.supervise import policy
from orchestrator.supervise.policy import (
    PEER_LOSS_ERRORS,
    Action,
    Failure,
    Snapshot,
    backoff_s,
    decide,
    job_decision,
    root_cause,
)
from worker import wire
from worker.wire import TaskError


def failure(
    task: str | tuple[str, ...] = "worker-0",
    kind: FailureKind = FailureKind.EXIT,
    *,
    attempt: int = 0,
    detail: str = "exited with code 1",
    exit_code: int | None = None,
    error: str | None = None,
    step: int | None = None,
    where: str | None = None,
) -> Failure:
    tasks = (task,) if isinstance(task, str) else task
    if kind is FailureKind.EXIT and exit_code is None:
        exit_code = 1
    err = TaskError(error, "boom", "Traceback …") if error is not None else None
    return Failure(tasks, kind, attempt, detail, exit_code, err, step, where)


def snap(
    *,
    attempt: int = 0,
    first_attempt: bool = True,
    restarts_used: int = 0,
    max_restarts: int = 3,
    history: tuple[Failure, ...] = (),
    on_failure: dict[str, OnFailure] | None = None,
    task_restarts: dict[str, int] | None = None,
) -> Snapshot:
    return Snapshot(
        attempt=attempt,
        first_attempt=first_attempt,
        restarts_used=restarts_used,
        max_restarts=max_restarts,
        history=history,
        on_failure=on_failure or {},
        task_restarts=task_restarts or {},
    )


# --- Failure ------------------------------------------------------------------------------------


def test_failure_tasks_is_a_tuple_and_failure_is_frozen() -> None:
    f = failure(("worker-0", "worker-1"), FailureKind.STARTUP_TIMEOUT, detail="not up within 120 s")
    assert isinstance(f.tasks, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.detail = "other"  # type: ignore[misc]


def test_describe_names_the_task_then_the_detail() -> None:
    assert failure("worker-1", detail="exited with code 1").describe() == "worker-1 exited with code 1"


def test_describe_joins_several_tasks() -> None:
    f = failure(("worker-0", "worker-1", "chief-0"), FailureKind.STARTUP_TIMEOUT, detail="not up")
    assert f.describe() == "worker-0, worker-1, chief-0 not up"


def test_describe_without_tasks_is_the_detail_alone() -> None:
    assert failure((), FailureKind.DIVERGED, detail="restored different states").describe() == (
        "restored different states"
    )


@pytest.mark.parametrize("name", PEER_LOSS_ERRORS)
def test_peer_loss_errors_are_recognized_with_or_without_their_module(name: str) -> None:
    assert failure(kind=FailureKind.EXCEPTION, error=name).is_peer_loss
    qualified = f"tensorflow.python.framework.errors_impl.{name}"
    assert failure(kind=FailureKind.EXCEPTION, error=qualified).is_peer_loss


def test_a_user_exception_is_not_a_peer_loss() -> None:
    assert not failure(kind=FailureKind.EXCEPTION, error="ValueError").is_peer_loss
    assert not failure(kind=FailureKind.EXIT).is_peer_loss  # no error at all


def test_preemption_is_an_exit_with_tensorflows_code_only() -> None:
    assert wire.EXIT_PREEMPTED == 42
    assert failure(exit_code=wire.EXIT_PREEMPTED).is_preemption
    assert not failure(exit_code=1).is_preemption
    assert not failure(kind=FailureKind.LOST, exit_code=wire.EXIT_PREEMPTED).is_preemption


# --- root_cause -----------------------------------------------------------------------------------

SIGNALED = failure("worker-0", exit_code=-9, detail="was killed by SIGKILL")
LOST = failure("worker-1", FailureKind.LOST, detail="no heartbeat for 10 s")
STALLED_IN_OWN_CODE = failure("worker-2", FailureKind.STALLED, detail="stalled", where="train.py:23 in wait")
USER_EXCEPTION = failure("worker-3", FailureKind.EXCEPTION, detail="raised ValueError", error="ValueError")
PLAIN_EXIT = failure("worker-4", exit_code=1)
STALLED_IN_TF = failure("worker-5", FailureKind.STALLED, detail="stalled")
PEER_LOSS = failure("worker-6", FailureKind.EXCEPTION, detail="raised", error="UnavailableError")

# (more likely the cause, less likely): the first wins whatever the order it is seen in
RANKED = [
    ("signal beats exception", SIGNALED, USER_EXCEPTION),
    ("lost beats exception", LOST, USER_EXCEPTION),
    ("stalled in own code beats exception", STALLED_IN_OWN_CODE, USER_EXCEPTION),
    ("launch beats exception", failure(kind=FailureKind.LAUNCH, detail="no such file"), USER_EXCEPTION),
    ("startup timeout beats exception", failure(kind=FailureKind.STARTUP_TIMEOUT), USER_EXCEPTION),
    ("exception beats plain exit", USER_EXCEPTION, PLAIN_EXIT),
    ("exception beats stalled in TF", USER_EXCEPTION, STALLED_IN_TF),
    ("plain exit beats peer loss", PLAIN_EXIT, PEER_LOSS),
    ("stalled in TF beats peer loss", STALLED_IN_TF, PEER_LOSS),
    ("signal beats plain exit", SIGNALED, PLAIN_EXIT),
    ("stalled in own code beats stalled in TF", STALLED_IN_OWN_CODE, STALLED_IN_TF),
    ("signal beats peer loss", SIGNALED, PEER_LOSS),
]


@pytest.mark.parametrize(("cause", "consequence"), [r[1:] for r in RANKED], ids=[r[0] for r in RANKED])
def test_root_cause_ranking(cause: Failure, consequence: Failure) -> None:
    assert root_cause([cause, consequence]) is cause
    assert root_cause([consequence, cause]) is cause


def test_root_cause_of_a_whole_mwms_crash_is_the_killed_peer() -> None:
    # one worker killed, the survivors raise UnavailableError and exit non-zero a moment later
    seen = [PEER_LOSS, PLAIN_EXIT, STALLED_IN_TF, USER_EXCEPTION, SIGNALED]
    assert root_cause(seen) is SIGNALED


def test_external_deaths_share_a_rank_so_the_first_seen_wins() -> None:
    # a signal and a lost task are both "external": the supervisor's order decides
    assert root_cause([SIGNALED, LOST]) is SIGNALED
    assert root_cause([LOST, SIGNALED]) is LOST


def test_root_cause_of_one_failure_is_that_failure() -> None:
    assert root_cause([PEER_LOSS]) is PEER_LOSS


# --- decide: per-task policies --------------------------------------------------------------------


def test_no_failures_no_decisions() -> None:
    assert decide([], snap()) == []


def test_restart_task_while_the_tasks_own_budget_lasts() -> None:
    f = failure("evaluator-0", detail="exited with code 1")
    s = snap(on_failure={"evaluator-0": OnFailure.RESTART_TASK}, task_restarts={"evaluator-0": 1})
    [d] = decide([f], s)
    assert d.action is Action.RESTART_TASK
    assert d.failure is f
    assert not d.stops_job
    assert d.reason == (
        "evaluator-0 exited with code 1; restarting it alone (restart 2 of 3; the others go on)"
    )


def test_restart_task_counts_that_tasks_restarts_not_the_jobs() -> None:
    f = failure("evaluator-0")
    s = snap(restarts_used=3, on_failure={"evaluator-0": OnFailure.RESTART_TASK})  # job budget spent
    [d] = decide([f], s)
    assert d.action is Action.RESTART_TASK
    assert "restart 1 of 3" in d.reason


def test_ignore_reports_and_goes_on() -> None:
    f = failure("evaluator-0", detail="exited with code 1")
    [d] = decide([f], snap(on_failure={"evaluator-0": OnFailure.IGNORE}))
    assert d.action is Action.IGNORE
    assert not d.stops_job
    assert d.failure is f
    assert d.reason == "evaluator-0 exited with code 1 (ignored)"


def test_restart_task_exhausted_escalates_to_a_job_decision() -> None:
    f = failure("evaluator-0", detail="exited with code 1")
    s = snap(on_failure={"evaluator-0": OnFailure.RESTART_TASK}, task_restarts={"evaluator-0": 3})
    [d] = decide([f], s)
    assert d.action is Action.RESTART_JOB  # the job's own budget is untouched
    assert d.stops_job
    assert d.failure.tasks == ("evaluator-0",)
    assert d.failure.kind is FailureKind.EXIT and d.failure.exit_code == 1
    assert d.failure.detail == (
        "exited with code 1; its own restart budget is exhausted (3 of restart.max_restarts = 3)"
    )
    assert "its own restart budget is exhausted" in d.reason
    assert "restart 1 of 3" in d.reason


def test_restart_task_exhausted_with_the_job_budget_spent_fails() -> None:
    f = failure("evaluator-0")
    s = snap(
        restarts_used=3,
        on_failure={"evaluator-0": OnFailure.RESTART_TASK},
        task_restarts={"evaluator-0": 3},
    )
    [d] = decide([f], s)
    assert d.action is Action.FAIL
    assert "its own restart budget is exhausted" in d.reason
    assert "restart budget exhausted (3 of restart.max_restarts = 3 used)" in d.reason


def test_a_failure_of_several_tasks_is_a_job_failure_whatever_their_roles_policy() -> None:
    f = failure(("evaluator-0", "worker-0"), FailureKind.STARTUP_TIMEOUT, detail="not up")
    s = snap(on_failure={"evaluator-0": OnFailure.IGNORE, "worker-0": OnFailure.IGNORE})
    [d] = decide([f], s)
    assert d.action is Action.RESTART_JOB


def test_tasks_without_a_policy_restart_the_job() -> None:
    [d] = decide([failure("worker-0")], snap())
    assert d.action is Action.RESTART_JOB
    assert d.reason == "worker-0 exited with code 1; restart 1 of 3"


# --- decide: job-level failures -------------------------------------------------------------------


def test_job_failures_root_cause_first_the_others_follow_with_its_action() -> None:
    failures = [PEER_LOSS, PLAIN_EXIT, SIGNALED]
    decisions = decide(failures, snap())
    assert len(decisions) == 3
    first, *rest = decisions
    assert first.failure is SIGNALED
    assert first.action is Action.RESTART_JOB
    assert [d.failure for d in rest] == [PEER_LOSS, PLAIN_EXIT]
    assert all(d.action is Action.RESTART_JOB for d in rest)
    assert rest[0].reason == f"{PEER_LOSS.describe()} (after {SIGNALED.describe()})"


def test_the_others_follow_a_fail_too() -> None:
    decisions = decide([PEER_LOSS, USER_EXCEPTION], snap(first_attempt=True))
    assert [d.failure for d in decisions] == [USER_EXCEPTION, PEER_LOSS]
    assert {d.action for d in decisions} == {Action.FAIL}


def test_per_task_decisions_come_before_the_job_ones_and_each_failure_gets_one() -> None:
    ignored = failure("evaluator-0", detail="exited with code 2")
    alone = failure("ps-0", detail="exited with code 3")
    s = snap(on_failure={"evaluator-0": OnFailure.IGNORE, "ps-0": OnFailure.RESTART_TASK})
    decisions = decide([PEER_LOSS, ignored, SIGNALED, alone], s)
    assert [(d.action, d.failure) for d in decisions] == [
        (Action.IGNORE, ignored),
        (Action.RESTART_TASK, alone),
        (Action.RESTART_JOB, SIGNALED),
        (Action.RESTART_JOB, PEER_LOSS),
    ]


# --- job_decision ---------------------------------------------------------------------------------


def test_launch_failure_on_the_first_attempt_fails() -> None:
    f = failure(kind=FailureKind.LAUNCH, detail="cannot start worker-0: no such file")
    d = job_decision(f, snap(first_attempt=True))
    assert d.action is Action.FAIL
    assert d.reason == "could not launch: worker-0 cannot start worker-0: no such file"


def test_launch_failure_after_a_restart_restarts() -> None:
    f = failure(kind=FailureKind.LAUNCH, attempt=1, detail="host unreachable")
    d = job_decision(f, snap(attempt=1, first_attempt=False, restarts_used=1))
    assert d.action is Action.RESTART_JOB
    assert d.reason.endswith("restart 2 of 3")


def test_launch_failure_after_a_restart_still_needs_budget() -> None:
    f = failure(kind=FailureKind.LAUNCH, attempt=3, detail="host unreachable")
    d = job_decision(f, snap(first_attempt=False, restarts_used=3))
    assert d.action is Action.FAIL
    assert "restart budget exhausted" in d.reason


@pytest.mark.parametrize("first_attempt", [True, False])
def test_diverged_fails_even_with_budget_left(first_attempt: bool) -> None:
    f = failure(("worker-0", "worker-1"), FailureKind.DIVERGED, detail="restored different states")
    d = job_decision(f, snap(first_attempt=first_attempt, restarts_used=0, max_restarts=10))
    assert d.action is Action.FAIL
    assert d.reason == "worker-0, worker-1 restored different states; not restarted"


def test_preemption_restarts_even_with_the_budget_exhausted() -> None:
    f = failure(exit_code=wire.EXIT_PREEMPTED, detail="exited with code 42")
    d = job_decision(f, snap(first_attempt=False, restarts_used=3, max_restarts=3))
    assert d.action is Action.RESTART_JOB
    assert "not counted" in d.reason
    assert d.reason == "worker-0 exited with code 42; preempted, restarting (not counted as a restart)"


def test_preemption_on_the_first_attempt_restarts_too() -> None:
    f = failure(exit_code=wire.EXIT_PREEMPTED)
    assert job_decision(f, snap(first_attempt=True, max_restarts=0)).action is Action.RESTART_JOB


def test_exception_in_user_code_on_the_first_attempt_fails() -> None:
    f = failure(kind=FailureKind.EXCEPTION, detail="raised ValueError: bad", error="ValueError", step=5)
    d = job_decision(f, snap(first_attempt=True))
    assert d.action is Action.FAIL
    assert d.reason == (
        "worker-0 raised ValueError: bad — an error in the job's code on the first attempt; "
        "not restarted (it would fail again)"
    )


def test_the_same_exception_at_the_same_step_as_before_fails() -> None:
    earlier = failure(kind=FailureKind.EXCEPTION, error="ValueError", step=7)
    now = failure(kind=FailureKind.EXCEPTION, attempt=1, detail="raised", error="ValueError", step=7)
    d = job_decision(now, snap(attempt=1, first_attempt=False, restarts_used=1, history=(earlier,)))
    assert d.action is Action.FAIL
    assert "again at step 7" in d.reason


@pytest.mark.parametrize(
    ("earlier_type", "earlier_step"),
    [("ValueError", 6), ("KeyError", 7)],
    ids=["same-type-other-step", "other-type-same-step"],
)
def test_a_different_exception_after_a_restart_restarts(earlier_type: str, earlier_step: int) -> None:
    earlier = failure(kind=FailureKind.EXCEPTION, error=earlier_type, step=earlier_step)
    now = failure(kind=FailureKind.EXCEPTION, attempt=1, error="ValueError", step=7)
    d = job_decision(now, snap(attempt=1, first_attempt=False, restarts_used=1, history=(earlier,)))
    assert d.action is Action.RESTART_JOB
    assert d.reason.endswith("restart 2 of 3")


def test_an_earlier_exit_at_the_same_step_is_not_the_same_exception() -> None:
    earlier = failure(kind=FailureKind.EXIT, exit_code=1, step=7)
    now = failure(kind=FailureKind.EXCEPTION, attempt=1, error="ValueError", step=7)
    d = job_decision(now, snap(first_attempt=False, restarts_used=1, history=(earlier,)))
    assert d.action is Action.RESTART_JOB


@pytest.mark.parametrize("name", PEER_LOSS_ERRORS)
def test_peer_loss_errors_are_never_user_code(name: str) -> None:
    f = failure(kind=FailureKind.EXCEPTION, error=name, step=3)
    history = (failure(kind=FailureKind.EXCEPTION, error=name, step=3),)
    assert job_decision(f, snap(first_attempt=True)).action is Action.RESTART_JOB
    assert job_decision(f, snap(first_attempt=False, history=history)).action is Action.RESTART_JOB


def test_budget_exhausted_fails_and_names_the_knob() -> None:
    d = job_decision(
        failure(detail="exited with code 1"), snap(first_attempt=False, restarts_used=2, max_restarts=2)
    )
    assert d.action is Action.FAIL
    assert d.stops_job
    assert d.reason == (
        "worker-0 exited with code 1; restart budget exhausted (2 of restart.max_restarts = 2 used)"
    )


def test_no_restarts_allowed_fails_at_once() -> None:
    d = job_decision(failure(kind=FailureKind.LOST), snap(max_restarts=0))
    assert d.action is Action.FAIL
    assert "(0 of restart.max_restarts = 0 used)" in d.reason


@pytest.mark.parametrize(
    "kind", [FailureKind.EXIT, FailureKind.LOST, FailureKind.STALLED, FailureKind.STARTUP_TIMEOUT]
)
def test_other_failures_restart_while_the_budget_lasts(kind: FailureKind) -> None:
    d = job_decision(failure(kind=kind), snap(first_attempt=True, restarts_used=0, max_restarts=1))
    assert d.action is Action.RESTART_JOB
    assert d.reason.endswith("restart 1 of 1")


# --- backoff_s ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("used", "expected"), [(0, 2.0), (1, 4.0), (2, 8.0), (4, 32.0), (5, 60.0), (9, 60.0)]
)
def test_backoff_doubles_up_to_the_cap(used: int, expected: float) -> None:
    assert backoff_s(2.0, used) == expected


def test_backoff_cap_is_a_parameter() -> None:
    assert backoff_s(1.0, 3, cap_s=5.0) == 5.0
    assert backoff_s(1.0, 2, cap_s=5.0) == 4.0


def test_zero_base_never_waits() -> None:
    assert backoff_s(0.0, 10) == 0.0


def test_backoff_stays_at_the_cap_after_very_many_restarts() -> None:
    assert backoff_s(2.0, 1100) == 60.0


# --- around a decision: blame, grace, what a restart costs, the end of training -------------------


def test_a_frozen_peer_takes_the_blame_from_the_survivors_peer_loss():
    snap = Snapshot(attempt=1, first_attempt=False, restarts_used=0, max_restarts=3)
    survivors = job_decision(failure("worker-0", FailureKind.EXCEPTION, error="UnavailableError"), snap)
    frozen = failure("worker-1", FailureKind.LOST, detail="sent no heartbeat for 10.2 s")
    blamed = policy.blame_frozen_peer(survivors, frozen, snap)
    assert blamed.failure is frozen and blamed.action is Action.RESTART_JOB
    assert policy.blame_frozen_peer(survivors, None, snap) is survivors  # nobody else to blame
    own = job_decision(failure("worker-0", FailureKind.EXCEPTION, error="ValueError"), snap)
    assert policy.blame_frozen_peer(own, frozen, snap) is own  # an error of its own: its own cause


def test_a_job_whose_collectives_are_broken_is_stopped_at_once_and_one_that_can_save_gets_its_grace():
    died = failure("worker-1", exit_code=-9)
    assert policy.stop_grace_s(False, None, 30.0, 3.0) == 30.0  # asked for, or done: a final checkpoint
    assert policy.stop_grace_s(True, died, 30.0, 3.0) == 0.0  # a peer is gone: nothing can be saved
    broken = (FailureKind.EXCEPTION, FailureKind.STALLED, FailureKind.STARTUP_TIMEOUT, FailureKind.DIVERGED)
    for kind in broken:
        assert policy.stop_grace_s(True, failure(kind=kind), 30.0, 3.0) == 0.0, kind
    frozen = failure("worker-1", FailureKind.LOST)  # continued with the SIGTERM: the job may save
    assert policy.stop_grace_s(True, frozen, 30.0, 3.0) == 3.0
    preempted = failure("worker-0", exit_code=wire.EXIT_PREEMPTED)  # the others save as they exit
    assert policy.stop_grace_s(True, preempted, 30.0, 3.0) == 3.0
    assert policy.stop_grace_s(True, None, 30.0, 3.0) == 3.0  # the coordinator's own trouble
    assert policy.stop_grace_s(True, frozen, 1.0, 3.0) == 1.0  # never more than the spec's
    assert policy.task_stop_grace_s(AtEnd.WAIT, 3.0) == 3.0
    assert policy.task_stop_grace_s(AtEnd.STOP, 3.0) == QUICK_GRACE_S


def test_a_restart_after_progress_waits_nothing_and_the_backoff_doubles_only_without_progress():
    snap = Snapshot(attempt=2, first_attempt=False, restarts_used=2, max_restarts=3)
    killed = job_decision(failure("worker-0", exit_code=-9), snap)
    preempted = job_decision(failure("worker-0", exit_code=wire.EXIT_PREEMPTED), snap)
    trained = dataclasses.replace(snap, progressed=True, idle_in_a_row=2)
    assert policy.job_restart(killed, trained, 1.5) == policy.JobRestart(wait_s=0.0, counted=True)
    idle = dataclasses.replace(snap, progressed=False)
    assert policy.job_restart(killed, idle, 1.5) == policy.JobRestart(wait_s=1.5, counted=True)
    again = dataclasses.replace(snap, progressed=False, idle_in_a_row=2)
    assert policy.job_restart(killed, again, 1.5) == policy.JobRestart(wait_s=6.0, counted=True)
    assert policy.job_restart(preempted, again, 1.5) == policy.JobRestart(wait_s=6.0, counted=False)
    cut = dataclasses.replace(snap, progressed=True, in_doubt=True)  # a host cut off: give it time
    assert policy.job_restart(killed, cut, 1.5) == policy.JobRestart(wait_s=1.5, counted=True)


def test_the_end_of_training_waits_once_and_bounded_for_the_tasks_that_end_by_themselves():
    training, done = ["chief-0", "worker-0"], ["chief-0"]
    alone = policy.end_of_training(100.0, ["chief-0", "worker-0"], training, [], None, 120.0)
    assert alone == policy.EndOfTraining("every training task exited 0", stop=True)
    first = policy.end_of_training(100.0, done, training, ["evaluator-0"], None, 120.0)
    assert not first.stop and first.deadline == 220.0
    assert first.note == "chief-0 exited 0; waiting up to 120 s for evaluator-0 to finish"
    meanwhile = policy.end_of_training(219.0, done, training, ["evaluator-0"], first.deadline, 120.0)
    assert not meanwhile.stop and meanwhile.note is None  # said once
    late = policy.end_of_training(220.0, done, training, ["evaluator-0"], first.deadline, 120.0)
    assert late.stop and late.done == (
        "chief-0 exited 0; evaluator-0 still running after health.final_wait_s = 120"
    )
    at_once = policy.end_of_training(100.0, done, training, ["evaluator-0"], None, 0.0)
    assert at_once.stop and "still running after health.final_wait_s = 0" in at_once.done
