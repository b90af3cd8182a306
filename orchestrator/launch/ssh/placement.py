"""Launch layer, ssh backend: where each task runs — its host, in WORKDIR/runs/<run id> there.

Pure functions, without the transport: `orchestrate plan` shows them without connecting anywhere
(and without importing paramiko)."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping

from orchestrator.environment import task_env
from orchestrator.launch.ssh.spec import section
from orchestrator.plan.placement import Placement
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots

SSH_DEFAULT_BASE_PORT = 23456  # remote hosts: free ports are checked there (`orchestrate check`)
SSH_DEFAULT_WORKDIR = "~/.orchestrate"


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
    spec: ClusterSpec,
    run_id: str,
    workdirs: Mapping[int, str],
    urls: Mapping[int, str],
    pythons: Mapping[int, str] | None = None,
) -> dict[str, Placement]:
    """Each task on its host, in WORKDIR/runs/<run id>, the job's folder copied to code/ and the
    worker runtime to lib/. `workdirs` and `urls` per host index (the absolute folder learned by
    connecting, and where its heartbeats go); `pythons`: each host's environment's interpreter
    (`environment:`), else the host's own."""
    ports = ssh_ports(spec)
    out = {}
    for slot in task_slots(spec):
        host = spec.hosts[slot.host_index]
        folder = posixpath.join(workdirs[slot.host_index], "runs", run_id)
        code = posixpath.join(folder, "code")
        made = (pythons or {}).get(slot.host_index)
        out[slot.name] = Placement(
            host=host.address,
            port=ports[slot.name],
            run_folder=folder,
            python=(made,) if made else tuple(shlex.split(host.python)),
            cwd=code,
            coordinator_url=urls[slot.host_index],
            host_index=slot.host_index,
            code_root=code,
            pythonpath=(posixpath.join(folder, "lib"),),
            # the stacks reader of the environment's
            env=task_env(made) if made else {},
        )
    return out


def ssh_preview(spec: ClusterSpec, run_id: str) -> dict[str, Placement]:
    """Before connecting (`orchestrate plan`): each host's folder as written."""
    direct = section(spec).coordinator_address
    url = f"http://{direct}" if direct else "http://127.0.0.1:<port forwarded through SSH>"
    indexes = range(len(spec.hosts))
    workdirs = {i: spec.hosts[i].workdir or SSH_DEFAULT_WORKDIR for i in indexes}
    made = "envs/<made from environment: at launch>/bin/python"
    pythons = {i: posixpath.join(workdirs[i], made) for i in indexes} if spec.environment else None
    return ssh_placements(spec, run_id, workdirs, {i: url for i in indexes}, pythons)
