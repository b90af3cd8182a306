"""Launch layer: the worker runtime's files a backend runs on a host, each alone (standard library
only, nothing installed there first): the shim that runs a task, the probe of a host's facts and
ports, and a state folder's modes (`python -c SOURCE MODE …`)."""

from __future__ import annotations

from pathlib import Path

RUNTIME_ROOT = Path(__file__).resolve().parents[2]  # the folder holding worker/
SHIM = RUNTIME_ROOT / "worker" / "shim.py"
PROBE_SOURCE = (RUNTIME_ROOT / "worker" / "probe.py").read_text(encoding="utf-8")
FOLDERS_SOURCE = (RUNTIME_ROOT / "worker" / "folders.py").read_text(encoding="utf-8")
ENVIRONMENT_SOURCE = (RUNTIME_ROOT / "worker" / "environment.py").read_text(encoding="utf-8")
#: worker/folders.py's modes (the others are worker/probe.py's).
FOLDER_MODES = ("tree", "stamp", "commit", "shared", "pack", "unpack")


def source_for(mode: str) -> str:
    """The source that runs `mode`: worker/folders.py's for a state folder's, else the probe's."""
    return FOLDERS_SOURCE if mode in FOLDER_MODES else PROBE_SOURCE
