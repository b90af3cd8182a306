"""Launch layer, slurm backend: its section of the spec (`slurm:`), which places the tasks on nodes
in place of `hosts:`, and its checks."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, model_validator

from orchestrator.errors import SpecProblem
from orchestrator.launch.kind import Where
from orchestrator.spec.base import Strict
from orchestrator.spec.model import MAX_HOSTS, MAX_TASKS, ClusterSpec, HostSpec, Role

#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
SLURM_TIME = r"^([0-9]{1,5}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|[0-9]{1,7}(:[0-9]{1,2}){0,2})$"
RoleCounts = dict[Role, Annotated[int, Field(le=MAX_TASKS)]]


class SlurmSpec(Strict):
    """backend: slurm — an allocation of `nodes` nodes on a Slurm cluster; the same tasks on each
    node used (or one entry per node), the rest kept as spares for a restart."""

    nodes: int = Field(ge=1, le=MAX_HOSTS, description="nodes to allocate (more than used: spares)")
    tasks_per_node: RoleCounts | Annotated[list[RoleCounts], Field(min_length=1, max_length=MAX_HOSTS)] = (
        Field(
            description="counts per role on every node used, e.g. {worker: 1}; or a list, one entry per "
            "node used, e.g. [{chief: 1, ps: 1}, {worker: 2}]"
        )
    )
    spare_nodes: int = Field(
        default=0,
        ge=0,
        description="with the mapping form of tasks_per_node: nodes kept free for a restart "
        "(the list form uses len(list) nodes and keeps the rest spare)",
    )
    partition: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.+-]+$", max_length=128)
    account: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.+-]+$", max_length=128)
    time: str | None = Field(
        default=None, pattern=SLURM_TIME, description='time limit of the allocation, e.g. "02:00:00"'
    )
    extra_args: list[Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=list, max_length=100, description="more salloc options, e.g. [--gres=gpu:1]"
    )
    queue_timeout_s: float = Field(
        default=600.0, gt=0, description="give up (and cancel the request) if not allocated within this"
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="how long a Slurm command may wait for slurmctld"
    )
    python: str | None = Field(
        default=None, min_length=1, description="interpreter on the nodes (default: the coordinator's own)"
    )
    coordinator_address: str | None = Field(
        default=None,
        pattern=r"^[^\s:/]+(:[0-9]{1,5})?$",
        description="host[:port] of this machine that the nodes reach (default: this machine's address "
        "on the route to the nodes)",
    )
    workdir: str | None = Field(
        default=None,
        pattern=r"^/[^\x00]*$",
        max_length=1000,
        description="where nodes that do not see this machine's files keep the run's copy "
        "(default /tmp/orchestrate-<uid>; unused on a shared filesystem)",
    )

    def time_s(self) -> float | None:
        """slurm.time in seconds (Slurm's formats: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
        if self.time is None:
            return None
        days, _, rest = self.time.rpartition("-")
        parts = [int(p) for p in rest.split(":")]
        if days:  # D-HH, D-HH:MM, D-HH:MM:SS
            parts += [0] * (3 - len(parts))
            hours, minutes, seconds = parts
            return float(((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds)
        scale = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]  # minutes | MM:SS | HH:MM:SS
        return float(sum(p * k for p, k in zip(parts, scale, strict=True)))

    @staticmethod
    def warning_lead_s(stop_grace_s: float) -> int:
        """How long before the time limit Slurm is asked to send SIGTERM (`--signal=TERM@lead`):
        the stop's grace period for a final checkpoint, and some margin (Slurm checks every ~30 s)."""
        return max(60, math.ceil(stop_grace_s) + 30)

    def layout(self) -> list[dict[Role, int]]:
        """The tasks of each node used, in node order."""
        if isinstance(self.tasks_per_node, list):
            return [dict(t) for t in self.tasks_per_node]
        return [dict(self.tasks_per_node) for _ in range(max(0, self.nodes - self.spare_nodes))]

    @model_validator(mode="after")
    def _fits(self) -> SlurmSpec:
        used = (
            len(self.tasks_per_node)
            if isinstance(self.tasks_per_node, list)
            else self.nodes - self.spare_nodes
        )
        if isinstance(self.tasks_per_node, list) and self.spare_nodes:
            raise ValueError(
                "slurm.spare_nodes goes with the mapping form of tasks_per_node; with a list, "
                "slurm.nodes beyond its length are the spares"
            )
        if used < 1:
            raise ValueError(
                f"slurm.spare_nodes ({self.spare_nodes}) leaves no node of slurm.nodes ({self.nodes})"
            )
        if used > self.nodes:
            raise ValueError(
                f"slurm.tasks_per_node lists {used} nodes, slurm.nodes allocates {self.nodes}; "
                "allocate at least as many"
            )
        return self


def section(spec: ClusterSpec) -> SlurmSpec:
    """The spec's `slurm:` section (a spec for this backend has one: checked at load)."""
    found = spec.section("slurm")
    if not isinstance(found, SlurmSpec):
        raise ValueError(f"spec {spec.name!r} has no slurm: section")
    return found


def nodes_as_hosts(conf: SlurmSpec) -> list[HostSpec]:
    """The nodes used stand where hosts stand for the other backends (the planner, the checks and
    the placing rules read hosts); their addresses are known once allocated."""
    return [HostSpec(address=f"<node {i}>", tasks=t) for i, t in enumerate(conf.layout(), 1)]


def tasks_key(spec: ClusterSpec, host: int) -> Where:
    """Where a node's task counts are written: the list's entry, or the one mapping for all."""
    if isinstance(section(spec).tasks_per_node, list):
        return ("slurm", "tasks_per_node", host)
    return ("slurm", "tasks_per_node")


def problems(spec: ClusterSpec) -> list[SpecProblem]:
    """The time limit leaves room for the final checkpoint; a mapping puts no chief (evaluator) on
    every node."""
    conf = section(spec)
    found = []
    if not isinstance(conf.tasks_per_node, list) and len(spec.hosts) > 1:
        for role in (Role.CHIEF, Role.EVALUATOR):
            if conf.tasks_per_node.get(role, 0) > 0:
                found.append(
                    SpecProblem(
                        ("slurm", "tasks_per_node", role.value),
                        f"a cluster has at most one {role.value}; this mapping puts one on each of "
                        f"{len(spec.hosts)} nodes: give a list, one entry per node, e.g. "
                        f"[{{{role.value}: 1, worker: 1}}, {{worker: 1}}]",
                    )
                )
    if conf.time is not None:
        limit_s, lead_s = conf.time_s() or 0.0, conf.warning_lead_s(spec.health.stop_grace_s)
        if limit_s <= 2 * lead_s:
            found.append(
                SpecProblem(
                    ("slurm", "time"),
                    f"{limit_s:g} s is too short: Slurm is asked for SIGTERM {lead_s} s before the limit "
                    "(a final checkpoint: health.stop_grace_s + 30 s, at least 60), so give more than "
                    f"{2 * lead_s} s",
                )
            )
    return found
