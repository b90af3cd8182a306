"""Coordinator: wires the layers for `orchestrate up` — spec → ports → plan → launcher →
supervisor, with the heartbeat server, the run record, the console view and signal handling.

Whatever happens (a failure, Ctrl-C, SIGTERM, a bug of ours), every task started is stopped
before this returns.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

from orchestrator import rundir
from orchestrator.errors import LaunchError, RunDirError, UsageError
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Launcher
from orchestrator.launch.local import LocalLauncher
from orchestrator.logtail import LogTailer
from orchestrator.plan import LaunchPlan, RunContext, make_plan
from orchestrator.ports import reserve_ports
from orchestrator.record import RunRecord, new_run_dir, new_run_id, now_iso, write_json_atomic
from orchestrator.spec.model import Backend, ClusterSpec
from orchestrator.supervise.states import ClusterState
from orchestrator.supervise.supervisor import RunResult, Supervisor, SupervisorConfig
from orchestrator.view import LiveView, PlainView

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class UpResult:
    run_dir: Path
    result: RunResult
    plan: LaunchPlan
    brought_home: tuple[str, ...] = ()  # results copied from the hosts into run_dir (ssh backend)


def make_launcher(spec: ClusterSpec, run_id: str, run_dir: Path) -> Launcher:
    if spec.backend is Backend.LOCAL:
        return LocalLauncher()
    from orchestrator.launch.ssh import SshLauncher  # paramiko loads only when needed

    return SshLauncher(spec, run_id, run_dir)


def heartbeat_bind(spec: ClusterSpec) -> tuple[str, int, bool]:
    """Where the heartbeat server listens, and whether tasks post there directly: loopback (local
    tasks, SSH tunnels) or the address the hosts reach (ssh.coordinator_address)."""
    direct = spec.ssh.coordinator_address if spec.backend is Backend.SSH else None
    if direct is None:
        return "127.0.0.1", 0, False
    host, _, port = direct.partition(":")
    return host, int(port or 0), True


def status_interval_s(tasks: int) -> float:
    """How fresh status.json and the live view keep steps and metrics (transitions are written at
    once): every second, or less often past 500 tasks, where one costs ~17 ms a thousand tasks (P6)."""
    return max(1.0, tasks / 500)


def up(
    spec: ClusterSpec,
    spec_path: Path,
    *,
    run_dir: Path | None = None,
    resume: bool = False,
    live: bool | None = None,
    config_overrides: dict[str, float] | None = None,
    launcher: Launcher | None = None,
) -> UpResult:
    """Run the job to its end. `launcher`: the spec's backend unless given (the capacity benchmark
    gives one whose tasks are simulated)."""
    _raise_open_files_limit()
    first_attempt, restarts, run_id = 0, 0, new_run_id(spec.name)
    if resume:
        assert run_dir is not None
        # the same run goes on: its id names its folders on the hosts (and their checkpoints)
        first_attempt, restarts, run_id = _resume_point(run_dir, spec)
    run_dir = run_dir or new_run_dir(spec.name)
    launcher = launcher or make_launcher(spec, run_id, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = RunRecord(run_dir)
    if resume:
        record.event(kind="resume", attempt=first_attempt, reason=f"resumed with attempt {first_attempt}")
    record.write_spec(spec_path.read_text(encoding="utf-8"))
    token = secrets.token_urlsafe(32)
    store = HealthStore(time.monotonic, on_points=record.metrics)
    bind_host, bind_port, direct = heartbeat_bind(spec)
    try:
        server = HeartbeatServer(store, token, host=bind_host, port=bind_port).start()
    except OSError as exc:
        launcher.close()
        raise LaunchError(
            f"cannot listen for heartbeats on {bind_host}:{bind_port} (ssh.coordinator_address): "
            f"{exc.strerror or exc}"
        ) from None
    use_live = sys.stdout.isatty() if live is None else live
    view = LiveView() if use_live else PlainView()
    tailer = None
    supervisor = None
    reservation = None
    try:
        reservation = reserve_ports(spec)
        hosts = launcher.prepare(
            reservation.ports, ("127.0.0.1", server.port), server.url if direct else None
        )
        hosts_record = launcher.hosts_record()
        if hosts_record is not None:
            write_json_atomic(run_dir / "hosts.json", hosts_record)
        context = RunContext(
            run_id=run_id,
            run_dir=run_dir.resolve(),
            spec_dir=spec_path.resolve().parent,
            coordinator_url=server.url,
            python=sys.executable,
            hosts=hosts,
        )
        plan = make_plan(spec, ports=reservation.ports, run=context)
        record.write_plan(plan.to_json())
        launcher.deploy(plan)

        def replan() -> tuple[LaunchPlan, list[str]] | None:
            assert reservation is not None
            moved = reservation.renew_busy()
            if not moved:
                return None
            new_plan = make_plan(spec, ports=reservation.ports, run=context)
            record.write_plan(new_plan.to_json())
            notes = [
                f"port {old} of {task} is in use by another program; moved to {new}"
                for task, (old, new) in moved.items()
            ]
            return new_plan, notes

        me = psutil.Process()
        record.write_coordinator(
            {
                "run_id": run_id,
                "pid": me.pid,
                "create_time": me.create_time(),
                "started_at": now_iso(),
                "heartbeat_url": server.url,
            }
        )
        last_state = [""]
        written = [-1, 0.0]  # transitions, time of the last status written
        status_every_s = status_interval_s(len(plan.tasks))
        tailer = LogTailer({t.name: record.log_path(t.log_name) for t in plan.tasks}, view.log_line).start()

        def on_change(sup: Supervisor) -> None:
            # A transition is written at once; heartbeat news (steps, metrics) once per interval:
            # with many tasks, status.json and the view are the coordinator's largest cost.
            now = time.monotonic()
            if sup.transitions == written[0] and now - written[1] < status_every_s:
                return
            written[:] = [sup.transitions, now]
            status = sup.status()
            if tailer is not None and status["state"] != last_state[0]:
                tailer.poll()  # the tasks' last words come before the news of their end
                last_state[0] = status["state"]
            record.write_status(status)
            record.flush()
            view.update(status)

        supervisor = Supervisor(
            plan,
            launcher,
            store,
            record,
            token,
            SupervisorConfig.from_spec(spec, **(config_overrides or {})),
            on_change=on_change,
            first_attempt=first_attempt,
            restarts=restarts,
            replan=replan,
        )
        with _stop_on_signals(supervisor):
            result = supervisor.run()
        started = time.monotonic()
        home = launcher.bring_home(supervisor.plan)
        if home:
            took_s = round(time.monotonic() - started, 3)
            for line in home:
                record.event(kind="results", reason=line, seconds=took_s)
        return UpResult(run_dir, result, supervisor.plan, tuple(home))
    finally:
        if supervisor is not None and not supervisor.state.is_terminal:
            # Only a bug of ours gets here: still, leave nothing running.
            handles = [r.handle for r in supervisor.tasks.values() if r.handle is not None]
            launcher.stop(handles, grace_s=2.0)
        if tailer is not None:
            tailer.stop()
        view.close()
        server.close()
        if reservation is not None:
            reservation.release()
        launcher.close()
        record.close()


def _raise_open_files_limit() -> None:
    """Per task the coordinator holds a port lock, a heartbeat connection and a log file: the
    usual soft limit of 1,024 open files ends near 300 tasks. Raise it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _resume_point(run_dir: Path, spec: ClusterSpec) -> tuple[int, int, str]:
    """The attempt number, restart count and run id a resumed run continues with."""
    try:
        status = rundir.read_status(run_dir)
    except RunDirError as exc:
        raise UsageError(f"--resume {run_dir}: {exc}") from None
    if status.get("name") != spec.name:
        raise UsageError(
            f"--resume {run_dir}: that run is {status.get('name')!r}, this spec is {spec.name!r}; "
            "resume a run with the spec that started it"
        )
    if not ClusterState(status.get("state", "PENDING")).is_terminal and rundir.coordinator_alive(run_dir):
        raise UsageError(f"--resume {run_dir}: that run is still going (state {status.get('state')})")
    run_id = status.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise UsageError(f"--resume {run_dir}: its status.json records no run_id")
    return int(status.get("attempt", 0)) + 1, int(status.get("restarts", 0)), run_id


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
        for sig in self._SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def detach(argv: list[str], run_dir: Path) -> int:
    """Start `orchestrate up` again in the background, in its own session; return its pid."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "coordinator.log", "ab") as out:
        proc = psutil.Popen(
            [sys.executable, "-m", "orchestrator", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return proc.pid
