"""Launch layer, slurm backend: where the tasks go on the allocation's nodes — every node probed in
one step each (it answers, sees the run's files, has the tasks' TF ports free), each task given its
node (the first that answer at first, then as `relayout` says) and a port there (its own while it
is free). A part of the SlurmBackend class (backend.py), kept in a module of its own."""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.api import Heartbeats
from orchestrator.launch.slurm.allocation import Allocation
from orchestrator.launch.slurm.cluster import Slurm
from orchestrator.launch.slurm.files import NodeFiles
from orchestrator.launch.slurm.nodes import NodeProbe
from orchestrator.launch.slurm.placement import task_port, task_python
from orchestrator.launch.slurm.spec import SlurmSpec
from orchestrator.plan.placement import Placement
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots

log = logging.getLogger("orchestrator.slurm")


class SlurmPlacing:
    """The slurm backend's placement on its nodes (mixed into SlurmBackend, which sets what is
    declared here)."""

    _spec: ClusterSpec
    _laid: ClusterSpec
    _conf: SlurmSpec
    _run_id: str
    _run_dir: Path
    _spec_dir: Path
    _slurm: Slurm
    _python: tuple[str, ...]
    _folder: Path
    _alloc: Allocation | None
    _heartbeats: Heartbeats | None
    _placements: dict[str, Placement]
    _node_of: dict[str, str]
    _assign: dict[int, str | None]
    _excluded: dict[str, tuple[str, str | None]]
    _addresses: dict[str, str]
    _env_pythons: dict[str, str]
    _shipping: bool
    _files: NodeFiles

    def _healthy(self, nodes: list[str], *, reason: str, required: bool) -> dict[str, dict[str, Any]]:
        """Probe every node (one step each, in parallel): its answer, for those that answered (and
        see the run's files, unless they are shipped). Nodes that did not are named in the error
        (required) or left out. Each answer's `sees_run` says whether the node reads the run
        directory."""
        assert self._alloc is not None
        probe = NodeProbe(self._slurm, self._spec, self._alloc.job_id, self._run_id, self._python)
        answers, problems = probe.run(
            nodes,
            self._folder,
            ports={
                n: [str(p.port) for t, p in self._placements.items() if self._node_of.get(t) == n]
                for n in nodes
            },
            timeout_s=self._conf.connect_timeout_s + 20,
        )
        if problems and required:
            raise LaunchError(f"node check {reason} failed:\n  " + "\n  ".join(problems))
        for p in problems:
            log.warning("left out %s", p)
        return answers

    def _place(self, answers: Mapping[str, dict[str, Any]]) -> dict[str, Placement]:
        """Give every task its node (the first nodes that answer, in order, at first; then as
        `relayout` said) and a free port there (the one it had while it is free). Returns the tasks
        placed anew."""
        assert self._heartbeats is not None and self._alloc is not None
        used = len(self._spec.hosts)
        well = [n for n in self._alloc.nodes if n in answers and n not in self._excluded]
        if not any(self._assign.values()):  # the first placement, or a new allocation's
            left_out = {p for p, node in self._assign.items() if node is None and p in self._assign}
            if len(well) < used - len(left_out):
                raise LaunchError(
                    f"{len(well)} node(s) of allocation {self._alloc.job_id} answer, the spec uses {used}"
                    + (f" (left out: {', '.join(sorted(self._excluded))})" if self._excluded else "")
                )
            free_nodes = iter(well)
            self._assign = {p: None if p in left_out else next(free_nodes) for p in range(used)}
        for p, node in self._assign.items():
            if node is not None and node not in well:
                raise LaunchError(f"node {node} (for the spec's node {p + 1}) does not answer")
        old, self._placements, old_nodes = self._placements, {}, self._node_of
        self._node_of = {}
        moved: dict[str, Placement] = {}
        free = {n: list(a.get("free", [])) for n, a in answers.items()}
        for slot in task_slots(self._laid):
            node = self._assign[slot.host_index]
            assert node is not None  # a spec node left out has no task
            place = self._placement(slot, node, old, old_nodes, answers, free)
            if slot.name in old and old[slot.name] != place:
                moved[slot.name] = place
            self._placements[slot.name] = place
            self._node_of[slot.name] = node
        return moved

    def _placement(
        self, slot: Any, node: str, old: Any, old_nodes: Any, answers: Any, free: Any
    ) -> Placement:
        """The task's port on `node`: its own while that is free there, else a free one."""
        assert self._heartbeats is not None
        before = old.get(slot.name)
        mine = before.port if before is not None and old_nodes.get(slot.name) == node else 0
        port = task_port(mine, answers[node], free.setdefault(node, []), slot.name, node)
        folder = self._files.folder if self._shipping else str(self._run_dir)
        code = posixpath.join(folder, "code") if self._shipping else None
        python, pythonpath, env = task_python(
            self._python, self._env_pythons.get(node), folder if self._shipping else None, self._run_dir,
            runtime=self._conf.python is not None,
        )  # fmt: skip
        return Placement(
            host=self._addresses.get(node, node),
            port=port,
            run_folder=folder,
            python=python,
            env=env,
            cwd=code or str(self._spec_dir),
            code_root=code,
            coordinator_url=self._heartbeats.url,
            host_index=slot.host_index,
            pythonpath=pythonpath,
        )
