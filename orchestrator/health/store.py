"""Health layer: the latest word from every task, as the supervisor reads it each iteration.

The HTTP server thread writes, the supervisor thread reads a frozen snapshot. Arrival times use
the supervisor's clock (injected), so detectors are testable without sleeping.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from worker import wire
from worker.wire import Dropped, Heartbeat, Restored, TaskError
from worker.wire.failure import Written


@dataclass(frozen=True)
class TaskHealth:
    """What one task of the current attempt has told us. Times are the supervisor clock's."""

    task: str
    attempt: int
    pid: int | None = None
    last_heartbeat_at: float | None = None
    last_heartbeat_wall: float | None = None  # the same instant, seconds since the epoch
    connecting_at: float | None = None
    ready_at: float | None = None
    step: int | None = None
    step_changed_at: float | None = None
    total_steps: int | None = None
    examples_per_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    rss_bytes: int = 0
    cpu_percent: float = 0.0
    done: bool = False
    error: TaskError | None = None
    steps_per_s: float | None = None
    user_frame: str | None = None
    busy: str | None = None  # between training steps: validating, saving, … (never a stall)
    busy_changed_at: float | None = None  # when it started or stopped being busy
    seq: int = 0  # of the latest heartbeat taken
    restored: Restored | None = None  # where the task started this attempt from (built-in loop)
    points_taken: int = 0  # of the process's points, the number written (a resend's are skipped)
    folders: dict[str, str] = field(default_factory=dict)  # the job's own checkpoint folders it told
    first_step: int | None = None  # the first step it reported this attempt (progress: a step past it)
    first_step_at: float | None = None  # when that came
    restored_at: float | None = None  # when its `restored` came
    dropped: Dropped | None = None  # the metric names its reporter dropped so far

    @property
    def progressed(self) -> bool:
        """It reported a step past its first one this attempt: its training advanced."""
        return self.step is not None and self.first_step is not None and self.step > self.first_step


class HealthStore:
    def __init__(
        self,
        clock: Callable[[], float],
        on_points: Callable[[str, int, list[dict[str, Any]]], None] | None = None,
    ):
        self._clock = clock
        self._on_points = on_points
        self._lock = threading.Lock()
        self._attempt = 0
        self._tasks: dict[str, TaskHealth] = {}

    def reset(self, attempt: int, tasks: Iterable[str]) -> None:
        """Start a new attempt: forget everything the previous one said."""
        with self._lock:
            self._attempt = attempt
            self._tasks = {t: TaskHealth(task=t, attempt=attempt) for t in tasks}

    def reset_task(self, task: str) -> None:
        """One task starts again alone (same attempt): forget what its previous process said."""
        with self._lock:
            self._tasks[task] = TaskHealth(task=task, attempt=self._attempt)

    def ingest(self, hb: Heartbeat) -> int:
        """Take one heartbeat; returns the HTTP status to answer with (200, 404 unknown task, 409
        another process than the task's, 410 stale)."""
        now = self._clock()
        with self._lock:
            if hb.attempt < self._attempt:
                return wire.STALE_ATTEMPT_STATUS
            old = self._tasks.get(hb.task)
            if old is None or hb.attempt != self._attempt:
                return wire.NOT_FOUND_STATUS
            if old.pid is not None and hb.pid != old.pid:
                return wire.CONFLICT_STATUS  # the task's process spoke first: it alone speaks for it
            if hb.seq <= old.seq:
                return wire.OK_STATUS  # sent again by a relay that did not hear our answer: taken already
            # Points this process sent before (a heartbeat whose answer was lost, sent again with
            # the next one) are skipped: each is written once.
            points = hb.points[max(0, old.points_taken - hb.points_from) :]
            metrics = _merged(old.metrics, hb.metrics)
            step_changed = hb.step is not None and hb.step != old.step
            rate = _rate(old, hb.step, now) if step_changed else old.steps_per_s
            # Built whole rather than with dataclasses.replace: this runs once per task per second.
            self._tasks[hb.task] = TaskHealth(
                task=old.task,
                attempt=old.attempt,
                pid=hb.pid,
                last_heartbeat_at=now,
                last_heartbeat_wall=time.time(),
                connecting_at=old.connecting_at
                if old.connecting_at is not None
                else (now if hb.connecting or hb.ready else None),
                ready_at=old.ready_at if old.ready_at is not None else (now if hb.ready else None),
                step=hb.step if hb.step is not None else old.step,
                step_changed_at=now if step_changed else old.step_changed_at,
                total_steps=hb.total_steps if hb.total_steps is not None else old.total_steps,
                examples_per_step=hb.examples_per_step or old.examples_per_step,
                metrics=metrics,
                rss_bytes=hb.rss_bytes,
                cpu_percent=hb.cpu_percent,
                done=old.done or hb.done,
                error=hb.error or old.error,
                steps_per_s=rate,
                user_frame=hb.user_frame,
                busy=hb.busy,
                busy_changed_at=now if hb.busy != old.busy else old.busy_changed_at,
                seq=hb.seq,
                restored=_restored(old.restored, hb.restored),
                points_taken=max(old.points_taken, hb.points_from + len(hb.points)),
                folders=hb.folders or old.folders,
                first_step=old.first_step if old.first_step is not None else hb.step,
                first_step_at=old.first_step_at
                if old.first_step_at is not None
                else (now if hb.step is not None else None),
                restored_at=old.restored_at
                if old.restored_at is not None
                else (now if hb.restored is not None and hb.restored.final else None),
                dropped=hb.dropped or old.dropped,
            )
        if points and self._on_points is not None:
            self._on_points(hb.task, hb.attempt, points)
        return wire.OK_STATUS

    def add_written_error(self, task: str, attempt: int, written: Written) -> TaskHealth | None:
        """What a task wrote as it died (its error file), where no heartbeat brought its error:
        taken as if its last heartbeat had said it. The task's health then; None for another attempt."""
        with self._lock:
            old = self._tasks.get(task)
            if old is None or attempt != self._attempt:
                return None
            if old.error is None:
                step = old.step if old.step is not None else written.step
                old = self._tasks[task] = dataclasses.replace(old, error=written.error, step=step)
            return old

    def snapshot(self) -> dict[str, TaskHealth]:
        with self._lock:
            return dict(self._tasks)


def _merged(old: dict[str, float], new: dict[str, float]) -> dict[str, float]:
    """A task's metrics with a heartbeat's: at most wire.MAX_METRICS names, those it had first stay."""
    if not new:
        return old
    metrics = {**old, **new}
    if len(metrics) > wire.MAX_METRICS:
        extra = [k for k in new if k not in old]
        for name in extra[wire.MAX_METRICS - len(metrics) :]:
            del metrics[name]
    return metrics


def _rate(old: TaskHealth, step: int | None, now: float) -> float | None:
    """Steps per second, smoothed, once the step moved from `old.step` to `step` at `now`."""
    rate = old.steps_per_s
    if old.step is None or old.step_changed_at is None or step is None:
        return rate
    dt = now - old.step_changed_at
    if dt <= 0:
        return rate
    instant = (step - old.step) / dt
    return instant if rate is None else 0.7 * rate + 0.3 * instant


def _restored(old: Restored | None, new: Restored | None) -> Restored | None:
    """A task's final restore report stands for the attempt; one not final, until the next."""
    return old if old is not None and old.final else new or old
