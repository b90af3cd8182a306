"""Launch layer: the Launcher interface and the live handle of one task's process.

A launcher starts each task in its own process group (session), so stopping a task means one
signal to one group — never a search by process name. `stop()` is SIGTERM, a grace period, then
SIGKILL, and returns only when the group is gone.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.plan import HostContext, LaunchPlan, TaskPlan


@dataclass(frozen=True)
class ProcessInfo:
    """What a status reader needs to find (and safely stop) a task's process later."""

    pid: int
    pgid: int
    create_time: float  # guards against a recycled pid


class TaskHandle(abc.ABC):
    """One running attempt of one task."""

    def __init__(self, task: TaskPlan, attempt: int, log_path: Path):
        self.task = task
        self.attempt = attempt
        self.log_path = log_path

    @property
    @abc.abstractmethod
    def process(self) -> ProcessInfo: ...

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code once the task's main process has exited (negative: killed by that signal)."""


class Launcher(abc.ABC):
    def prepare(
        self, ports: Mapping[str, int], heartbeat: tuple[str, int], direct_url: str | None
    ) -> dict[int, HostContext]:
        """Reach and check every host before planning (nothing starts if one fails); what the
        planner needs to know of each. `heartbeat` is the coordinator's local server."""
        return {}

    def hosts_record(self) -> dict[str, Any] | None:
        """How to reach the hosts later (`orchestrate down` without a coordinator); None if local."""
        return None

    def deploy(self, plan: LaunchPlan) -> None:
        """Put what the tasks need (code, runtime) where they run."""
        return None

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> list[str]:
        """Give every host what the attempt needs of the earlier ones: where hosts share no disk,
        the owner's latest checkpoint (plan.state). Lines for the record; LaunchError if it fails.
        Nothing to do where every task sees one folder (the local backend)."""
        return []

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """At the end of the run, whatever its outcome: copy the results (model, TensorBoard,
        the latest checkpoint) into the run directory. Lines for the summary; never raises."""
        return []

    @abc.abstractmethod
    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        """Start one task; raises LaunchError when it cannot be started at all."""

    def start_all(
        self, tasks: list[TaskPlan], attempt: int, token: str, log_paths: list[Path]
    ) -> list[TaskHandle | LaunchError]:
        """Start every task (a launcher may do it in parallel); per task, its handle or its error."""
        out: list[Any] = []
        for task, log_path in zip(tasks, log_paths, strict=True):
            try:
                out.append(self.start(task, attempt, token, log_path))
            except LaunchError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    def stop(self, handles: list[TaskHandle], grace_s: float, hurry: threading.Event | None = None) -> None:
        """SIGTERM every handle's process group, wait up to `grace_s` (less once `hurry` is set),
        SIGKILL what is left, and return when no process of any group remains."""

    def close(self) -> None:
        """Release what the launcher holds (connections). Running tasks must be stopped first."""
        return None  # nothing to release by default
