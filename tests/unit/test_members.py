"""The policy of lost hosts (supervise/members.py), one decision at a time, and the layouts it makes
(`ClusterSpec.laid_out`: TF_CONFIG rebuilt, tasks renumbered)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from orchestrator.launch.ssh.placement import ssh_preview
from orchestrator.plan.launch_plan import make_plan
from orchestrator.plan.placement import Machine
from orchestrator.spec import ClusterSpec, parse_spec
from orchestrator.spec.roles import task_slots
from orchestrator.supervise.members import Snapshot, decide, names


def spec_of(
    tmp_path: Path, hosts: str, restart: str = "", strategy: str = "multi_worker_mirrored"
) -> ClusterSpec:
    (tmp_path / "loop.py").write_text("")
    text = (
        f"name: demo\nstrategy: {strategy}\nbackend: ssh\nhosts:\n"
        + textwrap.indent(textwrap.dedent(hosts).strip("\n"), "  ")
        + "\njob: {loop: loop.py}\ntrain: {steps: 10, global_batch_size: 12}\n"
        + (f"restart: {restart}\n" if restart else "")
    )
    return parse_spec(text, file="spec.yaml", base_dir=tmp_path)


THREE_AND_SPARE = """
- {address: 10.0.0.11, tasks: {worker: 1}}
- {address: 10.0.0.12, tasks: {worker: 1}}
- {address: 10.0.0.13, tasks: {worker: 1}}
- {address: 10.0.0.14, spare: true}
"""


def runs(machines: dict[int, str | None]) -> dict[int, int | None]:
    """A layout's machines (ssh: a host's index) as `ClusterSpec.laid_out` takes them."""
    return {p: None if key is None else int(key) for p, key in machines.items()}


def machines(
    spec: ClusterSpec, lost: dict[int, str] | None = None, at: dict[int, int | None] | None = None
) -> tuple[Machine, ...]:
    """Every host as a machine: `at` says which spec host each runs (default: its own; spares none)."""
    lost = lost or {}
    where = at if at is not None else {i: (None if h.spare else i) for i, h in enumerate(spec.hosts)}
    return tuple(
        Machine(str(i), h.address, where.get(i), lost.get(i), "14:02:11" if i in lost else None)
        for i, h in enumerate(spec.hosts)
    )


def test_a_lost_host_moves_to_the_spare_with_its_names(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, THREE_AND_SPARE)
    layout = decide(Snapshot(2, spec, machines(spec, {1: "unreachable"})))
    assert layout.machines == {0: "0", 1: "3", 2: "2"}
    assert layout.changed and layout.workers == 3
    assert layout.lines == (
        "attempt 2: worker-1 moved from 10.0.0.12 (unreachable since 14:02:11) to the spare 10.0.0.14",
    )
    moved = spec.laid_out(runs(layout.machines))
    slots = {s.name: s.host_index for s in task_slots(moved)}
    assert slots == {"worker-0": 0, "worker-1": 3, "worker-2": 2}
    plan = make_plan(moved, "r", ssh_preview(moved, "r"))
    cluster = json.loads(plan.task("worker-1").env["TF_CONFIG"])["cluster"]
    assert cluster["worker"] == ["10.0.0.11:23456", "10.0.0.14:23456", "10.0.0.13:23456"]


def test_nothing_lost_changes_nothing(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, THREE_AND_SPARE)
    layout = decide(Snapshot(1, spec, machines(spec)))
    assert not layout.changed and layout.lines == () and layout.workers == 3


def test_without_a_spare_or_shrink_the_lost_host_is_tried_again(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, THREE_AND_SPARE)
    # the spare took hosts[1]'s tasks last time, and is lost now too
    lost = machines(
        spec, {1: "unreachable", 3: "its probe failed: timed out"}, at={0: 0, 1: None, 2: 2, 3: 1}
    )
    layout = decide(Snapshot(3, spec, lost))
    assert layout.machines == {0: "0", 1: "3", 2: "2"} and not layout.changed
    assert "restart.shrink is off: tried there again" in layout.lines[0]
    assert "10.0.0.14 (its probe failed: timed out since 14:02:11) is lost" in layout.lines[0]


def test_shrink_leaves_the_lost_host_out_and_renumbers(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path, THREE_AND_SPARE.replace("- {address: 10.0.0.14, spare: true}\n", ""), "{shrink: true}"
    )
    layout = decide(Snapshot(1, spec, machines(spec, {1: "unreachable"})))
    assert layout.machines == {0: "0", 1: None, 2: "2"} and layout.workers == 2
    assert layout.lines == (
        "attempt 1: worker-1 left out with 10.0.0.12 (unreachable since 14:02:11): no spare host is "
        "left; the job runs on 2 workers (the last attempt's worker-2 is worker-1 now)",
    )
    shrunk = spec.laid_out(runs(layout.machines))
    assert [(s.name, s.host_index) for s in task_slots(shrunk)] == [("worker-0", 0), ("worker-1", 2)]


def test_the_spare_goes_first_then_shrinking(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, THREE_AND_SPARE, "{shrink: true}")
    layout = decide(Snapshot(1, spec, machines(spec, {0: "unreachable", 2: "unreachable"})))
    assert layout.machines == {0: "3", 1: "1", 2: None}
    assert "worker-0 moved from 10.0.0.11" in layout.lines[0]
    assert "worker-2 left out with 10.0.0.13" in layout.lines[1] and "runs on 2 workers" in layout.lines[1]


@pytest.mark.parametrize(
    ("hosts", "restart", "strategy", "why"),
    [
        (
            THREE_AND_SPARE.replace("- {address: 10.0.0.14, spare: true}\n", ""),
            "{shrink: true, min_workers: 3}",
            "multi_worker_mirrored",
            "would leave 2 worker(s), fewer than restart.min_workers = 3",
        ),
        (
            "- {address: a, tasks: {worker: 1}}\n- {address: b, tasks: {chief: 1, worker: 1}}\n"
            "- {address: c, tasks: {worker: 2}}",
            "{shrink: true}",
            "multi_worker_mirrored",
            "it runs the chief too",
        ),
        (
            "- {address: a, tasks: {worker: 1}}\n- {address: b, tasks: {worker: 1}}\n"
            "- {address: c, tasks: {worker: 4}}",
            "{shrink: true}",
            "multi_worker_mirrored",
            "the global batch of 12 would not split evenly over the 5 replicas left",
        ),
    ],
)
def test_a_shrink_refused_says_why(tmp_path: Path, hosts: str, restart: str, strategy: str, why: str) -> None:
    spec = spec_of(tmp_path, hosts, restart, strategy)
    replicas = {s.name: 1 for s in task_slots(spec)}
    layout = decide(Snapshot(1, spec, machines(spec, {1: "unreachable"}), replicas=replicas, global_batch=12))
    assert layout.machines[1] == "1" and not layout.changed
    assert why in layout.lines[0], layout.lines


def test_a_lost_host_back_is_a_spare_and_the_job_grows_again(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path, THREE_AND_SPARE.replace("- {address: 10.0.0.14, spare: true}\n", ""), "{shrink: true}"
    )
    # the last attempt ran without hosts[1] (lost); it answers again
    snap = Snapshot(2, spec, machines(spec, at={0: 0, 1: None, 2: 2}), was_lost=frozenset({"1"}))
    layout = decide(snap)
    assert layout.machines == {0: "0", 1: "1", 2: "2"} and layout.changed and layout.workers == 3
    assert layout.lines == (
        "10.0.0.12 answers again: a spare from now on",
        "attempt 2: worker-1 back, on the spare 10.0.0.12; the job runs on 3 workers (the last attempt's "
        "worker-1 is worker-2 now)",
    )


def test_names_number_each_role_over_the_hosts_kept(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        "- {address: a, tasks: {chief: 1, worker: 1}}\n- {address: b, tasks: {worker: 2}}\n"
        "- {address: c, tasks: {worker: 1}}",
    )
    assert names(spec, {0, 1, 2}) == {
        0: ["chief-0", "worker-0"],
        1: ["worker-1", "worker-2"],
        2: ["worker-3"],
    }
    assert names(spec, {0, 2}) == {0: ["chief-0", "worker-0"], 1: [], 2: ["worker-1"]}


def test_a_parameter_server_jobs_worker_host_may_be_left_out_its_chiefs_may_not(tmp_path: Path) -> None:
    hosts = (
        "- {address: a, tasks: {chief: 1, ps: 1}}\n- {address: b, tasks: {worker: 1}}\n"
        "- {address: c, tasks: {worker: 1}}"
    )
    spec = spec_of(tmp_path, hosts, "{shrink: true}", "parameter_server")
    layout = decide(Snapshot(1, spec, machines(spec, {1: "unreachable"})))  # no batch split to check
    assert layout.machines == {0: "0", 1: None, 2: "2"} and layout.workers == 1
    assert layout.lines[0].endswith("the job runs on 1 worker (the last attempt's worker-1 is worker-0 now)")
    layout = decide(Snapshot(1, spec, machines(spec, {0: "unreachable"})))
    assert layout.machines[0] == "0" and not layout.changed
    assert "it runs the chief and ps too, which the job cannot go without" in layout.lines[0]
