"""Launch layer, ssh backend: state folders between hosts that share no disk.

Lab machines have disks of their own, so a checkpoint the chief wrote is on the chief's host only.
Before an attempt restores, the coordinator makes every reader's folder an exact copy of the
owner's (`StatePlan`): it brings the owner's folder home (the run directory, which keeps the
latest copy of the run's state), then sends home's copy to each host that lacks it. At the end
of a run the same pull brings the results (model, TensorBoard, checkpoints) home.

A folder is compared file by file (size and SHA-256, listed by `worker/host/folders.py tree` on the
host and here), so only what differs travels. Files arrive under a staging folder beside the
target and are moved into place by `folders.py commit` — data first, TF's `checkpoint` index last —
so a reader never sees an index that names files not there yet, and a transfer cut short
leaves the previous complete checkpoint in use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import posixpath
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.launch.ssh.hosts import Host, probe
from orchestrator.launch.transfer import (
    IO_TIMEOUT_S,
    STAGING_PREFIX,
    Transfer,
    local_tree,
    pull_into,
    to_push,
)
from orchestrator.record.progress import size_text


@contextlib.contextmanager
def _sftp(conn: fabric.Connection, timeout_s: float) -> Iterator[paramiko.SFTPClient]:
    """An SFTP session of this transfer's own (one client shared by threads can deadlock in
    paramiko's prefetch)."""
    client = open_sftp(conn, timeout_s)
    try:
        yield client
    finally:
        client.close()


def open_sftp(conn: fabric.Connection, timeout_s: float) -> paramiko.SFTPClient:
    """An SFTP session whose channel opens within `timeout_s` (paramiko would wait an hour for a
    host that went away) and whose every read and write is bounded by it."""
    transport = conn.transport
    assert transport is not None
    channel = transport.open_session(timeout=timeout_s)
    channel.settimeout(timeout_s)
    channel.invoke_subsystem("sftp")
    return paramiko.SFTPClient(channel)


def stamp(sftp: paramiko.SFTPClient, remote: str) -> str | None:
    """`folders.py stamp` read over an SFTP session (no process started on the host: asked every
    half second while an attempt trains): the names, sizes and modification times of what `tree`
    lists; the same stamp, nothing changed. None where the folder is not there."""
    digest = hashlib.sha256()
    try:
        _stamp_into(sftp, remote, "", digest)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def _stamp_into(sftp: paramiko.SFTPClient, folder: str, prefix: str, digest: Any) -> None:
    for entry in sorted(sftp.listdir_attr(folder), key=lambda e: e.filename):
        name = entry.filename
        if name.startswith(".") or name.startswith("workertemp_"):  # as folders.py's `tree`
            continue
        mode = entry.st_mode or 0
        if stat.S_ISDIR(mode):  # readdir's own attributes: a symlink is neither, never followed
            _stamp_into(sftp, posixpath.join(folder, name), f"{prefix}{name}/", digest)
        elif stat.S_ISREG(mode):
            digest.update(f"{prefix}{name}\0{entry.st_size}\0{entry.st_mtime}\n".encode(errors="replace"))


@contextlib.contextmanager
def connection_errors(host: Host, what: str) -> Iterator[None]:
    """A connection that fails or goes silent mid-copy is a LaunchError naming the host."""
    try:
        yield
    except (OSError, EOFError, paramiko.SSHException) as exc:
        raise LaunchError(f"{host.label}: {what}: {exc or type(exc).__name__}") from None


def pull(
    conn: fabric.Connection,
    host: Host,
    remote: str,
    local: Path,
    *,
    mirror: bool = True,
    timeout_s: float = IO_TIMEOUT_S,
) -> Transfer:
    """Make `local` hold the files of `remote` on the host (`mirror`: and nothing else)."""
    with connection_errors(host, f"bringing {remote} home"):
        return _pull(conn, host, remote, local, mirror, timeout_s)


def _pull(
    conn: fabric.Connection, host: Host, remote: str, local: Path, mirror: bool, timeout_s: float
) -> Transfer:
    started = time.monotonic()
    # a snapshot of the folder (hard links): a task that saves meanwhile changes nothing it lists
    theirs = _checked(probe(conn, host, "tree", remote, "snapshot", timeout_s=timeout_s), host)
    source = (
        posixpath.join(theirs["folder"], theirs["snapshot"]) if theirs.get("snapshot") else theirs["folder"]
    )

    def fetch(files: list[str], staging: Path) -> None:
        with _sftp(conn, timeout_s) as sftp:
            for rel in files:
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    sftp.get(posixpath.join(source, rel), str(target))
                except OSError as exc:
                    raise LaunchError(f"{host.label}: cannot read {remote}/{rel}: {exc}") from None

    try:
        return pull_into(
            theirs, local, mirror=mirror, fetch=fetch, host=host.label, remote=remote, started=started
        )
    finally:
        if theirs.get("snapshot"):
            with (
                contextlib.suppress(OSError, EOFError, paramiko.SSHException),
                _sftp(conn, timeout_s) as sftp,
            ):
                _remove_tree(sftp, source, list(theirs["files"]))


def push(
    conn: fabric.Connection,
    host: Host,
    local: Path,
    remote: str,
    *,
    timeout_s: float = IO_TIMEOUT_S,
    ours: dict[str, Any] | None = None,
) -> Transfer:
    """Make `remote` on the host an exact copy of `local`. `ours`: local_tree(local), when the
    caller sends one folder to several hosts (listed and hashed once, not once per host)."""
    with connection_errors(host, f"sending the checkpoint to {remote}"):
        return _push(conn, host, local, remote, timeout_s, ours if ours is not None else local_tree(local))


def _push(
    conn: fabric.Connection, host: Host, local: Path, remote: str, timeout_s: float, ours: dict[str, Any]
) -> Transfer:
    started = time.monotonic()
    theirs = _checked(probe(conn, host, "tree", remote, timeout_s=timeout_s), host)
    plan = to_push(ours, theirs, host.label)
    if plan is None:
        return Transfer(0, 0, 0, time.monotonic() - started)
    todo, need = plan
    folder = theirs["folder"]
    staging = posixpath.join(folder, f"{STAGING_PREFIX}{secrets.token_hex(4)}")
    made: set[str] = set()
    with _sftp(conn, timeout_s) as sftp:
        try:
            _mkdirs(sftp, staging, made)
            for rel in todo:
                target = posixpath.join(staging, rel)
                _mkdirs(sftp, posixpath.dirname(target), made)
                try:
                    sftp.put(str(local / rel), target)
                except TimeoutError:
                    raise  # the host went silent: not a full disk
                except OSError as exc:
                    raise LaunchError(
                        f"{host.label}: cannot write {folder}/{rel} ({exc or type(exc).__name__}; "
                        f"{size_text(theirs['free_bytes'])} were free before the copy)"
                    ) from None
            keep = json.dumps(sorted(ours["files"]))
            done = _checked(
                probe(conn, host, "commit", folder, staging, stdin=keep, timeout_s=timeout_s), host
            )
        except LaunchError:
            _remove_staging(sftp, staging, made)  # the host answers: take the partial copy away
            raise
        # a host that went silent is not asked again: its next `tree` removes the staging folder
    return Transfer(len(todo), need, int(done["removed"]), time.monotonic() - started)


def _checked(answer: Any, host: Host) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise LaunchError(f"{host.label}: unexpected answer {answer!r:.200}")
    return answer


def _mkdirs(sftp: Any, path: str, made: set[str]) -> None:
    parts = path.split("/")
    for i in range(2, len(parts) + 1):
        sub = "/".join(parts[:i])
        if sub in made:
            continue
        with contextlib.suppress(OSError):  # there already (or not ours to make: the put says so)
            sftp.mkdir(sub, mode=0o700)
        made.add(sub)


def _remove_tree(sftp: Any, folder: str, files: list[str]) -> None:
    """A snapshot's files and folders removed (the next `tree` removes what is left)."""
    for rel in files:
        with contextlib.suppress(OSError):
            sftp.remove(posixpath.join(folder, rel))
    subs = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    for sub in sorted(subs, key=len, reverse=True):
        with contextlib.suppress(OSError):
            sftp.rmdir(posixpath.join(folder, sub))
    with contextlib.suppress(OSError):
        sftp.rmdir(folder)


def _remove_staging(sftp: Any, staging: str, made: set[str]) -> None:
    """Best effort; what is left is removed by the next `tree` of that folder."""
    try:
        for entry in sorted((m for m in made if m.startswith(staging)), key=len, reverse=True):
            for name in sftp.listdir(entry):
                path = posixpath.join(entry, name)
                if path not in made:
                    sftp.remove(path)
            sftp.rmdir(entry)
    except OSError:
        pass
