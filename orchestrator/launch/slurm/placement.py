"""Launch layer, slurm backend: where each task runs before the allocation is known
(`orchestrate plan`): nodes by number, ports chosen at launch."""

from __future__ import annotations

import shlex
from pathlib import Path

from orchestrator.launch.placement import Placement
from orchestrator.launch.slurm.spec import section
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots


def slurm_preview(spec: ClusterSpec, run_dir: Path, spec_dir: Path, *, python: str) -> dict[str, Placement]:
    """Before allocating: nodes and ports are known at launch."""
    conf = section(spec)
    interpreter = tuple(shlex.split(conf.python)) if conf.python else (python,)
    url = f"http://{conf.coordinator_address or '<this machine, on the route to the nodes>'}"
    return {
        slot.name: Placement(
            host=spec.hosts[slot.host_index].address,
            port=0,
            run_folder=str(run_dir),
            python=interpreter,
            cwd=str(spec_dir),
            coordinator_url=url,
            host_index=slot.host_index,
        )
        for slot in task_slots(spec)
    }
