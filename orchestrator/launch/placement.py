"""Launch layer: where each task runs, as its backend places it — the planner's only input
beyond the spec (plan.make_plan is a pure function of the two).

The backends' placing rules are pure functions here, without their transports, so that
`orchestrate plan` shows a placement without connecting anywhere (and without importing paramiko).
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots

SSH_DEFAULT_BASE_PORT = 23456  # remote hosts: free ports are checked there (`orchestrate check`)
SSH_DEFAULT_WORKDIR = "~/.orchestrate"


@dataclass(frozen=True)
class Placement:
    """Where and how one task runs."""

    host: str  # the address its peers reach it at (TF_CONFIG)
    port: int  # its TF server's port
    run_folder: str  # the run's folder on its host (ORCHESTRATE_RUN_DIR)
    python: tuple[str, ...]  # the interpreter there (a command, possibly several words)
    cwd: str
    coordinator_url: str  # where its heartbeats go
    host_index: int = 0  # its host in the spec
    code_root: str | None = None  # where the job's folder is copied on its host; None: used in place
    pythonpath: tuple[str, ...] = ()  # put first on PYTHONPATH (a copied worker runtime)
    env: Mapping[str, str] = field(default_factory=dict)  # what the backend adds to the task's env


def local_placements(
    spec: ClusterSpec,
    ports: Mapping[str, int],
    *,
    run_dir: Path,
    spec_dir: Path,
    coordinator_url: str,
    python: str,
) -> dict[str, Placement]:
    """The local backend: every task on this machine, in the run directory, with this Python."""
    return {
        slot.name: Placement(
            host="127.0.0.1",
            port=ports[slot.name],
            run_folder=str(run_dir),
            python=(python,),
            cwd=str(spec_dir),
            coordinator_url=coordinator_url,
            host_index=slot.host_index,
        )
        for slot in task_slots(spec)
    }


def ssh_ports(spec: ClusterSpec) -> dict[str, int]:
    """Each host's tasks take consecutive ports from its base_port (checked free there)."""
    ports = {}
    slots = task_slots(spec)
    for h, host in enumerate(spec.hosts):
        base = host.base_port or SSH_DEFAULT_BASE_PORT
        for i, slot in enumerate(s for s in slots if s.host_index == h):
            ports[slot.name] = base + i
    return ports


def ssh_placements(
    spec: ClusterSpec, run_id: str, workdirs: Mapping[int, str], urls: Mapping[int, str]
) -> dict[str, Placement]:
    """The ssh backend: each task on its host, in WORKDIR/runs/<run id>, the job's folder copied
    to code/ and the worker runtime to lib/. `workdirs` and `urls` per host index (the absolute
    folder learned by connecting, and where its heartbeats go)."""
    ports = ssh_ports(spec)
    out = {}
    for slot in task_slots(spec):
        host = spec.hosts[slot.host_index]
        folder = posixpath.join(workdirs[slot.host_index], "runs", run_id)
        code = posixpath.join(folder, "code")
        out[slot.name] = Placement(
            host=host.address,
            port=ports[slot.name],
            run_folder=folder,
            python=tuple(shlex.split(host.python)),
            cwd=code,
            coordinator_url=urls[slot.host_index],
            host_index=slot.host_index,
            code_root=code,
            pythonpath=(posixpath.join(folder, "lib"),),
        )
    return out


def ssh_preview(spec: ClusterSpec, run_id: str) -> dict[str, Placement]:
    """Before connecting (`orchestrate plan`): each host's folder as written."""
    direct = spec.ssh.coordinator_address
    url = f"http://{direct}" if direct else "http://127.0.0.1:<port forwarded through SSH>"
    indexes = range(len(spec.hosts))
    workdirs = {i: spec.hosts[i].workdir or SSH_DEFAULT_WORKDIR for i in indexes}
    return ssh_placements(spec, run_id, workdirs, {i: url for i in indexes})


def slurm_preview(spec: ClusterSpec, run_dir: Path, spec_dir: Path, *, python: str) -> dict[str, Placement]:
    """Before allocating (`orchestrate plan`): nodes and ports are known at launch."""
    assert spec.slurm is not None
    interpreter = tuple(shlex.split(spec.slurm.python)) if spec.slurm.python else (python,)
    url = f"http://{spec.slurm.coordinator_address or '<this machine, on the route to the nodes>'}"
    return {
        slot.name: Placement(
            host=spec.hosts[slot.host_index].address,
            port=0,
            run_folder=str(run_dir),
            python=interpreter,
            cwd=str(spec_dir),
            coordinator_url=url,
            host_index=slot.host_index,
        )
        for slot in task_slots(spec)
    }


def job_files_root(spec: ClusterSpec) -> Path:
    """The folder copied to hosts that share no disk with this one (job.files, or the job's own
    folder)."""
    entry = spec.job.script or spec.job.loop
    assert entry is not None
    return spec.job.files or entry.parent
