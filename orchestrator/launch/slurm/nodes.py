"""Launch layer, slurm backend: the probe of a run's nodes (one step each, in parallel) — each
answers whether its TF ports are free (and which are), that it sees the run's files (a nonce
written here must be read there), and that it sees a checkpoint folder the spec declares shared."""

from __future__ import annotations

import json
import secrets
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.launch.slurm.cluster import Slurm, job_name, step_argv
from orchestrator.launch.slurm.step import port_lock
from orchestrator.spec.model import ClusterSpec
from worker.host import PROBE_SOURCE, SHIM


class NodeProbe:
    def __init__(self, slurm: Slurm, spec: ClusterSpec, job_id: str, run_id: str, python: tuple[str, ...]):
        self._slurm, self._spec, self._job_id, self._run_id, self._python = (
            slurm,
            spec,
            job_id,
            run_id,
            python,
        )

    def run(
        self, nodes: Sequence[str], folder: Path, *, ports: Mapping[str, list[str]], timeout_s: float
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Every node's answer (for those that answered and see what they must), and the problems
        of the others. `folder`: the run directory here (its nonce); `ports`: each node's tasks'."""
        nonce = secrets.token_hex(16)
        nonce_path = folder / f"nonce-{secrets.token_hex(4)}"
        nonce_path.write_text(nonce, encoding="utf-8")
        declared = self._spec.shared_checkpoint_dir  # said to be shared by every node: proven so
        declared_nonce = declared / f".orchestrate-shared-{nonce}" if declared is not None else None
        try:
            paths = self._paths(nonce_path, nonce, declared_nonce)
            results = on_all(list(nodes), lambda node: self._one(node, paths, ports.get(node, []), timeout_s))
        finally:
            nonce_path.unlink(missing_ok=True)
            if declared_nonce is not None:
                declared_nonce.unlink(missing_ok=True)
        answers: dict[str, dict[str, Any]] = {}
        problems: list[str] = []
        for node, answer in results:
            if isinstance(answer, Exception):
                problems.append(f"{node}: {answer}")
                continue
            answer["sees_run"] = bool(answer.get("seen", {}).get(str(nonce_path)))
            answer["unseen"] = [p for p, ok in answer.get("seen", {}).items() if not ok]
            if declared_nonce is not None and str(declared_nonce) in answer["unseen"]:
                problems.append(
                    f"{node} does not see {declared}, which the spec says every node shares "
                    "(train.checkpoint_dir / job.checkpoint_dir)"
                )
                continue
            answers[node] = answer
        return answers, problems

    def _paths(self, nonce_path: Path, nonce: str, declared_nonce: Path | None) -> dict[str, str]:
        """The files every node must see, with (the start of) what they hold."""
        paths = {str(nonce_path): nonce, str(SHIM): SHIM.read_text(encoding="utf-8")[:4096]}
        entry = self._spec.job.script or self._spec.job.loop
        assert entry is not None
        paths[str(entry)] = entry.read_text(encoding="utf-8", errors="replace")[:4096]
        if declared_nonce is not None:
            try:
                declared_nonce.parent.mkdir(parents=True, exist_ok=True)
                declared_nonce.write_text(nonce, encoding="utf-8")
            except OSError as exc:
                raise LaunchError(
                    f"cannot write in {declared_nonce.parent} (the shared checkpoint folder): {exc}"
                ) from None
            paths[str(declared_nonce)] = nonce
        return paths

    def _one(self, node: str, paths: Mapping[str, str], mine: list[str], timeout_s: float) -> dict[str, Any]:
        count = max(sum(h.tasks.values()) for h in self._spec.hosts)
        argv = [
            *step_argv(self._job_id, node, f"{job_name(self._run_id)}-probe"),
            *self._python,
            "-S",  # standard library only: no site-packages to scan (`check` reports TensorFlow)
            "-c",
            PROBE_SOURCE,
            "node",
            str(count),
            port_lock(node, "{port}"),
            *mine,
        ]
        res = self._slurm.run(argv, f"probing {node}", timeout_s=timeout_s, stdin=json.dumps(dict(paths)))
        if res.returncode != 0:
            said = " ".join(res.stderr.split())[-400:] or f"exit {res.returncode}"
            if "execve" in said or "No such file" in said:
                said += f" ({shlex.join(self._python)}: set slurm.python to the interpreter on the nodes)"
            raise LaunchError(said)
        return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def files_copied(answers: Mapping[str, Mapping[str, Any]], run_dir: Path) -> bool:
    """Whether the run's files must be copied to the nodes (none sees the run directory), from
    the nodes' answers; LaunchError where some see it and others do not, or where the nodes see
    the run directory but not the job's folder or orchestrate."""
    sees = {n: a["sees_run"] for n, a in answers.items()}
    unseen = {n: a["unseen"] for n, a in answers.items() if a["unseen"]}
    if all(sees.values()) and unseen:
        node, paths = next(iter(unseen.items()))
        raise LaunchError(
            f"{node} sees the run directory but not {', '.join(paths[:2])}: the slurm backend needs the "
            "job's folder and orchestrate on a filesystem the nodes share, as the run directory"
        )
    if any(sees.values()) and not all(sees.values()):
        raise LaunchError(
            f"some nodes see the run directory {run_dir}, others do not "
            f"({', '.join(n for n, ok in sees.items() if not ok)}): a shared filesystem must be "
            "mounted on every node, or on none"
        )
    return not any(sees.values())


def node_addresses(slurm: Slurm, known_nodes: list[dict[str, str]], nodes: list[str]) -> dict[str, str]:
    """Each node's address (NodeAddr), from what is known of the cluster or asked of slurmctld;
    its name where it has none."""
    known = {n.get("NodeName", ""): n.get("NodeAddr", "") for n in known_nodes}
    if not all(known.get(n) for n in nodes):
        asked = slurm.records("node", ",".join(nodes))
        known.update({r.get("NodeName", ""): r.get("NodeAddr", "") for r in asked})
    return {n: known.get(n) or n for n in nodes}
