"""Launch layer: the built-in backend kinds (`registry.BUILTIN`), each importing its backend only
when used — `orchestrate plan` of an ssh spec never loads paramiko, `local` never at all.

Each kind says, for its backend: how to open it for a run, how to find a run's processes from its
records, where `orchestrate plan` places the tasks (reaching nothing), and what `orchestrate check`
checks. (One module for the three until each backend is a package of its own.)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.launch.placement import Placement
    from orchestrator.spec.model import ClusterSpec


class LocalKind:
    """Subprocesses on this machine (launch/local.py)."""

    name = "local"

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.local import LocalBackend

        return LocalBackend(spec, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.local import LocalLeftovers

        return LocalLeftovers(record, status)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.placement import local_placements
        from orchestrator.launch.ports import preview_ports

        ports, busy = preview_ports(spec)
        places = local_placements(
            spec,
            ports,
            run_dir=run_dir,
            spec_dir=spec_dir,
            coordinator_url="http://127.0.0.1:<chosen at launch>",
            python=sys.executable,
        )
        note = "local ports are free now and chosen again at launch unless the spec fixes base_port"
        return places, "\n".join([note, *(f"warning: {b}" for b in busy)])

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        return None  # every task runs on this machine


class SshKind:
    """Lab hosts over SSH, one shim per task (launch/ssh.py)."""

    name = "ssh"

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.ssh import SshBackend

        return SshBackend(spec, run_id, run_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.ssh import SshLeftovers

        return SshLeftovers(record, plan)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.placement import ssh_preview

        note = "work folders as written; `orchestrate check` tries the hosts, their ports and their folders"
        return ssh_preview(spec, run_id), note

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        from orchestrator.launch import preflight
        from orchestrator.launch.placement import ssh_ports

        return preflight.check(spec, ssh_ports(spec))


class SlurmKind:
    """Job steps in a Slurm allocation (launch/slurm.py)."""

    name = "slurm"

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.slurm import SlurmBackend

        return SlurmBackend(spec, run_id, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.slurm import SlurmLeftovers

        return SlurmLeftovers(record)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.placement import slurm_preview
        from orchestrator.launch.slurm_check import preview_lines

        places = slurm_preview(spec, run_dir, spec_dir, python=sys.executable)
        return places, "\n".join(preview_lines(spec, run_id, run_dir))

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        from orchestrator.launch import slurm_check

        return slurm_check.check(spec)


LOCAL, SSH, SLURM = LocalKind(), SshKind(), SlurmKind()
