"""Launch layer: the backends (where tasks run) behind one interface (api.py), found by name in
the registry (registry.py: the built-in ones, and any an installed package registers).

What the coordinator and the CLI ask of the spec's backend, before there is a run: `open_backend`
makes it for a run, `reattach` finds a run's processes from its record, `preview` places the tasks
without reaching anything (`orchestrate plan`), `check` runs its checks (`orchestrate check`),
`reach` says from where the tasks' TF ports will be reachable.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import RunDirError
from orchestrator.launch import registry
from orchestrator.spec.model import ClusterSpec

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.launch.exposure import Exposure
    from orchestrator.plan.placement import Placement


def open_backend(spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
    """The spec's backend for one run (not opened yet). `spec_dir`: the spec's folder."""
    return registry.get(spec.backend).open(spec, run_id, run_dir, spec_dir)


def reattach(record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]) -> Leftovers:
    """A run's processes, from its backend record (backend.json), status.json and plan.json."""
    name = record.get("backend")
    try:
        kind = registry.get(str(name))
    except registry.UnknownBackend as exc:
        raise RunDirError(f"backend.json names an unknown backend {name!r}: {exc}") from None
    return kind.reattach(record, status, plan)


def preview(
    spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
) -> tuple[dict[str, Placement], str]:
    """Where the tasks would run, without reaching any host, and a note on what may change at launch."""
    return registry.get(spec.backend).preview(spec, run_id, run_dir, spec_dir)


def reach(spec: ClusterSpec) -> Exposure:
    """From where the tasks' TF ports will be reachable (`orchestrate plan` and `check`)."""
    return registry.get(spec.backend).reach(spec)


def check(spec: ClusterSpec) -> CheckReport | None:
    """`orchestrate check`: the backend's report, or None where there is nothing to check (every
    task runs on this machine)."""
    return registry.get(spec.backend).check(spec)
