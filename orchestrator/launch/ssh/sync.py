"""Launch layer, ssh backend: the job's files and the worker runtime, sent to each host once.

Each host keeps a content-addressed cache (`WORKDIR/cache/<sha256>`). The preflight asks each host
which checksums it lacks; only those files travel (SFTP, written under a temporary name, then
renamed). The shim, run from that cache, fills the run's folder (`WORKDIR/runs/<run id>/code` and
`/lib`) on the host itself.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import stat
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import fabric

from orchestrator.errors import LaunchError
from orchestrator.launch.ssh.hosts import Host
from worker.host import WORKER, runtime_files
from worker.host.folders import sha256_file

MAX_FILES = 5000
MAX_BYTES = 2 * 1024**3
# Never copied: version control, virtual environments, caches and run folders.
_SKIP_DIRS = {"__pycache__", "runs", "node_modules", "venv"}


@dataclass(frozen=True)
class FileEntry:
    rel: str  # path inside the run folder, "/"-separated
    sha256: str
    mode: int
    size: int
    source: Path


@dataclass(frozen=True)
class SyncResult:
    uploaded: int
    uploaded_bytes: int
    unchanged: int


def job_files(root: Path) -> list[FileEntry]:
    """Every file under the job's folder, as `code/<path>` (dot-files and caches left out)."""
    entries = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith(".pyc"):
                continue
            path = Path(dirpath) / name
            if not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            entry = _entry(f"code/{rel}", path)
            total += entry.size
            entries.append(entry)
            if len(entries) > MAX_FILES or total > MAX_BYTES:
                raise LaunchError(
                    f"job.files {root} holds more than {MAX_FILES} files or {MAX_BYTES >> 30} GiB; "
                    "point job.files at the folder with just the job's code and small data "
                    "(large data sets belong on the hosts already)"
                )
    return entries


def worker_files() -> list[FileEntry]:
    """The worker runtime (pure Python), as `lib/worker/<room>/<file>`: every host runs this exact
    copy."""
    return [_entry(f"lib/worker/{p.relative_to(WORKER).as_posix()}", p) for p in runtime_files()]


def shim_entry(entries: Sequence[FileEntry]) -> FileEntry:
    return runtime_entry(entries, "host/shim.py")


def runtime_entry(entries: Sequence[FileEntry], name: str) -> FileEntry:
    """A file of the worker runtime that runs straight from the host's cache (`host/shim.py`,
    `host/relay.py`, `wire/http1.py`)."""
    return next(e for e in entries if e.rel == f"lib/worker/{name}")


def _deltas(progress: Callable[[int], None] | None) -> Callable[[int, int], None] | None:
    """paramiko's callback (bytes so far, total) as the bytes of each part."""
    if progress is None:
        return None
    seen = [0]

    def told(done: int, total: int) -> None:
        progress(done - seen[0])
        seen[0] = done

    return told


def _entry(rel: str, path: Path) -> FileEntry:
    st = path.stat()
    return FileEntry(rel, sha256_file(path), stat.S_IMODE(st.st_mode), st.st_size, path)


def upload(
    conn: fabric.Connection,
    host: Host,
    workdir: str,
    entries: Sequence[FileEntry],
    missing: Collection[str],
    progress: Callable[[int], None] | None = None,
) -> SyncResult:
    """Send the files whose checksum the host's cache lacks (`missing`, from the preflight);
    `progress` is told the bytes of each part as it goes."""
    cache = posixpath.join(workdir, "cache")
    todo = {e.sha256: e for e in entries if e.sha256 in missing}
    if todo:
        sftp = conn.sftp()
        parts = cache.split("/")
        for i in range(2, len(parts) + 1):  # mkdir -p; one already there is fine
            with contextlib.suppress(OSError):
                sftp.mkdir("/".join(parts[:i]))
        for digest, entry in todo.items():
            tmp = posixpath.join(cache, f".{digest}.{secrets.token_hex(4)}")
            try:
                sftp.put(str(entry.source), tmp, callback=_deltas(progress))
                sftp.posix_rename(tmp, posixpath.join(cache, digest))
            except OSError as exc:
                raise LaunchError(f"{host.label}: cannot copy {entry.source} to {cache}: {exc}") from None
    sent_bytes = sum(e.size for e in todo.values())
    return SyncResult(
        uploaded=len(todo), uploaded_bytes=sent_bytes, unchanged=len({e.sha256 for e in entries}) - len(todo)
    )
