"""Coordinator: wires the layers for `orchestrate up` — spec → backend (placements) → plan →
supervisor, with the heartbeat server, the run record, the console view and signal handling.

Whatever happens (a failure, Ctrl-C, SIGTERM, a bug of ours), every task started is stopped
before this returns.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import psutil

from orchestrator import launch, rundir
from orchestrator.errors import LaunchError, RunDirError, UsageError
from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer, connection_cap, connections_needed
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Backend, Heartbeats
from orchestrator.launch.placement import Placement
from orchestrator.logtail import LogTailer
from orchestrator.plan import LaunchPlan, make_plan
from orchestrator.quiet import ConsoleFilter, console_writes_anything
from orchestrator.record import (
    RunRecord,
    ensure_free,
    make_private_dir,
    new_run_dir,
    new_run_id,
    now_iso,
    private_open,
    share_with_group,
)
from orchestrator.spec.load import redact_text
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.records import SupervisorResult
from orchestrator.supervise.states import ClusterState
from orchestrator.supervise.supervisor import Supervisor
from orchestrator.view import LiveView, PlainView, View

if TYPE_CHECKING:
    from orchestrator.web.server import WebServer

log = logging.getLogger("orchestrator")


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
        from orchestrator.view import progress_of

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


def status_interval_s(tasks: int) -> float:
    """How fresh status.json and the live view keep steps and metrics (transitions are written at
    once): every second, or less often past 500 tasks, where one costs ~17 ms a thousand tasks (P6)."""
    return max(1.0, tasks / 500)


def up(
    spec: ClusterSpec,
    spec_path: Path | None,
    *,
    spec_text: str | None = None,
    spec_dir: Path | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
    live: bool | None = None,
    config_overrides: dict[str, float] | None = None,
    backend: Backend | None = None,
    backend_option: str | None = None,
    view: View | None = None,
    progress_every_s: float = 15.0,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    stop: StopRequest | None = None,
    web: tuple[str, int] | None = ("127.0.0.1", 0),
    own_process: bool = False,
) -> RunResult:
    """Run the job to its end, from any thread (signals are caught only on the main one).

    `live`: the live view (True), plain lines (False), by the terminal (None); `view`: another
    (`orchestrator.up` passes a silent one); `backend`: the spec's unless given (the capacity
    benchmark gives one whose tasks are simulated); `backend_option`: the --backend given, for the
    command that resumes the run; `on_event`: called with every events.jsonl line, as written;
    `stop`: a way to stop the run from another thread. `web`: where the run's page and metrics
    are served (None: not at all). `own_process`: the process is the run's alone (the CLI), so
    its start-up objects may be frozen out of the garbage collector's way. A spec that is not a
    file (the Python API's dict) comes as `spec_path` None, with its text and the folder its paths
    are relative to."""
    if spec_path is not None:
        spec_text, spec_dir = spec_path.read_text(encoding="utf-8"), spec_path.resolve().parent
    assert spec_text is not None and spec_dir is not None
    _raise_open_files_limit()
    run_id, first_attempt, restarts = (
        _resume_point(run_dir, spec, spec_path) if resume else (new_run_id(spec.name), 0, 0)
    )
    run_dir, record = _open_record(run_dir, spec)
    credentials = Credentials()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(record.close)
        backend = backend or launch.open_backend(spec, run_id, run_dir, spec_dir)
        cleanup.callback(backend.close)
        if resume:
            record.event(kind="resume", attempt=first_attempt, reason=f"resumed with attempt {first_attempt}")
        record.write_spec(redact_text(spec_text, spec.secret_names()))
        store = HealthStore(time.monotonic, on_points=record.metrics)
        server = cleanup.enter_context(_heartbeat_server(backend, store, credentials, spec))
        view = view or _console_view(live, progress_every_s)
        cleanup.callback(view.close)
        for listener in (view.event, on_event):
            if listener is not None:
                record.listen(listener)
        again = _resume_argv(spec_path, run_dir, backend_option)
        # who supervises the run, before its page is served: a resumed run's page never takes the
        # coordinator that wrote the run before for this one, gone (its `stale` rule)
        record.write_coordinator(_coordinator_info(run_id, server.url, again))
        urls = _serve_page(cleanup, run_dir, web, view)
        # tunnels end on loopback
        placements = backend.open(Heartbeats("127.0.0.1", server.port, server.url, credentials))
        planner = _Planner(spec, run_id, placements, record, credentials, backend)
        plan = planner({})
        if record.broken:
            raise LaunchError(f"{record.broken}; nothing was started")
        console = ConsoleFilter()  # TF's start-up noise and traceback frames stay in the log files
        tailer = _tail_logs(plan, record, view, console)
        cleanup.callback(tailer.stop)
        supervisor = Supervisor(
            plan,
            backend,
            store,
            record,
            credentials.task_token,
            SupervisorConfig.from_spec(spec, **(config_overrides or {})),
            on_change=_StatusWriter(record, view, tailer, status_interval_s(len(plan.tasks)), urls),
            first_attempt=first_attempt,
            restarts=restarts,
            replan=planner,
        )
        cleanup.callback(_leave_nothing_running, supervisor)
        if stop is not None:
            stop.attach(supervisor)
        if own_process:
            # start-up's objects (the page's modules among them) live as long as the run: frozen, a full
            # collection no longer walks them — a pause in the heartbeat thread (P6's p99 doubled)
            gc.freeze()
        with _stop_on_signals(supervisor):
            result = supervisor.run()
        home = _bring_home(backend, supervisor.plan, record)
        tailer.stop()  # the last lines, before the count of those held back
        return RunResult(run_dir, result, supervisor.plan, tuple(home), supervisor.status(), console.hidden)


def _serve_page(
    cleanup: contextlib.ExitStack, run_dir: Path, web: tuple[str, int] | None, view: View
) -> dict[str, str]:
    """The run's page and /metrics, served while the run lives (until `cleanup`); their addresses."""
    if web is None:
        return {}
    page = cleanup.enter_context(_web_server(run_dir, web))
    view.notice(f"the run's page: {page.page_url}   (Prometheus: {page.metrics_url})")
    return {"page": page.page_url, "metrics": page.metrics_url}


def _console_view(live: bool | None, progress_every_s: float) -> View:
    """The live view on a terminal (or when asked), plain lines otherwise."""
    console_writes_anything()
    on_tty = sys.stdout.isatty() if live is None else live
    return LiveView() if on_tty else PlainView(progress_every_s=progress_every_s)


def _resume_argv(spec_path: Path | None, run_dir: Path, backend_option: str | None) -> list[str] | None:
    """The command that continues this run from its checkpoints (none for a spec that is no file)."""
    if spec_path is None:
        return None
    again = ["orchestrate", "up", str(spec_path.resolve()), "--resume", str(run_dir.resolve())]
    return again + (["--backend", backend_option] if backend_option else [])


def _tail_logs(plan: LaunchPlan, record: RunRecord, view: View, console: ConsoleFilter) -> LogTailer:
    """The tasks' log lines to the view, through the console's filter."""

    def show(task: str, line: str) -> None:
        for shown in console(task, line):
            view.log_line(task, shown)

    return LogTailer({t.name: record.log_path(t.log_name) for t in plan.tasks}, show).start()


def _open_record(run_dir: Path | None, spec: ClusterSpec) -> tuple[Path, RunRecord]:
    """The run directory, created 0700, and its record (its lock taken: one coordinator at a time)."""
    share_with_group(spec.record.share_with_group)
    try:
        run_dir = run_dir or new_run_dir(spec.name)
        return run_dir, RunRecord(run_dir)
    except OSError as exc:
        where = run_dir or exc.filename or "runs/"
        raise LaunchError(f"cannot write the run directory {where}: {exc.strerror or exc}") from None


class _Planner:
    """The plan from the spec and the backend's placements, made again when the backend moves a
    task between attempts; each one written to plan.json, with the backend's record (a task moved
    to a spare node, a new allocation) to backend.json."""

    def __init__(
        self,
        spec: ClusterSpec,
        run_id: str,
        placements: Mapping[str, Placement],
        record: RunRecord,
        credentials: Credentials,
        backend: Backend,
    ):
        self._spec, self._run_id, self._record = spec, run_id, record
        self._placements = dict(placements)
        self._credentials = credentials
        self._backend = backend
        self._backend_record: dict[str, Any] | None = None

    def __call__(self, moved: Mapping[str, Placement]) -> LaunchPlan:
        self._placements.update(moved)
        plan = make_plan(self._spec, self._run_id, self._placements)
        self._record.write_plan(plan.to_json())
        if (backend := self._backend.record()) != self._backend_record:
            self._record.write_backend(backend)
            self._backend_record = backend
        self._credentials.place({t.name: t.host_index for t in plan.tasks})  # whose key signs a task's
        return plan


class _StatusWriter:
    """After each supervisor step: a transition is written at once; heartbeat news (steps,
    metrics) once per interval — with many tasks, status.json and the view are the coordinator's
    largest cost."""

    def __init__(
        self, record: RunRecord, view: View, tailer: LogTailer, every_s: float, urls: Mapping[str, str]
    ):
        self._record, self._view, self._tailer, self._every_s = record, view, tailer, every_s
        self._urls = dict(urls)
        self._transitions, self._written_at, self._state = -1, 0.0, ""

    def __call__(self, sup: Supervisor) -> None:
        now = time.monotonic()
        if sup.transitions == self._transitions and now - self._written_at < self._every_s:
            return
        self._transitions, self._written_at = sup.transitions, now
        if self._record.broken and not sup.state.is_terminal:  # a full or read-only disk
            sup.abort(f"{self._record.broken}; the job is stopped, the record kept as it was")
        status = sup.status()
        if self._urls and not sup.state.is_terminal:  # while the run lives (its page goes with it)
            status["urls"] = self._urls
        if status["state"] != self._state:
            self._tailer.poll()  # the tasks' last words come before the news of their end
            self._state = status["state"]
        self._record.write_status(status)
        self._record.flush()
        self._view.update(status)


@contextlib.contextmanager
def _heartbeat_server(
    backend: Backend, store: HealthStore, credentials: Credentials, spec: ClusterSpec
) -> Iterator[HeartbeatServer]:
    tasks = len(task_slots(spec))
    cap = connection_cap(tasks)
    if cap < connections_needed(tasks):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise LaunchError(
            f"the open-files limit ({soft}) is too low for {tasks} tasks: it leaves {max(cap, 0)} heartbeat "
            f"connections, they need {connections_needed(tasks)}; raise it (`ulimit -n "
            f"{soft - cap + connections_needed(tasks)}` or more) and start again"
        )
    host, port = backend.listen()
    # an idle connection is closed after several heartbeat timeouts (a task reconnects at once)
    idle_s = max(60.0, 3 * spec.health.heartbeat_timeout_s)
    try:
        server = HeartbeatServer(
            store, credentials, host=host, port=port, max_connections=cap, idle_s=idle_s
        ).start()
    except OSError as exc:
        key = f" ({backend.listen_key})" if backend.listen_key else ""
        raise LaunchError(
            f"cannot listen for heartbeats on {host}:{port}{key}: {exc.strerror or exc}"
        ) from None
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def _web_server(run_dir: Path, where: tuple[str, int]) -> Iterator[WebServer]:
    from orchestrator.web.server import serve_run

    server = serve_run(run_dir, *where)
    try:
        yield server
        server.linger()  # a page open now is shown how the run ended (bounded: ~1 s, at most 2.5)
    finally:
        server.close()


def _coordinator_info(run_id: str, url: str, resume_argv: list[str] | None) -> dict[str, Any]:
    me = psutil.Process()
    return {
        "run_id": run_id,
        "pid": me.pid,
        "create_time": me.create_time(),
        "started_at": now_iso(),
        "heartbeat_url": url,
        "resume_argv": resume_argv,  # what continues this run from its checkpoints (`down` says it)
    }


def _bring_home(backend: Backend, plan: LaunchPlan, record: RunRecord) -> list[str]:
    started = time.monotonic()
    home = backend.bring_home(plan)
    took_s = round(time.monotonic() - started, 3)
    for line in home:
        record.event(kind="results", reason=line, seconds=took_s)
    return home


def _leave_nothing_running(supervisor: Supervisor) -> None:
    """Only a bug of ours ends `up` before the supervisor's own teardown: still, stop everything."""
    if not supervisor.state.is_terminal:
        left = supervisor.stop_now(grace_s=2.0)
        if left:
            log.error("could not confirm the exit of %s", ", ".join(left))


def _raise_open_files_limit() -> None:
    """Per task the coordinator holds a port lock, a heartbeat connection and a log file: the
    usual soft limit of 1,024 open files ends near 300 tasks. Raise it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _resume_point(run_dir: Path | None, spec: ClusterSpec, spec_path: Path | None) -> tuple[str, int, int]:
    """The run id, attempt number and restart count a resumed run continues with: the same run
    goes on, its id names its folders on the hosts (and their checkpoints)."""
    if run_dir is None:
        raise UsageError("--resume needs the run directory")
    try:
        status = rundir.read_status(run_dir)
    except RunDirError as exc:
        raise UsageError(f"--resume {run_dir}: {exc}") from None
    if status.get("name") != spec.name:
        raise UsageError(
            f"--resume {run_dir}: that run is {status.get('name')!r}, this spec is {spec.name!r}; "
            "resume a run with the spec that started it"
        )
    state = ClusterState(status.get("state", "PENDING"))
    if not state.is_terminal and rundir.coordinator_alive(run_dir):
        raise UsageError(f"--resume {run_dir}: that run is still going (state {state.value})")
    if state is ClusterState.SUCCEEDED:
        raise UsageError(
            f"--resume {run_dir}: that run SUCCEEDED ({status.get('reason', '')}) "
            f"at {status.get('ended_at')}; "
            "there is nothing to resume — start a new run"
            + (f": orchestrate up {spec_path}" if spec_path is not None else "")
        )
    run_id = status.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise UsageError(f"--resume {run_dir}: its status.json records no run_id")
    return run_id, int(status.get("attempt", 0)) + 1, int(status.get("restarts", 0))


class _stop_on_signals:
    """SIGINT/SIGTERM/SIGHUP: the first asks for a clean stop, the second for an immediate one."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, supervisor: Supervisor):
        self._supervisor = supervisor
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._supervisor.request_stop(f"interrupted by {name}")

    def __enter__(self) -> _stop_on_signals:
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
