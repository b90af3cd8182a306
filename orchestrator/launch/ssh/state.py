"""Launch layer, ssh backend: the run's state between hosts that share no disk (docs/architecture.md §4).

The owner's checkpoint folder is the truth (plan.state). Before an attempt that restores, its
latest checkpoint is brought home into the run directory and home's copy is sent to every reader's
host whose folder differs (ship.py moves the files); an evaluator on another host gets each new
checkpoint while the attempt runs; at the end the results come home.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fabric

from orchestrator.errors import LaunchError
from orchestrator.launch.api import on_all
from orchestrator.launch.ssh import ship
from orchestrator.launch.ssh.hosts import Host
from orchestrator.plan import LaunchPlan, StatePlan, TaskPlan
from orchestrator.spec.model import Role
from worker import wire

log = logging.getLogger("orchestrator.ssh")


class StateCopies:
    def __init__(
        self,
        hosts: list[Host],
        home: Path,
        connection: Callable[[int], fabric.Connection],
        suspect: Callable[[int], None],
        *,
        io_timeout_s: float,
        every_s: float,
    ):
        self._hosts = hosts
        self._home = home  # the run directory on this machine: results and the latest state come here
        self._connection = connection  # a host's connection, renewed when needed
        self._suspect = suspect  # a host whose copy failed: renew its connection before the next use
        self._io_timeout_s = io_timeout_s  # a copy gives up on a host silent this long
        self._every_s = every_s  # how often the evaluators' follower looks for a new checkpoint
        self._follower: threading.Thread | None = None
        self._follow_stop = threading.Event()

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> list[str]:
        """Attempts after the first restore the owner's latest checkpoint: bring it home, then
        send home's copy to every reader's host whose folder differs (ship.py). An evaluator on
        another host than the owner then gets each new checkpoint while the attempt runs."""
        self.stop_following()
        state = plan.state
        if state is None or state.shared:
            return []
        notes = self._ship(plan, state) if attempt > 0 else []
        evaluators = [t for t in map(plan.task, state.readers) if t.role is Role.EVALUATOR]
        if self._targets(plan, evaluators):
            self._follow_stop = threading.Event()
            self._follower = threading.Thread(
                target=self._follow, args=(plan, evaluators, self._follow_stop), daemon=True, name="ship"
            )
            self._follower.start()
        return notes

    def _targets(self, plan: LaunchPlan, readers: list[TaskPlan]) -> list[tuple[int, str]]:
        """(host, folder) of the readers, but the owner's own."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        source = (owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR])
        return sorted({(t.host_index, t.env[wire.ENV_CHECKPOINT_DIR]) for t in readers} - {source})

    def _ship(self, plan: LaunchPlan, state: StatePlan) -> list[str]:
        owner = plan.task(state.owner)
        host = self._hosts[owner.host_index]
        home = self._home / "checkpoints"
        try:
            got = ship.pull(
                self._connection(owner.host_index),
                host,
                owner.env[wire.ENV_CHECKPOINT_DIR],
                home,
                timeout_s=self._io_timeout_s,
            )
        except LaunchError:
            self._suspect(owner.host_index)  # its connection is renewed before the next use
            raise
        notes = [f"checkpoints of {owner.name} ({host.label}) → {home}: {got.describe()}"]
        targets = self._targets(plan, list(map(plan.task, state.readers)))
        if not got.exists and any(home.iterdir() if home.is_dir() else ()):
            # the owner's folder is gone (a --resume after its host was cleaned): home's copy is
            # the latest state there is, so the owner gets it back too
            targets.append((owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR]))
            notes[0] = f"{owner.name} ({host.label}) has no checkpoint folder; using the copy in {home}"

        ours = ship.local_tree(home)  # once for every host it goes to

        def one(target: tuple[int, str]) -> ship.Transfer:
            index, folder = target
            try:
                return self._push_home(index, folder, ours)
            except LaunchError:
                self._suspect(index)
                raise

        results = on_all(targets, one).raise_if_failed("copying the checkpoint to the hosts")
        for (index, folder), sent in zip(targets, results, strict=True):
            notes.append(f"→ {self._hosts[index].label} {folder}: {sent.describe()}")
        return notes

    def _push_home(self, index: int, folder: str, ours: dict[str, Any]) -> ship.Transfer:
        """Make `folder` on host `index` a copy of the run directory's checkpoints/ (listed in `ours`)."""
        return ship.push(
            self._connection(index),
            self._hosts[index],
            self._home / "checkpoints",
            folder,
            timeout_s=self._io_timeout_s,
            ours=ours,
        )

    def _follow(self, plan: LaunchPlan, evaluators: list[TaskPlan], stop: threading.Event) -> None:
        """While the attempt runs: each new checkpoint of the owner, home and on to the evaluators'
        hosts. A round that fails (a file changed while copied, a host away) is tried again."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        home = self._home / "checkpoints"
        every_s = self._every_s
        while not stop.wait(every_s):
            try:
                got = ship.pull(
                    self._connection(owner.host_index),
                    self._hosts[owner.host_index],
                    owner.env[wire.ENV_CHECKPOINT_DIR],
                    home,
                    timeout_s=self._io_timeout_s,
                )
                if not got.exists:
                    continue
                ours = ship.local_tree(home)
                for index, folder in self._targets(plan, evaluators):
                    if stop.is_set():
                        return
                    sent = self._push_home(index, folder, ours)
                    if sent.files:
                        log.debug("%s %s: %s", self._hosts[index].label, folder, sent.describe())
            except LaunchError as exc:
                log.debug("checkpoints to the evaluators, tried again in %g s: %s", every_s, exc)

    def stop_following(self) -> None:
        if self._follower is not None:
            self._follow_stop.set()
            self._follower.join(timeout=4 * self._io_timeout_s)
            self._follower = None

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """The owner's model/, tensorboard/ and latest checkpoint, the evaluators' tensorboard/,
        into the run directory. A host that cannot be reached is said, not raised."""
        self.stop_following()
        if plan.state is None:
            return []
        owner = plan.task(plan.state.owner)
        wanted: list[tuple[TaskPlan, str, Path, bool]] = []
        if not plan.state.shared:
            wanted.append((owner, owner.env[wire.ENV_CHECKPOINT_DIR], self._home / "checkpoints", True))
        for task in plan.tasks:
            folder = task.env[wire.ENV_RUN_DIR]
            if task.name == owner.name:
                wanted.append((task, posixpath.join(folder, "model"), self._home / "model", False))
            board = posixpath.join(folder, "tensorboard")
            seen = any(w[0].host_index == task.host_index and w[1] == board for w in wanted)
            if (task.name == owner.name or task.role is Role.EVALUATOR) and not seen:
                wanted.append((task, board, self._home / "tensorboard", False))

        def host_pulls(index: int) -> list[str]:
            # one host's pulls one after another (they share its connection); hosts in parallel
            lines = []
            host = self._hosts[index]
            for task, remote, local, mirror in (w for w in wanted if w[0].host_index == index):
                try:
                    got = ship.pull(
                        self._connection(index),
                        host,
                        remote,
                        local,
                        mirror=mirror,
                        timeout_s=self._io_timeout_s,
                    )
                except LaunchError as exc:
                    lines.append(f"could not bring {remote} home from {task.name}: {exc}")
                    continue
                if got.files:
                    lines.append(f"{local.name}/ from {task.name} ({host.label}): {got.describe()}")
            return lines

        hosts = sorted({w[0].host_index for w in wanted})
        out: list[str] = []
        for index, result in on_all(hosts, host_pulls):
            out += [f"{self._hosts[index].label}: {result}"] if isinstance(result, Exception) else result
        return out
