"""A state folder (checkpoints, results) on a host (ssh and slurm backends),
read and written one way everywhere — the coordinator runs the same modes on its own machine.

Run as `PYTHON -c SOURCE MODE ARGS…` (nothing needs to be installed there first), as probe.py is.
Standard library only; each mode prints one JSON object on stdout (pack: a tar).

- tree FOLDER [snapshot]  every file under a state folder with its size and SHA-256, and the free
                          disk there. Hidden names and other tasks' scratch folders (`workertemp_*`)
                          are left out; symlinks are never followed. With `snapshot` (a folder a
                          task still writes: its checkpoints copied while it trains), the files are
                          first hard-linked into a hidden folder of its own (`snapshot` in the
                          answer, under FOLDER), TF's `checkpoint` index first: what it lists stays
                          whole and unchanged while it is copied, whatever the task saves or
                          removes meanwhile. A snapshot left over (older than SNAPSHOT_KEEP_S) goes.
- stamp FOLDER            what `tree` lists, by name, size and modification time only (no file is
                          read): the same stamp, nothing changed (a follower asks it often).
- commit FOLDER STAGING   move the files received in STAGING into FOLDER (data first, index files
                          such as TF's `checkpoint` last, so a reader never sees an index naming
                          files not there yet), then remove what is not in the list on stdin (JSON).
- shared write|mark|read|remove FOLDER NONCE…   prove a folder is shared: each host writes a nonce
                          file there, then reads the others'.
- pack FOLDER SUB…        a tar of FOLDER/SUB… on stdout (the files `tree` lists: no hidden ones, no
                          scratch folders, no symlinks); a SUB may be a folder or one file, one
                          that does not exist is left out. A snapshot's FOLDER is removed after.
- copy SOURCE TARGET      the files named on stdin (JSON, as `tree` listed them) from SOURCE into
                          TARGET, a staging folder: where this host and the coordinator share the
                          file system one of them is on (Slurm nodes that see the run directory),
                          in place of a tar through the connection. No symlink is followed.
- unpack FOLDER [replace] the tar on stdin into FOLDER, received beside it first; with `replace`,
                          each top folder of the tar is left holding exactly what the tar holds
                          (data first, index files last, as `commit`). Members that are not plain
                          files or folders, absolute, or with `..` are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tarfile
import time
from typing import Any

MODES = ("tree", "stamp", "commit", "shared", "pack", "unpack", "copy")


STAGING_PREFIX = ".incoming-"
SNAPSHOT_PREFIX = ".orchestrate-snapshot-"
SNAPSHOT_KEEP_S = 120.0  # a snapshot whose copy never came to remove it


def _skipped(name: str) -> bool:
    # hidden: our loop's non-chief save folders (.worker-1), staging; workertemp_N: tf-keras'
    return name.startswith(".") or name.startswith("workertemp_")


def _walk(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows a symlinked folder
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if _skipped(name) or os.path.islink(path) or not os.path.isfile(path):
                continue
            out.append(os.path.relpath(path, folder))
    return out


def sha256_file(path: str | os.PathLike[str]) -> str:
    """A file's SHA-256 (hex), read in 1 MiB pieces: the one checksum of a state folder's files and
    of what the coordinator sends a host (its file cache is named by it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree(folder: str, *how: str) -> dict[str, Any]:
    folder = os.path.abspath(os.path.expanduser(folder))
    out: dict[str, Any] = {"folder": folder, "exists": os.path.isdir(folder), "files": {}}
    if out["exists"]:
        for name in os.listdir(folder):  # what an interrupted transfer left: never half-used
            if name.startswith(STAGING_PREFIX) or _stale_snapshot(folder, name):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        base = folder
        if "snapshot" in how:
            snapshot = _snapshot(folder)
            if snapshot is not None:
                base, out["snapshot"] = os.path.join(folder, snapshot), snapshot
        for rel in _walk(base):
            path = os.path.join(base, rel)
            try:
                out["files"][rel] = [os.path.getsize(path), sha256_file(path)]
            except OSError:
                continue  # removed meanwhile
    probe = folder
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    out["free_bytes"] = shutil.disk_usage(probe).free
    return out


def _stale_snapshot(folder: str, name: str) -> bool:
    if not name.startswith(SNAPSHOT_PREFIX):
        return False
    try:
        return time.time() - os.stat(os.path.join(folder, name)).st_mtime > SNAPSHOT_KEEP_S
    except OSError:
        return False


def _snapshot(folder: str) -> str | None:
    """The folder's files hard-linked into a hidden folder of their own (index files first: the
    checkpoint they name was whole when they were linked, and stays so); None where links cannot
    be made there (another filesystem's rules): the files are then listed in place."""
    name = f"{SNAPSHOT_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
    snapshot = os.path.join(folder, name)
    try:
        os.mkdir(snapshot, 0o700)
        for rel in sorted(_walk(folder), key=lambda r: (not _is_index(r), r)):
            target = os.path.join(snapshot, rel)
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile (an older checkpoint)
                os.link(os.path.join(folder, rel), target, follow_symlinks=False)
    except OSError:
        shutil.rmtree(snapshot, ignore_errors=True)
        return None
    return name


def stamp(folder: str) -> dict[str, Any]:
    folder = os.path.abspath(os.path.expanduser(folder))
    digest = hashlib.sha256()
    exists = os.path.isdir(folder)
    for rel in _walk(folder) if exists else []:
        try:
            st = os.stat(os.path.join(folder, rel))
        except OSError:
            continue  # removed meanwhile
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
    return {"exists": exists, "stamp": digest.hexdigest()}


def _is_index(rel: str) -> bool:
    return os.path.basename(rel) == "checkpoint" or rel.endswith(".json")


def commit(folder: str, staging: str, keep_files: list[str] | None = None) -> dict[str, Any]:
    keep = set(json.loads(sys.stdin.read() or "[]") if keep_files is None else keep_files)
    received = sorted(_walk(staging), key=lambda rel: (_is_index(rel), rel))
    for rel in received:
        target = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(os.path.join(staging, rel), target)
    removed = 0
    for rel in _walk(folder):  # after the index moved on: what it named before may go now
        if rel not in keep:
            os.remove(os.path.join(folder, rel))
            removed += 1
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda x: -len(x[0])):
        if dirpath != folder and not _skipped(os.path.basename(dirpath)):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)  # only when empty
    shutil.rmtree(staging, ignore_errors=True)
    return {"moved": len(received), "removed": removed}


def pack(folder: str, *subs: str) -> None:
    try:
        _pack(folder, *subs)
    finally:
        if os.path.basename(folder.rstrip("/")).startswith(SNAPSHOT_PREFIX):  # used once: gone
            shutil.rmtree(folder, ignore_errors=True)


def _pack(folder: str, *subs: str) -> None:
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for sub in subs:
            top = os.path.join(folder, sub)
            if os.path.islink(top):
                continue
            if os.path.isdir(top):
                for rel in sorted(_walk(top)):
                    tar.add(os.path.join(top, rel), arcname=f"{sub}/{rel}", recursive=False)
            elif os.path.isfile(top):  # one file `tree` listed
                tar.add(top, arcname=sub, recursive=False)


def copy(source: str, target: str) -> dict[str, Any]:
    names, done = json.loads(sys.stdin.read() or "[]"), 0
    try:
        for rel in names:
            if rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"refused {rel!r}")
            dest = os.path.join(target, rel)
            _makedirs_private(os.path.dirname(dest))
            fd = os.open(os.path.join(source, rel), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
                done += out.tell()
    finally:
        if os.path.basename(source.rstrip("/")).startswith(SNAPSHOT_PREFIX):  # used once: gone
            shutil.rmtree(source, ignore_errors=True)
    return {"copied": len(names), "bytes": done}


def _makedirs_private(folder: str) -> None:
    """Every folder it creates on the way is the user's alone (0700): a node's copy of a run holds
    the job's code, and /tmp/orchestrate-<uid> holds the shim's port locks, which must be private."""
    missing = []
    path = os.path.abspath(folder)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


def unpack(folder: str, *how: str) -> dict[str, Any]:
    _makedirs_private(os.path.dirname(os.path.abspath(folder)))
    staging = f"{folder.rstrip('/')}.incoming-{os.getpid()}"
    names: list[str] = []
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for member in tar:
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                raise ValueError(f"refused tar member {member.name!r}")
            if member.isdir():
                continue
            target = os.path.join(staging, member.name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            with open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            os.chmod(target, member.mode & 0o755)
            names.append(member.name)
    _makedirs_private(folder)
    tops = sorted({n.split("/")[0] for n in names})
    moved = removed = 0
    for top in tops:
        target, received = os.path.join(folder, top), os.path.join(staging, top)
        if os.path.isfile(received):  # a file at the tar's top: in place of the one there
            os.replace(received, target)
            moved += 1
        elif "replace" in how:
            keep = [n.split("/", 1)[1] for n in names if n.startswith(f"{top}/")]
            done = commit(target, received, keep)
            moved, removed = moved + done["moved"], removed + done["removed"]
        else:
            for rel in _walk(received):
                os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
                os.replace(os.path.join(received, rel), os.path.join(target, rel))
                moved += 1
    shutil.rmtree(staging, ignore_errors=True)
    return {"moved": moved, "removed": removed}


def shared(action: str, folder: str, *nonces: str) -> dict[str, Any]:
    """write FOLDER NONCE: leave a file named by the nonce (`mark`: only in a folder that is
    there); read FOLDER NONCE…: which of those files this host sees; remove FOLDER NONCE: take
    ours away again."""
    base = os.path.abspath(os.path.expanduser(folder))
    out: dict[str, Any] = {"error": None, "seen": []}
    try:
        for nonce in nonces:
            path = os.path.join(base, f".orchestrate-shared-{nonce}")
            if action in ("write", "mark"):  # mark: into a folder that is there, never made
                if action == "write":
                    os.makedirs(base, exist_ok=True)
                with open(path, "x") as f:
                    f.write(nonce)
            elif action == "read":
                if os.path.isfile(path):
                    out["seen"].append(nonce)
            elif os.path.isfile(path):
                os.remove(path)
    except OSError as exc:
        out["error"] = exc.strerror or str(exc)
    return out


def main(argv: list[str]) -> int:
    mode, args = argv[0], argv[1:]
    if mode == "pack":
        pack(*args)
        return 0
    handlers: dict[str, Any] = {
        "tree": tree,
        "stamp": stamp,
        "commit": commit,
        "shared": shared,
        "unpack": unpack,
        "copy": copy,
    }
    print(json.dumps(handlers[mode](*args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
