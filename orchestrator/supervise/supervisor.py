"""Supervision layer: the control loop. `while not state.is_terminal: step()`.

Each step polls the task group once into a frozen view (exit codes, heartbeats, the clock), moves
task states, runs the detectors (process exit, heartbeat timeout, stall, startup deadline, a
diverged start), hands the failures to the policy (policy.decide) and executes its decisions
through the backend; the run's state moves through `states.CLUSTER_TRANSITIONS`. How it stops
(the job, or one task alone on a thread of its own) is in stopping.py. Time and sleep are
injected so tests can step it deterministically.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Backend, TaskHandle, stop_in_background
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.record.progress import dropped_text
from orchestrator.record.write import now_iso
from orchestrator.spec.model import ClusterSpec
from orchestrator.stacks.record import Capture, capture_all
from orchestrator.states import (
    CLUSTER_TRANSITIONS,
    TASK_TRANSITIONS,
    ClusterState,
    Degraded,
    FailureKind,
    TaskState,
    check_transition,
)
from orchestrator.supervise import detect, policy, restores
from orchestrator.supervise.config import STANDBYS_AFTER_S, SupervisorConfig
from orchestrator.supervise.hosts import Hosts, Replan
from orchestrator.supervise.policy import Action, Failure
from orchestrator.supervise.poll import poll_tasks, task_view
from orchestrator.supervise.records import EventSink, SupervisorResult, TaskRecord, status_document
from orchestrator.supervise.records import task_status as task_row
from orchestrator.supervise.stopping import Stop, Stopping
from orchestrator.supervise.timeline import Timeline

log = logging.getLogger("orchestrator.supervise")


class Supervisor(Stopping, Hosts):
    def __init__(
        self,
        plan: LaunchPlan,
        backend: Backend,
        store: HealthStore,
        sink: EventSink,
        token_for: Callable[[str, int], str],
        config: SupervisorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_change: Callable[[Supervisor], None] | None = None,
        first_attempt: int = 0,
        restarts: int = 0,
        replan: Replan | None = None,
        spec: ClusterSpec | None = None,
        in_background: Callable[[list[TaskHandle], float, threading.Event], Future[Any]] = stop_in_background,
        job_folders: Sequence[str] = (),
        capture: Callable[[list[TaskHandle], float, str, bool], Capture] = capture_all,
        keep_stacks: Callable[[Capture, int], None] = lambda _capture, _attempt: None,
        degraded: Sequence[Degraded] = (),
    ):
        self.job_folders = restores.JobFolders(job_folders)  # the job's own checkpoint folders
        self.plan = self.job_folders.plan(plan)
        self.config = config
        self._backend = backend
        self._store = store
        self._sink = sink
        self._token_for = token_for  # (task, attempt) -> the task's heartbeat credential
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
        self._stop: Stop | None = None
        self._restart_at = 0.0
        self._interrupt: str | None = None
        self._abort: str | None = None
        self._replan = replan  # between attempts: a new plan when the backend moved a task
        self._spec = spec  # the run's: its hosts' tasks, where lost hosts' tasks may go (hosts.py)
        self.machine_rows: list[dict[str, Any]] = []  # status.json's machines: as last seen
        self.workers: dict[int, int] = {}  # per attempt: its worker tasks
        self.changes: dict[int, list[str]] = {}  # per attempt: the hosts it ran on anew
        self._lost_machines: set[str] = set()
        self._launches = 0
        self._in_background = in_background  # how one task alone is stopped (a thread; tests: at once)
        self._capture, self._keep_stacks = capture, keep_stacks  # a hung job's stacks, and where they go
        self.unconfirmed: list[str] = []  # tasks whose exit no stop could confirm
        self.idle_in_a_row = 0
        self._standbys_at: float | None = None  # when to prepare standbys at the latest (running)
        self._standbys_on_step = False  # or once every deciding task has stepped
        self.timeline = Timeline()
        self.hurry = threading.Event()
        self.transitions = 0  # of the run and of its tasks: a view can tell news from refreshes
        self._same_start = False  # every training task reported the same restored state
        self.never_up: list[str] = []  # training tasks that exited 0 before their strategy came up
        self.degraded: list[Degraded] = []  # what of the run fell back, lasting (status.json)
        self._dropping: set[str] = set()  # tasks whose dropped metric names were said
        for fallback in degraded:  # known as the run opens (its network): said before any launch
            self.degrade(fallback)

    # --- control -----------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Fail the job now, for a reason of the coordinator's own (its record cannot be written):
        every task is stopped, no restart."""
        if self._abort is None:
            self._abort = reason

    def request_stop(self, reason: str) -> None:
        """Ask for a clean stop (first call) or an immediate one (second call). Signal-handler safe."""
        if self._interrupt is None:
            self._interrupt = reason
        else:
            self.hurry.set()

    def run(self) -> SupervisorResult:
        while not self.state.is_terminal:
            self.step()
            if not self.state.is_terminal:
                self._sleep(self.config.poll_interval_s)
        return self.result()

    def result(self) -> SupervisorResult:
        return SupervisorResult.of(self)

    def step(self) -> tuple[ClusterState, ClusterState]:
        before = self.state
        if self._interrupt is None and not before.is_terminal:
            self._interrupt = self._backend.ended_outside()
        if self._abort is not None and self.state is not ClusterState.STOPPING and not before.is_terminal:
            self._begin_stop(Stop(ClusterState.FAILED, self._abort))
        elif (
            self._interrupt is not None
            and self.state not in (ClusterState.STOPPING,)
            and not before.is_terminal
        ):
            self._begin_stop(Stop(ClusterState.INTERRUPTED, self._interrupt))
        elif self.state is ClusterState.PENDING:
            self._launch_all()
        elif self.state in (ClusterState.LAUNCHING, ClusterState.RUNNING):
            self._observe()
        elif self.state is ClusterState.STOPPING:
            self._teardown()
        if self.state is ClusterState.RESTARTING and self._clock() >= self._restart_at:
            if before is not ClusterState.RESTARTING and self._on_change is not None:
                self._on_change(self)  # said before the launch, which may wait on its hosts
            self.attempt += 1  # at once after the stop when there is no backoff: no idle poll
            self._launch_all()
        if self._on_change is not None:
            self._on_change(self)
        return before, self.state

    # --- states ------------------------------------------------------------------------------

    def _launch_all(self) -> None:
        trouble = None
        if self._launches:  # an attempt after this coordinator's first: the hosts may have changed
            try:
                self._relayout()
            except LaunchError as exc:
                trouble = LaunchError(f"moving the tasks of a lost host: {exc}")
        self._launches += 1
        self._count_workers()
        self._store.reset(self.attempt, self.tasks)
        self._same_start, self.never_up = False, []
        self.job_folders.attempt_starts()
        self._move(ClusterState.LAUNCHING, f"attempt {self.attempt}: starting {len(self.tasks)} tasks")
        records = list(self.tasks.values())
        self._end_deadline = None
        self.timeline.launching(self._clock())
        for rec in records:
            rec.exit_code, rec.health, rec.handle, rec.restart_at, rec.stopping = None, None, None, None, None
        try:
            if trouble is not None:
                raise trouble
            prepared = self._backend.before_attempt(self.plan, self.attempt)
        except LaunchError as exc:
            failure = Failure((), FailureKind.LAUNCH, self.attempt, f"before attempt {self.attempt}: {exc}")
            self._fail(failure)
            return
        if (prepared.moved or prepared.record_changed) and self._replan is not None:
            self._move_tasks(prepared.moved)
        for note in prepared.notes:
            self._sink.event(kind="state", attempt=self.attempt, reason=note)
            log.info("%s", note)
        results = self._backend.start_all(
            [r.plan for r in records],
            self.attempt,
            [self._token_for(r.plan.name, self.attempt) for r in records],
            [self._sink.log_path(r.plan.log_name) for r in records],
        )
        self.timeline.started(self._clock())
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

    def _snapshot(self) -> policy.Snapshot:
        return policy.Snapshot(
            attempt=self.attempt,
            first_attempt=self.attempt == self._first_attempt,
            restarts_used=self.restarts,
            max_restarts=self.config.max_restarts,
            history=tuple(self.failures),
            on_failure={name: rec.policy.on_failure for name, rec in self.tasks.items()},
            task_restarts={name: rec.restarts for name, rec in self.tasks.items()},
            learned_folders=self.job_folders.learned_this_attempt,
            progressed=any(r.health.progressed for r in self._training() if r.health),
            idle_in_a_row=self.idle_in_a_row,
        )

    def _observe(self) -> None:
        poll = poll_tasks(self.tasks, self._store, self._clock())
        now = poll.now
        self._news()
        failures: list[Failure] = []
        for rec in self.tasks.values():
            due = rec.restart_at is not None and now >= rec.restart_at
            if due and (rec.stopping is None or rec.stopping.done()):
                failure = self._restart_task(rec)
                if failure is not None:
                    failures.append(failure)
        for view in poll.tasks.values():
            if view.exit_code is not None:
                self.tasks[view.name].exit_code = view.exit_code
            failures += self._apply(detect.check_task(view, now, self.config, self.attempt))
        if not self._same_start:
            diverged = self._diverged_start(failures)
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
            if stop.failure.is_peer_loss:  # the survivors' error: a frozen peer is the one to name
                still = [v for v in poll.tasks.values() if not self.tasks[v.name].state.is_terminal]
                frozen = detect.frozen_peer(still, now, self.config, self.attempt)
                if frozen is not None and frozen.failure is not None:
                    self._apply([frozen])
                stop = policy.blame_frozen_peer(stop, frozen.failure if frozen else None, self._snapshot())
            self._begin_stop(Stop(ClusterState.FAILED, stop.failure.describe(), stop))
            return
        in_cluster = self._training()
        deciders = [r for r in self.tasks.values() if r.policy.decides]
        if self.state is ClusterState.LAUNCHING:
            if all(r.state in (TaskState.RUNNING, TaskState.SUCCEEDED) for r in in_cluster):
                why = "every task's distribution strategy is up"
                if self.never_up:
                    alone = ", ".join(self.never_up)
                    why = f"every task is up or done; {alone} exited without a distribution strategy"
                self._move(ClusterState.RUNNING, why)
                self.timeline.up(now)
                self._standbys_at, self._standbys_on_step = now + STANDBYS_AFTER_S, True
            elif now - self._launched_at() > self.config.startup_timeout_s:
                late = [task_view(r) for r in in_cluster if r.state is TaskState.STARTING]
                self._fail(self._diagnosed(detect.startup_failure(late, self.config, self.attempt)))
        elif all(r.state is TaskState.SUCCEEDED for r in deciders):
            self._finish_training(now, deciders)
        if self.state is ClusterState.RUNNING:
            self._said(self.timeline.observe(r.health for r in deciders))
            trained = all(r.health is not None and r.health.first_step_at is not None for r in deciders)
            if self._standbys_at is not None and (
                (trained and self._standbys_on_step) or now >= self._standbys_at
            ):
                self._standbys_at = None  # the next attempt's standbys: once this one trains
                self._standbys(self._backend.prepare_standbys)

    def _apply(self, verdicts: list[detect.Verdict]) -> list[Failure]:
        """Move the tasks as the detectors saw them; their failures."""
        out = []
        for v in verdicts:
            rec = self.tasks[v.task]
            if v.state is TaskState.SUCCEEDED and rec.state is TaskState.STARTING and rec.plan.in_cluster:
                self._never_up(rec)
            self._move_task(rec, v.state, v.reason)
            if v.failure is not None:
                out.append(v.failure)
        return out

    def _standbys(self, ask: Callable[[LaunchPlan], list[str]]) -> None:
        """Warm standbys prepared (the attempt is up) or found broken: said, never fatal."""
        try:
            lines = ask(self.plan)
        except Exception as exc:  # noqa: BLE001 - a standby is an optimisation: the run goes on
            lines = [f"warm standbys: {type(exc).__name__}: {exc}"]
        for line in lines:
            self._sink.event(kind="standby", attempt=self.attempt, reason=line)
            log.info("%s", line)

    def _news(self) -> None:
        """Told beside the states: the job's folders, standbys, fallbacks, metric names dropped."""
        self._learn_folders()
        self._standbys(lambda _plan: self._backend.standby_news())
        try:  # a fallback's word never stops the run
            fallbacks = self._backend.degraded()
        except Exception as exc:  # noqa: BLE001
            fallbacks = [Degraded("backend", "this run", f"{type(exc).__name__}: {exc}", "", lasting=False)]
        for fallback in fallbacks:
            self.degrade(fallback)
        dropping = {n for n, r in self.tasks.items() if r.health is not None and r.health.dropped is not None}
        for name in sorted(dropping - self._dropping):  # said once (the count: status.json, the views)
            self._dropping.add(name)
            self._sink.event(kind="warning", task=name, reason=dropped_text(task_row(self.tasks[name])))

    def degrade(self, fallback: Degraded) -> None:
        """A fallback said once (an event); a lasting one kept (status.json) until one of its
        promise and place comes (pasta started again, or ended for good)."""
        kept = [d for d in self.degraded if (d.what, d.where) != (fallback.what, fallback.where)]
        if fallback in self.degraded:
            return
        self.degraded = kept + ([fallback] if fallback.lasting else [])
        self.transitions += 1
        self._sink.event(kind="degraded", what=fallback.what, where=fallback.where, reason=fallback.line)
        log.info("%s: %s", fallback.where, fallback.line)

    def _learn_folders(self) -> None:
        """The job's own checkpoint folders, as the owner tells them: kept from the next attempt on."""
        owner = self.plan.state.owner if self.plan.state is not None else None
        for line in self.job_folders.learn(owner, self.tasks[owner].health if owner else None):
            self._sink.event(kind="checkpoints", task=owner, attempt=self.attempt, reason=line)
            self.plan = self.job_folders.plan(self.plan)

    def _diverged_start(self, failures: list[Failure]) -> Failure | None:
        reports = {name: (rec.plan.in_cluster, rec.health) for name, rec in self.tasks.items()}
        self._same_start, failure = restores.check_start(self.plan, reports, self.attempt, failures)
        return failure

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

    def _training(self) -> list[TaskRecord]:
        return [r for r in self.tasks.values() if r.plan.in_cluster]

    def _launched_at(self) -> float:
        return min(r.launched_at for r in self.tasks.values() if r.launched_at is not None)

    def standby_rows(self) -> list[dict[str, Any]]:
        try:
            return self._backend.standbys()
        except Exception as exc:  # noqa: BLE001 - a status is written whatever a backend says
            log.warning("listing the warm standbys: %s", exc)
            return []

    def status(self) -> dict[str, Any]:
        """The status.json document (docs/architecture.md §5; its JSON Schema: `orchestrate schema
        status`)."""
        return status_document(self)
