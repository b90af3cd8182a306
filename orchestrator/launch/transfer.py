"""Launch layer: what every backend's copy of a state folder shares, whatever carries the files (an
SFTP session, a tar through a Slurm step) — a folder listed here the way it is listed on a host
(`worker/host/folders.py tree`, run on this machine: the one implementation), the files that differ,
received files committed (data first, TF's `checkpoint` index last), and what a copy moved.
"""

from __future__ import annotations

import abc
import hashlib
import posixpath
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.record.progress import size_text
from worker.host.folders import sha256_file

#: A folder's name for files received before they are committed (`tree` removes a leftover one).
STAGING_PREFIX = ".incoming-"
IO_TIMEOUT_S = 60.0  # default: no answer this long and the host is gone (a cut-off host never answers)


@dataclass(frozen=True)
class Transfer:
    """What one copy of a folder moved."""

    files: int
    bytes: int
    removed: int
    seconds: float
    exists: bool = True  # the source folder was there

    def describe(self) -> str:
        if not self.files and not self.removed:
            return "already the same"
        moved = f"{self.files} file(s), {size_text(self.bytes)}"
        gone = f", {self.removed} removed" if self.removed else ""
        return f"{moved}{gone} in {self.seconds:.1f} s"


def pull_into(
    theirs: dict[str, Any],
    local: Path,
    *,
    mirror: bool,
    fetch: Callable[[list[str], Path], None],
    host: str,
    remote: str,
    started: float,
) -> Transfer:
    """Make `local` hold the files of a host's folder (`theirs`: its `tree`; `mirror`: and nothing
    else): `fetch(files, staging)` writes the files that differ under a staging folder beside it,
    each is checked against its listed SHA-256 (a task still writing there is caught), then they
    are committed (data first, index last). `host` and `remote` name the folder for an error."""
    if not theirs["exists"]:
        return Transfer(0, 0, 0, time.monotonic() - started, exists=False)
    ours = local_tree(local)
    todo = differing(theirs["files"], ours["files"])
    need = sum(theirs["files"][rel][0] for rel in todo)
    if need > ours["free_bytes"]:
        raise LaunchError(
            f"cannot bring {remote} home from {host}: it needs {size_text(need)} in {local}, "
            f"{size_text(ours['free_bytes'])} free"
        )
    staging = local / f"{STAGING_PREFIX}{secrets.token_hex(4)}"
    try:
        staging.mkdir(parents=True, mode=0o700)
        if todo:
            fetch(todo, staging)
        for rel in todo:
            if sha256_file(staging / rel) != theirs["files"][rel][1]:
                raise LaunchError(
                    f"{host}: {remote}/{rel} changed while it was copied (is a task still writing there?)"
                )
        keep = sorted(theirs["files"]) if mirror else sorted(set(theirs["files"]) | set(ours["files"]))
        done = commit_here(local, staging, keep)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Transfer(len(todo), need, int(done["removed"]), time.monotonic() - started)


def to_push(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> tuple[list[str], int] | None:
    """The files of `ours` a host's folder (`theirs`: its `tree`) must get, and their bytes; None
    where it is already the same. LaunchError where they do not fit there."""
    todo = differing(ours["files"], theirs["files"])
    if not todo and not set(theirs["files"]) - set(ours["files"]):
        return None
    need = sum(ours["files"][rel][0] for rel in todo)
    if need > theirs["free_bytes"]:
        raise LaunchError(
            f"{where}: no room for the checkpoint in {theirs['folder']}: it needs {size_text(need)}, "
            f"{size_text(theirs['free_bytes'])} free"
        )
    return todo, need


def local_tree(folder: Path) -> dict[str, Any]:
    """folders.py's `tree`, on this machine (the one implementation, as on the hosts; in this
    process: a follower copying each checkpoint home would pay a Python start-up each time)."""
    from worker.host import folders

    try:
        return folders.tree(str(folder))
    except OSError as exc:
        raise LaunchError(f"this machine: cannot list {folder}: {exc.strerror or exc}") from None


def differing(source: dict[str, list[Any]], target: dict[str, list[Any]]) -> list[str]:
    """The files of `source` that `target` lacks or holds otherwise (size, SHA-256); LaunchError
    for a name that would leave the folder."""
    for rel in source:
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "" in parts:
            raise LaunchError(f"refusing to copy a file named {rel!r}")
    return sorted(rel for rel, (size, digest) in source.items() if target.get(rel) != [size, digest])


def commit_here(folder: Path, staging: Path, keep: list[str]) -> dict[str, Any]:
    """Files received in `staging` moved into `folder` (data first, index last), then what is not
    in `keep` removed (folders.py's `commit`, on this machine, in this process)."""
    from worker.host import folders

    try:
        return folders.commit(str(folder), str(staging), keep)
    except OSError as exc:
        raise LaunchError(f"this machine: cannot commit into {folder}: {exc.strerror or exc}") from None


def folder_slug(folder: str) -> str:
    """A folder's name in the run directory: its last part and a hash of the whole path."""
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in posixpath.basename(folder.rstrip("/")))[
        :40
    ]
    return f"{tail or 'root'}-{hashlib.sha256(folder.encode(errors='replace')).hexdigest()[:10]}"


class Folders(abc.ABC):
    """How a backend moves a folder between this machine and one of its hosts (by host index)."""

    @abc.abstractmethod
    def label(self, host: int) -> str:
        """The host, for people."""

    @abc.abstractmethod
    def pull(self, host: int, remote: str, local: Path, *, mirror: bool) -> Transfer:
        """Make `local` hold the files of `remote` on the host (`mirror`: and nothing else);
        `exists` False where the host has no such folder. LaunchError when it cannot."""

    @abc.abstractmethod
    def push(self, host: int, local: Path, remote: str, ours: dict[str, Any]) -> Transfer:
        """Make `remote` on the host an exact copy of `local` (`ours`: its `local_tree`, listed
        once for every host it goes to). LaunchError when it cannot."""

    def stamp(self, host: int, remote: str) -> str | None:
        """A cheap stamp of `remote` on the host (worker/host/folders.py `stamp`: names, sizes, times):
        the same, nothing changed there. None where the backend has none (the folder is pulled
        every time, only what differs moving). LaunchError when the host cannot be asked."""
        return None

    def lost(self, host: int) -> None:
        """A copy to or from the host failed (ssh: its connection is renewed before the next use)."""
        return None

    def shared(self, host: int, action: str, folder: str, nonce: str) -> bool:
        """worker/host/folders.py's `shared` on the host: `mark` (a nonce file into `folder`, if it is
        there: True if written), `read` (True if seen), `remove`. Without it: nothing is shared."""
        return False


def pull_results(folders: Folders, wanted: list[tuple[Any, str, Path, bool]]) -> list[str]:
    """Each (task, its folder, where it comes here, mirrored) pulled: one host's pulls one after
    another (they share its connection), hosts in parallel. A host that cannot be reached is
    said, not raised."""

    def host_pulls(index: int) -> list[str]:
        lines = []
        for task, remote, local, mirror in (w for w in wanted if w[0].host_index == index):
            try:
                got = folders.pull(index, remote, local, mirror=mirror)
            except LaunchError as exc:
                lines.append(f"could not bring {remote} home from {task.name}: {exc}")
                continue
            if got.files or (mirror and got.exists):  # the checkpoint: said though it came already
                said = got.describe() if got.files or got.removed else "already here (copied as it was saved)"
                lines.append(f"{local.name}/ from {task.name} ({folders.label(index)}): {said}")
        return lines

    out: list[str] = []
    for index, result in on_all(sorted({w[0].host_index for w in wanted}), host_pulls):
        out += [f"{folders.label(index)}: {result}"] if isinstance(result, Exception) else result
    return out
