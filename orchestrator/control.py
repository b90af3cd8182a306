"""What a caller holds of a run: the options `orchestrate up` starts it with (`UpOptions`), a way to
stop it from another thread (`StopRequest`) or a signal, how it ended (`RunResult`), and a
coordinator started in the background (`detach`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import psutil

from orchestrator.launch.api import Backend
from orchestrator.plan import LaunchPlan
from orchestrator.record import ensure_free, make_private_dir, private_open
from orchestrator.supervise.records import SupervisorResult
from orchestrator.supervise.states import ClusterState

if TYPE_CHECKING:
    from orchestrator.supervise.supervisor import Supervisor
    from orchestrator.view import View


@dataclass(frozen=True)
class UpOptions:
    """How `orchestrate up` runs a job (every field has the CLI's default)."""

    run_dir: Path | None = None  # the run directory (default: runs/<name>-<time>); --resume's run
    resume: bool = False  # continue the run in run_dir from its checkpoints
    live: bool | None = None  # the live view (True), plain lines (False), by the terminal (None)
    config_overrides: Mapping[str, float] | None = None  # the supervisor's knobs, over the spec's
    backend: Backend | None = None  # the spec's unless given (the capacity benchmark simulates tasks)
    backend_option: str | None = None  # the --backend given, for the command that resumes the run
    view: View | None = None  # another view (`orchestrator.up` passes a silent one)
    progress_every_s: float = 15.0  # plain lines: a progress line this often
    on_event: Callable[[dict[str, Any]], None] | None = None  # every events.jsonl line, as written
    stop: StopRequest | None = None  # a way to stop the run from another thread
    web: tuple[str, int] | None = ("127.0.0.1", 0)  # where the run's page is served (None: not at all)
    own_process: bool = False  # the process is the run's alone (the CLI): start-up objects frozen


@dataclass(frozen=True)
class RunResult:
    """How a run ended (what `orchestrator.up` returns): its record, the supervisor's outcome, the
    plan it ended with and its last status.json."""

    run_dir: Path
    result: SupervisorResult
    plan: LaunchPlan
    brought_home: tuple[str, ...] = ()  # results copied from the hosts into run_dir
    status: Mapping[str, Any] = field(default_factory=dict)  # the last status.json
    hidden_lines: int = 0  # task output left off the console (TF's start-up noise, traceback frames)

    @property
    def state(self) -> ClusterState:
        return self.result.state

    @property
    def ok(self) -> bool:
        return self.result.state is ClusterState.SUCCEEDED

    @property
    def exit_code(self) -> int:
        """`orchestrate up`'s: 0 ok, 1 failed, 3 not launched, 130 interrupted."""
        code = self.result.exit_code
        assert code is not None  # a run returned has ended
        return code

    @property
    def reason(self) -> str:
        return self.result.reason

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def metrics(self) -> dict[str, float]:
        """The final reported values: the leading training task's, then the evaluator's."""
        from orchestrator.progress import progress_of

        progress = progress_of(self.status)
        return {**progress.metrics, **progress.eval_metrics}


class StopRequest:
    """A way to stop a run from another thread (`orchestrator.start(…).stop()`): the first call asks
    for a clean stop, the second for an immediate one — as Ctrl-C does on the console."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._supervisor: Supervisor | None = None
        self._asked: list[str] = []

    def __call__(self, reason: str = "stopped by the caller") -> None:
        with self._lock:
            self._asked.append(reason)
            supervisor = self._supervisor
        if supervisor is not None:
            supervisor.request_stop(reason)

    def attach(self, supervisor: Supervisor) -> None:
        with self._lock:
            self._supervisor = supervisor
            asked = list(self._asked)
        for reason in asked:
            supervisor.request_stop(reason)


class stop_on_signals:
    """SIGINT/SIGTERM/SIGHUP: the first asks for a clean stop, the second for an immediate one."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, supervisor: Supervisor):
        self._supervisor = supervisor
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._supervisor.request_stop(f"interrupted by {name}")

    def __enter__(self) -> stop_on_signals:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only: its handlers stay
        for sig in self._SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def detach(argv: list[str], run_dir: Path) -> int:
    """Start `orchestrate up` again in the background, in its own session; return its pid."""
    ensure_free(run_dir)
    make_private_dir(run_dir)
    with private_open(run_dir / "coordinator.log") as out:
        proc = psutil.Popen(
            [sys.executable, "-m", "orchestrator", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return proc.pid
