"""The supervisor before a later attempt: the backend's machines, the policy's layout, the plan made
again with a lost host's tasks moved or left out (supervise/hosts.py), stepped with fakes."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.health.store import HealthStore
from orchestrator.launch.ssh.placement import ssh_preview
from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.plan.placement import Machine, Relaid
from orchestrator.spec.load import parse_spec
from orchestrator.states import ClusterState, FailureKind
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.supervisor import Supervisor
from tests.unit.test_supervisor import FakeBackend, FakeClock, Sink, at_once, beat, start_running

SPEC = """
name: t
backend: ssh
hosts:
  - {address: 10.0.0.1, tasks: {worker: 1}}
  - {address: 10.0.0.2, tasks: {worker: 1}}
  - {address: 10.0.0.3, tasks: {worker: 1}}
job:
  script: job.py
restart: {shrink: true, min_workers: 2}
"""


class Machines(FakeBackend):
    """Hosts that can be lost: a task cut off makes its host lost."""

    def __init__(self, fail_relayout: bool = False) -> None:
        super().__init__()
        self.asked: list[dict[str, tuple[str, str | None]]] = []
        self.laid: list[dict[int, str | None]] = []
        self.fail_relayout = fail_relayout
        self.spec = None
        self.runs: dict[int, int | None] = {}

    def machines(self, plan: LaunchPlan, suspects: Mapping[str, tuple[str, str | None]]) -> list[Machine]:
        self.asked.append(dict(suspects))
        lost = {plan.task(name).host_index for name in suspects}
        at = {self.runs.get(p, p): p for p in range(3) if self.runs.get(p, p) is not None}
        return [
            Machine(str(i), f"10.0.0.{i + 1}", at.get(i), "unreachable" if i in lost else None, "12:00:00")
            for i in range(3)
        ]

    def relayout(self, machines: Mapping[int, str | None]) -> Relaid:
        self.laid.append(dict(machines))
        if self.fail_relayout:
            raise LaunchError("no way")
        self.runs = {p: None if k is None else int(k) for p, k in machines.items()}
        laid = self.spec.laid_out(self.runs)
        return Relaid(self.runs, ssh_preview(laid, "t-1"))


def make(tmp_path: Path, backend: Machines):
    (tmp_path / "job.py").write_text("")
    spec = parse_spec(SPEC, file="s.yaml", base_dir=tmp_path)
    backend.spec = spec
    clock = FakeClock()
    store = HealthStore(clock)
    config = SupervisorConfig(
        heartbeat_timeout_s=10,
        stall_timeout_s=30,
        startup_timeout_s=60,
        max_restarts=2,
        backoff_s=1,
        poll_interval_s=0,
    )
    sink = Sink()

    def replan(moved, runs=None):
        return make_plan(spec.laid_out(runs) if runs is not None else spec, "t-1", moved)

    sup = Supervisor(
        make_plan(spec, "t-1", ssh_preview(spec, "t-1")),
        backend,
        store,
        sink,
        lambda task, attempt: "tok",
        config,
        clock=clock,
        sleep=clock.advance,
        in_background=at_once,
        replan=replan,
        spec=spec,
    )
    return sup, store, clock, sink


def cut_off(sup: Supervisor, backend: Machines, store: HealthStore, clock: FakeClock, name: str) -> None:
    """`name`'s host is cut off: it is lost (no heartbeat), its end never confirmed; the job restarts."""
    backend.handles[name].cut_off = True
    for _ in range(12):
        clock.advance(1)
        for other in sup.tasks:
            if other != name:
                beat(store, other, sup.attempt, step=5)
        sup.step()
        if sup.state is ClusterState.RESTARTING:
            break
    assert sup.state is ClusterState.RESTARTING, sup.reason
    clock.advance(5)
    sup.step()


def test_a_lost_host_is_left_out_and_the_tasks_renumbered(tmp_path: Path) -> None:
    backend = Machines()
    sup, store, clock, sink = make(tmp_path, backend)
    start_running(sup, backend, store, clock)
    assert backend.asked == []  # the first attempt asks nothing
    cut_off(sup, backend, store, clock, "worker-1")
    assert sup.attempt == 1 and sup.state is ClusterState.LAUNCHING
    assert list(backend.asked[0]) == ["worker-1"] and backend.asked[0]["worker-1"][0] == "unreachable"
    assert backend.laid == [{0: "0", 1: None, 2: "2"}]
    assert [(t.name, t.host) for t in sup.plan.tasks] == [("worker-0", "10.0.0.1"), ("worker-1", "10.0.0.3")]
    assert list(sup.tasks) == ["worker-0", "worker-1"]
    assert backend.started[-2:] == [("worker-0", 1), ("worker-1", 1)]
    assert '"worker":["10.0.0.1:23456","10.0.0.3:23456"]' in backend.handles["worker-1"].task.env["TF_CONFIG"]
    said = [e["reason"] for e in sink.events if e["kind"] == "hosts"]
    assert said == [
        "attempt 1: worker-1 left out with 10.0.0.2 (unreachable since 12:00:00): no spare host is left; the "
        "job runs on 2 workers (the last attempt's worker-2 is worker-1 now)"
    ]
    status = sup.status()
    assert [a["workers"] for a in status["attempts"]] == [3, 2]
    assert status["attempts"][1]["changes"] == said
    assert [(m["host"], m["state"], m["tasks"]) for m in status["machines"]] == [
        ("10.0.0.1", "in use", ["worker-0"]),
        ("10.0.0.2", "lost", []),
        ("10.0.0.3", "in use", ["worker-1"]),
    ]
    # the attempt trains on two
    for name in sup.tasks:
        beat(store, name, 1, ready=True)
    sup.step()
    assert sup.state is ClusterState.RUNNING


def test_a_layout_the_backend_cannot_make_fails_the_attempt_as_a_launch(tmp_path: Path) -> None:
    backend = Machines(fail_relayout=True)
    sup, store, clock, sink = make(tmp_path, backend)
    start_running(sup, backend, store, clock)
    cut_off(sup, backend, store, clock, "worker-2")
    assert sup.state is ClusterState.STOPPING
    assert sup.failures[-1].kind is FailureKind.LAUNCH
    assert "moving the tasks of a lost host: no way" in sup.failures[-1].detail
