"""Launch layer: the backends by name — the three built in (`local`, `ssh`, `slurm`) and any that an
installed package registers under the entry-point group `tf_orchestrate.backends` (as pytest finds
its plugins and submitit its executors).

A name maps to a `BackendKind`: what the coordinator and the CLI need of a backend before there is
a run (`open` one for a run, `reattach` a run's processes from its record, `preview` where the tasks
would go, `check` the hosts). Nothing is imported until a name is asked for: `local` never loads
paramiko, and a broken plugin troubles only the runs that name it. An unknown name is an error that
lists the registered ones, never a fall-through to some default.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from orchestrator.errors import UsageError, did_you_mean

if TYPE_CHECKING:
    from orchestrator.launch.api import Backend, CheckReport, Leftovers
    from orchestrator.launch.placement import Placement
    from orchestrator.spec.model import ClusterSpec

#: The entry-point group a package registers its backends in (name = the spec's `backend:`).
GROUP = "tf_orchestrate.backends"
#: The built-in backends: name -> "module:attribute" of their kind, imported when first asked for.
BUILTIN = {
    "local": "orchestrator.launch.kinds:LOCAL",
    "ssh": "orchestrator.launch.kinds:SSH",
    "slurm": "orchestrator.launch.kinds:SLURM",
}


@runtime_checkable
class BackendKind(Protocol):
    """A backend as the coordinator and the CLI find it by name (docs/backends.md)."""

    name: str

    def open(self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path) -> Backend:
        """The backend for one run (not opened yet: `Backend.open` reaches the hosts)."""
        ...

    def reattach(
        self, record: Mapping[str, Any], status: Mapping[str, Any], plan: Mapping[str, Any]
    ) -> Leftovers:
        """A run's processes, from its records alone (`orchestrate down` once its coordinator died)."""
        ...

    def preview(
        self, spec: ClusterSpec, run_id: str, run_dir: Path, spec_dir: Path
    ) -> tuple[dict[str, Placement], str]:
        """Where the tasks would run, reaching nothing (`orchestrate plan`), and a note."""
        ...

    def check(self, spec: ClusterSpec) -> CheckReport | None:
        """`orchestrate check`: the report, or None where there is nothing to check."""
        ...


class UnknownBackend(UsageError):
    """A backend name nothing registered."""


_loaded: dict[str, BackendKind] = {}
_lock = threading.Lock()


def names() -> list[str]:
    """Every registered name: the built-in ones, then the installed packages' (sorted)."""
    return [*BUILTIN, *sorted(set(_entry_points()) - set(BUILTIN))]


def is_registered(name: str) -> bool:
    """Whether `name` is a backend's (a built-in one's without reading any package's metadata)."""
    return name in BUILTIN or name in _entry_points()


def get(name: str) -> BackendKind:
    """The backend kind registered as `name`; UnknownBackend (with the likely one meant) otherwise,
    or when what a package registered cannot be loaded."""
    with _lock:
        kind = _loaded.get(name)
        if kind is None:
            kind = _loaded[name] = _load(name)
        return kind


def _load(name: str) -> BackendKind:
    if name in BUILTIN:
        module, _, attribute = BUILTIN[name].partition(":")
        kind = getattr(importlib.import_module(module), attribute)
        source = BUILTIN[name]
    else:
        point = _entry_points().get(name)
        if point is None:
            raise UnknownBackend(unknown_message(name))
        source = f"{point.value} (package {point.dist.name if point.dist else '?'})"
        try:
            kind = point.load()
        except Exception as exc:  # noqa: BLE001 - any failure of someone else's package, said plainly
            raise UnknownBackend(
                f"backend {name!r}: cannot load {source}: {type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(kind, BackendKind) or kind.name != name:
        raise UnknownBackend(
            f"backend {name!r}: {source} is not a backend kind named {name!r} "
            "(an object with name, open, reattach, preview and check: docs/backends.md)"
        )
    return kind


def unknown_message(name: str) -> str:
    """`no backend 'sluurm' (did you mean 'slurm'?); registered: local, ssh, slurm`."""
    known = names()
    guess = did_you_mean(name, known)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    return f"no backend {name!r}{hint}; registered: {', '.join(known)}"


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {point.name: point for point in metadata.entry_points(group=GROUP)}
