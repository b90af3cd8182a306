"""orchestrator/supervise/detect.py: the detectors as pure functions of one polled view and the
clock (the supervisor's stepped tests prove them in the loop; these pin each rule alone)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.health.store import TaskHealth
from orchestrator.states import FailureKind, TaskState
from orchestrator.supervise import detect
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.detect import TaskView
from worker.wire import TaskError

CONFIG = SupervisorConfig(
    heartbeat_interval_s=1, heartbeat_timeout_s=10, stall_timeout_s=30, startup_timeout_s=60
)


def view(
    state: TaskState = TaskState.RUNNING, code: int | None = None, in_cluster: bool = True, **h: Any
) -> TaskView:
    health = TaskHealth(task="worker-1", attempt=0, **h) if h else None
    return TaskView("worker-1", state, in_cluster, 0.0, code, health)


def test_exit_zero_succeeds_and_a_reported_exception_is_the_failure() -> None:
    assert detect.check_task(view(code=0), 1.0, CONFIG, 0) == [
        detect.Verdict("worker-1", TaskState.SUCCEEDED, "exit code 0")
    ]
    [v] = detect.check_task(view(code=1, error=TaskError("ValueError", "boom", ""), step=7), 1.0, CONFIG, 2)
    assert v.state is TaskState.FAILED and v.failure is not None
    assert (v.failure.kind, v.failure.tasks, v.failure.attempt, v.failure.step) == (
        FailureKind.EXCEPTION,
        ("worker-1",),
        2,
        7,
    )
    assert v.reason == "raised ValueError: boom"


@pytest.mark.parametrize(
    ("code", "error", "reason"),
    [
        (-9, None, "was killed by SIGKILL (exit code -9)"),
        (3, None, "exited with code 3"),
        (2, TaskError("SystemExit", "2", ""), "exited with code 2"),  # sys.exit is an exit, not an exception
    ],
)
def test_a_plain_exit_is_described_by_its_code(code: int, error: TaskError | None, reason: str) -> None:
    [v] = detect.check_task(view(code=code, error=error), 1.0, CONFIG, 0)
    assert v.failure is not None and v.failure.kind is FailureKind.EXIT and v.reason == reason


def test_ready_moves_a_starting_task_up_and_silence_then_loses_it() -> None:
    ready = view(TaskState.STARTING, last_heartbeat_at=0.0, ready_at=0.0)
    assert [v.state for v in detect.check_task(ready, 5.0, CONFIG, 0)] == [TaskState.RUNNING]
    verdicts = detect.check_task(ready, 10.5, CONFIG, 0)
    assert [v.state for v in verdicts] == [TaskState.RUNNING, TaskState.LOST]
    assert verdicts[1].reason == "sent no heartbeat for 10.5 s (health.heartbeat_timeout_s = 10)"


def test_silence_inside_the_strategy_constructor_is_left_to_the_startup_deadline() -> None:
    waiting = view(TaskState.STARTING, last_heartbeat_at=0.0, connecting_at=0.0)
    assert detect.check_task(waiting, 50.0, CONFIG, 0) == []
    never_heard = view(TaskState.STARTING)  # silent since its launch
    assert [v.state for v in detect.check_task(never_heard, 30.5, CONFIG, 0)] == [TaskState.LOST]


def test_a_starting_task_gets_at_least_thirty_seconds_of_silence() -> None:
    # importing TensorFlow holds the GIL for up to a second at a time, longer on a loaded host, and
    # over 10 s when its libraries are read from a cold page cache
    short = SupervisorConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3)
    importing = view(TaskState.STARTING, last_heartbeat_at=0.0)
    assert detect.check_task(importing, 29.5, short, 0) == []
    [lost] = detect.check_task(importing, 30.5, short, 0)
    assert lost.state is TaskState.LOST
    assert lost.reason == "sent no heartbeat for 30.5 s (health.heartbeat_timeout_s = 3; 30 s while starting)"
    # once running, the configured timeout holds
    running = view(TaskState.RUNNING, last_heartbeat_at=0.0, ready_at=0.0)
    assert [v.state for v in detect.check_task(running, 3.5, short, 0)] == [TaskState.LOST]


def test_a_stall_names_where_the_task_is_busy_but_never_for_the_evaluator() -> None:
    stuck: dict[str, Any] = {
        "last_heartbeat_at": 40.0,
        "step": 5,
        "step_changed_at": 0.0,
        "user_frame": "t.py:3 in f",
    }
    [v] = detect.check_task(view(**stuck), 40.0, CONFIG, 0)
    assert (
        v.failure is not None and v.failure.kind is FailureKind.STALLED and v.failure.where == "t.py:3 in f"
    )
    assert "stalled at step 5 for 40.0 s while alive, busy in t.py:3 in f" in v.reason
    assert detect.check_task(view(in_cluster=False, **stuck), 40.0, CONFIG, 0) == []
    assert detect.check_task(view(done=True, **stuck), 40.0, CONFIG, 0) == []  # finished, saving


def test_the_frozen_peer_is_the_silent_one() -> None:
    alive = TaskView(
        "worker-0", TaskState.RUNNING, True, 0.0, None, TaskHealth("worker-0", 0, last_heartbeat_at=9.9)
    )
    frozen = TaskView(
        "worker-1", TaskState.RUNNING, True, 0.0, None, TaskHealth("worker-1", 0, last_heartbeat_at=7.0)
    )
    v = detect.frozen_peer([alive, frozen], 10.0, CONFIG, 0)
    assert v is not None and v.task == "worker-1" and v.state is TaskState.LOST
    assert detect.frozen_peer([alive], 10.0, CONFIG, 0) is None


def test_startup_failure_blames_who_never_began_and_says_who_waited() -> None:
    began = TaskView(
        "worker-0", TaskState.STARTING, True, 0.0, None, TaskHealth("worker-0", 0, connecting_at=1.0)
    )
    never = TaskView("worker-1", TaskState.STARTING, True, 0.0, None, None)
    f = detect.startup_failure([began, never], CONFIG, 0)
    assert f.tasks == ("worker-1",) and f.kind is FailureKind.STARTUP_TIMEOUT
    assert f.detail.endswith("(never created its distribution strategy; worker-0 waited for it)")
    both = detect.startup_failure([began], CONFIG, 0)
    assert both.tasks == ("worker-0",) and both.detail.endswith("(its cluster never connected)")


def test_tasks_that_run_but_never_begin_a_strategy_fail_as_no_strategy() -> None:
    def running(name: str) -> TaskView:
        return TaskView(
            name, TaskState.STARTING, True, 0.0, None, TaskHealth(name, 0, last_heartbeat_at=59.0)
        )

    f = detect.startup_failure([running("worker-0"), running("worker-1")], CONFIG, 0)
    assert f.kind is FailureKind.NO_STRATEGY and f.tasks == ("worker-0", "worker-1")
    assert "never created a tf.distribute strategy" in f.detail and "health.startup_timeout_s" in f.detail
    # one that never spoke at all may not have started: the plain deadline
    silent = TaskView("worker-1", TaskState.STARTING, True, 0.0, None, None)
    assert (
        detect.startup_failure([running("worker-0"), silent], CONFIG, 0).kind is FailureKind.STARTUP_TIMEOUT
    )


def test_an_exceptions_reason_is_its_first_line() -> None:
    long = "Attempt to convert a value (PerReplica:{\n  0: <tf.Tensor>,\n  1: <tf.Tensor>\n}) to a Tensor."
    error = TaskError("ValueError", long, "Traceback…")
    task = TaskView("worker-0", TaskState.RUNNING, True, 0.0, 1, TaskHealth("worker-0", 0, error=error))
    (verdict,) = detect.check_task(task, 1.0, CONFIG, 0)
    assert verdict.reason == "raised ValueError: Attempt to convert a value (PerReplica:{ …"
    assert verdict.failure is not None and verdict.failure.error is error  # the whole message kept
    assert detect.first_line("x" * 500).endswith("…") and len(detect.first_line("x" * 500)) == 300


def test_a_task_busy_between_its_steps_is_never_a_stall_and_its_clock_starts_when_it_trains_again() -> None:
    saving: dict[str, Any] = {"last_heartbeat_at": 99.0, "step": 5, "step_changed_at": 0.0}
    assert (
        detect.check_task(view(busy="ending the epoch", busy_changed_at=10.0, **saving), 99.0, CONFIG, 0)
        == []
    )
    # it trains again since t=80 (the end of its busy phase): 19 s without a step is not 30
    assert detect.check_task(view(busy=None, busy_changed_at=80.0, **saving), 99.0, CONFIG, 0) == []
    later = {**saving, "last_heartbeat_at": 110.0}
    [v] = detect.check_task(view(busy=None, busy_changed_at=80.0, **later), 111.0, CONFIG, 0)
    assert v.failure is not None and v.failure.kind is FailureKind.STALLED and "for 31.0 s" in v.reason
