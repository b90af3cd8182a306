"""Launch layer, local backend: tasks as local subprocesses — a one-machine simulation of the cluster.

Opening reserves a free TF port per task (ports.py: locked for the coordinator's lifetime, so two
runs never collide). Each task starts in a new session (its own process group). Its stdout and
stderr go straight to its log file (not through a pipe), so the log stays complete even if the
coordinator dies, and a dead coordinator cannot kill a task with SIGPIPE by accident.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import psutil

from orchestrator.environment.prepare import HostEnvironment
from orchestrator.errors import LaunchError
from orchestrator.launch import standby
from orchestrator.launch.api import (
    Backend,
    Heartbeats,
    Leftovers,
    Prepared,
    ProcessInfo,
    Sig,
    TaskHandle,
    stop_all,
)
from orchestrator.launch.exposure import Exposure
from orchestrator.launch.local import netns
from orchestrator.launch.local.placement import local_placements
from orchestrator.launch.local.ports import PortReservation, reserve_ports
from orchestrator.launch.local.standbys import LocalStandbys
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan
from orchestrator.plan.placement import Placement
from orchestrator.record.write import now_iso, private_open
from orchestrator.spec.model import ClusterSpec, Role
from orchestrator.states import Degraded
from worker import wire
from worker.host import stacks
from worker.wire import failure

log = logging.getLogger("orchestrator.launch")

_SIGNALS = {Sig.TERM: signal.SIGTERM, Sig.KILL: signal.SIGKILL}


class Child(Protocol):
    """A task's process as its starter knows it: a Popen, or a task its keeper forked."""

    pid: int

    def poll(self) -> int | None: ...


class LocalTaskHandle(TaskHandle):
    def __init__(self, task: TaskPlan, attempt: int, log_path: Path, popen: Child, warm: bool = False):
        super().__init__(task, attempt, log_path)
        self.popen = popen
        self.warm = warm  # its keeper forked this task
        try:
            created = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            created = 0.0
        self._process = ProcessInfo(pid=popen.pid, pgid=popen.pid, create_time=created)

    @property
    def process(self) -> ProcessInfo:
        return self._process

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: Sig) -> None:
        signal_group(self._process.pgid, _SIGNALS[sig])
        if sig is Sig.TERM:
            signal_group(self._process.pgid, signal.SIGCONT)  # a stopped (SIGSTOP) task gets to handle it

    @property
    def exited(self) -> bool:
        # its own exit code collected (so it can be reported), and its group empty
        return self.popen.poll() is not None and not group_alive(self._process.pgid)

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        dumps = stacks.path(self.task.env[wire.ENV_RUN_DIR], self.task.name, self.attempt)
        py_spy = stacks.find_py_spy()
        return stacks.capture(self._process.pid, deadline, stacks_file=dumps, py_spy=py_spy, native=native)

    def written_error(self) -> failure.Written | None:
        if self.popen.poll() is None:
            return None
        return failure.read(failure.path(self.task.env[wire.ENV_RUN_DIR], self.task.name, self.attempt))


class LocalBackend(Backend):
    name = "local"

    def __init__(self, spec: ClusterSpec, run_dir: Path, spec_dir: Path, python: str = sys.executable):
        self._spec = spec
        self._run_dir = run_dir
        self._spec_dir = spec_dir  # the tasks' working folder: relative paths mean what they meant there
        self._python = python
        self._environment: list[HostEnvironment] = []
        self._ports: PortReservation | None = None
        self._placements: dict[str, Placement] = {}
        self._network = netns.Network(spec)  # the tasks' own network namespace, made by `listen`
        self._standbys = LocalStandbys(
            spec.restart.standby, standby.for_run(spec), run_dir / "logs" / "standby", self._network
        )

    def listen(self) -> tuple[str, int]:
        """In a namespace of their own, the tasks reach the coordinator's Unix socket alone."""
        path = self._network.make(self._run_dir)
        return (f"{wire.UNIX_SCHEME}{path}", 0) if path is not None else super().listen()

    def exposure(self) -> Exposure | None:
        return self._network.exposure

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        pythonpath: tuple[str, ...] = ()
        if self._spec.environment is not None:  # the job's own, made here (orchestrator/environment/)
            from orchestrator.environment import local as env_local
            from orchestrator.environment.prepare import prepare
            from orchestrator.environment.resolve import cache_root

            site = env_local.LocalSite(self._spec.environment.python, cache_root())
            self._environment = prepare(self._spec.environment, [site], heartbeats.notify)
            assert self._environment[0].python is not None
            self._python = self._environment[0].python
            pythonpath = (str(env_local.runtime_copy(self._run_dir.resolve())),)
        ports = self._network.ports()  # inside the namespace every port is the run's own
        if ports is None:
            self._ports = reserve_ports(self._spec)
            ports = self._ports.ports
        self._placements = local_placements(
            self._spec,
            ports,
            run_dir=self._run_dir.resolve(),
            spec_dir=self._spec_dir,
            coordinator_url=heartbeats.url,
            python=self._python,
            pythonpath=pythonpath,
        )
        return dict(self._placements)

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
        """A port another program took since the last attempt (ours are stopped now) moves."""
        if attempt == 0 or self._ports is None:
            return Prepared()
        moved = {}
        for task, (_, new) in self._ports.renew_busy().items():
            moved[task] = self._placements[task] = dataclasses.replace(self._placements[task], port=new)
        return Prepared(moved=moved)

    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        env = {**os.environ, **task.launch_env(attempt=attempt, token=token)}
        # an error file of this task's attempt from before (restarted alone) is not this process's
        with contextlib.suppress(OSError):
            os.unlink(failure.path(task.env[wire.ENV_RUN_DIR], task.name, attempt))
        with private_open(log_path) as out:
            out.write(
                f"===== orchestrate: {task.name} attempt {attempt} started {now_iso()} =====\n".encode()
            )
            out.flush()
            warm, cold_why = self._standbys.take(task, env, log_path)
            if warm is not None:
                log.debug("%s attempt %d: forked by its keeper, pid %d", task.name, attempt, warm.pid)
                return LocalTaskHandle(task, attempt, log_path, warm, warm=True)
            if attempt > 0 and cold_why != "no standby":
                out.write(f"orchestrate: started cold: {cold_why}\n".encode())
                out.flush()
            try:
                popen = subprocess.Popen(
                    self._network.enter(list(task.argv), task.cwd),
                    cwd=task.cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: stopped as one, never by name
                    pass_fds=self._network.fds,
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {task.name} ({task.argv[0]}): {exc}") from None
        log.debug("started %s attempt %d: pid %d", task.name, attempt, popen.pid)
        return LocalTaskHandle(task, attempt, log_path, popen)

    def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
        return self._standbys.prepare(list(plan.tasks), os.environ)

    def standby_news(self) -> list[str]:
        return self._standbys.news()

    def standbys(self) -> list[dict[str, Any]]:
        return self._standbys.status()

    def degraded(self) -> list[Degraded]:
        return self._network.watch() + self._standbys.degraded()

    def record(self) -> dict[str, Any]:
        # The tasks' process groups are in status.json (pid, pgid, start time) as they start.
        record: dict[str, Any] = {"backend": self.name}
        if self._environment:
            record["environment"] = [h.as_data() for h in self._environment]
        return record

    def close(self) -> None:
        self._standbys.close()
        if self._ports is not None:
            self._ports.release()
            self._ports = None
        self._network.close()


class _RecordedGroup(TaskHandle):
    """A task's process group found again from status.json (not our child: no exit code)."""

    def __init__(self, task: TaskPlan, pgid: int):
        super().__init__(task, 0, Path(os.devnull))
        self._process = ProcessInfo(pid=pgid, pgid=pgid, create_time=0.0)

    @property
    def process(self) -> ProcessInfo:
        return self._process

    def poll(self) -> int | None:
        return None

    def signal(self, sig: Sig) -> None:
        signal_group(self._process.pgid, _SIGNALS[sig])

    @property
    def exited(self) -> bool:
        return not group_alive(self._process.pgid)


class LocalLeftovers(Leftovers):
    """The process groups status.json records for the run's tasks that still carry its run id."""

    def __init__(self, record: Mapping[str, Any], status: Mapping[str, Any]):
        self._status = status

    def stop(self, grace_s: float) -> list[tuple[str, bool]]:
        groups = live_task_groups(self._status)
        if not groups:
            return []
        handles = [_RecordedGroup(_placeholder(name), pgid) for name, pgid in groups]
        left = stop_all(handles, grace_s)
        names = ", ".join(name for name, _ in groups)
        line = f"this machine: stopped {len(groups)} task process group(s) the coordinator left ({names})"
        if left:
            line += f"; still running: {', '.join(h.task.name for h in left)}"
        return [(line, not left)]


def _placeholder(name: str) -> TaskPlan:
    """A recorded task's plan, for its handle: only its name is read (for the record's lines)."""
    return TaskPlan(name, Role.WORKER, 0, "", "", 0, (), {}, "", True)


def live_task_groups(status: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(task, process group) of the run's tasks that still exist (the leader's pid and start time
    must match, or a member must carry the run id)."""
    groups = []
    for t in status.get("tasks", []):
        pgid, pid, created = t.get("pgid"), t.get("pid"), t.get("create_time")
        if not pgid or not group_alive(pgid):
            continue
        try:
            leader_ok = abs(psutil.Process(pid).create_time() - float(created)) < 0.01
        except (psutil.Error, TypeError, ValueError):
            leader_ok = False  # the leader is gone; the group lives on in its children
        run_id = status.get("run_id")
        if leader_ok or any(_carries_run(p, pgid, run_id) for p in psutil.process_iter()):
            groups.append((str(t.get("task")), int(pgid)))
    return groups


def _carries_run(proc: psutil.Process, pgid: int, run_id: object) -> bool:
    # one process gone between being listed and looked at says nothing of the others
    try:
        return os.getpgid(proc.pid) == pgid and _env_run_id(proc) == run_id
    except (ProcessLookupError, psutil.Error):
        return False


def _env_run_id(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(wire.ENV_RUN_ID)
    except psutil.Error:
        return None


def group_alive(pgid: int) -> bool:
    """True while any process (other than a zombie) is in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds on a group of zombies too; look closer before saying it is alive.
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def signal_group(pgid: int, sig: int) -> None:
    """Signal a whole process group; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
