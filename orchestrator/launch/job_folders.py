"""Launch layer: the job's own folders between hosts that share no disk (a Keras job's
`BackupAndRestore('/tmp/backup')`, a CheckpointManager's folder: plan.state.job_folders) — the
owner's brought home, handed to every reader's host at the same place, and made the owner's again
everywhere at the end; a folder every host is proven to see (a nonce) is left as it is. A part of
StateExchange (exchange.py), kept in a module of its own."""

from __future__ import annotations

import contextlib
import logging
import posixpath
import secrets
from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.launch.transfer import Folders, Transfer, folder_slug
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan

log = logging.getLogger("orchestrator.launch")


class JobFolders:
    """The job's own folders (mixed into StateExchange, which sets what is declared here)."""

    _folders: Folders
    _home: Path
    _job_home: dict[str, Path]
    _shared: dict[str, bool]
    _handed: set[str]
    _seen: Callable[[str], bool]
    _pull: Callable[[int, str, Path], Transfer]
    _send: Callable[[Path, list[tuple[int, str]], str], list[Transfer]]

    def fetch_job(self, plan: LaunchPlan) -> list[str]:
        """The owner's copy of each of the job's own folders brought home (only what differs)."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        where = f"{owner.name} ({self._folders.label(owner.host_index)})"
        self._job_home = {}
        notes = []
        for folder in plan.state.job_folders:
            targets = self._job_targets(plan, folder)
            if not targets:
                continue  # every reader is on the owner's host
            if self._is_shared(owner, folder, targets):
                notes.append(f"{folder} is on a disk every host of the job shares: left as it is")
                continue
            home = self._job_copy(folder)
            if self._pull(owner.host_index, folder, home).exists:
                self._job_home[folder] = home
            else:
                notes.append(f"{where} has no {folder}: not copied")
        return notes

    def hand_out_job(self, plan: LaunchPlan) -> list[str]:
        """Each folder brought home to every reader's host at the same place (under its working
        folder, where the owner's is under the owner's). Only what differs moves: a folder every
        host shares is left as it is (nothing in it differs)."""
        notes = []
        for folder, home in self._job_home.items():
            self._handed.add(folder)
            notes += self._send_job(plan, folder, home, "copying {} of {} to the hosts", "")
        return notes

    def _settle_job(self, plan: LaunchPlan) -> list[str]:
        """At the end, each of the job's own folders handed out this run is made the owner's
        again on the other hosts (only what differs): Keras deletes its backup once `fit` is done,
        so the copies go too, and the next run on these hosts starts as it would on one."""
        assert plan.state is not None
        owner, out = plan.task(plan.state.owner), []
        for folder in (f for f in plan.state.job_folders if f in self._handed):
            home = self._job_copy(folder)
            try:
                if not self._pull(owner.host_index, folder, home).exists:
                    continue  # its host cleaned (a reboot?): home's copy is the last state there is
                out += self._send_job(plan, folder, home, "making {} the same on the hosts", " at the end")
            except LaunchError as exc:
                out.append(f"{folder} could not be made the same on every host at the end: {exc}")
        return out

    def _job_copy(self, folder: str) -> Path:
        """Home's copy of one of the job's own folders."""
        return self._home / "job-checkpoints" / folder_slug(folder)

    def _send_job(self, plan: LaunchPlan, folder: str, home: Path, what: str, when: str) -> list[str]:
        """Home's copy of `folder` to every reader's host (only what differs): a line each."""
        assert plan.state is not None
        owner, targets = plan.task(plan.state.owner), self._job_targets(plan, folder)
        sent = self._send(home, targets, what.format(folder, owner.name))
        return [
            f"{folder} of {owner.name} → {self._folders.label(i)} {f}{when}: {s.describe()}"
            for (i, f), s in zip(targets, sent, strict=True)
        ]

    def _job_targets(self, plan: LaunchPlan, folder: str) -> list[tuple[int, str]]:
        """(host, where the owner's `folder` goes there) of the readers, but the owner's own."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        places = {(t.host_index, same_place(folder, owner, t)) for t in map(plan.task, plan.state.readers)}
        return sorted(places - {(owner.host_index, folder)})

    def _is_shared(self, owner: TaskPlan, folder: str, targets: list[tuple[int, str]]) -> bool:
        """Whether every reader's host sees the owner's `folder` (a nonce written there by the
        owner's host, looked for by the others'; known once a run, from the first time the owner
        has the folder): then nothing is copied."""
        if folder in self._shared:
            return self._shared[folder]
        if self._seen(folder) and all(self._seen(f) for _, f in targets):
            self._shared[folder] = True
            return True
        nonce = secrets.token_hex(8)
        try:
            if not self._folders.shared(owner.host_index, "mark", folder, nonce):
                return False  # not there (yet): asked again next time
            seen = on_all(targets, lambda t: self._folders.shared(t[0], "read", t[1], nonce))
            self._shared[folder] = all(v is True for _, v in seen)
            return self._shared[folder]
        except LaunchError as exc:
            log.debug("is %s shared: %s", folder, exc)
            return False
        finally:
            with contextlib.suppress(LaunchError):
                self._folders.shared(owner.host_index, "remove", folder, nonce)


def same_place(folder: str, owner: TaskPlan, reader: TaskPlan) -> str:
    """Where `reader` looks for the owner's `folder`: under its own working folder where the
    owner's is under the owner's (a relative path in the job), else the same absolute path."""
    base = owner.cwd.rstrip("/") + "/"
    if folder.startswith(base):
        return posixpath.join(reader.cwd, folder[len(base) :])
    return folder
