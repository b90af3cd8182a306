"""Supervision layer: how the supervisor stops — the whole job (a failure, the end, a request) and
one task alone before it is restarted — and what those stops could not confirm. A part of the
Supervisor class (supervisor.py), kept in a module of its own; it only executes: how long a stop
waits and what a restart costs are the policy's (policy.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.errors import LaunchError
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Backend, TaskHandle, stop_all, unconfirmed_reason
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.record.write import now_iso
from orchestrator.spec.model import AtEnd
from orchestrator.stacks.record import BEFORE_STOP
from orchestrator.states import ClusterState, FailureKind, TaskState
from orchestrator.supervise import detect, policy
from orchestrator.supervise.config import STANDBYS_AFTER_S, SupervisorConfig
from orchestrator.supervise.policy import Action, Decision, Failure
from orchestrator.supervise.records import EventSink, TaskRecord
from orchestrator.supervise.timeline import Recovery, Timeline, what_happened

if TYPE_CHECKING:
    from orchestrator.stacks.record import Capture

log = logging.getLogger("orchestrator.supervise")

#: The failures of a job that may hang rather than end: its stacks are read before it is stopped.
HUNG = (FailureKind.STALLED, FailureKind.LOST, FailureKind.STARTUP_TIMEOUT, FailureKind.NO_STRATEGY)


@dataclass
class Stop:
    outcome: ClusterState  # SUCCEEDED, FAILED (then the policy's decision), INTERRUPTED
    reason: str
    decision: Decision | None = None  # a failure's: restart the job, or fail it


class Stopping:
    """The supervisor's stops (mixed into Supervisor, which sets what is declared here)."""

    plan: LaunchPlan
    tasks: dict[str, TaskRecord]
    config: SupervisorConfig
    attempt: int
    restarts: int
    failures: list[Failure]
    task_failures: list[Failure]
    root_cause: Failure | None
    unconfirmed: list[str]
    idle_in_a_row: int  # failed attempts in a row that advanced no step (the backoff doubles)
    _standbys_at: float | None  # when to prepare the next standbys at the latest
    _standbys_on_step: bool  # or as soon as every deciding task has stepped
    timeline: Timeline  # each restart's phases
    never_up: list[str]
    _end_deadline: float | None
    ended_at: str | None
    hurry: threading.Event
    _backend: Backend
    _store: HealthStore
    _sink: EventSink
    _token_for: Callable[[str, int], str]
    _clock: Callable[[], float]
    _sleep: Callable[[float], None]
    _in_background: Callable[[list[TaskHandle], float, threading.Event], Future[Any]]
    _capture: Callable[[list[TaskHandle], float, str, bool], Capture]  # stacks: record.capture_all
    _keep_stacks: Callable[[Capture, int], None]
    _stop: Stop | None
    _restart_at: float
    _abort: str | None
    _interrupt: str | None

    if TYPE_CHECKING:  # the supervisor's own

        def _move(self, new: ClusterState, reason: str) -> None: ...

        def _move_task(self, rec: TaskRecord, new: TaskState, reason: str) -> None: ...

        def _snapshot(self) -> policy.Snapshot: ...

        def _standbys(self, ask: Callable[[LaunchPlan], list[str]]) -> None: ...

    def _fail(self, failure: Failure) -> None:
        """A failure that stops the job (a launch, a start-up deadline): the policy says how."""
        decision = next(d for d in policy.decide([failure], self._snapshot()) if d.stops_job)
        self._begin_stop(Stop(ClusterState.FAILED, failure.describe(), decision))

    def _diagnosed(self, failure: Failure) -> Failure:
        """A start-up deadline with the backend's finding on why the cluster never connected (hosts
        that cannot reach each other), when it has one."""
        if failure.kind is not FailureKind.STARTUP_TIMEOUT:
            return failure
        try:
            finding = self._backend.diagnose_startup(self.plan, failure.tasks)
        except Exception as exc:  # noqa: BLE001 - a diagnosis that fails never hides the failure
            log.warning("diagnosing the start-up deadline: %s", exc)
            return failure
        return dataclasses.replace(failure, detail=f"{failure.detail}; {finding}") if finding else failure

    def _begin_stop(self, stop: Stop) -> None:
        self._stop = stop
        if stop.decision is not None:
            self.failures.append(stop.decision.failure)
            if self.root_cause is None:
                self.root_cause = stop.decision.failure
            failure, wall = stop.decision.failure, now_iso()
            self._said(self.timeline.failure_stops(self.attempt + 1, failure, self._clock(), wall))
        # stopping from now on, as the detector said it (said at once); a hung job's stacks are
        # read first thing in the stop (`_teardown`), and may name another task as the one
        self._move(ClusterState.STOPPING, stop.reason)

    def _looked_at(self, stop: Stop) -> list[TaskHandle]:
        """A hung job (stalled, lost, not up in time): every live task's stacks, read before its
        tasks are stopped (health.stacks_timeout_s at most), kept, said, and let name whom the
        others wait for (the stop's failure, the run's root cause and the restart's cause then).
        Returns the tasks whose hosts did not answer."""
        decision = stop.decision
        timeout_s = self.config.stacks_timeout_s
        if decision is None or decision.failure.kind not in HUNG or timeout_s <= 0 or self.hurry.is_set():
            return []
        handles = [r.handle for r in self.tasks.values() if r.handle is not None and r.handle.poll() is None]
        if not handles:
            return []
        why = f"{BEFORE_STOP}: {decision.failure.describe()}"
        capture = self._capture(handles, timeout_s, why, False)  # Python frames: tens of ms
        if not (self._restarts_after(stop) and any(w.culprit for w in capture.wheres())):
            # C++ frames too (seconds: py-spy reads TensorFlow's symbols) where the job ends here,
            # or its Python frames name no task the others wait for; not before a restart that
            # they would only delay
            left_s = timeout_s - capture.seconds
            if left_s >= 0.5:
                capture = capture.then(self._capture(handles, left_s, why, True))
        try:
            self._keep_stacks(capture, self.attempt)
        except OSError as exc:  # a full disk: the stop goes on, the event still says where they were
            log.warning("keeping the stacks: %s", exc)
        self._sink.event(kind="stacks", attempt=self.attempt, reason=capture.line(), seconds=capture.seconds)
        training = {name for name, r in self.tasks.items() if r.plan.in_cluster}
        stop.decision = policy.blame_by_stacks(decision, capture.wheres(), training)
        stop.reason = stop.decision.failure.describe()
        old, new = decision.failure, stop.decision.failure
        if new is not old:
            self.failures = [new if f is old else f for f in self.failures]
            self.root_cause = new if self.root_cause is old else self.root_cause
            if self.timeline.current is not None:
                self.timeline.current.cause = what_happened(new)
        return [h for h in handles if h.unanswering]

    def _cut_off(self, unanswered: list[TaskHandle]) -> list[TaskHandle]:
        """The tasks this stop gives up at once: their hosts did not answer the stacks read just
        before (`_looked_at`), and they are silent (no heartbeat for heartbeat_timeout_s): cut
        off. Waiting for their exits (the grace, then `kill_wait_s`) would only delay the restart:
        nothing can confirm them, and their shims stop them once the connection is gone."""
        now, health = self._clock(), self._store.snapshot()

        def silent(h: TaskHandle) -> bool:
            launched = self.tasks[h.task.name].launched_at
            last = detect.last_heard(health.get(h.task.name), launched if launched is not None else -math.inf)
            return now - last > self.config.heartbeat_timeout_s

        return [h for h in unanswered if silent(h)]

    def _said(self, recovery: Recovery | None) -> None:
        """A restart's timeline, complete: an event (`recovery`) with its line and phases."""
        if recovery is not None:
            self._sink.event(
                kind="recovery",
                attempt=recovery.attempt,
                reason=recovery.line(),
                phases_s=recovery.status()["phases_s"],
            )

    def _teardown(self) -> None:
        assert self._stop is not None
        unanswered = self._looked_at(self._stop)
        handles = [r.handle for r in self.tasks.values() if r.handle is not None]
        failed = self._stop.outcome is ClusterState.FAILED
        failure = self._stop.decision.failure if self._stop.decision is not None else None
        grace_s = policy.stop_grace_s(failed, failure, self.config.stop_grace_s, self.config.failure_grace_s)
        confirmed = len(self.unconfirmed)  # exits this stop cannot confirm come after
        for rec in self.tasks.values():  # a task stopping alone is part of the stop, too
            if rec.stopping is not None:
                rec.stopping.exception()  # done within its own grace
                self._note_unconfirmed(rec.stopping)
            rec.restart_at, rec.stopping = None, None
        # the roles stopped at the end (servers) save nothing: a short grace, not the whole period
        quick = [h for h in handles if self.tasks[h.task.name].policy.at_end is AtEnd.STOP]
        left = stop_all(
            handles,
            grace_s,
            self.hurry,
            quick=quick,
            gone=self._cut_off(unanswered),
            clock=self._clock,
            sleep=self._sleep,
            on_exit=self._state_known if self._restarts_after(self._stop) else None,
        )
        noted = set(self.unconfirmed[confirmed:])  # by a stop of its own, just above
        self._unconfirmed([h for h in left if h.task.name not in noted])
        health = self._store.snapshot()  # the tasks' last words (final step, error) before they went
        for rec in self.tasks.values():
            rec.health = health.get(rec.plan.name, rec.health)
            if rec.handle is not None and not rec.state.is_terminal:
                rec.exit_code = rec.handle.poll()
                self._move_task(rec, TaskState.STOPPED, f"stopped by orchestrate ({self._stop.reason})")
        stop, self._stop = self._stop, None
        if stop.outcome is ClusterState.FAILED and stop.decision is not None:
            if self._abort is not None:  # the coordinator cannot go on: no restart
                self._finish(ClusterState.FAILED, self._abort)
                return
            if self._interrupt is not None:  # a failure seen while the user asked to stop: just stop
                self._finish(ClusterState.INTERRUPTED, self._interrupt)
                return
            if stop.decision.action is Action.RESTART_JOB:
                # a task of it (or one stopping alone) may still run: the next attempt would meet it
                snap = dataclasses.replace(self._snapshot(), in_doubt=len(self.unconfirmed) > confirmed)
                restart = policy.job_restart(stop.decision, snap, self.config.backoff_s)
                self.restarts += 1 if restart.counted else 0
                self.idle_in_a_row = 0 if snap.progressed else snap.idle_in_a_row + 1
                self.timeline.stopped(self._clock(), restarting=True)
                self._restart_at = self._clock() + restart.wait_s
                self._move(ClusterState.RESTARTING, f"{stop.decision.reason}, in {restart.wait_s:g} s")
                return
            self._finish(ClusterState.FAILED, stop.decision.reason)
            return
        self._finish(stop.outcome, stop.reason)

    def _restarts_after(self, stop: Stop) -> bool:
        """Whether the job restarts once this stop is done (as far as is known now)."""
        decision = stop.decision
        return (
            stop.outcome is ClusterState.FAILED
            and decision is not None
            and decision.action is Action.RESTART_JOB
            and self._abort is None
            and self._interrupt is None
        )

    def _state_known(self, handle: TaskHandle) -> None:
        """A task of a stop before a restart has exited: the owner's last checkpoint is known once
        it has, and the backend may bring it home while the others still stop."""
        if self.plan.state is not None and handle.task.name == self.plan.state.owner:
            try:
                self._backend.state_known(self.plan)
            except Exception as exc:  # noqa: BLE001 - a head start that fails costs only its time
                log.warning("bringing the checkpoints home early: %s", exc)

    def _finish_training(self, now: float, deciders: list[TaskRecord]) -> None:
        """The deciders are done: wait (bounded) for the tasks whose role ends by itself, then stop."""
        waiting = [
            r.plan.name
            for r in self.tasks.values()
            if r.policy.at_end is AtEnd.WAIT and r.handle is not None and not r.state.is_terminal
        ]
        training = [r.plan.name for r in self.tasks.values() if r.plan.in_cluster]
        end = policy.end_of_training(
            now,
            [r.plan.name for r in deciders],
            training,
            waiting,
            self._end_deadline,
            self.config.final_wait_s,
        )
        self._end_deadline = end.deadline
        if end.note is not None:
            self._sink.event(kind="run", attempt=self.attempt, reason=end.note)
        if end.stop:
            self._begin_stop(Stop(ClusterState.SUCCEEDED, end.done))

    def _never_up(self, rec: TaskRecord) -> None:
        """A training task ended well without its strategy ever coming up: it trained alone, if at all."""
        self.never_up.append(rec.plan.name)
        self._sink.event(
            kind="warning",
            task=rec.plan.name,
            attempt=self.attempt,
            reason=f"{rec.plan.name} exited 0 without its distribution strategy ever coming up: it did "
            "not train with the others (does the script create a tf.distribute strategy?)",
        )

    def _finish(self, state: ClusterState, reason: str) -> None:
        self.ended_at = now_iso()
        self.timeline.stopped(self._clock(), restarting=False)  # no restart follows this stop
        self._said(self.timeline.run_ends())
        self._move(state, reason)

    # --- transitions -------------------------------------------------------------------------

    def stop_now(self, grace_s: float) -> list[str]:
        """Stop every task at once, whatever the state (the coordinator's last resort after a bug of
        ours); the tasks whose exit could not be confirmed."""
        handles = [r.handle for r in self.tasks.values() if r.handle is not None]
        return [h.task.name for h in stop_all(handles, grace_s, clock=self._clock, sleep=self._sleep)]

    def _schedule_task_restart(self, rec: TaskRecord, decision: Decision) -> None:
        """Stop what is left of the task (a frozen one still runs) on a thread of its own, then
        restart it once that is done and the backoff has passed."""
        assert rec.handle is not None
        grace_s = policy.task_stop_grace_s(rec.policy.at_end, self.config.failure_grace_s)
        rec.stopping = self._in_background([rec.handle], grace_s, self.hurry)
        wait_s = policy.backoff_s(self.config.backoff_s, rec.restarts)
        rec.restart_at = self._clock() + wait_s
        self.task_failures.append(decision.failure)
        self._sink.event(
            kind="task_restart",
            task=rec.plan.name,
            attempt=self.attempt,
            reason=f"{decision.reason}, in {wait_s:g} s",
        )

    def _restart_task(self, rec: TaskRecord) -> Failure | None:
        self._note_unconfirmed(rec.stopping)
        rec.restart_at, rec.stopping = None, None
        rec.restarts += 1
        rec.exit_code, rec.health = None, None
        self._store.reset_task(rec.plan.name)
        try:
            rec.handle = self._backend.start(
                rec.plan,
                self.attempt,
                self._token_for(rec.plan.name, self.attempt),
                self._sink.log_path(rec.plan.log_name),
            )
        except LaunchError as exc:
            self._move_task(rec, TaskState.FAILED, str(exc))
            return Failure((rec.plan.name,), FailureKind.LAUNCH, self.attempt, str(exc))
        rec.launched_at = self._clock()
        self._move_task(
            rec,
            TaskState.STARTING,
            f"restarted alone (restart {rec.restarts} of {self.config.max_restarts}), "
            f"pid {rec.handle.process.pid}",
        )
        # the next one, once it is going: not while it starts (the others have stepped long ago)
        self._standbys_at, self._standbys_on_step = self._clock() + STANDBYS_AFTER_S, False
        return None

    def _note_unconfirmed(self, stopping: Future[Any] | None) -> None:
        """A stop that ran on its own thread: what it could not confirm goes in the record."""
        if stopping is None:
            return
        try:
            left = stopping.result(timeout=0)
        except Exception as exc:  # noqa: BLE001 - a stop that failed is said, never fatal
            self._sink.event(kind="error", reason=f"stopping a task: {exc}")
            return
        self._unconfirmed(left)

    def _unconfirmed(self, left: list[TaskHandle]) -> None:
        if not left:
            return
        self.unconfirmed += [h.task.name for h in left]
        self._sink.event(
            kind="unconfirmed", tasks=[h.task.name for h in left], reason=unconfirmed_reason(left)
        )
