"""Launch layer, slurm backend: the run's files on nodes that share no disk with this machine.

Each node keeps the run's copy in `slurm.workdir/runs/<run id>/` (default /tmp/orchestrate-<uid>):
the job's folder as code/, the worker runtime as lib/worker/. Files travel as tar streams through
job steps, never through a shell: one `srun --ntasks-per-node=1` hands the same tar on stdin to
every node at once (worker/host/probe.py `unpack`), and one step on a node packs folders to stdout
(`pack`). The run's state moves as between any hosts that share no disk (launch/exchange.py):
`NodeFolders` carries a node's folders through steps — before a new attempt the owner's latest
checkpoint comes home and goes to every reader's node where it differs, an evaluator on another
node follows each new one, and at the end the results come home.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.cluster import Slurm, job_name, step_argv
from orchestrator.launch.slurm.spec import section
from orchestrator.launch.transfer import STAGING_PREFIX, Folders, Transfer, pull_into, to_push
from orchestrator.plan.placement import job_files_root
from orchestrator.record.write import private_open
from orchestrator.spec.model import ClusterSpec
from worker.host import FOLDERS_SOURCE, RUNTIME_ROOT

log = logging.getLogger("orchestrator.slurm")


class NodeFiles:
    def __init__(
        self,
        slurm: Slurm,
        spec: ClusterSpec,
        run_id: str,
        run_dir: Path,
        python: tuple[str, ...],
        timeout_s: float,
    ):
        self._slurm, self._spec, self._run_id, self._run_dir = slurm, spec, run_id, run_dir
        self._python, self._timeout_s = python, timeout_s
        self.python, self.run_id = python, run_id
        self.workdir = section(spec).workdir or f"/tmp/orchestrate-{os.getuid()}"
        self.folder = posixpath.join(self.workdir, "runs", run_id)  # the run's copy, on every node

    def ship_code(self, job_id: str, nodes: list[str]) -> None:
        """The job's folder (code/) and the worker runtime (lib/worker/) to every node, at once."""
        spec = self._spec
        data = pack_tar({"code": job_files_root(spec), "lib/worker": RUNTIME_ROOT / "worker"})
        self.push(job_id, nodes, data, replace=False, what="copying the job's files")
        log.info("copied the job's files (%d bytes) to %s", len(data), ",".join(nodes))

    def push(self, job_id: str, nodes: list[str], data: bytes, *, replace: bool, what: str) -> None:
        """A tar into the run's copy on every node of `nodes` (srun hands stdin to each task)."""
        argv = [
            "srun",
            f"--jobid={job_id}",
            "--overlap",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}",
            f"--job-name={job_name(self._run_id)}-copy",
            "--quiet",
            *self._python,
            "-S",
            "-c",
            FOLDERS_SOURCE,
            "unpack",
            self.folder,
            *(["replace"] if replace else []),
        ]
        res = self._slurm.run_bytes(argv, what, data, timeout_s=self._timeout_s)
        if res.returncode != 0:
            said = " ".join(res.stderr.decode(errors="replace").split())[-400:]
            raise LaunchError(f"{what}: {said or f'exit {res.returncode}'}")


def pack_tar(folders: Mapping[str, Path]) -> bytes:
    """One tar of several folders' files, each under its name."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, folder in folders.items():
            for rel, path in tree(folder):
                tar.add(str(path), arcname=f"{name}/{rel}", recursive=False)
    return buffer.getvalue()


def tree(folder: Path) -> list[tuple[str, Path]]:
    """Every plain file under `folder` (relative path, path): no hidden ones, no symlinks, no
    caches — what is copied to nodes that share no disk with this machine."""
    out = []
    for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
        rel = path.relative_to(folder).as_posix()
        if (
            path.is_symlink()
            or not path.is_file()
            or any(p.startswith(".") or p == "__pycache__" for p in rel.split("/"))
        ):
            continue
        out.append((rel, path))
    return out


def _safe(name: str) -> bool:
    parts = name.split("/")
    return not name.startswith("/") and ".." not in parts


class NodeFolders(Folders):
    """A node's folders moved through job steps (`worker/host/folders.py` run there: its `tree` to see
    what differs, `pack` of those files to stdout, `unpack` into a staging folder and `commit`),
    for the state exchange (launch/exchange.py). A host index is a node slot of the spec; the node
    behind it is the one the placement gives it now."""

    def __init__(
        self,
        slurm: Slurm,
        run_id: str,
        python: tuple[str, ...],
        timeout_s: float,
        node: Callable[[int], str | None],
        job_id: Callable[[], str | None],
        home_seen: Callable[[], bool] = lambda: False,
    ):
        self._slurm, self._run_id, self._python, self._timeout_s = slurm, run_id, python, timeout_s
        self._node, self._job_id = node, job_id
        self._home_seen = home_seen  # the nodes see the run directory: files go through it

    def label(self, host: int) -> str:
        return self._node(host) or f"<node {host + 1}>"

    def pull(self, host: int, remote: str, local: Path, *, mirror: bool) -> Transfer:
        started = time.monotonic()
        node = self._where(host)
        theirs = self._step(node, "tree", remote, "snapshot")  # hard links: a task saving changes nothing
        source = (
            posixpath.join(theirs["folder"], theirs["snapshot"])
            if theirs.get("snapshot")
            else theirs["folder"]
        )

        def fetch(files: list[str], staging: Path) -> None:
            if self._home_seen():  # the node writes them into the run directory itself
                self._step(node, "copy", source, str(staging), stdin=json.dumps(files))
                return
            data = self._bytes(node, b"", "pack", source, *files)
            _extract(data, staging, set(files), f"{node}: {remote}")

        return pull_into(theirs, local, mirror=mirror, fetch=fetch, host=node, remote=remote, started=started)

    def push(self, host: int, local: Path, remote: str, ours: dict[str, Any]) -> Transfer:
        started = time.monotonic()
        node = self._where(host)
        theirs = self._step(node, "tree", remote)
        plan = to_push(ours, theirs, node)
        if plan is None:
            return Transfer(0, 0, 0, time.monotonic() - started)
        todo, need = plan
        staging = posixpath.join(theirs["folder"], f"{STAGING_PREFIX}{secrets.token_hex(4)}")
        if self._home_seen():  # the node reads them from the run directory itself
            self._step(node, "copy", str(local), staging, stdin=json.dumps(todo))
        else:
            self._bytes(node, pack_files(local, todo), "unpack", staging)
        done = self._step(node, "commit", theirs["folder"], staging, stdin=json.dumps(sorted(ours["files"])))
        return Transfer(len(todo), need, int(done["removed"]), time.monotonic() - started)

    def stamp(self, host: int, remote: str) -> str | None:
        answer = self._step(self._where(host), "stamp", remote)
        return str(answer["stamp"]) if answer.get("exists") else None

    def shared(self, host: int, action: str, folder: str, nonce: str) -> bool:
        answer = self._step(self._where(host), "shared", action, folder, nonce)
        return not answer.get("error") and (action != "read" or nonce in answer.get("seen", []))

    def _where(self, host: int) -> str:
        node = self._node(host)
        if node is None or self._job_id() is None:
            raise LaunchError(f"no node holds the spec's node {host + 1} now")
        return node

    def _argv(self, node: str, mode: str, *args: str) -> list[str]:
        job_id = self._job_id()
        assert job_id is not None
        steps = step_argv(job_id, node, f"{job_name(self._run_id)}-copy")
        return [*steps, *self._python, "-S", "-c", FOLDERS_SOURCE, mode, *args]

    def _step(self, node: str, mode: str, *args: str, stdin: str | None = None) -> dict[str, Any]:
        res = self._slurm.run(
            self._argv(node, mode, *args), f"{mode} on {node}", timeout_s=self._timeout_s, stdin=stdin
        )
        if res.returncode != 0:
            said = " ".join(res.stderr.split())[-400:] or f"exit {res.returncode}"
            raise LaunchError(f"{node}: {mode} {args[0] if args else ''}: {said}")
        answer: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
        return answer

    def _bytes(self, node: str, data: bytes, mode: str, *args: str) -> bytes:
        res = self._slurm.run_bytes(
            self._argv(node, mode, *args), f"{mode} on {node}", data, timeout_s=self._timeout_s
        )
        if res.returncode != 0:
            said = " ".join(res.stderr.decode(errors="replace").split())[-400:] or f"exit {res.returncode}"
            raise LaunchError(f"{node}: {mode} {args[0]}: {said}")
        return res.stdout


def pack_files(folder: Path, files: list[str]) -> bytes:
    """One tar of the named files of `folder` (as `tree` listed them)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for rel in files:
            tar.add(str(folder / rel), arcname=rel, recursive=False)
    return buffer.getvalue()


def _extract(data: bytes, staging: Path, wanted: set[str], what: str) -> None:
    """The files of a tar into `staging`: plain files that were asked for, nothing else."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            if not member.isfile() or not _safe(member.name) or member.name not in wanted:
                raise LaunchError(f"{what}: refused tar member {member.name!r}")
            target = staging / member.name
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            source = tar.extractfile(member)
            assert source is not None
            with private_open(target, "wb") as out:
                shutil.copyfileobj(source, out)
