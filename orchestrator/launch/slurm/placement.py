"""Launch layer, slurm backend: where each task runs before the allocation is known
(`orchestrate plan`): nodes by number, ports chosen at launch; and which Python a task runs on
its node (`task_python`)."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.environment import task_env
from orchestrator.environment.local import runtime_copy
from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.spec import section
from orchestrator.plan.placement import Placement
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from worker.host import RUNTIME_ROOT


def slurm_preview(spec: ClusterSpec, run_dir: Path, spec_dir: Path, *, python: str) -> dict[str, Placement]:
    """Before allocating: nodes and ports are known at launch."""
    conf = section(spec)
    interpreter = tuple(shlex.split(conf.python)) if conf.python else (python,)
    if spec.environment is not None:  # made on each node at launch
        workdir = conf.workdir or "/tmp/orchestrate-<uid>"
        interpreter = (
            posixpath.join(workdir, "envs", "<made from environment: at launch>", "bin", "python"),
        )
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


def task_python(
    python: tuple[str, ...], made: str | None, shipped: str | None, run_dir: Path, *, runtime: bool
) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """A task's interpreter on its node, what goes first on its PYTHONPATH, and what its env adds.
    `made`: the node's environment's interpreter (`environment:`); `shipped`: the run's copy on
    the node, where the job's files are copied (its lib/ holds the worker runtime); `runtime`:
    slurm.python names an interpreter without this package (the runtime comes from here)."""
    if shipped is not None:
        pythonpath: tuple[str, ...] = (posixpath.join(shipped, "lib"),)
    elif made:  # the environment has the job's packages alone: the runtime copied beside the run
        pythonpath = (str(runtime_copy(run_dir)),)
    else:
        pythonpath = (str(RUNTIME_ROOT),) if runtime else ()
    if made is None:
        return python, pythonpath, {}
    return (made,), pythonpath, task_env(made)


def task_port(mine: int, answer: Mapping[str, Any], free: list[Any], task: str, node: str) -> int:
    """A task's port on its node: its own (`mine`, 0: none) while free there, else the next free."""
    if mine and answer.get("ports", {}).get(str(mine), True):
        return mine
    if not free:
        raise LaunchError(f"{node}: no free TCP port found for {task}")
    return int(free.pop(0))
