"""Launch layer, ssh backend: state folders between hosts that share no disk.

Lab machines have disks of their own, so a checkpoint the chief wrote is on the chief's host only.
Before an attempt restores, the coordinator makes every reader's folder an exact copy of the
owner's (`StatePlan`): it brings the owner's folder home (the run directory, which keeps the
latest copy of the run's state), then sends home's copy to each host that lacks it. At the end
of a run the same pull brings the results (model, TensorBoard, checkpoints) home.

A folder is compared file by file (size and SHA-256, listed by `worker/folders.py tree` on the
host and here), so only what differs travels. Files arrive under a staging folder beside the
target and are moved into place by `folders.py commit` — data first, TF's `checkpoint` index last —
so a reader never sees an index that names files not there yet, and a transfer cut short
leaves the previous complete checkpoint in use.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.launch.runtime import source_for
from orchestrator.launch.ssh.hosts import Host, probe
from orchestrator.launch.ssh.sync import sha256_file

STAGING_PREFIX = ".incoming-"


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
        moved = f"{self.files} file(s), {_size(self.bytes)}"
        gone = f", {self.removed} removed" if self.removed else ""
        return f"{moved}{gone} in {self.seconds:.1f} s"


def local_tree(folder: Path) -> dict[str, Any]:
    """folders.py's `tree`, run on this machine (the one implementation, as on the hosts)."""
    return _probe_here("tree", str(folder))


IO_TIMEOUT_S = 60.0  # default: no answer this long and the host is gone (a cut-off host never answers)


@contextlib.contextmanager
def _sftp(conn: fabric.Connection, timeout_s: float) -> Iterator[paramiko.SFTPClient]:
    """An SFTP session of this transfer's own (one client shared by threads can deadlock in
    paramiko's prefetch). Its channel opens within `timeout_s` (paramiko would wait an hour for a
    host that went away) and every read and write is bounded by it."""
    transport = conn.transport
    assert transport is not None
    channel = transport.open_session(timeout=timeout_s)
    channel.settimeout(timeout_s)
    channel.invoke_subsystem("sftp")
    client = paramiko.SFTPClient(channel)
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def _connection_errors(host: Host, what: str) -> Iterator[None]:
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
    with _connection_errors(host, f"bringing {remote} home"):
        return _pull(conn, host, remote, local, mirror, timeout_s)


def _pull(
    conn: fabric.Connection, host: Host, remote: str, local: Path, mirror: bool, timeout_s: float
) -> Transfer:
    started = time.monotonic()
    theirs = _checked(probe(conn, host, "tree", remote, timeout_s=timeout_s), host)
    if not theirs["exists"]:
        return Transfer(0, 0, 0, time.monotonic() - started, exists=False)
    ours = local_tree(local)
    todo = _differing(theirs["files"], ours["files"])
    need = sum(theirs["files"][rel][0] for rel in todo)
    if need > ours["free_bytes"]:
        raise LaunchError(
            f"cannot bring {remote} home from {host.label}: it needs {_size(need)} in {local}, "
            f"{_size(ours['free_bytes'])} free"
        )
    staging = local / f"{STAGING_PREFIX}{secrets.token_hex(4)}"
    try:
        with _sftp(conn, timeout_s) as sftp:
            for rel in todo:
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    sftp.get(posixpath.join(theirs["folder"], rel), str(target))
                except OSError as exc:
                    raise LaunchError(f"{host.label}: cannot read {remote}/{rel}: {exc}") from None
                if sha256_file(target) != theirs["files"][rel][1]:
                    raise LaunchError(
                        f"{host.label}: {remote}/{rel} changed while it was copied (is a task still "
                        "writing there?)"
                    )
        keep = sorted(theirs["files"]) if mirror else sorted(set(theirs["files"]) | set(ours["files"]))
        staging.mkdir(parents=True, exist_ok=True, mode=0o700)
        done = _probe_here("commit", str(local), str(staging), stdin=json.dumps(keep))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Transfer(len(todo), need, int(done["removed"]), time.monotonic() - started)


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
    with _connection_errors(host, f"sending the checkpoint to {remote}"):
        return _push(conn, host, local, remote, timeout_s, ours if ours is not None else local_tree(local))


def _push(
    conn: fabric.Connection, host: Host, local: Path, remote: str, timeout_s: float, ours: dict[str, Any]
) -> Transfer:
    started = time.monotonic()
    theirs = _checked(probe(conn, host, "tree", remote, timeout_s=timeout_s), host)
    todo = _differing(ours["files"], theirs["files"])
    extra = set(theirs["files"]) - set(ours["files"])
    if not todo and not extra:
        return Transfer(0, 0, 0, time.monotonic() - started)
    need = sum(ours["files"][rel][0] for rel in todo)
    if need > theirs["free_bytes"]:
        raise LaunchError(
            f"{host.label}: no room for the checkpoint in {theirs['folder']}: it needs {_size(need)}, "
            f"{_size(theirs['free_bytes'])} free"
        )
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
                        f"{_size(theirs['free_bytes'])} were free before the copy)"
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


def _differing(source: dict[str, list[Any]], target: dict[str, list[Any]]) -> list[str]:
    for rel in source:
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "" in parts:
            raise LaunchError(f"refusing to copy a file named {rel!r}")
    return sorted(rel for rel, (size, digest) in source.items() if target.get(rel) != [size, digest])


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


def _probe_here(mode: str, *args: str, stdin: str | None = None) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-S", "-c", source_for(mode), mode, *args],
        input=stdin or "",
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if res.returncode != 0:
        said = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit code {res.returncode}"
        raise LaunchError(f"this machine: {mode} {' '.join(args)} failed: {said}")
    answer: dict[str, Any] = json.loads(res.stdout)
    return answer


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
