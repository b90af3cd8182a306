"""Launch layer, ssh backend: copy the job's files and the worker runtime to each host.

Each host keeps a content-addressed cache (`WORKDIR/cache/<sha256>`); only files whose checksum it
does not hold yet travel (SFTP, written under a temporary name then renamed). The run's own
folder (`WORKDIR/runs/<run id>/code` and `/lib`) is then filled from the cache on the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import fabric

from orchestrator.errors import LaunchError
from orchestrator.launch.hosts import Host, probe

MAX_FILES = 5000
MAX_BYTES = 2 * 1024**3
# Never copied: version control, virtual environments, caches and run folders.
_SKIP_DIRS = {"__pycache__", "runs", "node_modules", "venv"}
_WORKER_DIR = Path(__file__).resolve().parents[2] / "worker"


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
    """The worker runtime (pure Python), as `lib/worker/<file>`: every host runs this exact copy."""
    return [_entry(f"lib/worker/{p.name}", p) for p in sorted(_WORKER_DIR.glob("*.py"))]


def _entry(rel: str, path: Path) -> FileEntry:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    st = path.stat()
    return FileEntry(rel, digest.hexdigest(), stat.S_IMODE(st.st_mode), st.st_size, path)


def sync(
    conn: fabric.Connection, host: Host, workdir: str, run_folder: str, entries: Sequence[FileEntry]
) -> SyncResult:
    """Bring `entries` into `run_folder` on the host, uploading only what its cache lacks."""
    cache = posixpath.join(workdir, "cache")
    sftp = conn.sftp()
    parts = cache.split("/")
    for i in range(2, len(parts) + 1):  # mkdir -p; one already there is fine (a real failure shows next)
        with contextlib.suppress(OSError):
            sftp.mkdir("/".join(parts[:i]))
    try:
        have = set(sftp.listdir(cache))
    except OSError as exc:
        raise LaunchError(f"{host.label}: cannot list {cache}: {exc}") from None
    sent, sent_bytes = 0, 0
    for digest, entry in {e.sha256: e for e in entries if e.sha256 not in have}.items():
        tmp = posixpath.join(cache, f".{digest}.{secrets.token_hex(4)}")
        try:
            sftp.put(str(entry.source), tmp)
            sftp.posix_rename(tmp, posixpath.join(cache, digest))
        except OSError as exc:
            raise LaunchError(f"{host.label}: cannot copy {entry.source} to {cache}: {exc}") from None
        sent += 1
        sent_bytes += entry.size
    manifest = json.dumps([[e.rel, e.sha256, e.mode] for e in entries])
    answer = probe(conn, host, "materialize", cache, run_folder, stdin=manifest)
    if answer["missing"]:
        raise LaunchError(f"{host.label}: files missing from {cache} after upload: {answer['missing'][:5]}")
    return SyncResult(uploaded=sent, uploaded_bytes=sent_bytes, unchanged=len(entries) - sent)
