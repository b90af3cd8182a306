"""Launch layer: tasks as Slurm job steps on a Slurm cluster (backend: slurm).

- **The allocation.** Inside one (`salloc … orchestrate up`, an sbatch script: SLURM_JOB_ID is
  set), the run uses it and leaves it alone. Otherwise it asks for one sized from the spec with
  `salloc --no-kill … -- sh -c 'echo …; exec cat'`: the command salloc runs on this machine only
  reads a pipe from the coordinator, so the allocation is released when the coordinator closes it —
  at the end, or when the coordinator dies, even by SIGKILL. A request still pending after
  `slurm.queue_timeout_s` is cancelled. Every Slurm command runs under a timeout: a slurmctld that
  does not answer is a launch error within `slurm.connect_timeout_s`, never a hang.
- **The tasks.** Each attempt of each task is one step on its node (`srun --overlap -N1 -n1 -w NODE`)
  running worker/host/shim.py, as over SSH: the job (environment and credential included) travels on
  the step's stdin, never on a command line; TERM/KILL lines follow; end of file stops the task;
  events come back on stderr. Heartbeats go straight from the nodes to the coordinator's server,
  which listens on this machine's address on the route to the nodes (`slurm.coordinator_address`).
- **Nodes and ports.** One probe step per attempt (the first in `open`) checks every node answers,
  its TF ports are free (new ones chosen where not), and it sees the run's files. A node whose
  task's end could not be confirmed, or that does not answer, is lost: the supervisor's policy
  puts its tasks on a spare node (`slurm.nodes` beyond those used) or leaves them out (shrink).
- **Files.** A Slurm cluster's nodes normally share a filesystem with the login node: then the
  job's folder, the run directory and orchestrate's worker runtime are used in place. The launch
  probe proves it (a nonce file written here must be read on every node). When no node sees the
  run directory, each gets a copy under `slurm.workdir` instead (one srun hands a tar to every
  node), logs stream back, the owner's checkpoints go to every reader's node before a new
  attempt, and the results come home at the end (docs/slurm.md).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.environment.prepare import HostEnvironment
from orchestrator.errors import LaunchError
from orchestrator.launch.api import (
    Backend,
    Heartbeats,
    Prepared,
)
from orchestrator.launch.exchange import StateExchange
from orchestrator.launch.shim_standbys import ShimStandbys
from orchestrator.launch.slurm.allocation import Allocation
from orchestrator.launch.slurm.cluster import (
    Request,
    Slurm,
    cancel_steps,
    check_cluster,
    job_name,
    route_address,
)
from orchestrator.launch.slurm.environment import slurm_environments
from orchestrator.launch.slurm.files import NodeFiles, NodeFolders
from orchestrator.launch.slurm.nodes import files_copied, node_addresses
from orchestrator.launch.slurm.placing import SlurmPlacing
from orchestrator.launch.slurm.spec import SlurmSpec, section
from orchestrator.launch.slurm.step import SlurmTaskHandle
from orchestrator.launch.slurm.tasks import SlurmTasks
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.plan.placement import Machine, Placement, Relaid
from orchestrator.record.write import make_private_dir
from orchestrator.spec.model import ClusterSpec

log = logging.getLogger("orchestrator.slurm")


class SlurmBackend(SlurmTasks, SlurmPlacing, Backend):
    name = "slurm"
    listen_key = "slurm.coordinator_address"
    starts_at_once = True

    def __init__(
        self,
        spec: ClusterSpec,
        run_id: str,
        run_dir: Path,
        spec_dir: Path,
        env: Mapping[str, str] | None = None,
    ):
        self._spec = spec
        self._conf: SlurmSpec = section(spec)
        self._run_id = run_id
        self._run_dir = run_dir.resolve()
        self._spec_dir = spec_dir
        self._env = dict(env if env is not None else os.environ)
        self._slurm = Slurm(self._conf.connect_timeout_s, self._env)
        self._python = tuple(shlex.split(self._conf.python)) if self._conf.python else (sys.executable,)
        self._folder = self._run_dir / "slurm"  # salloc's output, the nodes' pid files
        self._alloc: Allocation | None = None
        self._addresses: dict[str, str] = {}  # node name -> NodeAddr
        self._cluster_nodes: list[dict[str, str]] = []
        self._surrounding: Allocation | None = None
        self._heartbeats: Heartbeats | None = None
        self._placements: dict[str, Placement] = {}
        self._node_of: dict[str, str] = {}  # task -> node name
        # spec node (hosts[p]) -> the node running it; None: left out
        self._assign: dict[int, str | None] = {}
        self._laid = spec  # the spec as this attempt runs (`laid_out`: hosts left out)
        self._excluded: dict[str, tuple[str, str | None]] = {}  # nodes lost: why, since when
        self._answers: dict[str, dict[str, Any]] = {}  # the nodes' answers to the last probe
        self._lost_positions: set[int] = set()  # spec nodes whose node was lost before this attempt
        self._handles: dict[str, SlurmTaskHandle] = {}
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._shipping = False  # the nodes do not see this machine's files: they are copied
        self._environment: list[HostEnvironment] = []  # each node's (`environment:`)
        self._env_pythons: dict[str, str] = {}  # its interpreter, by node
        self._files = NodeFiles(
            self._slurm, spec, run_id, self._run_dir, self._python, self._conf.connect_timeout_s + 60
        )
        folders = NodeFolders(
            self._slurm,
            run_id,
            self._python,
            self._conf.connect_timeout_s + 60,
            lambda index: self._assign.get(index),  # the node running hosts[index]'s tasks now
            lambda: self._alloc.job_id if self._alloc is not None else None,
            lambda: not self._shipping,  # known from `open`, before anything is copied
        )
        every_s, copy_s = max(2.0, spec.health.heartbeat_interval_s), self._conf.connect_timeout_s + 60
        self._exchange = StateExchange(folders, self._run_dir, every_s=every_s, stop_wait_s=copy_s)
        self._standbys = ShimStandbys(spec)
        self._logs = self._run_dir / "logs"

    # --- opening ---

    def listen(self) -> tuple[str, int]:
        """slurm.coordinator_address, else this machine's address on the route to the nodes."""
        self._learn_cluster()
        direct = self._conf.coordinator_address
        if direct is not None:
            host, _, port = direct.partition(":")
            return host, int(port or 0)
        targets = [n.get("NodeAddr") or n.get("NodeName", "") for n in self._cluster_nodes]
        return route_address([t for t in targets if t]), 0

    def _learn_cluster(self) -> None:
        """The request checked against the cluster (or the surrounding allocation), and its nodes."""
        if self._cluster_nodes:
            return
        Slurm.require_commands()
        self._surrounding = Allocation.surrounding(self._slurm, self._env)
        if self._surrounding is not None:
            self._cluster_nodes = self._slurm.records("node", ",".join(self._surrounding.nodes))
        else:
            _, self._cluster_nodes = check_cluster(self._slurm, Request.of(self._spec))

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        self._heartbeats = heartbeats
        self._learn_cluster()
        make_private_dir(self._folder)
        alloc = self._surrounding
        if alloc is None:
            alloc = Allocation.request(self._slurm, self._spec, self._run_id, self._folder, self._cancel)
            log.info("allocation: job %s on %s", alloc.job_id, ",".join(alloc.nodes))
        else:
            log.info("inside allocation %s (%s): it is left as it is", alloc.job_id, ",".join(alloc.nodes))
        self._alloc = alloc
        used = len(self._spec.hosts)
        if len(alloc.nodes) < used:
            raise LaunchError(
                f"allocation {alloc.job_id} has {len(alloc.nodes)} node(s); the spec uses {used} "
                "(slurm.tasks_per_node)"
            )
        self._addresses = node_addresses(self._slurm, self._cluster_nodes, alloc.nodes)
        answers = self._healthy(alloc.nodes, reason="at launch", required=True)
        self._shipping = files_copied(answers, self._run_dir)
        if self._shipping:
            log.info("the nodes do not see %s: the job's files are copied to them", self._run_dir)
            self._files.ship_code(alloc.job_id, list(answers))
        else:  # its checkpoints are not copied; a job's own folder elsewhere (its /tmp/backup) may be
            self._exchange.seen_everywhere(str(self._run_dir))
        self._make_environments(list(answers))
        self._place(answers)
        return dict(self._placements)

    def _make_environments(self, nodes: list[str]) -> None:
        """`environment:`: every node's (spares too) ready; its interpreter runs the tasks there."""
        if self._spec.environment is not None and self._alloc is not None and self._heartbeats is not None:
            f = self._files
            self._environment, self._env_pythons = slurm_environments(
                self._spec.environment, self._slurm, self._alloc.job_id, nodes, f, self._heartbeats.notify
            )

    def record(self) -> dict[str, Any]:
        alloc = self._alloc
        return {
            "backend": self.name,
            "run_id": self._run_id,
            "job_name": job_name(self._run_id),
            "job_id": alloc.job_id if alloc else None,
            "owned": alloc.owned if alloc else None,
            "nodes": alloc.nodes if alloc else [],
            "connect_timeout_s": self._conf.connect_timeout_s,
            "environment": [h.as_data() for h in self._environment] or None,
        }

    # --- per attempt ---

    def state_known(self, plan: LaunchPlan) -> None:
        if self._alloc is not None:
            self._exchange.bring_early(plan)

    def machines(self, plan: LaunchPlan, suspects: Mapping[str, tuple[str, str | None]]) -> list[Machine]:
        """The allocation's nodes: one whose task's end could not be confirmed is lost (cut off:
        its probe would wait out the timeout); the others answer a probe step each, or are lost."""
        if self._alloc is None:
            return []
        now = time.strftime("%H:%M:%S")
        for name, (why, since) in suspects.items():
            node = self._node_of.get(name)
            if node is not None:
                self._excluded.setdefault(node, (why, since or now))
        self._handles = {}
        candidates = [n for n in self._alloc.nodes if n not in self._excluded]
        self._answers = self._healthy(candidates, reason="before an attempt", required=False)
        for node in candidates:
            if node not in self._answers:
                self._excluded[node] = ("it did not answer a probe step", now)
        at = {node: p for p, node in self._assign.items() if node is not None}
        self._lost_positions = {p for node, p in at.items() if node in self._excluded}
        return [Machine(n, n, at.get(n), *self._excluded.get(n, (None, None))) for n in self._alloc.nodes]

    def relayout(self, machines: Mapping[int, str | None]) -> Relaid:
        """Each spec node's tasks on the node given (a spare for a lost one), or left out."""
        runs = {p: None if node is None else p for p, node in machines.items()}
        self._assign = dict(machines)
        self._laid = self._spec.laid_out(runs)
        self._place(self._answers)
        return Relaid(runs, dict(self._placements))

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
        """From the second attempt (the nodes asked and placed by `machines` and `relayout`): the
        checkpoint home while the owner's node is ours; a new allocation when ours ended (its time
        limit) or is about to; the tasks' ports checked again; the checkpoint to every reader."""
        self._exchange.stop_following(lost=self._lost_positions)
        if attempt == 0 or self._alloc is None:
            self._exchange.follow(plan)  # the owner's checkpoints home while it trains (not shared)
            return Prepared()
        notes: list[str] = []
        if plan.state is not None:  # while the owner's node is still ours
            try:
                notes += self._exchange.fetch_ran(plan, lost=self._lost_positions)
            except LaunchError as exc:
                notes.append(f"{exc}; the last checkpoints brought home are used")
        renewed = self._alloc.owned and self._renew_allocation(notes)
        if renewed:
            self._excluded.clear()
            self._assign = {p: None for p, node in self._assign.items() if node is None}
            self._answers = self._healthy(
                list(self._alloc.nodes), reason=f"before attempt {attempt}", required=False
            )
            if self._shipping:
                self._files.ship_code(self._alloc.job_id, list(self._answers))  # new nodes, perhaps
            self._make_environments(list(self._answers))
        elif not self._answers:  # not asked by `machines` (no supervisor's layout): asked now
            self._answers = self._healthy(
                [n for n in self._alloc.nodes if n not in self._excluded],
                reason=f"before attempt {attempt}",
                required=False,
            )
        moved = self._place(self._answers)
        self._answers = {}
        notes += self._exchange.hand_out_all(plan)  # each folder not every node sees (exchange.py)
        self._exchange.follow(plan)
        return Prepared(notes=notes, moved=moved, record_changed=renewed)

    def _renew_allocation(self, notes: list[str]) -> bool:
        assert self._alloc is not None
        new = self._alloc.renewed(self._slurm, self._spec, self._run_id, self._folder, self._cancel, notes)
        if new is not None:
            self._alloc = new
            self._standbys.drop()  # steps of the old allocation, on nodes that may bear the same names
            self._addresses = node_addresses(self._slurm, self._cluster_nodes, new.nodes)
        return new is not None

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """What of the model, TensorBoard's files and the latest checkpoints is not in the run
        directory already comes into it (launch/exchange.py). Never raises."""
        if plan.state is None or self._alloc is None:
            return []
        try:
            return self._exchange.bring_home(plan)
        except Exception as exc:  # noqa: BLE001 - never raises: the run's outcome stands
            return [f"could not copy the results: {exc}"]

    def ended_outside(self) -> str | None:
        """The allocation was cancelled from outside (scancel): the run ends INTERRUPTED. A time
        limit is not: the next attempt gets a new allocation."""
        alloc = self._alloc
        if alloc is None:
            return None
        ended = alloc.ended()
        if ended is None or "time limit" in ended.lower():
            return None
        return f"the allocation (Slurm job {alloc.job_id}) ended from outside: {ended}"

    def close(self) -> None:
        self._standbys.close()
        self._cancel.set()
        self._exchange.stop_following()
        alloc = self._alloc
        if alloc is None:
            return
        for h in list(self._handles.values()):
            h.release()
        if alloc.owned:
            alloc.release(self._slurm)
        else:
            cancel_steps(self._slurm, alloc.job_id, job_name(self._run_id))
