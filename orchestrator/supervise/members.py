"""Supervision layer: on which machines the next attempt runs (the policy of lost hosts).

Before an attempt after the first, the backend says how each machine stands (`Machine`: the one
running a spec host's tasks, a spare, one lost and why). `decide` takes that frozen snapshot and
answers with the next attempt's layout: a lost host's tasks moved to a spare (same roles and
indexes, TF_CONFIG rebuilt), left out (restart.shrink: the job goes on with fewer workers,
renumbered as TensorFlow requires, down to restart.min_workers, while the global batch still
splits evenly over the replicas left), or tried again there as before. A host left out comes back
when a spare is there for it; a lost host that answers again is a spare from then on. The
supervisor executes (supervisor.py); this module only decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.plan.placement import Machine
from orchestrator.spec.model import ClusterSpec, Role
from orchestrator.spec.roles import task_slots


@dataclass(frozen=True)
class Snapshot:
    """What the policy knows of the run's machines before the next attempt (frozen)."""

    attempt: int  # the attempt about to start
    spec: ClusterSpec  # the run's (its hosts and the tasks each gives)
    machines: tuple[Machine, ...]  # every machine: those that ran tasks (`position`), spares, lost
    was_lost: frozenset[str] = frozenset()  # machines lost before this decision
    #: Per training task of the last attempt: its replicas (devices), where the global batch is
    #: split over them all (multi_worker_mirrored); empty: no split to check.
    replicas: Mapping[str, int] = field(default_factory=dict)
    global_batch: int | None = None  # the built-in loop's; None: the job splits its own


@dataclass(frozen=True)
class Layout:
    """The next attempt's machines: per spec host that gives tasks, the machine that runs them
    (None: left out), and what changed, a line each."""

    machines: Mapping[int, str | None]
    lines: tuple[str, ...] = ()
    changed: bool = False
    workers: int = 0  # worker tasks of the next attempt


def decide(snap: Snapshot) -> Layout:
    """The next attempt's layout (module docstring): spares first to the hosts lost, in the spec's
    order; then shrinking, where the spec allows it; then spares to the hosts left out earlier."""
    spec = snap.spec
    by_key = {m.key: m for m in snap.machines}
    now = {p: m.key for m in snap.machines if (p := m.position) is not None}
    positions = [p for p, h in enumerate(spec.hosts) if h.tasks and not h.spare]
    assign: dict[int, str | None] = {p: now.get(p) for p in positions}
    was = names(spec, {p for p in positions if now.get(p) is not None})
    spares = [m for m in snap.machines if m.position is None and m.lost is None]
    lines = [f"{m.label} answers again: a spare from now on" for m in spares if m.key in snap.was_lost]
    head = f"attempt {snap.attempt}:"
    for p in positions:
        machine = by_key.get(assign[p] or "")
        if machine is None or machine.lost is None:
            continue
        tasks = ", ".join(was[p])
        if spares:
            spare = spares.pop(0)
            assign[p] = spare.key
            lines.append(f"{head} {tasks} moved from {machine.said} to the spare {spare.label}")
            continue
        refused = _shrink_refused(snap, assign, p)
        if refused is not None:
            lines.append(
                f"{head} {machine.said} is lost and no spare host is left; {refused}: tried there again"
            )
            continue
        assign[p] = None
        shrunk = _shrunk(spec, was, assign)
        lines.append(f"{head} {tasks} left out with {machine.said}: no spare host is left; {shrunk}")
    for p in positions:
        if assign[p] is None and now.get(p) is None and spares:  # left out earlier: back
            spare = spares.pop(0)
            assign[p] = spare.key
            back = ", ".join(names(spec, {q for q, k in assign.items() if k is not None})[p])
            lines.append(f"{head} {back} back, on the spare {spare.label}; {_shrunk(spec, was, assign)}")
    changed = any(assign[p] != now.get(p) for p in positions)
    return Layout(assign, tuple(lines), changed, _workers(spec, assign))


def names(spec: ClusterSpec, kept: set[int]) -> dict[int, list[str]]:
    """The names of each spec host's tasks when only the hosts `kept` give theirs (each role
    numbered in the order of the hosts, spec/roles.py `task_slots`); the others: none."""
    alone = spec.laid_out({p: p if p in kept else None for p in range(len(spec.hosts))})
    out: dict[int, list[str]] = {p: [] for p in range(len(spec.hosts))}
    for slot in task_slots(alone):
        out[slot.host_index].append(slot.name)
    return out


def _workers(spec: ClusterSpec, assign: Mapping[int, str | None]) -> int:
    return sum(h.tasks.get(Role.WORKER, 0) for p, h in enumerate(spec.hosts) if assign.get(p) is not None)


def _shrink_refused(snap: Snapshot, assign: Mapping[int, str | None], position: int) -> str | None:
    """Why hosts[position] may not be left out (None: it may)."""
    spec = snap.spec
    host = spec.hosts[position]
    if not spec.restart.shrink:
        return "restart.shrink is off"
    if set(host.tasks) != {Role.WORKER}:
        held = " and ".join(sorted(r.value for r in host.tasks if r is not Role.WORKER))
        return f"it runs the {held} too, which the job cannot go without"
    after = {**assign, position: None}
    left = _workers(spec, after)
    if left < spec.restart.min_workers:
        return (
            f"leaving it out would leave {left} worker(s), fewer than restart.min_workers = "
            f"{spec.restart.min_workers}"
        )
    if snap.global_batch is not None and snap.replicas:
        was = names(spec, {p for p, key in assign.items() if key is not None or p == position})
        gone = {n for p, key in after.items() if key is None for n in was[p]}
        replicas = sum(n for task, n in snap.replicas.items() if task not in gone)
        if replicas and snap.global_batch % replicas:
            return (
                f"the global batch of {snap.global_batch} would not split evenly over the {replicas} "
                "replicas left"
            )
    return None


def _shrunk(spec: ClusterSpec, was: Mapping[int, list[str]], assign: Mapping[int, str | None]) -> str:
    """`the job runs on 2 workers (worker-2 is worker-1 now)`"""
    now = names(spec, {p for p, key in assign.items() if key is not None})
    renamed = [
        f"{old} is {new}"
        for p in sorted(was)
        for old, new in zip(was[p], now[p], strict=False)
        if old != new and now[p]
    ]
    workers = _workers(spec, assign)
    tail = f" (the last attempt's {', '.join(renamed)} now)" if renamed else ""
    return f"the job runs on {workers} worker{'s' if workers != 1 else ''}{tail}"
