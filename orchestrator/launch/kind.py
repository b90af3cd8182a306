"""Launch layer: a backend as the coordinator, the CLI and the spec find it by name (the registry).

A kind is what is needed of a backend before there is a run: `open` it for a run, `reattach` a
run's processes from its records (`orchestrate down`), `preview` where the tasks would go
(`orchestrate plan`), `check` its hosts (`orchestrate check`) — and what it adds to the spec: the
top-level section named after it (`ssh:`, `slurm:`), its checks, and where its section places tasks
in place of `hosts:`. Every spec hook has a default, so a backend that adds nothing to the spec
writes only the first three methods. docs/backends.md says how to write one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.launch.exposure import HOSTS_OWN, PRIVATE_NETWORK, Exposure

if TYPE_CHECKING:
    from pydantic import BaseModel

    from orchestrator.errors import SpecProblem
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.plan.placement import Placement
    from orchestrator.spec.model import ClusterSpec, HostSpec


#: Where a spec problem is: the keys from the top of the spec down (("hosts", 0, "tasks")).
Where = tuple[str | int, ...]


class Kind(abc.ABC):
    """A backend by name (subclass it; `name` is the spec's `backend:`)."""

    name: ClassVar[str]

    #: The model of the spec's top-level section named after this backend, or None where it has
    #: none. Validated with the rest of the spec (its errors at their lines); read with
    #: `spec.section(name)`. A spec may carry the sections of other registered backends (the same
    #: spec run with --backend): each is validated by its own backend.
    section: ClassVar[type[BaseModel] | None] = None
    #: Whether that section, not `hosts:`, places the tasks (`hosts:` may then be left out).
    places_tasks: ClassVar[bool] = False
    #: Whether its tasks run on machines that can be lost (restart.shrink applies), and whether
    #: `hosts:` may list spare ones (`spare: true`) for them (docs/architecture.md §6).
    loses_hosts: ClassVar[bool] = False
    spare_hosts: ClassVar[bool] = False
    #: Whether `reach` makes something to find out (local: a network namespace): a run asks its
    #: backend's `exposure()` instead.
    reach_makes: ClassVar[bool] = False

    @abc.abstractmethod
    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        """The backend for one run (not opened yet: `Backend.open` reaches the hosts)."""

    @abc.abstractmethod
    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        """A run's processes, from its records alone (`orchestrate down` once its coordinator died)."""

    @abc.abstractmethod
    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        """Where the tasks would run, reaching nothing (`orchestrate plan`), and a note."""

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        """`orchestrate check`: the report, or None where there is nothing to check."""
        return None

    # The spec's hooks. `spec` is validated key by key when they are called; `spec.hosts` is what
    # `section_hosts` gave, where it gave something.

    def section_hosts(self, spec: ClusterSpec) -> list[HostSpec] | None:
        """The hosts this backend's section stands for (it places the tasks: `hosts:` may be left
        out), or None where the spec's `hosts:` place them. Called with the section validated."""
        return None

    def tasks_key(self, spec: ClusterSpec, host: int) -> Where:
        """Where the task counts of `spec.hosts[host]` are written, for a problem said there."""
        return ("hosts", host, "tasks")

    def port_scope(self, spec: ClusterSpec, host: HostSpec) -> str:
        """Hosts with the same scope share one machine's ports (their base_port ranges must not
        overlap)."""
        return host.address

    def reach(self, spec: ClusterSpec) -> Exposure:
        """From where the tasks' TF ports will be reachable (asks nothing of the hosts)."""
        hosts = ", ".join(dict.fromkeys(h.address for h in spec.hosts)) or "the hosts"
        return Exposure(
            False, f"every address of {hosts}, by whoever can reach them", PRIVATE_NETWORK, outbound=HOSTS_OWN
        )

    def spec_problems(self, spec: ClusterSpec) -> list[SpecProblem]:
        """The backend's own checks of a spec that names it. At a key where it finds a problem,
        the general checks' problem (if any) is not said: the backend's message is the more precise."""
        return []
