"""Launch layer: tasks as local subprocesses — a one-machine simulation of the cluster.

Each task starts in a new session (its own process group). Its stdout and stderr go straight to
its log file (not through a pipe), so the log stays complete even if the coordinator dies, and a
dead coordinator cannot kill a task with SIGPIPE by accident.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

from orchestrator.errors import LaunchError
from orchestrator.launch.api import Launcher, ProcessInfo, TaskHandle
from orchestrator.plan import TaskPlan
from orchestrator.record import now_iso

log = logging.getLogger("orchestrator.launch")


class LocalTaskHandle(TaskHandle):
    def __init__(self, task: TaskPlan, attempt: int, log_path: Path, popen: subprocess.Popen[bytes]):
        super().__init__(task, attempt, log_path)
        self.popen = popen
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


class LocalLauncher(Launcher):
    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        env = {**os.environ, **task.launch_env(attempt=attempt, token=token)}
        with open(log_path, "ab") as out:
            out.write(
                f"===== orchestrate: {task.name} attempt {attempt} started {now_iso()} =====\n".encode()
            )
            out.flush()
            try:
                popen = subprocess.Popen(
                    list(task.argv),
                    cwd=task.cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: stopped as one, never by name
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {task.name} ({task.argv[0]}): {exc}") from None
        log.debug("started %s attempt %d: pid %d", task.name, attempt, popen.pid)
        return LocalTaskHandle(task, attempt, log_path, popen)

    def stop(self, handles: list[TaskHandle], grace_s: float, hurry: threading.Event | None = None) -> None:
        groups = [h.process.pgid for h in handles if group_alive(h.process.pgid)]
        for pgid in groups:
            signal_group(pgid, signal.SIGTERM)
            signal_group(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) task gets to handle its SIGTERM

        def gone() -> bool:
            # every group empty, and every task's own exit code collected (so it can be reported)
            return all(h.poll() is not None for h in handles) and not any(group_alive(g) for g in groups)

        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
            if gone():
                return
            time.sleep(0.05)
        for pgid in groups:
            signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if gone():
                return
            time.sleep(0.02)
        alive = [g for g in groups if group_alive(g)]
        raise LaunchError(f"process groups {alive} survived SIGKILL (uninterruptible I/O?)")


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
