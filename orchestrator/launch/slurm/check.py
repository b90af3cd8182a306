"""Launch layer, slurm backend: what `orchestrate plan` and `orchestrate check` show of it —
the Slurm command lines `up` will use, and one short probe step on the nodes (Python, TensorFlow,
the files they see, and whether they reach each other on a TF port)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.api import (
    CheckReport,
)
from orchestrator.launch.check_cells import page_copy_warning, stacks_cell, stacks_warning
from orchestrator.launch.slurm.allocation import salloc_argv
from orchestrator.launch.slurm.cluster import (
    Request,
    Slurm,
    check_cluster,
    job_name,
    srun_argv,
)
from orchestrator.launch.slurm.spec import SlurmSpec, section
from orchestrator.spec.model import ClusterSpec
from worker.host import PROBE_SOURCE, SHIM


def preview_lines(
    spec: ClusterSpec, run_id: str, run_dir: Path, env: Mapping[str, str] | None = None
) -> list[str]:
    """`orchestrate plan`: the Slurm commands `up` will use."""
    env = env if env is not None else os.environ
    job = env.get("SLURM_JOB_ID")
    if job:
        alloc = f"inside Slurm job {job} (SLURM_JOB_ID): its nodes are used, the allocation is left as it is"
    else:
        alloc = f"allocation: {shlex.join(salloc_argv(spec, run_id))}"
    conf = spec.section("slurm")
    chosen = conf.python if isinstance(conf, SlurmSpec) else None
    python = tuple(shlex.split(chosen)) if chosen else (sys.executable,)
    step = shlex.join(srun_argv(job or "JOB", "NODE", f"{job_name(run_id)}-TASK", python))
    return [
        alloc,
        f"each task, one step: {step}",
        "  (the task's command and environment reach worker/host/shim.py on its stdin, "
        "never on a command line)",
        "nodes, their addresses and free TF ports are known once allocated; the nodes must see this "
        f"machine's files (the job's folder, {run_dir}, orchestrate): checked at launch",
    ]


def check(spec: ClusterSpec) -> CheckReport:
    """`orchestrate check`: the partition can run the request; one short step on the nodes
    (Python, TensorFlow, the files they see); the nodes reach each other on a TF port."""
    conf = section(spec)
    title = f"{spec.name}: Slurm, {conf.nodes} node(s)"
    slurm = Slurm(conf.connect_timeout_s)
    try:
        partition, nodes = check_cluster(slurm, Request.of(spec))
    except LaunchError as exc:
        return CheckReport(title, [{"node": "-", "problem": str(exc)}], [], [str(exc)])
    rows = {
        n.get("NodeName", "?"): {
            "node": n.get("NodeName", "?"),
            "address": n.get("NodeAddr", "?"),
            "state": n.get("State", "?"),
            "cpus": n.get("CPUTot", "?"),
            "python": "-",
            "tensorflow": "-",
            "files": "-",
            "peers": "-",
            "stacks": "-",
        }
        for n in nodes
    }
    python = tuple(shlex.split(conf.python)) if conf.python else (sys.executable,)
    answers, failed = _mesh_step(spec, slurm, partition, nodes, python)
    problems = [failed] if failed else []
    notes: list[str] = []  # worth a look, not a stop
    problems += _judge(answers, rows, python, notes, made=spec.environment is not None)
    versions = {(a.get("python"), a.get("tensorflow")) for a in answers if a.get("hostname") in rows}
    warnings = (
        [f"the nodes differ in Python/TensorFlow: {sorted(map(str, versions))}"] if len(versions) > 1 else []
    ) + notes
    return CheckReport(title, list(rows.values()), warnings, problems)


def _mesh_step(
    spec: ClusterSpec, slurm: Slurm, partition: str, nodes: list[dict[str, str]], python: tuple[str, ...]
) -> tuple[list[dict[str, Any]], str | None]:
    """One short step on the nodes (worker/host/probe.py's `mesh`): each node's answer, and why the
    step failed, if it did."""
    conf = section(spec)
    entry = spec.job.script or spec.job.loop
    assert entry is not None
    seen = {str(SHIM): SHIM.read_text(encoding="utf-8")[:4096]}
    with contextlib.suppress(OSError):
        seen[str(entry)] = entry.read_text(encoding="utf-8", errors="replace")[:4096]
    port = secrets.SystemRandom().randrange(15000, 32000)
    # the step runs on nodes we name, so that each knows its peers: idle ones first
    ready = sorted(nodes, key=lambda n: not n.get("State", "").startswith(("IDLE", "MIXED")))[: conf.nodes]
    addresses = [n.get("NodeAddr") or n.get("NodeName", "") for n in ready]
    argv = [
        "srun",
        f"--immediate={max(1, math.ceil(conf.connect_timeout_s))}",
        f"--nodes={len(ready)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(n.get('NodeName', '') for n in ready)}",
        f"--partition={partition}",
        *([f"--account={conf.account}"] if conf.account else []),
        f"--job-name=orchestrate-check-{secrets.token_hex(4)}",
        "--quiet",
        *python,
        "-c",
        PROBE_SOURCE,
        "mesh",
        str(port),
        "3",
        *(f"{a}:{port}" for a in addresses),
    ]
    timeout_s = conf.connect_timeout_s + 60
    res = slurm.run(argv, "a probe step on the nodes", timeout_s=timeout_s, stdin=json.dumps(seen))
    answers = []
    for line in res.stdout.splitlines():
        with contextlib.suppress(ValueError):
            answers.append(json.loads(line))
    if res.returncode != 0 or not answers:
        said = " ".join(res.stderr.split())[-400:] or f"exit {res.returncode}"
        return answers, f"a probe step on {conf.nodes} node(s) of {partition} failed: {said}"
    return answers, None


def _judge(
    answers: list[dict[str, Any]],
    rows: dict[str, dict[str, str]],
    python: tuple[str, ...],
    notes: list[str],
    made: bool = False,
) -> list[str]:
    """Each node's answer into its row of the table; the problems found. `made`: the spec's
    `environment:` makes the tasks' Python on each node at `up` (the nodes' own needs none)."""
    problems = []
    for a in answers:
        row = rows.get(a.get("hostname", ""))
        if row is None:
            continue
        row["python"] = f"{a.get('python')} ({a.get('executable')})"
        row["tensorflow"] = "(environment)" if made else str(a.get("tensorflow") or "MISSING")
        if not a.get("tensorflow") and not made:
            problems.append(
                f"{row['node']}: TensorFlow is not installed for {shlex.join(python)} (slurm.python)"
            )
        unseen = [p for p, ok in a.get("seen", {}).items() if not ok]
        row["files"] = "shared" if not unseen else "NOT SEEN"
        if unseen:
            problems.append(
                f"{row['node']} does not see {', '.join(unseen)}: the slurm backend needs this "
                "machine's files on a filesystem the nodes share"
            )
        row["stacks"] = stacks_cell(a)
        if (said := stacks_warning(row["node"], a)) is not None:
            notes.append(said)
        if (said := page_copy_warning(row["node"], a)) is not None:
            notes.append(said)
        unreached = [peer for peer, ok in a.get("reached", {}).items() if not ok]
        row["peers"] = "all reached" if not unreached else f"cannot reach {', '.join(unreached)}"
        if unreached:
            problems.append(f"{row['node']} cannot reach {', '.join(unreached)} (TF ports between nodes)")
    return problems
