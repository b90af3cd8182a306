"""A backend from outside the project, as a package would bring one (issue 23): registered under the
entry-point group `tf_orchestrate.backends` by its metadata (pigeon_backend-1.0.dist-info, as pip
installs it), found by name, with no change to the product. It runs tasks as local subprocesses
under a name of its own: the contract suite and a real job run on it (tests/e2e/test_backends.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.launch.api import Backend, Leftovers
from orchestrator.launch.kinds import LocalKind
from orchestrator.launch.local import LocalBackend, LocalLeftovers
from orchestrator.spec.model import ClusterSpec


class PigeonBackend(LocalBackend):
    name = "pigeon"  # its record (backend.json) names it: `orchestrate down` finds it again by it


class PigeonKind(LocalKind):
    name = "pigeon"

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        return PigeonBackend(spec, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        return LocalLeftovers(record, status)


KIND = PigeonKind()
