"""Launch layer: the backends (where tasks run) behind one interface (api.py).

This package is the only place that names a backend: `open_backend` makes the spec's, `reattach`
finds a run's processes from its record, `preview` places the tasks without reaching anything
(`orchestrate plan`), `check` runs a backend's checks (`orchestrate check`). Backends are imported
only when used: the SSH one loads paramiko.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import RunDirError
from orchestrator.spec.model import Backend as BackendName
from orchestrator.spec.model import ClusterSpec

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.launch.placement import Placement


def open_backend(spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
    """The spec's backend for one run (not opened yet). `spec_dir`: the spec's folder."""
    if spec.backend is BackendName.LOCAL:
        from orchestrator.launch.local import LocalBackend

        return LocalBackend(spec, run_dir, spec_dir)
    if spec.backend is BackendName.SLURM:
        from orchestrator.launch.slurm import SlurmBackend

        return SlurmBackend(spec, run_id, run_dir, spec_dir)
    from orchestrator.launch.ssh import SshBackend

    return SshBackend(spec, run_id, run_dir)


def reattach(record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]) -> Leftovers:
    """A run's processes, from its backend record (backend.json), status.json and plan.json."""
    name = record.get("backend")
    if name == BackendName.LOCAL.value:
        from orchestrator.launch.local import LocalLeftovers

        return LocalLeftovers(record, status)
    if name == BackendName.SSH.value:
        from orchestrator.launch.ssh import SshLeftovers

        return SshLeftovers(record, plan)
    if name == BackendName.SLURM.value:
        from orchestrator.launch.slurm import SlurmLeftovers

        return SlurmLeftovers(record)
    raise RunDirError(f"backend.json names an unknown backend {name!r}")


def preview(
    spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
) -> tuple[dict[str, Placement], str]:
    """Where the tasks would run, without reaching any host, and a note on what may change at launch."""
    from orchestrator.launch import placement

    if spec.backend is BackendName.LOCAL:
        from orchestrator.launch.ports import preview_ports

        ports, busy = preview_ports(spec)
        places = placement.local_placements(
            spec,
            ports,
            run_dir=run_dir,
            spec_dir=spec_dir,
            coordinator_url="http://127.0.0.1:<chosen at launch>",
            python=sys.executable,
        )
        note = "local ports are free now and chosen again at launch unless the spec fixes base_port"
        return places, "\n".join([note, *(f"warning: {b}" for b in busy)])
    if spec.backend is BackendName.SLURM:
        from orchestrator.launch.slurm_check import preview_lines

        places = placement.slurm_preview(spec, run_dir, spec_dir, python=sys.executable)
        return places, "\n".join(preview_lines(spec, run_id, run_dir))
    note = "work folders as written; `orchestrate check` tries the hosts, their ports and their folders"
    return placement.ssh_preview(spec, run_id), note


def check(spec: ClusterSpec) -> CheckReport | None:
    """`orchestrate check`: the backend's report, or None where there is nothing to check (every
    task runs on this machine)."""
    if spec.backend is BackendName.LOCAL:
        return None
    if spec.backend is BackendName.SLURM:
        from orchestrator.launch import slurm_check

        return slurm_check.check(spec)
    from orchestrator.launch import preflight
    from orchestrator.launch.placement import ssh_ports

    return preflight.check(spec, ssh_ports(spec))
