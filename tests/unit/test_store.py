"""orchestrator/health/store.py: what each task of the current attempt has said, as the supervisor
reads it (a frozen snapshot per iteration)."""

from __future__ import annotations

import pytest

from orchestrator.health.store import HealthStore
from worker import wire
from worker.wire import Heartbeat, TaskError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(seq: int, **kw: object) -> Heartbeat:
    return Heartbeat(**{"task": "worker-0", "attempt": 0, "seq": seq, "sent_at": 0.0, "pid": 7, **kw})  # type: ignore[arg-type]


@pytest.fixture
def store() -> tuple[HealthStore, Clock, list[tuple[str, int, list[dict[str, object]]]]]:
    clock, points = Clock(), []
    s = HealthStore(clock, on_points=lambda task, attempt, p: points.append((task, attempt, p)))
    s.reset(0, ["worker-0", "worker-1"])
    return s, clock, points


def test_statuses_for_unknown_tasks_stale_attempts_and_the_next_attempt(store) -> None:
    s, _, _ = store
    assert s.ingest(beat(1)) == wire.OK_STATUS
    assert s.ingest(beat(2, task="worker-9")) == wire.NOT_FOUND_STATUS
    assert s.ingest(beat(3, attempt=1)) == wire.NOT_FOUND_STATUS  # not started yet
    s.reset(1, ["worker-0"])
    assert s.ingest(beat(4, attempt=0)) == wire.STALE_ATTEMPT_STATUS  # a task of an attempt gone
    assert s.snapshot()["worker-0"].last_heartbeat_at is None  # a new attempt forgets the old one


def test_a_heartbeat_sent_again_is_taken_once(store) -> None:
    s, clock, points = store
    assert s.ingest(beat(5, step=10, points=[{"step": 10}])) == wire.OK_STATUS
    clock.now += 1
    assert s.ingest(beat(5, step=10, points=[{"step": 10}])) == wire.OK_STATUS  # a relay's retry
    assert len(points) == 1 and s.snapshot()["worker-0"].last_heartbeat_at == 100.0
    assert s.ingest(beat(6, pid=8)) == wire.CONFLICT_STATUS  # another process of the same task
    s.reset_task("worker-0")  # restarted alone: its new process starts its seq again
    assert s.ingest(beat(1, pid=8)) == wire.OK_STATUS
    assert s.snapshot()["worker-0"].pid == 8


def test_steps_rate_phases_and_first_error_are_kept(store) -> None:
    s, clock, _ = store
    s.ingest(beat(1, connecting=True))
    clock.now += 2
    s.ingest(beat(2, ready=True, step=0, total_steps=100))
    clock.now += 2
    s.ingest(beat(3, step=20, metrics={"loss": 0.5}))
    clock.now += 1
    s.ingest(beat(4, step=20, error=TaskError("ValueError", "boom", ""), metrics={"acc": 0.9}))
    h = s.snapshot()["worker-0"]
    assert (h.connecting_at, h.ready_at, h.step_changed_at) == (100.0, 102.0, 104.0)
    assert h.steps_per_s == pytest.approx(10.0) and h.total_steps == 100
    assert h.metrics == {"loss": 0.5, "acc": 0.9}
    assert h.error is not None and h.error.type == "ValueError"


def test_a_snapshot_does_not_change_under_the_reader(store) -> None:
    s, _, _ = store
    s.ingest(beat(1, step=1))
    seen = s.snapshot()
    s.ingest(beat(2, step=2))
    s.reset_task("worker-1")
    assert seen["worker-0"].step == 1  # the supervisor's view of this iteration stays as polled
    assert s.snapshot()["worker-0"].step == 2


def test_a_task_restarted_alone_starts_from_nothing(store) -> None:
    s, _, _ = store
    s.ingest(beat(9, step=50, done=True))
    s.reset_task("worker-0")
    h = s.snapshot()["worker-0"]
    assert (h.step, h.done, h.seq, h.attempt) == (None, False, 0, 0)
    assert s.ingest(beat(1, step=1)) == wire.OK_STATUS  # the new process's seq 1 is news


def test_the_global_batch_a_job_reported_stays(store) -> None:
    s, _, _ = store
    s.ingest(beat(1, total_steps=100, examples_per_step=64))
    s.ingest(beat(2, step=3))
    assert s.snapshot()["worker-0"].examples_per_step == 64


def test_what_a_task_is_busy_with_and_since_when(store) -> None:
    s, clock, _ = store
    s.ingest(beat(1, step=5))
    assert s.snapshot()["worker-0"].busy is None and s.snapshot()["worker-0"].busy_changed_at is None
    clock.now += 3
    s.ingest(beat(2, step=5, busy="validating"))
    clock.now += 3
    s.ingest(beat(3, step=5, busy="validating"))  # still: the time it began stays
    h = s.snapshot()["worker-0"]
    assert (h.busy, h.busy_changed_at) == ("validating", 103.0)
    clock.now += 3
    s.ingest(beat(4, step=5))
    assert (s.snapshot()["worker-0"].busy, s.snapshot()["worker-0"].busy_changed_at) == (None, 109.0)


def test_a_final_restore_report_stands_and_one_said_before_it_only_until_then(store) -> None:
    s, clock, _ = store
    early = wire.Restored(step=0, fingerprint="aa", source="/tmp/b/ckpt-1", final=False)
    s.ingest(beat(1, restored=early))
    assert s.snapshot()["worker-0"].restored == early and s.snapshot()["worker-0"].restored_at is None
    clock.now += 1
    final = wire.Restored(step=0, fingerprint="bb", source="/tmp/b/ckpt-2")
    s.ingest(beat(2, restored=final))
    s.ingest(beat(3, restored=early))  # a late one not final changes nothing
    h = s.snapshot()["worker-0"]
    assert h.restored == final and h.restored_at == 101.0  # the restore phase ends at the final one
