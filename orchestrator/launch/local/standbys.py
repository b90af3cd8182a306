"""Launch layer, local backend: the run's warm standbys on this machine (launch/standby.py says
what they are), each a keeper (worker/keeper.py) kept for the run: one per task slot, in a session
of its own, its stdin a pipe from the coordinator. Each attempt's handover comes on it and forks
that attempt's task (a session of its own too), whose start and exit code come back on its
stdout; so its import is paid once per run, and every restart after it is warm, a second failure
soon after a restart included. The pipe's end (the coordinator gone, even by SIGKILL) makes a
keeper exit once its task has (at once without one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

import psutil

from worker.shim_standby import KeeperEvents
from worker.standby import READY

log = logging.getLogger("orchestrator.launch")

_TAIL_BYTES = 4096
#: How long a keeper may take to say it forked the task (it does so at once: a fork, no import).
_FORK_S = 5.0


class Forked:
    """A task its keeper forked: its pid, and its exit code once the keeper reaped it."""

    def __init__(self, keeper: _One, pid: int):
        self._keeper = keeper
        self.pid = pid

    def poll(self) -> int | None:
        return self._keeper.exit_of(self.pid)


class _One:
    """A keeper (worker/keeper.py): the standby of one task slot, kept across attempts."""

    def __init__(self, task: str, popen: subprocess.Popen[bytes], env: Mapping[str, str], log_path: Path):
        self.task = task
        self.popen = popen
        self.env = dict(env)
        self.log_path = log_path
        self.offset = log_path.stat().st_size if log_path.exists() else 0  # where its own lines begin
        self.ready_s: str | None = None
        self.said = False  # its failure reported
        self._lock = threading.Lock()  # its events, read by whichever thread polls first
        assert popen.stdout is not None
        self._events = KeeperEvents(popen.stdout.fileno())

    def state(self) -> str:
        code = self.popen.poll()
        if code is not None:
            return "failed" if code != 0 else "gone"  # gone: its stdin closed
        if self.ready_s is None:
            line = next((x for x in self.lines() if x.startswith(READY)), None)
            self.ready_s = line[len(READY) :].strip() if line else None
        return "ready" if self.ready_s is not None else "importing"

    def lines(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self.offset, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return []

    def fork(self, handover: bytes) -> Forked:
        """Its task forked with this handover (OSError: the keeper is gone or did not say so)."""
        with self._lock:
            return Forked(self, self._events.fork(self.popen.stdin, handover, _FORK_S))

    def exit_of(self, pid: int) -> int | None:
        with self._lock:
            code = self._events.exit_of(pid, wait=False)
            if code is None and self._events.ended and not psutil.pid_exists(pid):
                return -signal.SIGKILL  # its keeper gone unreaped: it died with it (PR_SET_PDEATHSIG)
            return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5.0)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
