"""Launch layer: the backends by name — the three built in (`local`, `ssh`, `slurm`) and any that an
installed package registers under the entry-point group `tf_orchestrate.backends` (as pytest finds
its plugins and submitit its executors).

A name maps to a `Kind` (launch/kind.py): what the coordinator, the CLI and the spec need of a
backend before there is a run. Nothing is imported until a name is asked for: `local` never loads
paramiko, and a broken plugin troubles only the runs that name it. An unknown name is an error that
lists the registered ones, never a fall-through to some default.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import TYPE_CHECKING

from orchestrator.errors import UsageError, did_you_mean
from orchestrator.launch.kind import Kind

if TYPE_CHECKING:  # imported where a name is not a built-in one's
    from importlib import metadata

#: The entry-point group a package registers its backends in (name = the spec's `backend:`).
GROUP = "tf_orchestrate.backends"
#: The built-in backends: name -> "module:attribute" of their kind, imported when first asked for.
BUILTIN = {
    "local": "orchestrator.launch.local:KIND",
    "ssh": "orchestrator.launch.ssh:KIND",
    "slurm": "orchestrator.launch.slurm:KIND",
}


class UnknownBackend(UsageError):
    """A backend name nothing registered."""


_loaded: dict[tuple[str, str], Kind] = {}  # (name, what registers it) -> its kind
_lock = threading.Lock()


def names() -> list[str]:
    """Every registered name: the built-in ones, then the installed packages' (sorted)."""
    return [*BUILTIN, *sorted(set(_entry_points()) - set(BUILTIN))]


def is_registered(name: str) -> bool:
    """Whether `name` is a backend's (a built-in one's without reading any package's metadata)."""
    return name in BUILTIN or name in _entry_points()


def get(name: str) -> Kind:
    """The backend kind registered as `name`; UnknownBackend (with the likely one meant) otherwise,
    or when what a package registered cannot be loaded. Each is loaded once (per what registers
    it: a package installed meanwhile in its place is loaded anew)."""
    if name in BUILTIN:
        source = BUILTIN[name]
        point = None
    else:
        point = _entry_points().get(name)
        if point is None:
            raise UnknownBackend(unknown_message(name))
        source = f"{point.value} (package {point.dist.name if point.dist else '?'})"
    with _lock:
        kind = _loaded.get((name, source))
        if kind is None:
            kind = _loaded[(name, source)] = _load(name, source, point)
        return kind


def _load(name: str, source: str, point: metadata.EntryPoint | None) -> Kind:
    if point is None:
        module, _, attribute = source.partition(":")
        kind = getattr(importlib.import_module(module), attribute)
    else:
        try:
            kind = point.load()
        except Exception as exc:  # noqa: BLE001 - any failure of someone else's package, said plainly
            raise UnknownBackend(
                f"backend {name!r}: cannot load {source}: {type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(kind, Kind) or kind.name != name:
        raise UnknownBackend(
            f"backend {name!r}: {source} is not a backend kind named {name!r} "
            "(an instance of a subclass of orchestrator.launch.kind.Kind: docs/backends.md)"
        )
    return kind


def unknown_message(name: str) -> str:
    """`no backend 'sluurm' (did you mean 'slurm'?); registered: local, ssh, slurm`."""
    known = names()
    guess = did_you_mean(name, known)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    return f"no backend {name!r}{hint}; registered: {', '.join(known)}"


_scanned: dict[tuple[str, ...], dict[str, metadata.EntryPoint]] = {}
_scan_lock = threading.Lock()  # apart from _lock: a package's kind, being loaded, may list names


def _entry_points() -> dict[str, metadata.EntryPoint]:
    """The group's entry points, read once per `sys.path` (reading every installed package's
    metadata takes ~2 ms: a spec of 20,000 unknown keys asked it for each). A package added to the
    path is seen at once; one installed into a folder already on it, by the next process."""
    key = tuple(sys.path)
    with _scan_lock:
        found = _scanned.get(key)
        if found is None:
            from importlib import metadata

            found = _scanned[key] = {point.name: point for point in metadata.entry_points(group=GROUP)}
        return found
