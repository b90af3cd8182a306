"""Launch layer: the backends (where tasks run) behind one interface (api.py), found by name in
the registry (registry.py: the built-in ones, and any an installed package registers).

What the coordinator and the CLI ask of the spec's backend, before there is a run, they ask of its
kind (launch/kind.py), looked up once (`kind_of`): `open` makes the backend for a run, `preview`
places the tasks without reaching anything (`orchestrate plan`), `check` runs its checks
(`orchestrate check`), `reach` says from where the tasks' TF ports will be reachable. `reattach`
finds a run's processes from its record (`orchestrate down`), by the name the record keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from orchestrator.errors import RunDirError
from orchestrator.launch import registry
from orchestrator.spec.model import ClusterSpec

if TYPE_CHECKING:
    from orchestrator.launch.api import Leftovers
    from orchestrator.launch.kind import Kind


def kind_of(spec: ClusterSpec) -> Kind:
    """The spec's backend kind, looked up once by whoever holds the spec (`up`, `plan`, `check`) and
    handed down: it opens the backend for a run, previews and checks its hosts, says who can reach
    the tasks' TF ports."""
    return registry.get(spec.backend)


def reattach(record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]) -> Leftovers:
    """A run's processes, from its backend record (backend.json), status.json and plan.json."""
    name = record.get("backend")
    try:
        kind = registry.get(str(name))
    except registry.UnknownBackend as exc:
        raise RunDirError(f"backend.json names an unknown backend {name!r}: {exc}") from None
    return kind.reattach(record, status, plan)
