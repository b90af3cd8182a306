"""Launch layer, slurm backend: the run's files on nodes that share no disk with this machine.

Each node keeps the run's copy in `slurm.workdir/runs/<run id>/` (default /tmp/orchestrate-<uid>):
the job's folder as code/, the worker runtime as lib/worker/. Files travel as tar streams through
job steps, never through a shell: one `srun --ntasks-per-node=1` hands the same tar on stdin to
every node at once (worker/probe.py `unpack`), and one step on a node packs folders to stdout
(`pack`). Before a new attempt the owner's checkpoints come home from the node it ran on and go
to every reader's node, replacing what was there; at the end the results come home.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import shutil
import tarfile
from collections.abc import Mapping
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.launch.placement import job_files_root
from orchestrator.launch.runtime import FOLDERS_SOURCE, RUNTIME_ROOT
from orchestrator.launch.slurm.cluster import Slurm, job_name, step_argv
from orchestrator.launch.slurm.spec import section
from orchestrator.plan import LaunchPlan
from orchestrator.record import private_open
from orchestrator.spec.model import ClusterSpec, Role
from orchestrator.spec.roles import task_slots

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
        workdir = section(spec).workdir or f"/tmp/orchestrate-{os.getuid()}"
        self.folder = posixpath.join(workdir, "runs", run_id)  # the run's copy, on every node

    def ship_code(self, job_id: str, nodes: list[str]) -> None:
        """The job's folder (code/) and the worker runtime (lib/worker/) to every node, at once."""
        spec = self._spec
        if any(s.role is Role.EVALUATOR for s in task_slots(spec)):
            owner = "chief-0" if spec.role_count(Role.CHIEF) else "worker-0"
            hosts = {s.name: s.host_index for s in task_slots(spec)}
            if hosts["evaluator-0"] != hosts[owner]:
                raise LaunchError(
                    "the nodes do not share this machine's files: the evaluator must run on the node of "
                    f"{owner} (it reads the checkpoints there; slurm.tasks_per_node)"
                )
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

    def pull(self, job_id: str, node: str, subs: list[str], into: Path) -> bool:
        """Folders of the run's copy on one node into `into` (each replaced); False if it failed."""
        argv = [
            *step_argv(job_id, node, f"{job_name(self._run_id)}-copy"),
            *self._python,
            "-S",
            "-c",
            FOLDERS_SOURCE,
            "pack",
            self.folder,
            *subs,
        ]
        try:
            res = self._slurm.run_bytes(argv, f"copying from {node}", b"", timeout_s=self._timeout_s)
        except LaunchError as exc:
            log.warning("%s", exc)
            return False
        if res.returncode != 0:
            log.warning("copying from %s: %s", node, res.stderr.decode(errors="replace")[-400:])
            return False
        with tarfile.open(fileobj=io.BytesIO(res.stdout), mode="r") as tar:
            members = [m for m in tar.getmembers() if m.isfile() and _safe(m.name)]
            for sub in subs:
                if any(m.name.startswith(f"{sub}/") for m in members):
                    shutil.rmtree(into / sub, ignore_errors=True)
            for m in members:
                target = into / m.name
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(m)
                assert source is not None
                with private_open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
        return True

    def fetch_state(self, job_id: str, plan: LaunchPlan, owner_node: str | None, notes: list[str]) -> None:
        """Before a new attempt (and before an allocation is given up): the owner's latest
        checkpoints home from the node it ran on (None: out of reach; the last copy stays)."""
        state = plan.state
        if state is None or state.shared:
            return
        if owner_node is not None and self.pull(job_id, owner_node, ["checkpoints"], self._run_dir):
            notes.append(f"checkpoints of {state.owner} copied from {owner_node}")
        else:
            notes.append(f"{state.owner}'s node is out of reach: the last checkpoints brought home are used")

    def hand_out_state(self, job_id: str, plan: LaunchPlan, node_of: Mapping[str, str]) -> None:
        """The checkpoints brought home to every reader's node (what was there replaced), so every
        task resumes from the same state."""
        state = plan.state
        if state is None or state.shared:
            return
        readers = sorted({node_of[t] for t in state.readers})
        if not readers or not tree(self._run_dir / "checkpoints"):
            return
        data = pack_tar({"checkpoints": self._run_dir / "checkpoints"})
        self.push(job_id, readers, data, replace=True, what="copying the checkpoints to the nodes")


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
