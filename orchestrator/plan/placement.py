"""Plan room: where each task runs, as its backend places it — the planner's only input
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


@dataclass(frozen=True)
class Machine:
    """A machine of the run, as its backend sees it before an attempt (supervise/members.py
    decides from these where the next attempt runs)."""

    key: str  # the backend's name for it (ssh: its index in hosts; slurm: its node)
    label: str  # for people: its address
    position: int | None = None  # the spec host whose tasks it ran last; None: a spare (or unused)
    lost: str | None = None  # why it is lost ("unreachable", …); None: it answers
    since: str | None = None  # since when (a wall-clock time, for people)

    @property
    def said(self) -> str:
        """`10.0.0.12 (unreachable since 14:02:11)`"""
        if self.lost is None:
            return self.label
        return f"{self.label} ({self.lost}{f' since {self.since}' if self.since else ''})"


@dataclass(frozen=True)
class Relaid:
    """Where the next attempt's tasks run once the backend moved them (`Backend.relayout`): the
    spec's layout (`ClusterSpec.laid_out`'s) and every task's placement under it."""

    runs: dict[int, int | None]
    placements: dict[str, Placement]
