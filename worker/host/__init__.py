"""The host room: what runs on a host beside its tasks, alone — the shim that runs one task
(shim.py) and keeps its warm standby (shim_standby.py), the per-host heartbeat relay (relay.py),
the probe of a host's facts and ports (probe.py), a state folder's modes (folders.py), the job's
Python environment (environment.py), a task's stacks read from outside (stacks.py) and its log
followed (follow.py).

A backend runs these files on a host as single files, before anything is installed there
(`python -S FILE`, `python -S -c SOURCE`, from a content-addressed cache): each imports the
standard library only, and loads a sibling (or the wire's http1.py) by its path, never by import.
That is a rule of this folder (tests/unit/test_imports.py). The coordinator and the task room may
import them as modules.

This module says where they are, for the coordinator that sends or runs them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent
WORKER = FOLDER.parent  # the whole runtime, as every host gets it (`lib/worker/`)
RUNTIME_ROOT = WORKER.parent  # the folder holding worker/ (a task's PYTHONPATH)
SHIM = FOLDER / "shim.py"
#: folders.py's modes (the others are probe.py's).
FOLDER_MODES = ("tree", "stamp", "commit", "shared", "pack", "unpack")
_SOURCES = {
    "PROBE_SOURCE": "probe.py",
    "FOLDERS_SOURCE": "folders.py",
    "ENVIRONMENT_SOURCE": "environment.py",
}


def runtime_files() -> list[Path]:
    """Every module of the worker runtime (bytecode caches left out), in order: what a host is
    sent, and what a frame of ours is."""
    return sorted(p for p in WORKER.rglob("*.py") if "__pycache__" not in p.parts)


@functools.cache
def source(name: str) -> str:
    """This room's file `name`, as text: what a host runs as `python -c SOURCE MODE …`."""
    return (FOLDER / name).read_text(encoding="utf-8")


def __getattr__(name: str) -> Any:
    """PROBE_SOURCE, FOLDERS_SOURCE, ENVIRONMENT_SOURCE: a file's source, read when first asked
    for; a task that imports the room reads none."""
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return source(_SOURCES[name])


def source_for(mode: str) -> str:
    """The source that runs `mode`: folders.py's for a state folder's, else the probe's."""
    return source("folders.py" if mode in FOLDER_MODES else "probe.py")
