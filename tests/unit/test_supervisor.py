"""The supervisor stepped one iteration at a time, with a fake backend and a fake clock: every rule
that is policy (restarts, budgets, deadlines, per-role answers) is proven here, without processes."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import LaunchError
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import (
    QUICK_GRACE_S,
    Backend,
    Heartbeats,
    Prepared,
    ProcessInfo,
    Sig,
    TaskHandle,
    stop_all,
    stop_in_background,
)
from orchestrator.launch.local.placement import local_placements
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan, make_plan
from orchestrator.plan.placement import Placement
from orchestrator.spec.load import parse_spec
from orchestrator.states import ClusterState, Degraded, FailureKind, TaskState
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.supervisor import Supervisor
from worker import wire
from worker.wire import Heartbeat, TaskError
from worker.wire.failure import Written


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


class FakeHandle(TaskHandle):
    def __init__(self, task: TaskPlan, attempt: int, pid: int, backend: FakeBackend):
        super().__init__(task, attempt, Path("/dev/null"))
        self.code: int | None = None
        self.ignores_term = False  # a task stuck where SIGTERM cannot reach it: only KILL ends it
        self.cut_off = False  # its host is unreachable: no signal arrives, no exit is ever learned
        self.unheard = False  # the same, its connection not yet known lost (a link just cut)
        self.answers_stacks = True  # whether its host answers a stacks request
        self.asked_stacks = False
        self.written: Written | None = None  # its error file
        self._proc = ProcessInfo(pid, pid, 0.0)
        self._backend = backend

    @property
    def process(self) -> ProcessInfo:
        return self._proc

    def poll(self) -> int | None:
        return self.code

    def signal(self, sig: Sig) -> None:
        self._backend.signals.append((self.task.name, sig))
        if self.cut_off or self.unheard or self.code is not None:
            return
        if sig is Sig.KILL:
            self.code = -9
        elif not self.ignores_term:
            self.code = -15

    @property
    def exited(self) -> bool:
        return self.code is not None

    @property
    def reachable(self) -> bool:
        return not self.cut_off

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        self.asked_stacks = True
        return super().stacks(deadline, native)

    @property
    def unanswering(self) -> bool:
        return self.asked_stacks and not self.answers_stacks

    def release(self) -> None:
        self._backend.released.append(self.task.name)

    def written_error(self) -> Written | None:
        return self.written if self.code is not None else None


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, fail_start: set[str] | None = None) -> None:
        self.handles: dict[str, FakeHandle] = {}
        self.started: list[tuple[str, int]] = []
        self.signals: list[tuple[str, Sig]] = []
        self.released: list[str] = []
        self.fail_start = fail_start or set()
        self._pid = 100
        self.known: list[list[str]] = []

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        raise AssertionError("the supervisor never opens its backend")

    def record(self) -> dict[str, Any]:
        return {"backend": self.name}

    def start(self, task: TaskPlan, attempt: int, secret: str, log_path: Path) -> TaskHandle:
        if task.name in self.fail_start:
            raise LaunchError(f"cannot start {task.name}")
        self._pid += 1
        h = FakeHandle(task, attempt, self._pid, self)
        self.handles[task.name] = h
        self.started.append((task.name, attempt))
        return h

    def termed(self) -> list[str]:
        return [name for name, sig in self.signals if sig is Sig.TERM]

    def state_known(self, plan: LaunchPlan) -> None:
        # which tasks still ran when the backend was told (it may bring the state home meanwhile)
        self.known.append(sorted(n for n, h in self.handles.items() if not h.exited))


def at_once(handles: list[TaskHandle], grace_s: float, hurry: threading.Event) -> Future[Any]:
    """Stop one task on the caller's thread (the supervisor uses a thread of its own)."""
    done: Future[Any] = Future()
    done.set_result(stop_all(handles, grace_s, hurry))
    return done


class Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, **fields: Any) -> None:
        self.events.append(fields)

    def log_path(self, log_name: str) -> Path:
        return Path("/dev/null")


SPEC = """
name: t
hosts:
  - address: 127.0.0.1
    tasks: {{worker: {workers}}}
job:
  script: job.py
"""


def plan_of(tmp_path: Path, text: str, ports: dict[str, int]) -> LaunchPlan:
    (tmp_path / "job.py").write_text("")
    spec = parse_spec(text, file="s.yaml", base_dir=tmp_path)
    places = local_placements(
        spec, ports, run_dir=tmp_path, spec_dir=tmp_path, coordinator_url="http://x:1", python="python"
    )
    return make_plan(spec, "t-1", places)


def make(tmp_path: Path, workers: int = 2, launcher: FakeBackend | None = None, **cfg: Any):
    plan = plan_of(tmp_path, SPEC.format(workers=workers), {f"worker-{i}": 20000 + i for i in range(workers)})
    clock = FakeClock()
    store = HealthStore(clock)
    launcher = launcher or FakeBackend()
    config = SupervisorConfig(
        **{
            "heartbeat_timeout_s": 10,
            "stall_timeout_s": 30,
            "startup_timeout_s": 60,
            "max_restarts": 2,
            "backoff_s": 1,
            "poll_interval_s": 0,
            **cfg,
        }
    )
    sink = Sink()
    sup = Supervisor(
        plan,
        launcher,
        store,
        sink,
        lambda task, attempt: "tok",
        config,
        clock=clock,
        sleep=clock.advance,  # a teardown waits on this clock, not in real time
        in_background=at_once,
    )
    return sup, launcher, store, clock, sink


_seq = itertools.count(1)


def beat(store: HealthStore, task: str, attempt: int = 0, **kw: Any) -> None:
    # every heartbeat a task sends has a new seq (the store takes a repeated one as already seen)
    hb = Heartbeat(task=task, attempt=attempt, seq=next(_seq), sent_at=0.0, pid=1, **kw)
    assert store.ingest(hb) == 200


@pytest.mark.parametrize("answers", [False, True])
def test_a_silent_task_whose_host_gave_no_answer_is_not_waited_for(tmp_path, answers):
    """A host's link cut: no heartbeat, no signal arrives, no exit comes, the connection not yet
    known lost. Its host not answering the stacks read before the stop, the stop gives up both
    its silent tasks at once (said unconfirmed) instead of waiting out the grace and the kill's
    confirmation; a host that answered is waited for as before."""
    sup, launcher, store, clock, sink = make(tmp_path, workers=3, max_restarts=1, failure_grace_s=3.0)
    start_running(sup, launcher, store, clock)
    for name in ("worker-1", "worker-2"):  # one host, cut off: both its tasks
        launcher.handles[name].unheard, launcher.handles[name].answers_stacks = True, answers
    clock.advance(9)
    beat(store, "worker-0", ready=True)
    clock.advance(1.5)  # worker-1 and worker-2 silent for 10.6 s > 10 s
    sup.step()
    assert sup.root_cause.kind is FailureKind.LOST
    began = clock.now
    while sup.state is not ClusterState.RESTARTING:
        sup.step()
    waited = clock.now - began
    if answers:
        assert waited >= 3.0 + FakeHandle.kill_wait_s, waited
    else:
        assert waited < 1.0, waited
        assert {("worker-1", Sig.KILL), ("worker-2", Sig.KILL)} <= set(launcher.signals)
    event = next(e for e in sink.events if e["kind"] == "unconfirmed")
    assert event["tasks"] == ["worker-1", "worker-2"] and "exit not confirmed" in event["reason"]


def start_running(sup, launcher, store, clock, attempt: int = 0) -> None:
    before = sup.state  # PENDING, or RESTARTING with its backoff over
    assert sup.step() == (before, ClusterState.LAUNCHING)
    for name in sup.tasks:
        beat(store, name, attempt, ready=True)
    clock.advance(0.1)
    assert sup.step()[1] is ClusterState.RUNNING


def test_success_path(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path)
    assert sup.step() == (ClusterState.PENDING, ClusterState.LAUNCHING)
    assert all(r.state is TaskState.STARTING for r in sup.tasks.values())
    beat(store, "worker-0", ready=True)
    assert sup.step() == (ClusterState.LAUNCHING, ClusterState.LAUNCHING)  # worker-1 not up yet
    beat(store, "worker-1", ready=True)
    assert sup.step() == (ClusterState.LAUNCHING, ClusterState.RUNNING)
    launcher.handles["worker-0"].code = 0
    assert sup.step() == (ClusterState.RUNNING, ClusterState.RUNNING)
    launcher.handles["worker-1"].code = 0
    assert sup.step() == (ClusterState.RUNNING, ClusterState.STOPPING)
    assert sup.step() == (ClusterState.STOPPING, ClusterState.SUCCEEDED)
    assert sorted(launcher.released) == ["worker-0", "worker-1"]  # teardown always runs over every task
    assert sup.status()["state"] == "SUCCEEDED"
    assert [e["new"] for e in sink.events if e["kind"] == "run"] == [
        "LAUNCHING",
        "RUNNING",
        "STOPPING",
        "SUCCEEDED",
    ]


def test_exception_is_root_cause_and_not_restarted(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path)
    start_running(sup, launcher, store, clock)
    beat(store, "worker-1", error=TaskError("ValueError", "boom", "Traceback…\nValueError: boom"))
    launcher.handles["worker-1"].code = 1
    # the peer dies of the consequence in the same instant: it must not be named the cause
    beat(
        store,
        "worker-0",
        error=TaskError("tensorflow.python.framework.errors_impl.UnavailableError", "peer", ""),
    )
    launcher.handles["worker-0"].code = 1
    sup.step()
    assert sup.state is ClusterState.STOPPING
    sup.step()
    assert sup.state is ClusterState.FAILED
    assert sup.root_cause.tasks == ("worker-1",) and sup.root_cause.kind is FailureKind.EXCEPTION
    assert "not restarted" in sup.reason
    assert sup.restarts == 0


def test_an_error_no_heartbeat_brought_is_read_from_the_error_file(tmp_path):
    """The final heartbeat was lost: the task's exception still becomes the root cause (with its
    step), from what it wrote as it died."""
    sup, launcher, store, clock, _ = make(tmp_path)
    start_running(sup, launcher, store, clock)
    written = Written(TaskError("KeyError", "'label'", "Traceback…\nKeyError: 'label'"), step=8)
    launcher.handles["worker-1"].written = written
    launcher.handles["worker-1"].code = 1
    sup.step()
    assert sup.root_cause is not None and sup.root_cause.kind is FailureKind.EXCEPTION
    assert sup.root_cause.error == written.error and "raised KeyError: 'label'" in sup.root_cause.detail
    assert sup.root_cause.step == 8 and sup.root_cause.tasks == ("worker-1",)


def test_a_heartbeats_error_is_kept_over_the_error_file(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path)
    start_running(sup, launcher, store, clock)
    beat(store, "worker-1", step=5, error=TaskError("ValueError", "from the heartbeat", ""))
    launcher.handles["worker-1"].written = Written(TaskError("OSError", "from the file", ""), step=9)
    launcher.handles["worker-1"].code = 1
    sup.step()
    assert sup.root_cause is not None and sup.root_cause.error is not None
    assert sup.root_cause.error.message == "from the heartbeat" and sup.root_cause.step == 5


def test_kill_restarts_whole_job_with_new_attempt(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-0"].code = -9
    sup.step()
    assert sup.state is ClusterState.STOPPING
    sup.step()
    assert sup.state is ClusterState.RESTARTING
    assert launcher.termed() == ["worker-1"]  # never restart one MWMS task alone: the survivor is stopped
    sup.step()
    assert sup.state is ClusterState.RESTARTING  # backoff not yet elapsed
    clock.advance(1.01)
    sup.step()
    assert sup.state is ClusterState.LAUNCHING and sup.attempt == 1
    assert ("worker-0", 1) in launcher.started and ("worker-1", 1) in launcher.started
    assert store.ingest(Heartbeat(task="worker-0", attempt=0, seq=9, sent_at=0, pid=1)) == 410  # stale
    start_running(sup, launcher, store, clock, attempt=1)
    assert sup.restarts == 1


def test_a_dead_peers_survivor_is_killed_at_once_and_a_job_that_trained_restarts_without_a_wait(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=3, backoff_s=2)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-1"].ignores_term = True  # it would take the whole grace over a SIGTERM
    beat(store, "worker-0", step=3), beat(store, "worker-0", step=9)  # it trained: 3 → 9
    launcher.handles["worker-0"].code = -9
    sup.step()
    stop_began = clock.now
    sup.step()  # stopped, and started again in the same step: no backoff after progress, no idle poll
    assert sup.state is ClusterState.LAUNCHING and sup.attempt == 1
    restarting = [e["reason"] for e in sink.events if e.get("new") == "RESTARTING"]
    assert len(restarting) == 1 and restarting[0].endswith(", in 0 s"), restarting
    assert ("worker-1", Sig.KILL) in launcher.signals and clock.now - stop_began < 0.5  # no grace
    # two attempts in a row that advance nothing: the backoff, doubling
    waits = []
    for attempt in (1, 2):
        start_running(sup, launcher, store, clock, attempt=attempt)
        beat(store, "worker-0", attempt, step=9)
        launcher.handles["worker-0"].code = -9
        sup.step(), sup.step()
        waits.append(sup.reason.rsplit(", in ", 1)[1])
        clock.advance(10)
    assert waits == ["2 s", "4 s"]


def test_the_owners_state_is_known_to_the_backend_as_soon_as_it_exits_while_the_others_still_stop(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, workers=3, max_restarts=1)
    start_running(sup, launcher, store, clock)
    assert sup.plan.state is not None and sup.plan.state.owner == "worker-0"
    # a lost peer: the survivors keep their grace; the owner saves and exits, worker-2 holds on
    launcher.handles["worker-2"].ignores_term = True
    clock.advance(20)
    sup.step()  # every heartbeat late: lost
    assert sup.state is ClusterState.STOPPING
    sup.step()
    assert sup.state is ClusterState.RESTARTING
    assert launcher.known == [["worker-2"]]  # told once, while worker-2 still ran
    clock.advance(1.01)
    start_running(sup, launcher, store, clock, attempt=1)
    launcher.handles["worker-0"].code = -9  # the owner itself dies, with no restart left
    sup.step(), sup.step()
    assert sup.state is ClusterState.FAILED
    assert launcher.known == [["worker-2"]]  # no restart follows: nothing to bring early


def test_a_restarts_timeline_is_measured_phase_by_phase_and_said_once(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=3, backoff_s=2)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-1"].code = -9
    clock.advance(0.5)
    sup.step()  # noticed
    launcher.handles["worker-0"].ignores_term = True
    clock.advance(0.25)
    sup.step()  # stopped (killed at once: it could save nothing)
    clock.advance(2.0)
    sup.step()  # the backoff (no step was trained) is over: started
    assert sup.state is ClusterState.LAUNCHING
    clock.advance(1.0)
    for name in sup.tasks:
        beat(store, name, 1, ready=True)
    sup.step()  # connected
    restored = wire.Restored(step=40, fingerprint="f" * 64)
    clock.advance(0.5)
    beat(store, "worker-0", 1, restored=restored), beat(store, "worker-1", 1, restored=restored)
    sup.step()
    assert sup.status()["recoveries"][0]["complete"] is False  # under way: said as it stands
    clock.advance(0.75)
    beat(store, "worker-0", 1, step=41), beat(store, "worker-1", 1, step=41)
    sup.step()
    said = [e for e in sink.events if e["kind"] == "recovery"]
    assert [e["reason"] for e in said] == [
        "attempt 1 training again 4.5 s after worker-1 died: stop 0.2, wait 2.0, start 0.0, connect 1.0, "
        "restore 0.5, first step 0.8"
    ]
    [recovery] = sup.status()["recoveries"]
    assert (
        recovery["phases_s"]
        == {"stop": 0.25, "wait": 2.0, "start": 0.0, "connect": 1.0, "restore": 0.5, "first_step": 0.75}
        and recovery["training_again_s"] == 4.5
        and recovery["complete"] is True
    )
    sup.step()
    assert len([e for e in sink.events if e["kind"] == "recovery"]) == 1  # said once


def test_a_restart_that_fails_before_training_is_said_with_what_it_saw(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=1, backoff_s=0)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step(), sup.step()
    assert sup.state is ClusterState.LAUNCHING
    launcher.handles["worker-1"].code = 1  # attempt 1 dies before any task is up
    sup.step(), sup.step()
    assert sup.state is ClusterState.FAILED
    [line] = [e["reason"] for e in sink.events if e["kind"] == "recovery"]
    assert line.startswith("attempt 1 after worker-0 died: never up: stop 0.0, start 0.0, connect —")
    assert len(sup.status()["recoveries"]) == 1  # the failure of attempt 1 restarted nothing


def test_restart_budget_exhausted(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=2)
    for attempt in range(3):
        start_running(sup, launcher, store, clock, attempt=attempt)
        assert {("worker-0", attempt), ("worker-1", attempt)} <= set(launcher.started)  # every task, again
        launcher.handles["worker-0"].code = -9
        sup.step(), sup.step()
        clock.advance(5)
    assert sup.state is ClusterState.FAILED
    assert sup.reason == (
        "worker-0 was killed by SIGKILL (exit code -9); restart budget exhausted "
        "(2 of restart.max_restarts = 2 used)"
    )
    assert (sup.restarts, sup.attempt) == (2, 2)
    assert sup.status()["state"] == "FAILED" and sup.status()["restarts"] == 2


def test_preemption_restarts_outside_the_budget(tmp_path):
    # exit 42: TF's PreemptionCheckpointHandler saved a checkpoint (SIGTERM, maintenance, Slurm)
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=0)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-0"].code = wire.EXIT_PREEMPTED
    sup.step(), sup.step()
    assert sup.state is ClusterState.RESTARTING, sup.reason
    assert "preempted" in sup.reason and "not counted" in sup.reason
    assert sup.restarts == 0  # the budget of 0 is untouched
    clock.advance(1.01)
    start_running(sup, launcher, store, clock, attempt=1)
    launcher.handles["worker-0"].code = -9  # a real failure now meets the empty budget
    sup.step(), sup.step()
    assert sup.state is ClusterState.FAILED and "restart budget exhausted (0 of" in sup.reason


def test_the_result_carries_every_failed_attempt_and_task_as_data(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=1)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-1"].code = -9
    sup.step(), sup.step()
    clock.advance(5)
    start_running(sup, launcher, store, clock, attempt=1)
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step()
    result = sup.result()
    assert result.state is ClusterState.FAILED
    assert [(f.tasks, f.attempt) for f in result.failures] == [(("worker-1",), 0), (("worker-0",), 1)]
    assert result.failed_tasks == ("worker-1",)  # the first failure: its logs tell why


def test_a_startup_deadline_names_every_late_task_as_data(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, workers=3, max_restarts=0)
    sup.step()
    for _ in range(7):
        beat(store, "worker-0", connecting=True)
        beat(store, "worker-1")  # alive, never created their strategy
        beat(store, "worker-2")
        clock.advance(9)
        sup.step()
    assert sup.root_cause.tasks == ("worker-1", "worker-2")
    assert sup.root_cause.describe().startswith("worker-1, worker-2 not up within")


def test_a_job_that_never_creates_its_strategy_fails_at_the_deadline_without_a_restart(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=3)
    sup.step()
    for _ in range(7):  # both alive and reporting, neither ever creating a strategy
        beat(store, "worker-0")
        beat(store, "worker-1")
        clock.advance(9)
        sup.step()
    sup.step()
    assert sup.state is ClusterState.FAILED and sup.restarts == 0  # not the whole budget
    assert sup.root_cause.kind is FailureKind.NO_STRATEGY
    assert "not restarted" in sup.reason and "create it" in sup.reason


def test_a_task_that_ends_before_its_strategy_came_up_is_said(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path)
    sup.step()
    launcher.handles["worker-0"].code = 0  # a script that never created a strategy
    launcher.handles["worker-1"].code = 0
    sup.step()
    warnings = [e for e in sink.events if e["kind"] == "warning"]
    assert [w["task"] for w in warnings] == ["worker-0", "worker-1"]
    assert "without its distribution strategy ever coming up" in warnings[0]["reason"]
    run = [e for e in sink.events if e["kind"] == "run" and e["new"] == "RUNNING"]
    assert run and "worker-0, worker-1 exited without a distribution strategy" in run[0]["reason"]
    assert "every task's distribution strategy is up" not in run[0]["reason"]


class Firewalled(FakeBackend):
    """Two hosts that cannot reach each other: the backend's peer probe says so."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, ...]] = []

    def diagnose_startup(self, plan: LaunchPlan, late: Any) -> str | None:
        self.asked.append(tuple(late))
        return "peer probe: hosts[1] (10.79.0.12) cannot reach 10.79.0.11:23456 (worker-0): timed out"


def test_a_startup_deadline_carries_the_backends_finding(tmp_path):
    backend = Firewalled()
    sup, launcher, store, clock, sink = make(tmp_path, launcher=backend, max_restarts=0)
    sup.step()
    for _ in range(7):
        beat(store, "worker-0", connecting=True)  # both inside their strategy: never connected
        beat(store, "worker-1", connecting=True)
        clock.advance(9)
        sup.step()
    assert backend.asked == [("worker-0", "worker-1")]
    assert sup.root_cause.kind is FailureKind.STARTUP_TIMEOUT
    assert "(its cluster never connected); peer probe: hosts[1] (10.79.0.12) cannot reach" in sup.reason


def test_a_task_whose_exit_cannot_be_confirmed_is_recorded_as_data(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=0)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-1"].cut_off = True  # its host is gone: no signal, no exit
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step()
    assert sup.state is ClusterState.FAILED
    assert sup.result().unconfirmed == ("worker-1",)
    event = next(e for e in sink.events if e["kind"] == "unconfirmed")
    assert event["tasks"] == ["worker-1"] and "exit not confirmed" in event["reason"]


def test_heartbeat_timeout_marks_lost(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    start_running(sup, launcher, store, clock)
    clock.advance(9)
    beat(store, "worker-0", ready=True)
    sup.step()
    assert sup.state is ClusterState.RUNNING
    clock.advance(1.5)  # worker-1 silent for 10.6 s > 10 s
    sup.step()
    assert sup.tasks["worker-1"].state is TaskState.LOST
    assert sup.root_cause.kind is FailureKind.LOST and sup.root_cause.tasks == ("worker-1",)
    sup.step()
    assert sup.state is ClusterState.FAILED


def test_stall_detected_while_heartbeats_continue(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    start_running(sup, launcher, store, clock)
    for _ in range(4):
        beat(store, "worker-0", step=5)
        beat(store, "worker-1", step=5)
        clock.advance(8)
        sup.step()
    assert sup.state is ClusterState.STOPPING
    assert sup.root_cause.kind is FailureKind.STALLED and "step 5" in sup.root_cause.detail


def test_startup_deadline_names_the_task_that_never_connected(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    sup.step()
    for _ in range(7):
        beat(store, "worker-0", connecting=True)  # waits for its peer inside the strategy
        beat(store, "worker-1")  # alive, never created its strategy
        clock.advance(9)
        sup.step()
    assert sup.state is ClusterState.STOPPING
    cause = sup.root_cause
    assert cause.kind is FailureKind.STARTUP_TIMEOUT and cause.tasks == ("worker-1",)
    assert "worker-0 waited for it" in cause.detail


def test_launch_error_stops_started_tasks(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, launcher=FakeBackend(fail_start={"worker-1"}))
    sup.step()
    assert sup.state is ClusterState.STOPPING
    sup.step()
    assert sup.state is ClusterState.FAILED
    assert launcher.termed() == ["worker-0"] and launcher.released == ["worker-0"]
    assert sup.root_cause.kind is FailureKind.LAUNCH


def test_interrupt_then_clean_stop(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path)
    start_running(sup, launcher, store, clock)
    sup.request_stop("interrupted by SIGINT")
    assert not sup.hurry.is_set()
    sup.step()
    assert sup.state is ClusterState.STOPPING
    sup.request_stop("again")
    assert sup.hurry.is_set()  # a second Ctrl-C cuts the grace period short
    sup.step()
    assert sup.state is ClusterState.INTERRUPTED
    assert all(r.state is TaskState.STOPPED for r in sup.tasks.values())


@pytest.mark.parametrize("code", [1, -9])
def test_run_loop_terminates(tmp_path, code):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    launcher_handles = launcher.handles

    def sleep(_s: float) -> None:
        clock.advance(0.5)
        if "worker-0" in launcher_handles:
            launcher_handles["worker-0"].code = code

    sup._sleep = sleep
    result = sup.run()
    assert result.state is ClusterState.FAILED and result.root_cause.tasks == ("worker-0",)


def test_task_waiting_inside_its_strategy_is_not_lost_before_startup_deadline(tmp_path):
    # MWMS's constructor holds the GIL while waiting for peers: no heartbeats, but not lost.
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    sup.step()
    beat(store, "worker-0", connecting=True)
    beat(store, "worker-1", connecting=True)
    clock.advance(30)  # > heartbeat_timeout_s, < startup_timeout_s
    sup.step()
    assert sup.state is ClusterState.LAUNCHING
    assert all(r.state is TaskState.STARTING for r in sup.tasks.values())
    clock.advance(31)
    sup.step()
    assert sup.state is ClusterState.STOPPING and sup.root_cause.kind is FailureKind.STARTUP_TIMEOUT


def test_port_taken_between_attempts_gets_a_new_plan_before_relaunch(tmp_path):
    moved_plan = plan_of(tmp_path, SPEC.format(workers=2), {"worker-0": 20000, "worker-1": 20555})
    calls = []

    class Moving(FakeBackend):
        def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
            if attempt == 0:
                return Prepared()
            return Prepared(moved={"worker-1": Placement("127.0.0.1", 20555, "", ("python",), "", "")})

    def replan(moved):
        calls.append((sup.attempt, {name: p.port for name, p in moved.items()}))
        return moved_plan

    sup, launcher, store, clock, sink = make(tmp_path, launcher=Moving())
    sup._replan = replan
    start_running(sup, launcher, store, clock)
    assert calls == []  # nothing moved before the first attempt
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step()
    clock.advance(5)
    sup.step()
    assert calls == [(1, {"worker-1": 20555})]
    assert launcher.handles["worker-1"].task.port == 20555  # relaunched with the new plan
    assert "20555" in launcher.handles["worker-0"].task.env["TF_CONFIG"]  # and every peer knows it
    assert any(
        e["kind"] == "port"
        and e["reason"] == "port 20001 of worker-1 is in use by another program; moved to 20555"
        for e in sink.events
    )


def test_exception_after_a_restart_is_retried_once_then_permanent_at_the_same_step(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=5)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-0"].code = -9  # attempt 0: a crash, retried
    sup.step(), sup.step()
    clock.advance(5)
    for attempt, expected in ((1, ClusterState.RESTARTING), (2, ClusterState.FAILED)):
        start_running(sup, launcher, store, clock, attempt=attempt)
        beat(store, "worker-1", attempt, step=40, error=TaskError("OSError", "bad record 40", ""))
        launcher.handles["worker-1"].code = 1
        sup.step(), sup.step()
        assert sup.state is expected, sup.reason
        clock.advance(10)
    assert "again at step 40" in sup.reason and "not restarted" in sup.reason
    assert [f.kind for f in sup.failures] == [FailureKind.EXIT, FailureKind.EXCEPTION, FailureKind.EXCEPTION]


def test_survivors_peer_loss_blames_the_silent_frozen_peer(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, heartbeat_interval_s=0.5, heartbeat_timeout_s=10)
    start_running(sup, launcher, store, clock)
    clock.advance(2.0)  # worker-1 frozen: silent since; worker-0 keeps beating, then loses its peer
    peer_loss = TaskError(
        "tensorflow.python.framework.errors_impl.UnavailableError", "task 1 unreachable", ""
    )
    beat(store, "worker-0", step=9, error=peer_loss)
    launcher.handles["worker-0"].code = 1
    sup.step()
    assert sup.root_cause.tasks == ("worker-1",) and sup.root_cause.kind is FailureKind.LOST
    assert sup.tasks["worker-1"].state is TaskState.LOST


def test_of_two_stalled_tasks_the_one_busy_in_its_own_code_is_the_cause(tmp_path):
    sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0)
    start_running(sup, launcher, store, clock)
    for _ in range(5):
        beat(store, "worker-0", step=7)  # waiting for its peer inside a collective
        beat(store, "worker-1", step=7, user_frame="train.py:23 in wait")
        clock.advance(8)
        sup.step()
    assert sup.root_cause.tasks == ("worker-1",)
    assert "busy in train.py:23 in wait" in sup.root_cause.detail


# ---------------------------------------------------------------- per-role policy (parameter_server)

PS_SPEC = """
name: t
strategy: parameter_server
hosts:
  - address: 127.0.0.1
    tasks: {chief: 1, worker: 2, ps: 1, evaluator: 1}
job:
  script: job.py
health: {final_wait_s: 20}
"""

PS_TASKS = ("chief-0", "worker-0", "worker-1", "ps-0", "evaluator-0")


def make_ps(tmp_path: Path, **cfg: Any):
    plan = plan_of(tmp_path, PS_SPEC, {name: 20000 + i for i, name in enumerate(PS_TASKS)})
    clock, launcher, sink = FakeClock(), FakeBackend(), Sink()
    store = HealthStore(clock)
    config = SupervisorConfig(
        **{
            "heartbeat_timeout_s": 10,
            "max_restarts": 2,
            "backoff_s": 1,
            "poll_interval_s": 0,
            "final_wait_s": 20,
            **cfg,
        }
    )
    sup = Supervisor(
        plan,
        launcher,
        store,
        sink,
        lambda task, attempt: "tok",
        config,
        clock=clock,
        sleep=clock.advance,
        in_background=at_once,
    )
    return sup, launcher, store, clock, sink


def ps_running(sup, store, clock) -> None:
    sup.step()  # launch
    for name in PS_TASKS:
        beat(store, name, ready=True)
    sup.step()
    assert sup.state is ClusterState.RUNNING


def test_ps_worker_failure_restarts_that_worker_alone(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    launcher.handles["worker-1"].code = -9
    sup.step()
    assert sup.state is ClusterState.RUNNING  # the job goes on
    assert sup.tasks["worker-1"].state is TaskState.FAILED
    assert launcher.released == ["worker-1"] and launcher.termed() == []  # only it (already dead)
    assert any(e.get("kind") == "task_restart" and e["task"] == "worker-1" for e in sink.events)
    sup.step()
    assert ("worker-1", 0) in launcher.started and launcher.started.count(("worker-1", 0)) == 1  # not yet
    clock.advance(1.0)  # restart.backoff_s
    sup.step()
    assert launcher.started.count(("worker-1", 0)) == 2
    assert (
        sup.tasks["worker-1"].state is TaskState.STARTING
        and "restarted alone" in sup.tasks["worker-1"].reason
    )
    assert sup.restarts == 0 and sup.attempt == 0  # no whole-job restart


def test_stopping_one_task_never_holds_up_the_other_detectors(tmp_path: Path) -> None:
    # worker-1 froze (only SIGKILL ends it): its stop takes the whole grace period, on its own
    # thread; meanwhile the supervisor keeps stepping and sees ps-0 die.
    sup, launcher, store, clock, sink = make_ps(tmp_path, failure_grace_s=1.5)
    sup._in_background = stop_in_background  # the real one: a thread
    ps_running(sup, store, clock)
    frozen = launcher.handles["worker-1"]
    frozen.ignores_term = True
    clock.advance(11)  # worker-1 silent past heartbeat_timeout_s; the others beat on
    for name in PS_TASKS:
        if name != "worker-1":
            beat(store, name)
    sup.step()
    stopping = sup.tasks["worker-1"].stopping
    assert stopping is not None and not stopping.done()  # the step returned while it is stopped
    launcher.handles["ps-0"].code = -9
    sup.step()
    assert sup.state is ClusterState.STOPPING and sup.reason.startswith("ps-0 ")
    assert not stopping.done()
    sup.step()  # the teardown waits for the stop in flight, then stops the rest
    assert stopping.done() and frozen.code == -9
    assert sup.state is ClusterState.RESTARTING


def test_a_task_restarts_alone_only_once_its_stop_is_done(tmp_path: Path) -> None:
    pending: list[Future[Any]] = []

    def later(handles: list[TaskHandle], grace_s: float, hurry: threading.Event) -> Future[Any]:
        pending.append(Future())
        return pending[-1]

    sup, launcher, store, clock, sink = make_ps(tmp_path)
    sup._in_background = later
    ps_running(sup, store, clock)
    launcher.handles["worker-1"].code = -9
    sup.step()
    clock.advance(5)  # the backoff is over, but the stop is not done
    sup.step()
    assert launcher.started.count(("worker-1", 0)) == 1
    pending[0].set_result([])
    sup.step()
    assert launcher.started.count(("worker-1", 0)) == 2


def test_a_task_restarted_alone_as_the_startup_deadline_passes(tmp_path: Path) -> None:
    # the restart and the deadline in one iteration: the restarted task was not in that
    # iteration's poll, and is named among the late ones all the same
    sup, launcher, store, clock, sink = make_ps(tmp_path, startup_timeout_s=20, heartbeat_timeout_s=30)
    sup.step()  # launching
    launcher.handles["worker-1"].code = -9
    sup.step()  # its restart is due in restart.backoff_s
    for name in PS_TASKS:
        beat(store, name)  # alive, none of them up
    clock.advance(21)
    sup.step()
    assert launcher.started.count(("worker-1", 0)) == 2
    assert sup.state is ClusterState.STOPPING and sup.root_cause is not None
    assert sup.root_cause.kind is FailureKind.STARTUP_TIMEOUT
    assert "worker-1" in sup.root_cause.tasks


def test_ps_worker_that_keeps_failing_exhausts_its_own_budget(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path, max_restarts=1)
    ps_running(sup, store, clock)
    launcher.handles["worker-0"].code = 1
    sup.step()
    clock.advance(5)
    sup.step()  # restarted alone (1 of 1)
    launcher.handles["worker-0"].code = 1
    sup.step()
    assert sup.state is ClusterState.STOPPING
    assert "its own restart budget is exhausted" in sup.reason


def test_ps_failure_restarts_the_whole_job(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    launcher.handles["ps-0"].code = -9
    sup.step()
    assert sup.state is ClusterState.STOPPING and sup.reason.startswith("ps-0 ")
    sup.step()
    assert sup.state is ClusterState.RESTARTING and sup.restarts == 1


def test_evaluator_failure_is_reported_and_ignored(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    beat(store, "evaluator-0", error=TaskError("ValueError", "no eval data", ""), done=True)
    launcher.handles["evaluator-0"].code = 1
    sup.step()
    assert sup.state is ClusterState.RUNNING
    assert sup.tasks["evaluator-0"].state is TaskState.FAILED
    assert [f.tasks for f in sup.ignored] == [("evaluator-0",)]
    assert any(e.get("kind") == "warning" and "(ignored)" in e["reason"] for e in sink.events)


def test_chief_success_waits_for_the_evaluator_then_stops_servers(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    launcher.handles["chief-0"].code = 0
    sup.step()
    assert sup.state is ClusterState.RUNNING  # the evaluator is still scoring the last checkpoint
    assert any("waiting up to 20 s for evaluator-0" in e.get("reason", "") for e in sink.events)
    clock.advance(5)
    launcher.handles["evaluator-0"].code = 0
    sup.step()
    assert sup.state is ClusterState.STOPPING and sup.reason == "chief-0 exited 0"
    sup.step()
    assert sup.state is ClusterState.SUCCEEDED
    assert {n: sup.tasks[n].state for n in ("worker-0", "worker-1", "ps-0")} == dict.fromkeys(
        ("worker-0", "worker-1", "ps-0"), TaskState.STOPPED
    )


def test_servers_stuck_in_join_are_stopped_without_waiting_out_the_grace(tmp_path: Path) -> None:
    # a ps and workers in server.join(): blocked in C++, Python never sees SIGTERM; they save nothing
    sup, launcher, store, clock, sink = make_ps(tmp_path, stop_grace_s=30)
    ps_running(sup, store, clock)
    for name in ("worker-0", "worker-1", "ps-0"):
        launcher.handles[name].ignores_term = True
    launcher.handles["evaluator-0"].code = 0
    launcher.handles["chief-0"].code = 0
    sup.step()
    assert sup.state is ClusterState.STOPPING
    before, started = clock.now, time.monotonic()
    sup.step()  # the teardown, on the supervisor's clock (stop_all takes it)
    assert sup.state is ClusterState.SUCCEEDED
    assert QUICK_GRACE_S <= clock.now - before < QUICK_GRACE_S + 0.5  # the servers' grace, not the 30 s
    assert time.monotonic() - started < 1.0  # and no real time waited
    assert {n: launcher.handles[n].code for n in ("worker-0", "worker-1", "ps-0")} == dict.fromkeys(
        ("worker-0", "worker-1", "ps-0"), -9
    )


def test_an_evaluator_that_never_ends_is_stopped_after_final_wait(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path)
    ps_running(sup, store, clock)
    launcher.handles["chief-0"].code = 0
    sup.step()
    clock.advance(21)
    beat(store, "evaluator-0")  # alive, so not lost, just slow
    for name in ("worker-0", "worker-1", "ps-0"):
        beat(store, name)
    sup.step()
    assert sup.state is ClusterState.STOPPING
    assert "evaluator-0 still running after health.final_wait_s = 20" in sup.reason
    sup.step()
    assert sup.state is ClusterState.SUCCEEDED and sup.tasks["evaluator-0"].state is TaskState.STOPPED


def test_an_evaluator_waiting_for_checkpoints_is_not_stalled(tmp_path: Path) -> None:
    sup, launcher, store, clock, sink = make_ps(tmp_path, stall_timeout_s=30)
    ps_running(sup, store, clock)
    beat(store, "evaluator-0", step=20)
    for _ in range(4):  # 80 s without a new checkpoint, heartbeats flowing
        clock.advance(20)
        for name in PS_TASKS:
            beat(store, name, step=20 if name == "evaluator-0" else None)
        sup.step()
    assert sup.state is ClusterState.RUNNING and sup.tasks["evaluator-0"].state is TaskState.RUNNING


def test_exit_codes_are_described_for_people():
    from orchestrator.supervise.records import describe_exit
    from worker import wire

    assert describe_exit(-9) == "was killed by SIGKILL (exit code -9)"
    assert describe_exit(3) == "exited with code 3"
    assert "cut off from the coordinator" in describe_exit(wire.EXIT_NO_COORDINATOR)


# --- every training task starts an attempt from the same state (hosts that share no disk) ---

RESTORED = {"step": 75, "fingerprint": "a1b2c3d4e5f60718", "source": "/h0/checkpoints/ckpt-75"}


def test_tasks_restoring_different_states_fail_the_job_at_once_and_are_not_restarted(tmp_path):
    from worker.wire import Restored

    sup, launcher, store, clock, sink = make(tmp_path)
    start_running(sup, launcher, store, clock)
    beat(store, "worker-0", restored=Restored(**RESTORED))
    sup.step()
    assert sup.state is ClusterState.RUNNING  # one report: nothing to compare yet
    beat(store, "worker-1", restored=Restored(step=0, fingerprint="ffff000011112222"))
    sup.step()
    assert sup.state is ClusterState.STOPPING
    cause = sup.root_cause
    assert cause is not None and cause.kind is FailureKind.DIVERGED and cause.tasks == ("worker-1",)
    # says which task restored what, and why it matters
    assert "worker-0 restored /h0/checkpoints/ckpt-75 at step 75" in cause.detail
    assert "worker-1 restored no checkpoint (fresh weights, state ffff000011112222)" in cause.detail
    assert "different models" in cause.detail
    while not sup.state.is_terminal:
        sup.step()
    assert sup.state is ClusterState.FAILED and sup.restarts == 0  # never restarted, never trained on
    assert "not restarted" in sup.reason


def test_tasks_restoring_the_same_state_train_on(tmp_path):
    from worker.wire import Restored

    sup, launcher, store, clock, sink = make(tmp_path)
    start_running(sup, launcher, store, clock)
    for name in ("worker-0", "worker-1"):
        beat(store, name, restored=Restored(**RESTORED))
    sup.step()
    assert sup.state is ClusterState.RUNNING and sup.root_cause is None
    status = sup.status()["tasks"]
    assert [t["restored"]["step"] for t in status] == [75, 75]  # status.json shows each task's start


def test_the_jobs_own_folders_are_learned_and_a_start_that_diverges_before_them_is_tried_once_more(tmp_path):
    """The tutorial case (issue 24): the owner tells its BackupAndRestore folder; a start that
    diverged while it was new is restarted once (the next attempt has the folder on every host
    first); diverging again with nothing new fails, never retried blindly."""
    from worker.wire import Restored

    class Planned(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.folders: list[tuple[str, ...]] = []

        def before_attempt(self, plan: Any, attempt: int) -> Prepared:
            self.folders.append(plan.state.job_folders)
            return Prepared()

    sup, launcher, store, clock, sink = make(tmp_path, launcher=Planned())
    told = {
        "/tmp/backup": "tf_keras.callbacks.BackupAndRestore",
        "/tmp/backup/chief": "tf.train.CheckpointManager",
    }
    chief = Restored(
        step=0, fingerprint="0f3c0f3c0f3c0f3c", source="/tmp/backup/chief/ckpt-2", epoch=1, step_in_epoch=30
    )
    nothing = Restored(step=0, fingerprint="nothing")
    for attempt in (0, 1):
        if attempt:
            clock.advance(60)
        start_running(sup, launcher, store, clock, attempt)
        beat(store, "worker-0", attempt, folders=told, restored=chief)
        beat(store, "worker-1", attempt, restored=nothing)
        sup.step()
        while sup.state is ClusterState.STOPPING:
            sup.step()
    assert launcher.folders == [(), ("/tmp/backup",)]  # the next attempt's plan has it
    said = [e["reason"] for e in sink.events if e.get("kind") == "checkpoints"]
    assert said == [
        "worker-0 checkpoints to /tmp/backup (tf_keras.callbacks.BackupAndRestore): kept the same on every "
        "host that has a disk of its own before each attempt",
        "worker-0 checkpoints to /tmp/backup/chief (tf.train.CheckpointManager): kept the same on every "
        "host that has a disk of its own before each attempt",
    ]
    assert sup.state is ClusterState.FAILED and sup.restarts == 1, sup.reason
    assert (
        "worker-0 restored /tmp/backup/chief/ckpt-2 at epoch 1 batch 30; worker-1 restored nothing"
        in sup.reason
    )
    assert sup.reason.endswith("not restarted")
    assert sup.status()["checkpoint_folders"] == ["/tmp/backup", "/tmp/backup/chief"]


def test_a_failure_to_ship_state_before_a_restart_is_a_launch_failure_of_that_attempt(tmp_path):
    class Shipping(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.attempts: list[int] = []

        def before_attempt(self, plan: Any, attempt: int) -> Prepared:
            self.attempts.append(attempt)
            if attempt == 1:
                raise LaunchError("hosts[1] 10.0.0.2: no room for the checkpoint in /w/checkpoints")
            return Prepared(notes=[f"attempt {attempt}: checkpoint copied"] if attempt else [])

    launcher = Shipping()
    sup, launcher, store, clock, sink = make(tmp_path, launcher=launcher)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-1"].code = -9
    while sup.state is not ClusterState.RESTARTING:
        sup.step()
    clock.advance(5)
    sup.step()  # attempt 1: shipping fails, no task starts
    assert launcher.started.count(("worker-0", 1)) == 0
    assert sup.state is ClusterState.STOPPING and "no room for the checkpoint" in sup.reason
    while sup.state is not ClusterState.RESTARTING:  # by policy: a launch failure after a restart
        sup.step()
    clock.advance(5)
    sup.step()  # attempt 2 ships and starts
    assert launcher.attempts == [0, 1, 2] and ("worker-0", 2) in launcher.started
    assert any(e.get("reason") == "attempt 2: checkpoint copied" for e in sink.events)


def test_what_the_backend_runs_in_taken_away_from_outside_ends_the_run_interrupted(tmp_path: Path) -> None:
    class Revocable(FakeBackend):
        why: str | None = None

        def ended_outside(self) -> str | None:
            return self.why

    sup, launcher, store, clock, _ = make(tmp_path, launcher=Revocable())
    start_running(sup, launcher, store, clock)
    sup.step()
    assert sup.state is ClusterState.RUNNING
    launcher.why = "the allocation (Slurm job 7) ended from outside: revoked"
    launcher.handles["worker-0"].code = -15  # Slurm's SIGTERM reached the task as well
    for _ in range(3):
        sup.step()
    assert sup.state is ClusterState.INTERRUPTED
    assert sup.reason == launcher.why and sup.restarts == 0


class StandbyBackend(FakeBackend):
    """Records when the supervisor asks for standbys; has news to tell once."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[int] = []  # the tasks started when asked
        self.news = ["the standby of worker-1 on hosts[1] could not import TensorFlow: no libcudart"]

    def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
        self.prepared.append(len(self.started))
        return ["warm standbys started for worker-0, worker-1"]

    def standby_news(self) -> list[str]:
        news, self.news = self.news, []
        return news


def test_standbys_are_asked_for_once_the_attempt_trains_and_their_news_is_said(tmp_path):
    launcher = StandbyBackend()
    sup, launcher, store, clock, sink = make(tmp_path, launcher=launcher)
    assert sup.step()[1] is ClusterState.LAUNCHING
    for name in sup.tasks:
        beat(store, name, ready=True)
    sup.step()
    assert sup.state is ClusterState.RUNNING
    assert launcher.prepared == []  # not while the attempt starts and traces its first step
    beat(store, "worker-0", step=1), beat(store, "worker-1", step=1)
    sup.step()
    assert len(launcher.prepared) == 1
    said = [e["reason"] for e in sink.events if e["kind"] == "standby"]
    assert said == [
        "the standby of worker-1 on hosts[1] could not import TensorFlow: no libcudart",
        "warm standbys started for worker-0, worker-1",
    ]
    sup.step()
    assert len(launcher.prepared) == 1  # once per attempt


def test_standbys_of_a_job_that_reports_no_step_come_a_while_after_it_is_up(tmp_path):
    launcher = StandbyBackend()
    sup, launcher, store, clock, sink = make(tmp_path, launcher=launcher)
    start_running(sup, launcher, store, clock)
    for seconds in (5.0, 4.0, 1.5):
        clock.advance(seconds)
        beat(store, "worker-0"), beat(store, "worker-1")  # alive, no step
        sup.step()
        assert sup.state is ClusterState.RUNNING
        assert launcher.prepared == ([] if seconds != 1.5 else [2])


def test_a_backend_whose_standbys_fail_to_start_does_not_stop_the_run(tmp_path):
    class Broken(FakeBackend):
        def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
            raise OSError("fork: Cannot allocate memory")

    sup, launcher, store, clock, sink = make(tmp_path, launcher=Broken())
    start_running(sup, launcher, store, clock)
    beat(store, "worker-0", step=1), beat(store, "worker-1", step=1)
    sup.step()
    assert sup.state is ClusterState.RUNNING
    assert [e["reason"] for e in sink.events if e["kind"] == "standby"] == [
        "warm standbys: OSError: fork: Cannot allocate memory"
    ]


def test_a_restart_after_a_host_was_cut_off_waits_its_backoff_even_after_progress(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path, backoff_s=2)
    start_running(sup, launcher, store, clock)
    beat(store, "worker-0", step=3), beat(store, "worker-0", step=9)  # it trained
    launcher.handles["worker-1"].cut_off = True  # its host is gone: its exit cannot be confirmed
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step()
    assert sup.state is ClusterState.RESTARTING and sup.reason.endswith(", in 2 s"), sup.reason
    assert sup.unconfirmed == ["worker-1"]


def test_a_task_stopping_alone_whose_exit_is_in_doubt_makes_the_job_restart_wait_too(tmp_path):
    sup, launcher, store, clock, sink = make_ps(tmp_path, backoff_s=2, heartbeat_timeout_s=3)
    ps_running(sup, store, clock)
    launcher.handles["worker-1"].cut_off = True  # its host is gone
    clock.advance(4)
    for name in PS_TASKS:
        if name != "worker-1":
            beat(store, name, step=5)
    sup.step()  # worker-1 lost: restarted alone, its exit never confirmed
    assert sup.tasks["worker-1"].restart_at is not None
    beat(store, "chief-0", step=9)  # the job trained
    launcher.handles["chief-0"].code = -9
    sup.step(), sup.step()
    assert sup.state is ClusterState.RESTARTING and sup.reason.endswith(", in 2 s"), sup.reason
    assert sup.unconfirmed == ["worker-1"]


def test_a_restart_whose_attempt_ends_before_any_step_is_said_when_the_run_ends(tmp_path):
    """A job that reports no step: its restart's timeline ends with the run, with what it saw."""
    sup, launcher, store, clock, sink = make(tmp_path, backoff_s=0)
    start_running(sup, launcher, store, clock)
    launcher.handles["worker-0"].code = -9
    sup.step(), sup.step()
    start_running(sup, launcher, store, clock, attempt=1)
    launcher.handles["worker-0"].code = launcher.handles["worker-1"].code = 0
    sup.step(), sup.step()
    assert sup.state is ClusterState.SUCCEEDED
    [said] = [e["reason"] for e in sink.events if e["kind"] == "recovery"]
    assert said.startswith("attempt 1 up 0.1 s after worker-0 died (no step reported): stop 0.0")
    assert said.endswith("restore —, first step —")
    assert sup.status()["recoveries"][0]["complete"] is True


class FallingBack(FakeBackend):
    """Tells fallbacks as a local backend does: pasta ended and started again, then for good."""

    def __init__(self) -> None:
        super().__init__()
        self.news: list[Degraded] = []

    def degraded(self) -> list[Degraded]:
        news, self.news = self.news, []
        return news


def test_a_fallback_is_said_once_listed_while_it_lasts_and_a_passing_one_is_an_event_alone(tmp_path):
    launcher = FallingBack()
    sup, launcher, store, clock, sink = make(tmp_path, launcher=launcher)
    names = Degraded("names", "this machine", "names are not resolved", "fix the resolver")
    sup.degrade(names)
    sup.degrade(names)  # the same again: nothing new
    start_running(sup, launcher, store, clock)
    again = Degraded(
        "outbound", "this machine", "pasta ended and was started again", "its log", "t1", lasting=False
    )
    offline = Degraded("outbound", "this machine", "offline since 12:00:00 UTC", "resume", "t2")
    launcher.news = [again]
    sup.step()
    assert [d.what for d in sup.degraded] == ["names"]  # a passing one is not listed
    launcher.news = [offline]
    sup.step()
    said = [(e["what"], e["reason"]) for e in sink.events if e["kind"] == "degraded"]
    assert said == [
        ("names", "names are not resolved (hint: fix the resolver)"),
        ("outbound", "pasta ended and was started again (hint: its log)"),
        ("outbound", "offline since 12:00:00 UTC (hint: resume)"),
    ]
    assert sup.status()["degraded"] == [names.to_json(), offline.to_json()]
    assert "lasting" not in sup.status()["degraded"][0]


def test_a_task_dropping_metric_names_is_said_once_and_counted_in_status(tmp_path):
    sup, launcher, store, clock, sink = make(tmp_path)
    start_running(sup, launcher, store, clock)
    for count in (1, 2950):
        beat(
            store,
            "worker-0",
            step=count,
            metrics={"loss": 1.0},
            dropped=wire.Dropped(count, "loss_64", "over 64 metric names"),
        )
        sup.step()
    said = [e["reason"] for e in sink.events if e["kind"] == "warning"]
    assert said == [
        "worker-0: 1 of 2 metric names kept, the rest dropped: first dropped `loss_64` (over 64 metric names)"
    ]
    row = next(t for t in sup.status()["tasks"] if t["task"] == "worker-0")
    assert row["metrics_dropped"] == {"count": 2950, "first": "loss_64", "why": "over 64 metric names"}
