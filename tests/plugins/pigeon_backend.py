"""A backend from outside the project, as a package would bring one (issue 23): registered under the
entry-point group `tf_orchestrate.backends` by its metadata (pigeon_backend-1.0.dist-info, as pip
installs it), found by name, with no change to the product. It runs tasks as local subprocesses
under a name of its own, and adds a section to the spec (`pigeon: {message: …}`, given to every
task as PIGEON_MESSAGE): the contract suite and a real job run on it (tests/e2e/test_backends.py),
and its section is validated at its lines like the spec's own (tests/unit/test_registry.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.launch.api import Backend, Heartbeats, Leftovers
from orchestrator.launch.local import LocalKind
from orchestrator.launch.local.backend import LocalBackend, LocalLeftovers
from orchestrator.plan.placement import Placement
from orchestrator.spec.model import ClusterSpec


class PigeonSpec(BaseModel):
    """The pigeon's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    message: str = Field(default="coo", pattern=r"^[a-z]+$", description="given to every task")


class PigeonBackend(LocalBackend):
    name = "pigeon"  # its record (backend.json) names it: `orchestrate down` finds it again by it

    def __init__(self, spec: ClusterSpec, run_dir: Path, spec_dir: Path):
        super().__init__(spec, run_dir, spec_dir)
        found = spec.section("pigeon")
        self._message = found.message if isinstance(found, PigeonSpec) else PigeonSpec().message

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        places = super().open(heartbeats)
        self._placements = {  # kept by LocalBackend: a task moved to a new port keeps its message
            task: dataclasses.replace(p, env={**p.env, "PIGEON_MESSAGE": self._message})
            for task, p in places.items()
        }
        return dict(self._placements)


class PigeonKind(LocalKind):
    name: ClassVar[str] = "pigeon"
    section = PigeonSpec

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        return PigeonBackend(spec, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        return LocalLeftovers(record, status)


KIND = PigeonKind()
