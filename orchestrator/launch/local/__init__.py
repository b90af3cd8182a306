"""The local backend: every task a subprocess on this machine (a one-machine simulation of the
cluster). `backend.py` runs them, `ports.py` reserves their TF ports, `placement.py` places them."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.launch.exposure import Exposure
from orchestrator.launch.kind import Kind
from orchestrator.launch.local.section import LocalSpec

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, Leftovers
    from orchestrator.plan.placement import Placement
    from orchestrator.spec.model import ClusterSpec, HostSpec


class LocalKind(Kind):
    """Subprocesses on this machine."""

    name: ClassVar[str] = "local"
    section = LocalSpec
    reach_makes = True  # it makes a namespace to see whether one can be made

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.local.backend import LocalBackend

        return LocalBackend(spec, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.local.backend import LocalLeftovers

        return LocalLeftovers(record, status)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.local import netns
        from orchestrator.launch.local.placement import local_placements
        from orchestrator.launch.local.ports import preview_ports
        from worker import wire

        if self.reach(spec).isolated:  # every port is the run's own, in its network namespace
            ports, busy = netns.inside_ports(spec), list[str]()
            url = f"{wire.UNIX_SCHEME}{run_dir}/.heartbeats-<chosen at launch>/hb"
            note = "every task in the run's own network namespace: its TF ports exist there alone"
        else:
            (ports, busy), url = preview_ports(spec), "http://127.0.0.1:<chosen at launch>"
            note = "local ports are free now and chosen again at launch unless the spec fixes base_port"
        python, pythonpath = sys.executable, tuple[str, ...]()
        if spec.environment is not None:  # its name is known once this machine's Python is asked
            from orchestrator.environment.resolve import cache_root

            python = str(cache_root() / "envs" / "<made from environment: at launch>" / "bin" / "python")
            pythonpath = (str(run_dir / "lib"),)
        places = local_placements(
            spec,
            ports,
            run_dir=run_dir,
            spec_dir=spec_dir,
            coordinator_url=url,
            python=python,
            pythonpath=pythonpath,
        )
        return places, "\n".join([note, *(f"warning: {b}" for b in busy)])

    def reach(self, spec: ClusterSpec) -> Exposure:
        from orchestrator.launch.local import netns

        return netns.Network(spec).probe()

    def port_scope(self, spec: ClusterSpec, host: HostSpec) -> str:
        return "127.0.0.1"  # every "host" is this machine


KIND = LocalKind()
