"""Launch layer, local backend: where each task runs — this machine, the run directory, this Python."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from orchestrator.environment import task_env
from orchestrator.plan.placement import Placement
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots


def local_placements(
    spec: ClusterSpec,
    ports: Mapping[str, int],
    *,
    run_dir: Path,
    spec_dir: Path,
    coordinator_url: str,
    python: str,
    pythonpath: tuple[str, ...] = (),
) -> dict[str, Placement]:
    """Every task on this machine, in the run directory, with this Python."""
    return {
        slot.name: Placement(
            host="127.0.0.1",
            port=ports[slot.name],
            run_folder=str(run_dir),
            python=(python,),
            cwd=str(spec_dir),
            coordinator_url=coordinator_url,
            host_index=slot.host_index,
            pythonpath=pythonpath,
            env=task_env(python) if pythonpath else {},  # an environment's (`environment:`)
        )
        for slot in task_slots(spec)
    }
