"""Launch layer, local backend: the run's warm standbys on this machine (launch/standby.py says
what they are), each a keeper (worker/warm/keeper.py) kept for the run: one per task slot, in a session
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
from typing import Any

import psutil

from orchestrator.launch import standby
from orchestrator.launch.local.netns import Network
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.record.write import now_iso, private_open
from orchestrator.spec.model import Standby
from orchestrator.states import Degraded
from worker.host.shim_standby import KeeperEvents
from worker.wire import STANDBY_NO_PAGE_COPY as NO_PAGE_COPY
from worker.wire import STANDBY_READY as READY

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
    """A keeper (worker/warm/keeper.py): the standby of one task slot, kept across attempts."""

    def __init__(self, task: str, popen: subprocess.Popen[bytes], env: Mapping[str, str], log_path: Path):
        self.task = task
        self.popen = popen
        self.env = dict(env)
        self.log_path = log_path
        self.offset = log_path.stat().st_size if log_path.exists() else 0  # where its own lines begin
        self.ready_s: str | None = None
        self.page_copy: str | None = None  # why this machine's spares cannot copy their pages, if so
        self.said = False  # its failure reported
        self._lock = threading.Lock()  # its events, read by whichever thread polls first
        assert popen.stdout is not None
        self._events = KeeperEvents(popen.stdout.fileno())

    def state(self) -> str:
        code = self.popen.poll()
        if code is not None:
            return "failed" if code != 0 else "gone"  # gone: its stdin closed
        if self.ready_s is None:
            lines = self.lines()
            line = next((x for x in lines if x.startswith(READY)), None)
            self.ready_s = line[len(READY) :].strip() if line else None
            said = next((x for x in lines if x.startswith(NO_PAGE_COPY)), None) if line else None
            self.page_copy = said[len(NO_PAGE_COPY) :].strip()[:500] if said else None
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
        with self._lock:  # its events end here: no poll reads a closed (or reused) descriptor
            self._events.ended = True
            for pipe in (self.popen.stdin, self.popen.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


class LocalStandbys:
    def __init__(self, mode: Standby, run: standby.Verdict, logs: Path, network: Network | None = None):
        self._mode = mode
        self._run = run  # whether the run may have standbys at all
        self._logs = logs  # each standby's output before its handover
        self._network = network  # the tasks' (a standby starts where its task would)
        self._ready: dict[str, _One] = {}
        self.said: str | None = None  # why there are none, once said
        self._page_copies = standby.PageCopies()

    def prepare(self, tasks: list[TaskPlan], base_env: Mapping[str, str]) -> list[str]:
        """A standby for each task that has none; lines for the record (why none, said once)."""
        missing = [t for t in tasks if t.name not in self._ready and standby.command(t.argv)]
        if not missing:
            return []
        memory = psutil.virtual_memory()
        verdict = (
            self._run
            if not self._run.on
            else standby.for_host(self._mode, len(missing), memory.available, memory.total)
        )
        if not verdict.on:
            if self.said == verdict.why:
                return []
            self.said = verdict.why
            return [f"no warm standbys: {verdict.why}"]
        for task in missing:
            env = standby.stable_env({**base_env, **task.launch_env(attempt=0, token="")})
            self._ready[task.name] = self._start(task, env)
        names = ", ".join(t.name for t in missing)
        return [f"warm standbys started for {names} ({verdict.why}; at the lowest CPU priority)"]

    def _start(self, task: TaskPlan, env: dict[str, str]) -> _One:
        command, _ = standby.command(task.argv) or ((), ())
        path = self._logs / f"{task.name}.log"
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with private_open(path) as out:
            out.write(f"===== orchestrate: standby of {task.name} started {now_iso()} =====\n".encode())
            out.flush()
            net = self._network
            popen = subprocess.Popen(
                net.enter(list(command), task.cwd) if net is not None else list(command),
                pass_fds=net.fds if net is not None else (),  # in the tasks' network namespace, if any
                cwd=task.cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # its events (its own output goes to its log)
                stderr=out,
                start_new_session=True,  # its own group, which its tasks are not in
            )
        log.debug("keeper of %s: pid %d", task.name, popen.pid)
        return _One(task.name, popen, env, path)

    def take(self, task: TaskPlan, env: Mapping[str, str], log_path: Path) -> tuple[Forked | None, str]:
        """The task forked by its keeper (the marker line already in its log), or None and why.
        A keeper that cannot serve this attempt is stopped (the next is prepared once it trains)."""
        one = self._ready.get(task.name)
        if one is None:
            return None, "no standby"
        args = standby.command(task.argv)
        state = one.state()
        why = (
            f"its standby {state}"
            if state in ("failed", "gone")
            else "its standby was still importing TensorFlow (it does so at the lowest priority)"
            if state == "importing"
            else standby.differs(one.env, env)
        )
        if why is None and args is not None:
            try:
                return one.fork(standby.handover(args[1], env, str(log_path))), ""
            except OSError as exc:
                why = f"its standby's handover failed ({exc})"
        del self._ready[task.name]
        one.kill()
        return None, why or "no standby"

    def news(self) -> list[str]:
        """Standbys that could not import TensorFlow, each said once with its last lines."""
        out = []
        for one in self._ready.values():
            if not one.said and one.state() == "failed":
                one.said = True
                tail = " | ".join(x for x in one.lines()[-3:] if x.strip())
                out.append(f"the standby of {one.task} (this machine) exited {one.popen.returncode}: {tail}")
        return out

    def degraded(self) -> list[Degraded]:
        """This machine's standbys cannot copy their pages ahead of a handover: said once."""
        return [
            d
            for one in self._ready.values()
            if one.ready_s is not None  # read as its state is (status.json's standbys)
            for d in self._page_copies.said("this machine", one.page_copy)
        ]

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for one in self._ready.values():
            try:
                rss = psutil.Process(one.popen.pid).memory_info().rss if one.popen.poll() is None else None
            except psutil.Error:
                rss = None
            rows.append(
                {"task": one.task, "host": "", "pid": one.popen.pid, "state": one.state(), "rss_bytes": rss}
            )
        return rows

    def close(self) -> None:
        for one in self._ready.values():
            one.kill()
        self._ready.clear()
