"""Launch layer: the run's state between hosts that share no disk, for every backend whose hosts
have disks of their own (ssh, slurm without a shared filesystem; docs/architecture.md §4).

The owner's checkpoint folder is the truth (plan.state). Before an attempt that restores, its
latest checkpoint is brought home into the run directory (`fetch`) and home's copy is sent to
every reader's folder that differs (`hand_out`); an evaluator on another host than the owner gets
each new checkpoint while the attempt runs (the follower); at the end the results come home.
What moves the files is the backend's `Folders` (an SFTP session, a tar through a Slurm step);
what moves is decided here, once: only files that differ (size and SHA-256), staged beside the
target and committed data first, index last, so a copy cut short never replaces a whole one.

Whether a folder moves at all is decided per folder, the same for every backend: not where every
host is proven to see it — a checkpoint folder the spec declares shared (proven at launch), one
under a folder the backend proved every host sees (`seen_everywhere`: the Slurm nodes' run
directory on a shared file system), a job's own folder whose nonce the owner's host wrote and
every reader's host read (job_folders.py's `_is_shared`). A job's `/tmp/backup` beside a shared
run directory is each node's own, and is copied.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import threading
from collections.abc import Collection
from concurrent.futures import Future
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.launch.job_folders import JobFolders
from orchestrator.launch.transfer import Folders, Transfer, local_tree, pull_results
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan
from orchestrator.spec.model import Role
from worker import wire

log = logging.getLogger("orchestrator.launch")


class StateExchange(JobFolders):
    def __init__(self, folders: Folders, home: Path, *, every_s: float, stop_wait_s: float = 60.0):
        self._folders = folders
        self._home = home  # the run directory here: results and the latest state come here
        self._every_s = every_s  # how often the follower looks for a new checkpoint of the owner
        self._stop_wait_s = stop_wait_s  # the follower's copy under way may finish this long
        self._follower: threading.Thread | None = None
        self._follow_stop = threading.Event()
        self._owner_lacks = False  # the owner's folder was gone: home's copy goes back to it too
        self._job_home: dict[str, Path] = {}  # the job's own folders brought home: where
        self._shared: dict[str, bool] = {}  # a job's folder: every reader's host sees the owner's
        self._early: Future[list[str]] | None = None  # the owner's state, brought home during the stop
        self._ran: LaunchPlan | None = None  # the plan of the attempt that ran last (its owner wrote)
        self._source: tuple[int, str] | None = None  # where home's copy came from this time
        self._everywhere: set[str] = set()  # folders every host is proven to see (`seen_everywhere`)
        self._handed: set[str] = set()  # the job's folders copied to other hosts this run

    def seen_everywhere(self, folder: str) -> None:
        """The backend proved that every host sees `folder` (and what is under it) at this path,
        this machine included: the run directory of nodes on a shared file system."""
        self._everywhere.add(folder.rstrip("/") or "/")

    def _seen(self, folder: str) -> bool:
        return any(folder == f or folder.startswith(f.rstrip("/") + "/") for f in self._everywhere)

    def _state_shared(self, plan: LaunchPlan) -> bool:
        """The owner's checkpoint folder is the one every reader sees: nothing of it is copied."""
        assert plan.state is not None
        return plan.state.shared or self._seen(plan.task(plan.state.owner).env[wire.ENV_CHECKPOINT_DIR])

    def before_attempt(self, plan: LaunchPlan, attempt: int, *, lost: Collection[int] = ()) -> list[str]:
        """Attempts after the first restore the latest checkpoint of the owner that wrote it:
        home (`fetch_ran`), then to every reader's folder that differs (`hand_out_all`); then the
        owner is followed while the attempt trains."""
        self.stop_following(lost=lost)
        notes = [*self.fetch_ran(plan, lost), *self.hand_out_all(plan)] if attempt > 0 else []
        self._ran = plan
        self.follow(plan)
        return notes

    def fetch_ran(self, plan: LaunchPlan, lost: Collection[int] = ()) -> list[str]:
        """The checkpoint of the owner of the attempt that ran last (another task may own them in
        `plan`: a lost host's tasks moved or left out) home, unless it came during the stop
        (`bring_early`) or while the attempt trained; a `lost` host is not asked: home's copy is
        the latest there is. Its job's own folders as `plan` knows them (learned as the run went)."""
        ran = self._ran or plan
        if plan.state is None or ran.state is None:
            return []
        state = dataclasses.replace(ran.state, job_folders=plan.state.job_folders)
        ran = dataclasses.replace(ran, state=state)
        return self.fetched(ran, reachable=ran.task(state.owner).host_index not in lost)

    def hand_out_all(self, plan: LaunchPlan) -> list[str]:
        """Home's copy of the checkpoints and of the job's own folders to every reader of `plan`
        whose folder differs (a new owner's included); `plan` is the one that ran from now on."""
        self._ran = plan
        return [] if plan.state is None else [*self.hand_out(plan), *self.hand_out_job(plan)]

    def bring_early(self, plan: LaunchPlan) -> None:
        """The job restarts and its owner has exited: its last checkpoint (and the job's own
        folders) come home now, on a thread of its own, while the other tasks still stop; the next
        `before_attempt` (or `early_copy`) waits for it and uses it."""
        state = plan.state
        if state is None or self._early is not None or (self._state_shared(plan) and not state.job_folders):
            return
        early: Future[list[str]] = Future()

        def run() -> None:
            try:
                self.stop_following()  # the evaluators' follower writes home too
                got = [*self.fetch(plan), *self.fetch_job(plan)]
                early.set_result([f"{line} (as soon as the owner had exited)" for line in got])
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                early.set_exception(exc)

        self._early = early
        threading.Thread(target=run, daemon=True, name="bring-early").start()

    def early_copy(self) -> list[str] | None:
        """Wait for the copy `bring_early` began (each pull gives up after the backend's I/O
        timeout): its lines; None when there was none, or it failed (copied again then)."""
        early, self._early = self._early, None
        if early is None:
            return None
        try:
            return early.result()
        except Exception as exc:  # noqa: BLE001 - copied again, where a lasting error shows
            log.info("the checkpoints brought home during the stop: %s; copied again", exc)
            return None

    def fetched(self, plan: LaunchPlan, *, reachable: bool = True) -> list[str]:
        """The owner's state at home: the early copy, or `fetch` and `fetch_job` now."""
        early = self.early_copy()
        if early is not None:
            return early
        return [*self.fetch(plan, reachable=reachable), *(self.fetch_job(plan) if reachable else [])]

    def _pull(self, host: int, remote: str, home: Path) -> Transfer:
        """`remote` on the host mirrored into `home` (only what differs); the host said lost if not."""
        try:
            return self._folders.pull(host, remote, home, mirror=True)
        except LaunchError:
            self._folders.lost(host)
            raise

    def _send(self, home: Path, targets: list[tuple[int, str]], what: str) -> list[Transfer]:
        """`home` to each (host, folder) that differs, hosts in parallel; a host that fails is
        said lost, and the first failure raised (`what` failed)."""
        ours = local_tree(home)  # once for every host it goes to

        def one(target: tuple[int, str]) -> Transfer:
            try:
                return self._folders.push(target[0], home, target[1], ours)
            except LaunchError:
                self._folders.lost(target[0])
                raise

        return on_all(targets, one).raise_if_failed(what)

    def fetch(self, plan: LaunchPlan, *, reachable: bool = True) -> list[str]:
        """The owner's checkpoint folder brought home (only what differs); `reachable` False: its
        host is known lost, and home keeps the last copy brought."""
        state = plan.state
        self._owner_lacks = False
        if state is None or self._state_shared(plan):
            return []
        owner = plan.task(state.owner)
        home = self._home / "checkpoints"
        where = f"{owner.name} ({self._folders.label(owner.host_index)})"
        self._source = None
        if not reachable:
            return [f"{where} is out of reach: the last checkpoints brought home are used"]
        got = self._pull(owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR], home)
        if not got.exists and any(home.iterdir() if home.is_dir() else ()):
            # the owner's folder is gone (a --resume after its host was cleaned): home's copy is
            # the latest state there is, so the owner gets it back too
            self._owner_lacks = True
            return [f"{where} has no checkpoint folder; using the copy in {home}"]
        self._source = (owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR])
        label = self._folders.label(owner.host_index)
        return [f"checkpoints of {owner.name} copied from {label} to {home}: {got.describe()}"]

    def hand_out(self, plan: LaunchPlan) -> list[str]:
        """Home's copy to every reader's folder (on its host) that differs, hosts in parallel."""
        state = plan.state
        home = self._home / "checkpoints"
        if state is None or self._state_shared(plan) or not home.is_dir():
            return []
        readers = list(map(plan.task, state.readers))
        # every reader but the folder home's copy came from (the owner that wrote it, if it was
        # asked and had it): a new owner, a lost host's reader on a spare, get it too
        places = {(t.host_index, t.env[wire.ENV_CHECKPOINT_DIR]) for t in readers}
        targets = sorted(places - ({self._source} if self._source and not self._owner_lacks else set()))
        sent = self._send(home, targets, "copying the checkpoint to the hosts")
        return [
            f"→ {self._folders.label(i)} {f}: {s.describe()}" for (i, f), s in zip(targets, sent, strict=True)
        ]

    def follow(self, plan: LaunchPlan) -> None:
        """While the attempt trains, each new checkpoint of the owner comes home (its host may be
        lost: the next attempt resumes from home's copy, a checkpoint interval lost at most) and
        goes on to an evaluator on another host. One copy at a time; the newest wins; a copy cut
        short never replaces a whole one (staged, checked, committed data first)."""
        self._ran = plan  # the attempt about to run: its owner writes the next checkpoints
        state = plan.state
        if state is None or self._state_shared(plan):
            return
        evaluators = [t for t in map(plan.task, state.readers) if t.role is Role.EVALUATOR]
        self._follow_stop = threading.Event()
        self._follower = threading.Thread(
            target=self._follow, args=(plan, evaluators, self._follow_stop), daemon=True, name="ship"
        )
        self._follower.start()

    def _targets(self, plan: LaunchPlan, readers: list[TaskPlan]) -> list[tuple[int, str]]:
        """(host, folder) of the readers, but the owner's own."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        source = (owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR])
        return sorted({(t.host_index, t.env[wire.ENV_CHECKPOINT_DIR]) for t in readers} - {source})

    def _follow(self, plan: LaunchPlan, evaluators: list[TaskPlan], stop: threading.Event) -> None:
        """A round that fails (a file changed while copied, a host away) is tried again; one whose
        stamp is the last one copied's moves nothing."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        home = self._home / "checkpoints"
        folder, copied, pause = owner.env[wire.ENV_CHECKPOINT_DIR], None, self._every_s
        # after a copy, 3 copies' time at least: a job saving faster than copies go pays a quarter
        while not stop.wait(pause):
            pause = self._every_s
            try:
                seen = self._folders.stamp(owner.host_index, folder)
                if seen is not None and seen == copied:
                    continue
                got = self._folders.pull(owner.host_index, folder, home, mirror=True)
                if not got.exists:
                    continue
                copied = seen
                pause = max(self._every_s, 3 * got.seconds) if got.files else self._every_s
                if got.files:
                    log.debug("%s of %s came home: %s", folder, owner.name, got.describe())
                targets = self._targets(plan, evaluators) if got.files or got.removed else []
                ours = local_tree(home) if targets else {}
                for index, target in targets:
                    if stop.is_set():
                        return
                    sent = self._folders.push(index, home, target, ours)
                    if sent.files:
                        log.debug("%s %s: %s", self._folders.label(index), target, sent.describe())
            except LaunchError as exc:
                log.debug("following the checkpoints, tried again in %g s: %s", self._every_s, exc)

    def stop_following(self, timeout_s: float | None = None, *, lost: Collection[int] = ()) -> None:
        """The follower stopped: its copy under way may finish (`timeout_s`, the I/O bound at most),
        not where the owner it follows is on a `lost` host (it waits on it; it ends once that fails)."""
        follower, self._follower, ran = self._follower, None, self._ran
        if follower is not None:
            self._follow_stop.set()
            if ran is not None and ran.state is not None and ran.task(ran.state.owner).host_index in lost:
                timeout_s = 0.0
            follower.join(timeout=self._stop_wait_s if timeout_s is None else timeout_s)

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """The owner's model/, tensorboard/ and latest checkpoint, the evaluators' tensorboard/,
        into the run directory. A host that cannot be reached is said, not raised."""
        self.early_copy()  # a copy begun for a restart that did not come: done first
        self.stop_following()
        if plan.state is None:
            return []
        return [*pull_results(self._folders, self._results(plan)), *self._settle_job(plan)]

    def _results(self, plan: LaunchPlan) -> list[tuple[TaskPlan, str, Path, bool]]:
        """(task, its folder, where it comes here, mirrored): the latest checkpoint (the owner's,
        mirrored), the model (the owner's), TensorBoard's files (the owner's and evaluators')."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        wanted: list[tuple[TaskPlan, str, Path, bool]] = []
        if not self._state_shared(plan):
            wanted.append((owner, owner.env[wire.ENV_CHECKPOINT_DIR], self._home / "checkpoints", True))
        for task in plan.tasks:
            folder = task.env[wire.ENV_RUN_DIR]
            if self._seen(folder):  # this machine sees it too: the results are home already
                continue
            if task.name == owner.name:
                wanted.append((task, posixpath.join(folder, "model"), self._home / "model", False))
            board = posixpath.join(folder, "tensorboard")
            seen = any(w[0].host_index == task.host_index and w[1] == board for w in wanted)
            if (task.name == owner.name or task.role is Role.EVALUATOR) and not seen:
                wanted.append((task, board, self._home / "tensorboard", False))
        return wanted
