"""Coordinator: wires the layers for `orchestrate up` — spec → backend (placements) → plan →
supervisor, with the heartbeat server, the run record, the console view and signal handling.

Whatever happens (a failure, Ctrl-C, SIGTERM, a bug of ours), every task started is stopped
before this returns. What a caller holds of a run (its options, a way to stop it, its result) is in
control.py; `StopRequest` and `RunResult` are named here too, where callers have found them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import resource
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from orchestrator import launch
from orchestrator import page as page_served
from orchestrator.control import RunResult, SilentView, UpOptions, View, stop_on_signals
from orchestrator.errors import LaunchError
from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer, connection_cap, connections_needed
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Backend, Heartbeats
from orchestrator.launch.exposure import Exposure
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.plan.planner import Planner
from orchestrator.record.logtail import LogTailer
from orchestrator.record.quiet import ConsoleFilter
from orchestrator.record.read import known_folders, resume_point
from orchestrator.record.write import (
    RunRecord,
    new_run_dir,
    new_run_id,
    now_iso,
    share_with_group,
)
from orchestrator.spec.load import redact_text
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from orchestrator.stacks import live as stacks_live
from orchestrator.stacks import record as stacks
from orchestrator.states import ClusterState
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.records import SupervisorResult
from orchestrator.supervise.supervisor import Supervisor
from worker import wire

if TYPE_CHECKING:
    from orchestrator.launch.kind import Kind

    pass

log = logging.getLogger("orchestrator")


def status_interval_s(tasks: int) -> float:
    """How fresh status.json and the live view keep steps and metrics (transitions are written at
    once): every second, or less often past 500 tasks, where one costs ~17 ms a thousand tasks (P6)."""
    return max(1.0, tasks / 500)


def up(
    spec: ClusterSpec,
    spec_path: Path | None,
    options: UpOptions | None = None,
    *,
    spec_text: str | None = None,
    spec_dir: Path | None = None,
) -> RunResult:
    """Run the job to its end, from any thread (signals are caught only on the main one); how, as
    `options` say. A spec that is not a file (the Python API's dict) comes as `spec_path` None,
    with its text and the folder its paths are relative to."""
    o = options or UpOptions()
    if spec_path is not None:
        spec_text, spec_dir = spec_path.read_text(encoding="utf-8"), spec_path.resolve().parent
    assert spec_text is not None and spec_dir is not None
    _raise_open_files_limit()
    run_id, first_attempt, restarts = (
        resume_point(o.run_dir, spec, spec_path) if o.resume else (new_run_id(spec.name), 0, 0)
    )
    run_dir, record = _open_record(o.run_dir, spec)
    credentials = Credentials()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(record.close)
        kind = launch.kind_of(spec)  # looked up once, handed down
        backend = o.backend or kind.open(spec, run_id, run_dir, spec_dir)
        cleanup.callback(backend.close)
        if o.resume:
            record.event(kind="resume", attempt=first_attempt, reason=f"resumed with attempt {first_attempt}")
        record.write_spec(redact_text(spec_text, spec.secret_names()))
        store = HealthStore(time.monotonic, on_points=record.metrics)
        server = cleanup.enter_context(_heartbeat_server(backend, store, credentials, spec))
        view = _shown(o, record, cleanup)
        network = _network(backend, kind, spec)
        again = _resume_argv(spec_path, run_dir, o.backend_option)
        # who supervises it, before its page is served (a resumed run's page: never the one before's)
        record.write_coordinator(_coordinator_info(run_id, server.url, again))
        page_served.check_address(o.web)  # the page itself (~0.4 s of imports) once the job trains
        page = page_served.serve_when(spec, cleanup, run_dir, o.web, view)
        # tunnels end on loopback
        placements = backend.open(_heartbeats(server.port, server.url, credentials, record))
        planner = Planner(spec, run_id, placements, record, credentials, backend)
        plan = planner({})
        if record.broken:
            raise LaunchError(f"{record.broken}; nothing was started")
        console = ConsoleFilter()  # TF's start-up noise and traceback frames stay in the log files
        tailer = _tail_logs(plan, record, view, console)
        cleanup.callback(tailer.stop)
        on_change = _StatusWriter(record, view, tailer, status_interval_s(len(plan.tasks)), page, network)
        supervisor = Supervisor(
            plan,
            backend,
            store,
            record,
            credentials.task_token,
            SupervisorConfig.from_spec(spec, **(o.config_overrides or {})),
            on_change=on_change,
            first_attempt=first_attempt,
            restarts=restarts,
            replan=planner,
            spec=spec,
            job_folders=known_folders(o.run_dir) if o.resume else (),
            keep_stacks=functools.partial(stacks.keep, run_dir),
            degraded=network().fallbacks(),  # said as the run opens, listed while they last
        )
        _answer_stacks(cleanup, run_dir, supervisor)
        result = _supervise(supervisor, o)
        home = _bring_home(backend, supervisor.plan, record)
        tailer.stop()  # the last lines, before the count of those held back
        return RunResult(run_dir, result, supervisor.plan, tuple(home), supervisor.status(), console.hidden)


def _heartbeats(port: int, url: str, credentials: Credentials, record: RunRecord) -> Heartbeats:
    """The heartbeat server as the backend sees it (tunnels end on loopback); what it tells people
    while opening (an environment's making) is an event of the run's."""
    return Heartbeats(
        "127.0.0.1", port, url, credentials, lambda text: record.event(kind="environment", reason=text)
    )


def _answer_stacks(cleanup: contextlib.ExitStack, run_dir: Path, supervisor: Supervisor) -> None:
    """`orchestrate stacks` on this run, answered while it lives (until `cleanup`, which stops
    whatever still runs first)."""
    cleanup.callback(_leave_nothing_running, supervisor)
    asked = stacks_live.Answerer(
        run_dir,  # the tasks of the attempt that runs (a lost host's moved, or left out)
        lambda: [
            r.handle
            for r in list(supervisor.tasks.values())
            if r.handle is not None and not r.state.is_terminal
        ],
        supervisor.config.stacks_timeout_s or 5.0,
    )
    cleanup.callback(asked.start().close)


def _supervise(supervisor: Supervisor, o: UpOptions) -> SupervisorResult:
    """The run, supervised to its end; stopped by the caller's StopRequest or a signal."""
    if o.stop is not None:
        o.stop.attach(supervisor)
    if o.own_process:
        # start-up's objects (the page's modules among them) live as long as the run: frozen, a full
        # collection no longer walks them — a pause in the heartbeat thread (P6's p99 doubled)
        gc.freeze()
    with stop_on_signals(supervisor):
        return supervisor.run()


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


class _StatusWriter:
    """After each supervisor step: a transition is written at once; heartbeat news (steps,
    metrics) once per interval — with many tasks, status.json and the view are the coordinator's
    largest cost."""

    def __init__(
        self,
        record: RunRecord,
        view: View,
        tailer: LogTailer,
        every_s: float,
        page: Callable[[], Mapping[str, str]],
        network: Callable[[], Exposure],
    ):
        self._record, self._view, self._tailer, self._every_s = record, view, tailer, every_s
        self._network = network  # from where the run's TF ports can be reached (pasta may end)
        self._page: Callable[[], Mapping[str, str]] | None = page  # served once the job trains
        self._page_by = time.monotonic() + PAGE_AT_THE_LATEST_S
        self._urls: dict[str, str] = {}
        self._transitions, self._written_at, self._state = -1, 0.0, ""

    def __call__(self, sup: Supervisor) -> None:
        now = time.monotonic()
        if self._page is not None and not sup.state.is_terminal and (now >= self._page_by or _trains(sup)):
            page, self._page = self._page, None
            try:
                self._urls = dict(page())
            except LaunchError as exc:  # its address taken meanwhile: the run goes on without it
                log.warning("%s; the run goes on without its page", exc)
        if sup.transitions == self._transitions and now - self._written_at < self._every_s:
            return
        self._transitions, self._written_at = sup.transitions, now
        if self._record.broken and not sup.state.is_terminal:  # a full or read-only disk
            sup.abort(f"{self._record.broken}; the job is stopped, the record kept as it was")
        status = sup.status()
        status["network"] = self._network().to_json()
        if self._urls and not sup.state.is_terminal:  # while the run lives (its page goes with it)
            status["urls"] = self._urls
        if status["state"] != self._state:
            self._tailer.poll()  # the tasks' last words come before the news of their end
            self._state = status["state"]
        self._record.write_status(status)
        self._record.flush()
        self._view.update(status)


#: The run's page is served once the job has trained a step (importing its modules takes
#: ~0.4 s of a core that the tasks' own TensorFlow imports and first step need: P1), at the latest
#: this long after the coordinator began supervising.
def _shown(o: UpOptions, record: RunRecord, cleanup: contextlib.ExitStack) -> View:
    """The run's view (the options', else none), told every event as the record writes it; the
    caller's `on_event` too."""
    view = o.view or SilentView()
    cleanup.callback(view.close)
    for listener in (view.event, o.on_event):
        if listener is not None:
            record.listen(listener)
    return view


PAGE_AT_THE_LATEST_S = 20.0


def _trains(sup: Supervisor) -> bool:
    """A task of the job reported a step, or its attempt is over (stopping, restarting)."""
    if sup.state in (ClusterState.PENDING, ClusterState.LAUNCHING) or sup.state.is_terminal:
        return False
    return sup.state is not ClusterState.RUNNING or any(
        r.health is not None and r.health.first_step_at is not None for r in sup.tasks.values()
    )


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
        where = host.removeprefix(wire.UNIX_SCHEME) if host.startswith(wire.UNIX_SCHEME) else f"{host}:{port}"
        raise LaunchError(f"cannot listen for heartbeats on {where}{key}: {exc.strerror or exc}") from None
    try:
        yield server
    finally:
        server.close()


def _network(backend: Backend, kind: Kind, spec: ClusterSpec) -> Callable[[], Exposure]:
    """From where the run's TF ports can be reached and what its tasks reach, as its backend says
    it now (its pasta may end); where it could have closed them and could not, the `fallbacks`."""
    said = backend.exposure()
    if said is None:  # as its kind says of the spec (asked of no host), where that asks nothing
        unsaid = Exposure(False, "wherever the backend's hosts can be reached", "the backend does not say")
        fixed = unsaid if kind.reach_makes else kind.reach(spec)
        return lambda: fixed
    return lambda: backend.exposure() or said


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
