"""The ssh backend: tasks on lab hosts, one shim per task over SSH (Fabric/paramiko).

`backend.py` runs a run's tasks; `hosts.py` connects and probes; `preflight.py` is `orchestrate
check` and the launch's checks; `sync.py` sends the job's files; `state.py` and `ship.py` keep the
checkpoints consistent between hosts that share no disk; `tunnel.py` brings heartbeats home;
`spec.py` is the spec's `ssh:` section and `placement.py` its placing rule. Nothing here is imported
before a spec names the backend: `local` never loads paramiko.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.launch.kind import Kind
from orchestrator.launch.ssh.spec import SshSpec

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.plan.placement import Placement
    from orchestrator.spec.model import ClusterSpec


class SshKind(Kind):
    """Lab hosts over SSH."""

    name: ClassVar[str] = "ssh"
    section = SshSpec
    loses_hosts = True
    spare_hosts = True

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.ssh.backend import SshBackend

        return SshBackend(spec, run_id, run_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.ssh.leftovers import SshLeftovers

        return SshLeftovers(record, plan)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.ssh.placement import ssh_preview

        note = "work folders as written; `orchestrate check` tries the hosts, their ports and their folders"
        return ssh_preview(spec, run_id), note

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        from orchestrator.launch.ssh import preflight
        from orchestrator.launch.ssh.placement import ssh_ports

        return preflight.check(spec, ssh_ports(spec))


KIND = SshKind()
