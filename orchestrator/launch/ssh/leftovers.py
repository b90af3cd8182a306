"""Launch layer, ssh backend: `orchestrate down` once a run's coordinator is gone — on every host,
the recorded process groups of the run's tasks that still carry its run id, stopped by the shim."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.group import on_all
from orchestrator.launch.api import Leftovers
from orchestrator.launch.ssh.hosts import Host, close_all, connect, run_json
from orchestrator.launch.ssh.spec import SshSpec


class SshLeftovers(Leftovers):
    """`orchestrate down` when the coordinator is gone: on every host, the recorded process groups
    of this run's tasks (plan.json's) that still carry its run id (the shim's `--stop`)."""

    def __init__(self, record: Mapping[str, Any], plan: Mapping[str, Any]):
        self._record = record
        self._tasks = list(plan.get("tasks", []))

    def stop(self, grace_s: float) -> list[tuple[str, bool]]:
        return stop_leftovers(self._record, self._tasks, grace_s)


def stop_leftovers(
    record: Mapping[str, Any], tasks: list[dict[str, Any]], grace_s: float
) -> list[tuple[str, bool]]:
    """Per host: a line, and whether the host could be asked."""
    ssh = SshSpec(**record["ssh"])
    run_id = record["run_id"]
    hosts = []
    workdirs = {h["index"]: h["workdir"] for h in record["hosts"]}
    for h in record["hosts"]:
        if h.get("workdir") is None:
            continue
        host = Host(
            index=h["index"],
            address=h["address"],
            ssh_port=h["port"],
            user=h["user"],
            identity_file=Path(h["identity_file"]) if h["identity_file"] else None,
            python=tuple(shlex.split(h["python"])),
        )
        folder = posixpath.join(h["workdir"], "runs", run_id, "tasks")
        # a task may have run on any host (a lost host's tasks moved to a spare, renumbered when the
        # job shrank): every name of the run, on every host; a pidfile not there is passed over
        names = sorted({t["name"] for t in tasks} | set(record.get("tasks", [])))
        hosts.append((host, [posixpath.join(folder, f"{n}.json") for n in names]))

    def one(item: tuple[Host, list[str]]) -> str:
        host, pidfiles = item
        if not pidfiles:
            return f"{host.label}: no task"
        conn = connect(host, ssh)
        shim = posixpath.join(workdirs[host.index], "cache", record["shim_sha256"])
        try:
            argv = [*host.python, "-S", shim, "--stop", run_id, repr(grace_s), *pidfiles]
            answer = run_json(conn, host, argv, "stop", timeout_s=grace_s + 60.0)
        finally:
            close_all({host.index: conn})
        found = {k: v for k, v in answer.items() if v != "no record"}  # a task that never ran there
        said = "; ".join(f"{posixpath.basename(k)[:-5]} {v}" for k, v in found.items())
        return f"{host.label}: {said or 'no task ran there'}"

    return [(str(r), not isinstance(r, Exception)) for _, r in on_all(hosts, one)]
