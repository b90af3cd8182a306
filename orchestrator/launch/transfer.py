"""Launch layer: what every backend's copy of a state folder shares, whatever carries the files (an
SFTP session, a tar through a Slurm step) — a folder listed here the way it is listed on a host
(`worker/folders.py tree`, run on this machine: the one implementation), the files that differ,
received files committed (data first, TF's `checkpoint` index last), and what a copy moved.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.runtime import source_for

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


def local_tree(folder: Path) -> dict[str, Any]:
    """folders.py's `tree`, run on this machine (the one implementation, as on the hosts)."""
    return run_here("tree", str(folder))


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
    in `keep` removed (folders.py's `commit`, on this machine)."""
    return run_here("commit", str(folder), str(staging), stdin=json.dumps(keep))


def run_here(mode: str, *args: str, stdin: str | None = None) -> dict[str, Any]:
    """One mode of worker/folders.py (or probe.py) on this machine; its JSON answer."""
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
