"""Plan room: the plan of each attempt, made again when the backend moves tasks, and written
to the run's record (plan.json, backend.json) with the credentials placed for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.plan.placement import Placement
from orchestrator.record.write import RunRecord
from orchestrator.spec.model import ClusterSpec


class Credentials(Protocol):
    """The run's credentials (orchestrator/health/credentials.py): whose key signs each task's."""

    def place(self, scopes: Mapping[str, int]) -> None: ...


class Backend(Protocol):
    """The run's backend (orchestrator/launch/api.py), as far as the planner asks it: its record."""

    def record(self) -> dict[str, Any]: ...


class Planner:
    """The plan from the spec and the backend's placements, made again when the backend moves a
    task between attempts (a port taken, a lost host's tasks on a spare or left out); each one
    written to plan.json, with the backend's record (a spare used, a new allocation) to
    backend.json."""

    def __init__(
        self,
        spec: ClusterSpec,
        run_id: str,
        placements: Mapping[str, Placement],
        record: RunRecord,
        credentials: Credentials,
        backend: Backend,
    ):
        self._spec, self._run_id, self._record = spec, run_id, record
        self._laid_out = spec  # as this attempt runs (`runs`)
        self._placements = dict(placements)
        self._credentials = credentials
        self._backend = backend
        self._backend_record: dict[str, Any] | None = None

    def __call__(
        self, moved: Mapping[str, Placement], runs: Mapping[int, int | None] | None = None
    ) -> LaunchPlan:
        """The plan with `moved`'s placements; with `runs`, the spec laid out anew (a lost host's
        tasks on a spare, or left out) and `moved` every task's placement under it."""
        if runs is not None:
            self._laid_out = self._spec.laid_out(runs)
            self._placements = {}
        self._placements.update(moved)
        plan = make_plan(self._laid_out, self._run_id, self._placements)
        self._record.write_plan(plan.to_json())
        if (backend := self._backend.record()) != self._backend_record:
            self._record.write_backend(backend)
            self._backend_record = backend
        self._credentials.place({t.name: t.host_index for t in plan.tasks})  # whose key signs a task's
        return plan
