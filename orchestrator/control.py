"""What a caller holds of a run: the options `orchestrate up` starts it with (`UpOptions`), what it
is shown through (`View`; the CLI's console views are orchestrator/cli/view.py's), a way to stop it
from another thread (`StopRequest`) or a signal, how it ended (`RunResult`), a coordinator
started in the background (`detach`), and a run stopped from another terminal (`down`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from orchestrator.launch.api import Backend
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.record.read import (
    coordinator_alive,
    diverged,
    has_ended,
    read_record,
    read_status,
    resume_command,
    unconfirmed_tasks,
)
from orchestrator.record.write import ensure_free, make_private_dir, private_open
from orchestrator.states import ClusterState
from orchestrator.supervise.records import SupervisorResult

if TYPE_CHECKING:
    from orchestrator.supervise.supervisor import Supervisor


class View(Protocol):
    """What the coordinator tells a view: the tasks' log lines, the record's events as written,
    and the status document after each change (and about once a second)."""

    def log_line(self, task: str, line: str) -> None: ...

    def event(self, event: Mapping[str, Any]) -> None: ...

    def notice(self, text: str) -> None: ...

    def update(self, status: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class SilentView:
    """Shows nothing (the Python API's default: the caller has the events and the record)."""

    def log_line(self, task: str, line: str) -> None:
        pass

    def event(self, event: Mapping[str, Any]) -> None:
        pass

    def notice(self, text: str) -> None:
        pass

    def update(self, status: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class UpOptions:
    """How `orchestrate up` runs a job (every field has the CLI's default)."""

    run_dir: Path | None = None  # the run directory (default: runs/<name>-<time>); --resume's run
    resume: bool = False  # continue the run in run_dir from its checkpoints
    config_overrides: Mapping[str, float] | None = None  # the supervisor's knobs, over the spec's
    backend: Backend | None = None  # the spec's unless given (the capacity benchmark simulates tasks)
    backend_option: str | None = None  # the --backend given, for the command that resumes the run
    view: View | None = None  # how the run is shown (None: not at all; the CLI passes its console's)
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
        from orchestrator.record.progress import progress_of

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


def down(run_dir: Path, grace_s: float = 10.0, out: Any = None) -> int:
    """Stop a run from outside. Idempotent: a run already stopped is left as it is (exit 0).

    Its coordinator is asked first. The places its tasks ran (launch.reattach, from the backend's
    record) are asked only when the coordinator may have left something: it died mid-run, or it
    could not confirm that a task had exited (a host cut off)."""
    from orchestrator import launch  # its backends' packages: only when a run is stopped from here

    out = out if out is not None else sys.stdout
    pid = coordinator_alive(run_dir)
    if pid is not None:
        out.write(f"asking the coordinator (pid {pid}) to stop the run…\n")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 20
        while time.monotonic() < deadline and coordinator_alive(run_dir) is not None:
            time.sleep(0.1)
        if coordinator_alive(run_dir) is not None:
            os.kill(pid, signal.SIGTERM)  # second signal: immediate teardown
            time.sleep(3)
    status = read_status(run_dir)
    ok = True
    if not has_ended(status) or unconfirmed_tasks(run_dir):
        record = read_record(run_dir, "backend.json")
        if record is not None:  # without it, nothing was started
            out.write("coordinator gone; stopping what is left of the run…\n")
            plan = read_record(run_dir, "plan.json") or {}
            for line, reached in launch.reattach(record, status, plan).stop(grace_s):
                out.write(line + "\n")
                ok = ok and reached
    status = read_status(run_dir)
    out.write(f"run {status.get('name')}: {status.get('state')} ({status.get('reason', '')})\n")
    again = resume_command(run_dir)
    if again is not None and status.get("state") != ClusterState.SUCCEEDED.value and not diverged(status):
        out.write(f"continue it from its checkpoints: {again}\n")
    return 0 if ok else 1
