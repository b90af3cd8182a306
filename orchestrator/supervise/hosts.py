"""Supervision layer: where each attempt runs — the machines the backend sees before an attempt
after the first, the policy's layout for it (members.py: a lost host's tasks on a spare, left out,
or tried again), and the plan made again when tasks moved (a spare, a port taken meanwhile). A
part of the Supervisor class (supervisor.py), kept in a module of its own; it only executes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from orchestrator.launch.api import Backend
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.plan.placement import Machine, Placement
from orchestrator.record.write import iso_time
from orchestrator.spec.model import ClusterSpec, Role, Strategy
from orchestrator.supervise import members
from orchestrator.supervise.records import EventSink, TaskRecord

log = logging.getLogger("orchestrator.supervise")

#: `replan(moved, runs=None)`: the plan made again with tasks placed anew (and the spec laid out
#: anew: `ClusterSpec.laid_out`'s runs, where the machines changed).
Replan = Callable[..., LaunchPlan]


class Hosts:
    """The supervisor's machines (mixed into Supervisor, which sets what is declared here)."""

    plan: LaunchPlan
    tasks: dict[str, TaskRecord]
    attempt: int
    machine_rows: list[dict[str, Any]]  # status.json's `machines`: as last seen, before an attempt
    workers: dict[int, int]  # per attempt: its worker tasks
    changes: dict[int, list[str]]  # per attempt: the hosts it ran on anew, a line each
    _spec: ClusterSpec | None
    _lost_machines: set[str]
    _backend: Backend
    _sink: EventSink
    _replan: Replan | None
    if TYPE_CHECKING:
        job_folders: Any

    def _relayout(self) -> None:
        """Before an attempt after the first: the backend's machines, and where the policy runs the
        attempt. LaunchError where the backend cannot move the tasks as decided."""
        if self._spec is None or self._replan is None:
            return
        suspects = self._suspects()
        try:
            found = self._backend.machines(self.plan, suspects)
        except Exception as exc:  # noqa: BLE001 - the attempt runs where the last one ran
            self._sink.event(
                kind="hosts", attempt=self.attempt, reason=f"the machines could not be asked: {exc}"
            )
            return
        if not found:
            return
        snap = members.Snapshot(
            self.attempt,
            self._spec,
            tuple(found),
            frozenset(self._lost_machines),
            self._replicas(),
            self.plan.examples_per_step,
        )
        layout = members.decide(snap)
        self._lost_machines = {m.key for m in found if m.lost is not None}
        self.machine_rows = self._rows(found, layout.machines)
        self.changes[self.attempt] = list(layout.lines)
        for line in layout.lines:
            self._sink.event(kind="hosts", attempt=self.attempt, reason=line)
            log.warning("%s", line)
        if layout.changed:
            relaid = self._backend.relayout(layout.machines)
            self._replanned(self._replan(relaid.placements, runs=relaid.runs))

    def _rows(self, found: list[Machine], machines: Mapping[int, str | None]) -> list[dict[str, Any]]:
        """status.json's `machines`: each with the tasks it runs this attempt."""
        assert self._spec is not None
        named = members.names(self._spec, {p for p, key in machines.items() if key is not None})
        runs_here = {key: p for p, key in machines.items() if key is not None}
        return [
            {
                "host": m.label,
                "state": "in use" if m.key in runs_here else "lost" if m.lost else "spare",
                "tasks": named[runs_here[m.key]] if m.key in runs_here else [],
                "lost": m.said if m.lost else None,
            }
            for m in found
        ]

    def _suspects(self) -> dict[str, tuple[str, str | None]]:
        """The last attempt's tasks whose host may be lost: their end could not be confirmed (its
        connection gone), with the time of their last heartbeat."""
        out = {}
        for name, rec in self.tasks.items():
            if rec.handle is None or rec.handle.exited:
                continue
            wall = rec.health.last_heartbeat_wall if rec.health is not None else None
            out[name] = ("unreachable", iso_time(wall)[11:19] if wall else None)
        return out

    def _replicas(self) -> dict[str, int]:
        """Per training task, its replicas, where the global batch is split over them all."""
        if self.plan.strategy is not Strategy.MULTI_WORKER_MIRRORED:
            return {}
        return {
            t.name: len(t.env["CUDA_VISIBLE_DEVICES"].split(",")) if t.env.get("CUDA_VISIBLE_DEVICES") else 1
            for t in self.plan.tasks
            if t.in_cluster
        }

    def _move_tasks(self, moved: Mapping[str, Placement]) -> None:
        """The backend placed some tasks anew (a port taken meanwhile): the plan is made again."""
        assert self._replan is not None
        old = self.plan
        self._replanned(self._replan(moved))
        for name, place in moved.items():
            if name not in {t.name for t in old.tasks}:
                continue
            was = old.task(name)
            if was.host != place.host:
                note = f"{name} moved from {was.host}:{was.port} to {place.host}:{place.port}"
            else:
                note = f"port {was.port} of {name} is in use by another program; moved to {place.port}"
            self._sink.event(kind="port", attempt=self.attempt, reason=note)
            log.warning("%s", note)

    def _replanned(self, plan: LaunchPlan) -> None:
        """The new plan, and a record per task of it (a task the layout left out goes; one it
        brought back comes)."""
        self.plan = self.job_folders.plan(plan)
        old = self.tasks
        self.tasks = {}
        for task in self.plan.tasks:
            rec = old.get(task.name) or TaskRecord(task, self.plan.policy_of(task))
            rec.plan = task
            self.tasks[task.name] = rec

    def _count_workers(self) -> None:
        self.workers[self.attempt] = sum(1 for t in self.plan.tasks if t.role is Role.WORKER)
