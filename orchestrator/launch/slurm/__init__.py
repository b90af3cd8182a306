"""The slurm backend: tasks as job steps (`srun`) in one Slurm allocation (`salloc`).

`backend.py` runs a run's tasks; `cluster.py` speaks to Slurm (its commands, the allocation);
`step.py` is a task's step; `files.py` keeps a run's files and checkpoints on nodes that do not see
this machine's disk; `check.py` is `orchestrate check` and `plan`'s notes; `spec.py` is the spec's
`slurm:` section, which places the tasks on nodes in place of `hosts:`; `placement.py` its rule.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.launch.exposure import HOSTS_OWN, PRIVATE_NETWORK, Exposure
from orchestrator.launch.kind import Kind, Where
from orchestrator.launch.slurm import spec as slurm_spec

if TYPE_CHECKING:
    from orchestrator.errors import SpecProblem
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.plan.placement import Placement
    from orchestrator.spec.model import ClusterSpec, HostSpec


class SlurmKind(Kind):
    """Job steps in a Slurm allocation."""

    name: ClassVar[str] = "slurm"
    section = slurm_spec.SlurmSpec
    places_tasks = True
    loses_hosts = True

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        from orchestrator.launch.slurm.backend import SlurmBackend

        return SlurmBackend(spec, run_id, run_dir, spec_dir)

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        from orchestrator.launch.slurm.leftovers import SlurmLeftovers

        return SlurmLeftovers(record)

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        from orchestrator.launch.slurm.check import preview_lines
        from orchestrator.launch.slurm.placement import slurm_preview

        places = slurm_preview(spec, run_dir, spec_dir, python=sys.executable)
        return places, "\n".join(preview_lines(spec, run_id, run_dir))

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        from orchestrator.launch.slurm import check

        return check.check(spec)

    def section_hosts(self, spec: ClusterSpec) -> list[HostSpec] | None:
        return slurm_spec.nodes_as_hosts(slurm_spec.section(spec))

    def tasks_key(self, spec: ClusterSpec, host: int) -> Where:
        return slurm_spec.tasks_key(spec, host)

    def reach(self, spec: ClusterSpec) -> Exposure:
        return Exposure(
            False,
            "every address of the allocated nodes, by whoever can reach them",
            PRIVATE_NETWORK,
            outbound=HOSTS_OWN,
        )

    def spec_problems(self, spec: ClusterSpec) -> list[SpecProblem]:
        return slurm_spec.problems(spec)


KIND = SlurmKind()
