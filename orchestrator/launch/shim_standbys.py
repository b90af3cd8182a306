"""Launch layer: warm standbys kept by shims on other hosts (ssh hosts, Slurm nodes), as
launch/standby.py says what they are. Each is a shim run in standby mode
(worker/host/shim_standby.py) over its own transport, kept for the run: each attempt handed to it
("GO {…}" on the shim's stdin) forks its task from the standby and has a handle of its own over
that transport (ShimHandle.next_attempt); closing it stops the standby.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.group import on_all
from orchestrator.launch import standby
from orchestrator.launch.shim import ShimHandle
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.spec.model import ClusterSpec, Standby
from orchestrator.states import Degraded

log = logging.getLogger("orchestrator.launch")


@dataclass
class _One:
    handle: ShimHandle
    env: dict[str, str]  # the environment it was started with
    place: str  # where it waits (a host's label, a node)
    said: bool = False  # its failure reported


#: How often the coordinator tells each standby's shim it is there ("ALIVE"), and how long a shim
#: waits for word before it stops its standby (a cut host's sshd may never see the connection end).
ALIVE_EVERY_S = 2.0
ALIVE_S = 30.0


def standby_job(spec: ClusterSpec, count_on_host: int, module: str, log_path: str) -> dict[str, Any]:
    """The `standby` part of a shim's job: its module's path, its log on the host, how long it
    waits without word from the coordinator, and what the host must keep available (`auto`),
    checked by the shim against the host's memory."""
    alive_s = max(ALIVE_S, 3 * spec.health.heartbeat_timeout_s)
    part: dict[str, Any] = {"module": module, "log": log_path, "need": None, "keep": None, "alive_s": alive_s}
    if spec.restart.standby is Standby.AUTO:
        part.update(need=count_on_host * standby.STANDBY_BYTES, keep=standby.KEEP_AVAILABLE_BYTES)
    return part


class ShimStandbys:
    def __init__(self, spec: ClusterSpec):
        self._spec = spec
        self._run = standby.for_run(spec)
        self._ready: dict[str, _One] = {}
        self._said: str | None = None
        self._lock = threading.Lock()  # the standbys, between the supervisor and the ALIVE thread
        self._closed = threading.Event()
        self._alive: threading.Thread | None = None
        self._opening: set[str] = set()  # tasks whose standby is being started
        self._notes: list[str] = []  # what the starts came to: said with the next news
        self._page_copies = standby.PageCopies()

    def prepare(
        self,
        tasks: Sequence[TaskPlan],
        open_one: Callable[[TaskPlan], tuple[ShimHandle, dict[str, str], str]],
    ) -> list[str]:
        """A standby for each task that has none (`open_one` starts its shim), hosts in parallel on
        a thread of its own: a host slow to answer (its connection renewed) never holds up the
        supervisor. What came of it is said with the next `news`."""
        with self._lock:
            missing = [
                t
                for t in tasks
                if t.name not in self._ready and t.name not in self._opening and standby.command(t.argv)
            ]
        if not missing:
            return []
        if not self._run.on:
            if self._said == self._run.why:
                return []
            self._said = self._run.why
            return [f"no warm standbys: {self._run.why}"]
        with self._lock:
            self._opening.update(t.name for t in missing)
        threading.Thread(
            target=self._open_all, args=(missing, open_one), name="standbys-open", daemon=True
        ).start()
        return []

    def _open_all(
        self,
        tasks: Sequence[TaskPlan],
        open_one: Callable[[TaskPlan], tuple[ShimHandle, dict[str, str], str]],
    ) -> None:
        started, notes, late = [], [], []
        for task, got in on_all(tasks, open_one):
            if isinstance(got, Exception):
                notes.append(f"the standby of {task.name} could not be started: {got}")
                continue
            with self._lock:
                if self._closed.is_set():  # the run ended meanwhile: it is stopped at once
                    late.append(_One(*got))
                else:
                    self._ready[task.name] = _One(*got)
                    started.append(task.name)
        _stop(late, wait_s=0.0)
        if started:
            notes.append(f"warm standbys started for {', '.join(started)} (at the lowest CPU priority)")
        with self._lock:
            self._opening.difference_update(t.name for t in tasks)
            self._notes += notes
            if self._alive is None and started:
                self._alive = threading.Thread(target=self._say_alive, name="standbys-alive", daemon=True)
                self._alive.start()

    def take(
        self, task: TaskPlan, env: Mapping[str, str], place: str, go: dict[str, Any], log_path: Path
    ) -> tuple[ShimHandle | None, str]:
        """The attempt's handle, its task forked by the task's standby (`go`: the attempt's part of
        the shim's job; the standby stays for the next), or None and why it starts cold (a
        standby that cannot serve it is stopped)."""
        with self._lock:
            one = self._ready.get(task.name)
        if one is None:
            return None, "no standby"
        events = one.handle.events
        why = (
            "its standby failed"
            if events.standby_failed is not None or events.ended.is_set()
            else "its standby was still importing TensorFlow (it does so at the lowest priority)"
            if not events.standby_ready
            else f"its standby waits on {one.place}, not {place}"
            if one.place != place
            else standby.differs(one.env, env)
        )
        if why is None:
            handle = one.handle.next_attempt(task, int(go["attempt"]), log_path)
            one.handle.transport.send(f"GO {json.dumps(go)}\n".encode())
            return handle, ""
        with self._lock:
            self._ready.pop(task.name, None)
        _stop([one], wait_s=0.0)
        return None, why

    def news(self) -> list[str]:
        """Standbys started (or not) since last asked, those that could not import TensorFlow (or
        exited later) or were refused for memory, each said once."""
        with self._lock:
            out, self._notes = self._notes, []
        for name, one in list(self._ready.items()):
            events = one.handle.events
            if one.said:
                continue
            if events.standby_failed is not None:
                one.said = True
                tail = " | ".join(x for x in events.standby_failed.splitlines()[-3:] if x.strip())
                what = "could not import TensorFlow"
                if events.standby_ready:
                    what = "exited after importing TensorFlow"
                out.append(f"the standby of {name} on {one.place} {what}: {tail}")
            elif events.standby_refused is not None:
                one.said = True
                available, total = events.standby_refused
                verdict = standby.for_host(self._spec.restart.standby, 1, available, total)
                out.append(f"no warm standby for {name} on {one.place}: {verdict.why}")
        return out

    def degraded(self) -> list[Degraded]:
        """Hosts whose standbys cannot copy their pages ahead of a handover, each said once."""
        with self._lock:
            ready = list(self._ready.values())
        return [d for one in ready for d in self._page_copies.said(one.place, one.handle.events.page_copy)]

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for name, one in list(self._ready.items()):
            events = one.handle.events
            state = (
                "failed"
                if events.standby_failed is not None
                else "gone"
                if events.ended.is_set()
                else "ready"
                if events.standby_ready
                else "importing"
            )
            pid = events.standby.pid if events.standby is not None else None
            rows.append({"task": name, "host": one.place, "pid": pid, "state": state, "rss_bytes": None})
        return rows

    def drop(self, wait_s: float = 0.0) -> None:
        """Every standby stopped (their nodes' allocation is gone); new ones come as they would."""
        with self._lock:
            ones = list(self._ready.values())
            self._ready.clear()
        _stop(ones, wait_s)

    def close(self) -> None:
        self._closed.set()
        self.drop(wait_s=5.0)

    def _say_alive(self) -> None:
        """Every ALIVE_EVERY_S, to each standby's shim: the coordinator is there (whatever the
        supervisor is doing meanwhile: a long stop, a backoff, a checkpoint copy)."""
        while not self._closed.wait(ALIVE_EVERY_S):
            with self._lock:
                for one in self._ready.values():
                    one.handle.transport.send(b"ALIVE\n")


def _stop(ones: list[_One], wait_s: float = 5.0) -> None:
    """End of file to each standby's shim, which stops it and says so; its transport let go once
    it did (or after `wait_s`). A standby is no task: its end needs no confirming (its shim stops
    it at end of file, or after `alive_s` without word), so its host is never taken for lost."""
    for one in ones:
        one.handle.transport.end_input()
    deadline = time.monotonic() + wait_s
    for one in ones:
        one.handle.events.ended.wait(max(0.0, deadline - time.monotonic()))
        one.handle.transport.close(True, one.handle.events)


class ToldByShims:
    """What a backend whose standbys wait on shims (ssh hosts, Slurm nodes) tells of them, as the
    Backend API asks each supervisor iteration (mixed in before Backend)."""

    _standbys: ShimStandbys

    def standby_news(self) -> list[str]:
        return self._standbys.news()

    def degraded(self) -> list[Degraded]:
        return self._standbys.degraded()

    def standbys(self) -> list[dict[str, Any]]:
        return self._standbys.status()
