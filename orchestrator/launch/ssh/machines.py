"""Launch layer, ssh backend: the hosts of a run as machines that can be lost (docs/ssh.md, "Spare
hosts and shrinking") — which one runs each spec host's tasks this attempt, which are lost and
since when, and a lost host watched until it answers again with nothing of the run left there
(its orphaned tasks stop by themselves once cut off from the coordinator): then a spare.

What to do with them is the supervisor's policy (supervise/members.py); this only looks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import fabric

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.launch.ssh.hosts import Host, probe
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.plan.placement import Machine
from orchestrator.spec.model import ClusterSpec

log = logging.getLogger("orchestrator.ssh")


class SshMachines:
    def __init__(
        self,
        spec: ClusterSpec,
        hosts: list[Host],
        connection: Callable[[int], fabric.Connection],
        *,
        timeout_s: float,
        every_s: float,
    ):
        self.spec = spec  # laid out as the next attempt runs (`laid_out`)
        self._hosts = hosts
        self._connection = connection  # a host's connection, renewed when needed
        self._timeout_s = timeout_s  # a probe gives up after this long
        self._every_s = every_s  # how often a lost host is asked again
        self._lock = threading.Lock()
        self._lost: dict[int, tuple[str, str | None]] = {}  # host -> why, since
        self._held: dict[int, list[int]] = {}  # a lost host -> the TF ports its tasks held
        self._workdirs: dict[int, str] = {}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def opened(self, workdirs: Mapping[int, str]) -> None:
        self._workdirs = dict(workdirs)

    def positions(self) -> dict[int, int]:
        """host -> the spec host whose tasks it runs this attempt."""
        out = {}
        for p, host in enumerate(self.spec.hosts):
            h = self.spec.runs_on(p)
            if host.tasks and not host.spare and h is not None:
                out[h] = p
        return out

    def machines(self, plan: LaunchPlan, suspects: Mapping[str, tuple[str, str | None]]) -> list[Machine]:
        """Every host: the ones whose tasks could not be confirmed ended are lost (their connection
        is gone: asking again would wait out the connect timeout); spares, when one may be
        needed, must answer a command within the connect timeout."""
        at = self.positions()
        now = time.strftime("%H:%M:%S")
        with self._lock:
            for name, (why, since) in suspects.items():
                task = plan.task(name)
                h = task.host_index
                held = self._held.setdefault(h, [])
                held.append(task.port)
                if h not in self._lost:
                    self._lost[h] = (why, since or now)
                elif since is not None and (self._lost[h][1] or "99") > since:
                    self._lost[h] = (why, since)
            lost = dict(self._lost)
        left_out = None in self.spec.runs.values()
        if left_out or any(h in lost for h in at):  # a spare may be needed: is it there?
            spares = [h for h in self._hosts if h.index not in at and h.index not in lost]
            for host, answer in on_all(spares, self._answers):
                if isinstance(answer, Exception):
                    self._lose(host.index, f"its probe failed: {answer}", now)
        self._watch()
        with self._lock:
            lost = dict(self._lost)
        return [
            Machine(str(h.index), h.where, at.get(h.index), *lost.get(h.index, (None, None)))
            for h in self._hosts
        ]

    def _answers(self, host: Host) -> None:
        """The host runs a command of ours within the timeout (LaunchError if not)."""
        conn = self._connection(host.index)
        probe(conn, host, "connect", "1", timeout_s=self._timeout_s)

    def _lose(self, index: int, why: str, since: str) -> None:
        with self._lock:
            self._lost.setdefault(index, (why, since))

    def _watch(self) -> None:
        """A thread asks each lost host again every `every_s` while there is one."""
        with self._lock:
            if not self._lost or (self._watcher is not None and self._watcher.is_alive()):
                return
            self._watcher = threading.Thread(target=self._watching, name="lost-hosts", daemon=True)
            self._watcher.start()

    def _watching(self) -> None:
        while not self._stop.wait(self._every_s):
            with self._lock:
                lost = {h: list(self._held.get(h, [])) for h in self._lost}
            if not lost:
                return
            self._ask_again(lost)

    def _ask_again(self, lost: Mapping[int, list[int]]) -> None:
        """Each lost host asked again: one that answers, its tasks' ports free, is lost no more."""
        for host, back in on_all([self._hosts[h] for h in lost], lambda h: self._clear(h, lost[h.index])):
            if back is True:
                log.info("%s answers again, nothing of the run left there", host.label)
                with self._lock:
                    self._lost.pop(host.index, None)
                    self._held.pop(host.index, None)

    def _clear(self, host: Host, ports: list[int]) -> bool:
        """The host answers and the TF ports its tasks held are free (its orphans are gone)."""
        try:
            conn = self._connection(host.index)
            workdir = self._workdirs.get(host.index, "~/.orchestrate")
            facts: dict[str, Any] = probe(
                conn, host, "facts", workdir, *map(str, ports), stdin="[]", timeout_s=self._timeout_s
            )
        except LaunchError as exc:
            log.debug("%s: still lost: %s", host.label, exc)
            return False
        return all(facts.get("ports", {}).values())

    def lost(self) -> set[int]:
        """The hosts lost now."""
        with self._lock:
            return set(self._lost)

    def close(self) -> None:
        self._stop.set()
