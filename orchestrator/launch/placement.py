"""Launch layer: where each task runs, as its backend places it — the planner's only input
beyond the spec (plan.make_plan is a pure function of the two).

Each backend's placing rule is a pure function in its package (`local/placement.py`, …), without
its transport, so that `orchestrate plan` shows a placement without connecting anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.spec.model import ClusterSpec


@dataclass(frozen=True)
class Placement:
    """Where and how one task runs."""

    host: str  # the address its peers reach it at (TF_CONFIG)
    port: int  # its TF server's port
    run_folder: str  # the run's folder on its host (ORCHESTRATE_RUN_DIR)
    python: tuple[str, ...]  # the interpreter there (a command, possibly several words)
    cwd: str
    coordinator_url: str  # where its heartbeats go
    host_index: int = 0  # its host in the spec
    code_root: str | None = None  # where the job's folder is copied on its host; None: used in place
    pythonpath: tuple[str, ...] = ()  # put first on PYTHONPATH (a copied worker runtime)
    env: Mapping[str, str] = field(default_factory=dict)  # what the backend adds to the task's env


def job_files_root(spec: ClusterSpec) -> Path:
    """The folder copied to hosts that share no disk with this one (job.files, or the job's own
    folder)."""
    entry = spec.job.script or spec.job.loop
    assert entry is not None
    return spec.job.files or entry.parent
