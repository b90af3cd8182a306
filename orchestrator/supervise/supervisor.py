"""Supervision layer: the control loop. `while not state.is_terminal: step()`.

Each step polls the task group once into a frozen view (exit codes, heartbeats, the clock), moves
task states, runs the detectors (process exit, heartbeat timeout, stall, startup deadline, a
diverged start), hands the failures to the policy (policy.decide) and executes its decisions
through the backend; the run's state moves through `states.CLUSTER_TRANSITIONS`. Stopping one
task alone happens on a thread of its own, so it never holds up the detectors. Time and sleep are
injected so tests can step it deterministically.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.errors import LaunchError
from orchestrator.health.store import HealthStore, TaskHealth
from orchestrator.launch.api import Backend, TaskHandle, stop_all, stop_in_background, unconfirmed_reason
from orchestrator.launch.placement import Placement
from orchestrator.plan import LaunchPlan
from orchestrator.record import now_iso
from orchestrator.spec.model import AtEnd, ClusterSpec, Role, Strategy
from orchestrator.supervise import policy
from orchestrator.supervise.policy import Action, Decision, Failure, FailureKind
from orchestrator.supervise.records import RunResult, TaskRecord, describe_exit, task_status
from orchestrator.supervise.states import (
    CLUSTER_TRANSITIONS,
    TASK_TRANSITIONS,
    ClusterState,
    TaskState,
    check_transition,
)

log = logging.getLogger("orchestrator.supervise")


class EventSink(Protocol):
    def event(self, **fields: Any) -> None: ...

    def log_path(self, log_name: str) -> Any: ...


@dataclass(frozen=True)
class SupervisorConfig:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    stall_timeout_s: float = 120.0
    startup_timeout_s: float = 120.0
    max_restarts: int = 3
    backoff_s: float = 2.0
    stop_grace_s: float = 30.0  # a stop asked for: time for the tasks' final checkpoint
    final_wait_s: float = 120.0  # training done: time for tasks that end by themselves (evaluator)
    failure_grace_s: float = 3.0  # a failure: the job's collectives are broken, no checkpoint can be agreed
    poll_interval_s: float = 0.1

    @classmethod
    def from_spec(cls, spec: ClusterSpec, **overrides: Any) -> SupervisorConfig:
        tasks = sum(spec.role_count(role) for role in Role)
        return cls(
            heartbeat_interval_s=spec.health.heartbeat_interval_s,
            heartbeat_timeout_s=spec.health.heartbeat_timeout_s,
            stall_timeout_s=spec.health.stall_timeout_s,
            startup_timeout_s=spec.health.startup_timeout_s,
            max_restarts=spec.restart.max_restarts,
            backoff_s=spec.restart.backoff_s,
            stop_grace_s=spec.health.stop_grace_s,
            final_wait_s=spec.health.final_wait_s,
            poll_interval_s=poll_interval_s(tasks),
            **overrides,
        )


def poll_interval_s(tasks: int) -> float:
    """A step looks at every task (~3 µs each here): 10 steps a second up to 500 tasks, then
    fewer, so that supervising costs about the same share of a core at any size (P6)."""
    return max(0.1, tasks / 5000)


@dataclass
class _Stop:
    outcome: ClusterState  # SUCCEEDED, FAILED (then the policy's decision), INTERRUPTED
    reason: str
    decision: Decision | None = None  # a failure's: restart the job, or fail it


@dataclass(frozen=True)
class _Poll:
    """The task group as seen once per iteration: detectors and policy read this, not the tasks."""

    now: float
    exit_codes: Mapping[str, int | None]
    health: Mapping[str, TaskHealth]


class Supervisor:
    def __init__(
        self,
        plan: LaunchPlan,
        backend: Backend,
        store: HealthStore,
        sink: EventSink,
        token: str,
        config: SupervisorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_change: Callable[[Supervisor], None] | None = None,
        first_attempt: int = 0,
        restarts: int = 0,
        replan: Callable[[Mapping[str, Placement]], LaunchPlan] | None = None,
        in_background: Callable[[list[TaskHandle], float, threading.Event], Future[Any]] = stop_in_background,
    ):
        self.plan = plan
        self.config = config
        self._backend = backend
        self._store = store
        self._sink = sink
        self._token = token
        self._clock = clock
        self._sleep = sleep
        self._on_change = on_change
        self.state = ClusterState.PENDING
        self.reason = ""
        self.attempt = first_attempt  # > 0 when resuming an earlier run
        self._first_attempt = first_attempt
        self.failures: list[Failure] = []  # the root cause of every failed attempt, in order
        self.restarts = restarts
        self.tasks = {t.name: TaskRecord(t, plan.policy_of(t)) for t in plan.tasks}
        self.root_cause: Failure | None = None
        self.ignored: list[Failure] = []  # failures of tasks whose role's policy is `ignore`
        self.task_failures: list[Failure] = []  # failures answered by restarting that task alone
        self._end_deadline: float | None = None  # training done: until when to wait for the rest
        self.started_at = now_iso()
        self.ended_at: str | None = None
        self._stop: _Stop | None = None
        self._restart_at = 0.0
        self._interrupt: str | None = None
        self._replan = replan  # between attempts: a new plan when the backend moved a task
        self._in_background = in_background  # how one task alone is stopped (a thread; tests: at once)
        self.unconfirmed: list[str] = []  # tasks whose exit no stop could confirm
        self.hurry = threading.Event()
        self.transitions = 0  # of the run and of its tasks: a view can tell news from refreshes
        self._same_start = False  # every training task reported the same restored state

    # --- control -----------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ask for a clean stop (first call) or an immediate one (second call). Signal-handler safe."""
        if self._interrupt is None:
            self._interrupt = reason
        else:
            self.hurry.set()

    def run(self) -> RunResult:
        while not self.state.is_terminal:
            self.step()
            if not self.state.is_terminal:
                self._sleep(self.config.poll_interval_s)
        return self.result()

    def result(self) -> RunResult:
        return RunResult(
            self.state,
            self.reason,
            self.attempt,
            self.restarts,
            self.root_cause,
            self.started_at,
            self.ended_at or "",
            tuple(self.ignored),
            tuple(self.task_failures),
            tuple(self.failures),
            tuple(self.unconfirmed),
        )

    def step(self) -> tuple[ClusterState, ClusterState]:
        before = self.state
        if (
            self._interrupt is not None
            and self.state not in (ClusterState.STOPPING,)
            and not before.is_terminal
        ):
            self._begin_stop(_Stop(ClusterState.INTERRUPTED, self._interrupt))
        elif self.state is ClusterState.PENDING:
            self._launch_all()
        elif self.state in (ClusterState.LAUNCHING, ClusterState.RUNNING):
            self._observe()
        elif self.state is ClusterState.STOPPING:
            self._teardown()
        elif self.state is ClusterState.RESTARTING and self._clock() >= self._restart_at:
            self.attempt += 1
            self._launch_all()
        if self._on_change is not None:
            self._on_change(self)
        return before, self.state

    def stop_now(self, grace_s: float) -> list[str]:
        """Stop every task at once, whatever the state (the coordinator's last resort after a bug of
        ours); the tasks whose exit could not be confirmed."""
        handles = [r.handle for r in self.tasks.values() if r.handle is not None]
        return [h.task.name for h in stop_all(handles, grace_s)]

    # --- states ------------------------------------------------------------------------------

    def _launch_all(self) -> None:
        self._store.reset(self.attempt, self.tasks)
        self._same_start = False
        self._move(ClusterState.LAUNCHING, f"attempt {self.attempt}: starting {len(self.tasks)} tasks")
        records = list(self.tasks.values())
        self._end_deadline = None
        for rec in records:
            rec.exit_code, rec.health, rec.handle, rec.restart_at, rec.stopping = None, None, None, None, None
        try:
            prepared = self._backend.before_attempt(self.plan, self.attempt)
        except LaunchError as exc:
            failure = Failure((), FailureKind.LAUNCH, self.attempt, f"before attempt {self.attempt}: {exc}")
            self._fail(failure)
            return
        if prepared.moved and self._replan is not None:
            self._move_tasks(prepared.moved)
        for note in prepared.notes:
            self._sink.event(kind="state", attempt=self.attempt, reason=note)
            log.info("%s", note)
        results = self._backend.start_all(
            [r.plan for r in records],
            self.attempt,
            self._token,
            [self._sink.log_path(r.plan.log_name) for r in records],
        )
        failed: Failure | None = None
        for rec, result in zip(records, results, strict=True):
            if isinstance(result, LaunchError):
                self._move_task(rec, TaskState.FAILED, str(result))
                failed = failed or Failure((rec.plan.name,), FailureKind.LAUNCH, self.attempt, str(result))
                continue
            rec.handle = result
            rec.launched_at = self._clock()
            where = f" on {result.where}" if result.where else ""
            self._move_task(rec, TaskState.STARTING, f"pid {result.process.pid}{where}")
        if failed is not None:  # the tasks that did start are stopped by the teardown
            self._fail(failed)

    def _move_tasks(self, moved: Mapping[str, Placement]) -> None:
        """The backend placed some tasks anew (a port taken meanwhile): the plan is made again."""
        assert self._replan is not None
        old = self.plan
        self.plan = self._replan(moved)
        for task in self.plan.tasks:
            self.tasks[task.name].plan = task
        for name, place in moved.items():
            note = f"port {old.task(name).port} of {name} is in use by another program; moved to {place.port}"
            self._sink.event(kind="port", attempt=self.attempt, reason=note)
            log.warning("%s", note)

    def _poll(self) -> _Poll:
        exit_codes, now = {}, self._clock()
        for name, rec in self.tasks.items():
            if rec.handle is not None and not rec.state.is_terminal:
                exit_codes[name] = rec.handle.poll()
        return _Poll(now, exit_codes, self._store.snapshot())

    def _snapshot(self) -> policy.Snapshot:
        return policy.Snapshot(
            attempt=self.attempt,
            first_attempt=self.attempt == self._first_attempt,
            restarts_used=self.restarts,
            max_restarts=self.config.max_restarts,
            history=tuple(self.failures),
            on_failure={name: rec.policy.on_failure for name, rec in self.tasks.items()},
            task_restarts={name: rec.restarts for name, rec in self.tasks.items()},
        )

    def _observe(self) -> None:
        poll = self._poll()
        now = poll.now
        failures: list[Failure] = []
        for rec in self.tasks.values():
            if rec.restart_at is not None:
                if now >= rec.restart_at and (rec.stopping is None or rec.stopping.done()):
                    failure = self._restart_task(rec)
                    if failure is not None:
                        failures.append(failure)
                continue
            if rec.handle is None or rec.state.is_terminal:
                continue
            rec.health = poll.health.get(rec.plan.name)
            failure = self._check_task(rec, now, poll.exit_codes[rec.plan.name])
            if failure is not None:
                failures.append(failure)
        if not self._same_start:
            diverged = self._diverged_start()
            if diverged is not None:
                failures.insert(0, diverged)
        decisions = policy.decide(failures, self._snapshot()) if failures else []
        for decision in decisions:
            if decision.action is Action.RESTART_TASK:
                self._schedule_task_restart(self.tasks[decision.failure.tasks[0]], decision)
            elif decision.action is Action.IGNORE:
                self.ignored.append(decision.failure)
                self._sink.event(kind="warning", task=decision.failure.tasks[0], reason=decision.reason)
        stop = next((d for d in decisions if d.stops_job), None)
        if stop is not None:
            if stop.failure.is_peer_loss:  # the survivors' error: name the frozen peer if there is one
                frozen = self._frozen_peer(now)
                stop = policy.job_decision(frozen, self._snapshot()) if frozen is not None else stop
            self._begin_stop(_Stop(ClusterState.FAILED, stop.failure.describe(), stop))
            return
        in_cluster = [r for r in self.tasks.values() if r.plan.in_cluster]
        deciders = [r for r in self.tasks.values() if r.policy.decides]
        if self.state is ClusterState.LAUNCHING:
            if all(r.state in (TaskState.RUNNING, TaskState.SUCCEEDED) for r in in_cluster):
                self._move(ClusterState.RUNNING, "every task's distribution strategy is up")
            elif now - self._launched_at() > self.config.startup_timeout_s:
                self._fail(self._startup_failure(in_cluster))
        elif all(r.state is TaskState.SUCCEEDED for r in deciders):
            self._finish_training(now, deciders)

    def _fail(self, failure: Failure) -> None:
        """A failure that stops the job (a launch, a start-up deadline): the policy says how."""
        decision = next(d for d in policy.decide([failure], self._snapshot()) if d.stops_job)
        self._begin_stop(_Stop(ClusterState.FAILED, failure.describe(), decision))

    def _diverged_start(self) -> Failure | None:
        """The training tasks of a synchronous job must start an attempt from one state, the owner's
        (its checkpoint is the truth). Compared as their restore reports arrive; settled once
        every one has reported the same."""
        state = self.plan.state
        if state is None or self.plan.strategy is Strategy.PARAMETER_SERVER:
            self._same_start = True
            return None
        names = [n for n in state.readers if self.tasks[n].plan.in_cluster]
        starts = {}
        for name in names:
            h = self.tasks[name].health
            if h is not None and h.restored is not None:
                starts[name] = h.restored
        if len({(r.step, r.fingerprint) for r in starts.values()}) < 2:
            self._same_start = len(starts) == len(names)
            return None
        truth = starts.get(state.owner)
        odd = [
            n
            for n, r in starts.items()
            if truth is None or (r.step, r.fingerprint) != (truth.step, truth.fingerprint)
        ]
        table = "; ".join(
            f"{n} step {r.step} from {r.source or 'no checkpoint (fresh weights)'} (state {r.fingerprint})"
            for n, r in starts.items()
        )
        detail = (
            f"restored a different state than {state.owner}: {table}. Trained together they would "
            "average the gradients of different models, so the job stops here; their hosts' "
            "checkpoint folders differ"
        )
        return Failure(tuple(odd), FailureKind.DIVERGED, self.attempt, detail)

    def _finish_training(self, now: float, deciders: list[TaskRecord]) -> None:
        """The deciders are done: wait (bounded) for the tasks whose role ends by itself, then stop."""
        if {r.plan.name for r in deciders} == {r.plan.name for r in self.tasks.values() if r.plan.in_cluster}:
            done = "every training task exited 0"
        else:
            done = f"{', '.join(r.plan.name for r in deciders)} exited 0"
        waiting = [
            r
            for r in self.tasks.values()
            if r.policy.at_end is AtEnd.WAIT and r.handle is not None and not r.state.is_terminal
        ]
        if waiting and self._end_deadline is None:
            self._end_deadline = now + self.config.final_wait_s
            names = ", ".join(r.plan.name for r in waiting)
            self._sink.event(
                kind="run",
                attempt=self.attempt,
                reason=f"{done}; waiting up to {self.config.final_wait_s:g} s for {names} to finish",
            )
        if waiting and self._end_deadline is not None and now < self._end_deadline:
            return
        if waiting:
            names = ", ".join(r.plan.name for r in waiting)
            done += f"; {names} still running after health.final_wait_s = {self.config.final_wait_s:g}"
        self._begin_stop(_Stop(ClusterState.SUCCEEDED, done))

    def _schedule_task_restart(self, rec: TaskRecord, decision: Decision) -> None:
        """Stop what is left of the task (a frozen one still runs) on a thread of its own, then
        restart it once that is done and the backoff has passed."""
        assert rec.handle is not None
        rec.stopping = self._in_background([rec.handle], self.config.failure_grace_s, self.hurry)
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
                rec.plan, self.attempt, self._token, self._sink.log_path(rec.plan.log_name)
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

    def _check_task(self, rec: TaskRecord, now: float, code: int | None) -> Failure | None:
        """Move one live task's state from what was polled; return its failure, if it failed."""
        assert rec.handle is not None and rec.launched_at is not None
        h = rec.health
        me = (rec.plan.name,)
        if code is not None:
            rec.exit_code = code
            if code == 0:
                self._move_task(rec, TaskState.SUCCEEDED, "exit code 0")
                return None
            error = h.error if h is not None else None
            if error is not None and error.type != "SystemExit":
                detail = f"raised {error.type}: {error.message}"
                kind = FailureKind.EXCEPTION
            else:
                detail = describe_exit(code)
                kind = FailureKind.EXIT
            self._move_task(rec, TaskState.FAILED, detail)
            step = h.step if h is not None else None
            return Failure(me, kind, self.attempt, detail, exit_code=code, error=error, step=step)
        if rec.state is TaskState.STARTING and h is not None and h.ready_at is not None:
            self._move_task(rec, TaskState.RUNNING, "strategy up")
        last = h.last_heartbeat_at if h is not None and h.last_heartbeat_at is not None else rec.launched_at
        silent_s = now - last
        # A MultiWorkerMirroredStrategy constructor holds the GIL while it waits for its peers, so a
        # task waiting there sends no heartbeat: the startup deadline, not this detector, covers it.
        in_strategy = rec.state is TaskState.STARTING and h is not None and h.connecting_at is not None
        if silent_s > self.config.heartbeat_timeout_s and not in_strategy:
            limit = self.config.heartbeat_timeout_s
            detail = f"sent no heartbeat for {silent_s:.1f} s (health.heartbeat_timeout_s = {limit:g})"
            self._move_task(rec, TaskState.LOST, detail)
            return Failure(me, FailureKind.LOST, self.attempt, detail)
        if (
            rec.state is TaskState.RUNNING
            and rec.plan.in_cluster  # the evaluator's step is the last checkpoint's: it waits on the chief
            and h is not None
            and h.step is not None
            and h.step_changed_at is not None
            and not h.done
            and now - h.step_changed_at > self.config.stall_timeout_s
        ):
            where = f", busy in {h.user_frame}" if h.user_frame else ", waiting inside TensorFlow"
            detail = (
                f"stalled at step {h.step} for {now - h.step_changed_at:.1f} s while alive{where} "
                f"(health.stall_timeout_s = {self.config.stall_timeout_s:g})"
            )
            self._move_task(rec, TaskState.FAILED, detail)
            return Failure(me, FailureKind.STALLED, self.attempt, detail, step=h.step, where=h.user_frame)
        return None

    def _frozen_peer(self, now: float) -> Failure | None:
        """When the survivors report losing a peer, the peer may be alive but frozen (SIGSTOP, a host
        cut off): still running, yet silent for several heartbeats. Name it, not the survivor."""
        quiet_s = max(2.5 * self.config.heartbeat_interval_s, 1.5)
        for rec in self.tasks.values():
            h = rec.health
            if rec.state.is_terminal or h is None or h.last_heartbeat_at is None:
                continue
            if now - h.last_heartbeat_at > quiet_s:
                detail = (
                    f"went silent {now - h.last_heartbeat_at:.1f} s ago and its peers lost contact with it"
                )
                self._move_task(rec, TaskState.LOST, detail)
                return Failure((rec.plan.name,), FailureKind.LOST, self.attempt, detail)
        return None

    def _startup_failure(self, deciders: list[TaskRecord]) -> Failure:
        late = [r for r in deciders if r.state is TaskState.STARTING]
        # A task that never began creating its strategy is the one the others wait for.
        never = [r for r in late if r.health is None or r.health.connecting_at is None]
        culprits = never or late
        waiting = [r.plan.name for r in late if r not in culprits]
        head = f"not up within health.startup_timeout_s = {self.config.startup_timeout_s:g} s"
        if never:
            waited = f"; {', '.join(waiting)} waited for it" if waiting else ""
            detail = f"{head} (never created its distribution strategy{waited})"
        else:
            detail = f"{head} (its cluster never connected)"
        return Failure(
            tuple(r.plan.name for r in culprits), FailureKind.STARTUP_TIMEOUT, self.attempt, detail
        )

    def _begin_stop(self, stop: _Stop) -> None:
        self._stop = stop
        if stop.decision is not None:
            self.failures.append(stop.decision.failure)
            if self.root_cause is None:
                self.root_cause = stop.decision.failure
        self._move(ClusterState.STOPPING, stop.reason)

    def _teardown(self) -> None:
        assert self._stop is not None
        handles = [r.handle for r in self.tasks.values() if r.handle is not None]
        grace_s = self.config.stop_grace_s
        if self._stop.outcome is ClusterState.FAILED:
            grace_s = min(grace_s, self.config.failure_grace_s)
        for rec in self.tasks.values():  # a task stopping alone is part of the stop, too
            if rec.stopping is not None:
                rec.stopping.exception()  # done within its own grace
                self._note_unconfirmed(rec.stopping)
            rec.restart_at, rec.stopping = None, None
        self._unconfirmed(stop_all(handles, grace_s, self.hurry))
        health = self._store.snapshot()  # the tasks' last words (final step, error) before they went
        for rec in self.tasks.values():
            rec.health = health.get(rec.plan.name, rec.health)
            if rec.handle is not None and not rec.state.is_terminal:
                rec.exit_code = rec.handle.poll()
                self._move_task(rec, TaskState.STOPPED, f"stopped by orchestrate ({self._stop.reason})")
        stop, self._stop = self._stop, None
        if stop.outcome is ClusterState.FAILED and stop.decision is not None:
            if self._interrupt is not None:  # a failure seen while the user asked to stop: just stop
                self._finish(ClusterState.INTERRUPTED, self._interrupt)
                return
            if stop.decision.action is Action.RESTART_JOB:
                wait_s = policy.backoff_s(self.config.backoff_s, self.restarts)
                if not stop.decision.failure.is_preemption:
                    self.restarts += 1
                self._restart_at = self._clock() + wait_s
                self._move(ClusterState.RESTARTING, f"{stop.decision.reason}, in {wait_s:g} s")
                return
            self._finish(ClusterState.FAILED, stop.decision.reason)
            return
        self._finish(stop.outcome, stop.reason)

    def _finish(self, state: ClusterState, reason: str) -> None:
        self.ended_at = now_iso()
        self._move(state, reason)

    # --- transitions -------------------------------------------------------------------------

    def _move(self, new: ClusterState, reason: str) -> None:
        old = self.state
        check_transition(CLUSTER_TRANSITIONS, old, new, f"run {self.plan.name}")
        self.state, self.reason = new, reason
        self.transitions += 1
        log.info("%s → %s (%s)", old.value, new.value, reason)
        self._sink.event(kind="run", attempt=self.attempt, old=old.value, new=new.value, reason=reason)

    def _move_task(self, rec: TaskRecord, new: TaskState, reason: str) -> None:
        old = rec.state
        check_transition(TASK_TRANSITIONS, old, new, rec.plan.name)
        rec.state, rec.reason = new, reason
        self.transitions += 1
        self._sink.event(
            kind="task", task=rec.plan.name, attempt=self.attempt, old=old.value, new=new.value, reason=reason
        )

    def _launched_at(self) -> float:
        return min(r.launched_at for r in self.tasks.values() if r.launched_at is not None)

    # --- views -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The status.json document (DESIGN §5)."""
        return {
            "name": self.plan.name,
            "run_id": self.plan.run_id,
            "state": self.state.value,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "tasks": [task_status(r) for r in self.tasks.values()],
        }
