"""Plan room: ClusterSpec + placements -> LaunchPlan, a pure function (no I/O: the backend placed
the tasks beforehand, plan/placement.py).

Builds every task's TF_CONFIG following TensorFlow's rules: one `cluster` of the training roles
(chief, worker, ps), the evaluator kept out of it and given its own TF_CONFIG that names the
training cluster it watches.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.plan.placement import Placement, job_files_root
from orchestrator.spec.model import ClusterSpec, Role, Strategy
from orchestrator.spec.roles import RolePolicy, TaskSlot, role_policies, task_slots
from worker import wire

_CLUSTER_ROLES = (Role.CHIEF, Role.WORKER, Role.PS)
REDACTED = "<redacted>"


@dataclass(frozen=True)
class TaskPlan:
    name: str  # e.g. "worker-1"
    role: Role
    index: int
    host: str  # where it runs (address the coordinator connects to)
    address: str  # host:port that peers use (TF_CONFIG)
    port: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    in_cluster: bool  # False for the evaluator
    host_index: int = 0

    @property
    def log_name(self) -> str:
        return f"{self.role.value}-{self.index}.log"

    def launch_env(self, *, attempt: int, token: str) -> dict[str, str]:
        """The full environment of one attempt: the plan's, plus what changes per attempt or is secret."""
        return {**self.env, wire.ENV_ATTEMPT: str(attempt), wire.ENV_TOKEN: token}


@dataclass(frozen=True)
class StatePlan:
    """Where a run's checkpoints live, and who must see them (ORCHESTRATE_CHECKPOINT_DIR;
    docs/architecture.md §4).

    Each task's folder is its env's ORCHESTRATE_CHECKPOINT_DIR, on its own host. Unless the spec
    declares a shared folder, the owner's folder is the truth: before an attempt restores, its
    latest state is copied to the readers' hosts that lack it (by the backend, where hosts share
    no disk)."""

    shared: bool  # the spec's folder, which every host sees (nothing is copied)
    owner: str  # the task whose checkpoints are the truth: the chief, or worker-0
    readers: tuple[str, ...]  # tasks that restore from (or score) them, the owner included
    #: The folders the job writes its own checkpoints to, as the owner told them (learned as the
    #: run goes: supervise/restores.py); kept like the owner's ORCHESTRATE_CHECKPOINT_DIR.
    job_folders: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    name: str
    run_id: str
    strategy: Strategy
    backend: str
    cluster: Mapping[str, list[str]]
    tasks: tuple[TaskPlan, ...] = field(default_factory=tuple)
    policy: Mapping[Role, RolePolicy] = field(default_factory=dict)
    state: StatePlan | None = None
    secrets: frozenset[str] = frozenset()  # env names whose values are never written nor printed
    examples_per_step: int | None = None  # the global batch, when the plan knows it (mode 2)

    def shown_env(self, task: TaskPlan) -> dict[str, str]:
        """A task's environment as the record and the console show it: secret values redacted."""
        return {k: REDACTED if k in self.secrets else v for k, v in task.env.items()}

    def task(self, name: str) -> TaskPlan:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def policy_of(self, task: TaskPlan) -> RolePolicy:
        return self.policy[task.role]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["strategy"] = self.strategy.value
        out["backend"] = self.backend
        out["tasks"] = list(out["tasks"])  # asdict keeps the tuple; the JSON form has lists only
        out["secrets"] = sorted(self.secrets)
        if out["state"] is not None:
            out["state"]["readers"] = list(out["state"]["readers"])
            out["state"]["job_folders"] = list(out["state"]["job_folders"])
        out["policy"] = {
            role.value: {"decides": p.decides, "on_failure": p.on_failure.value, "at_end": p.at_end.value}
            for role, p in self.policy.items()
        }
        for t, task in zip(out["tasks"], self.tasks, strict=True):
            t["role"] = task.role.value
            t["env"] = self.shown_env(task)
            t["argv"] = list(task.argv)
            t["tf_config"] = json.loads(task.env["TF_CONFIG"])
        return out


def make_plan(spec: ClusterSpec, run_id: str, placements: Mapping[str, Placement]) -> LaunchPlan:
    """The whole run's plan from the spec and where the backend placed each task."""
    slots = task_slots(spec)
    missing = [s.name for s in slots if s.name not in placements]
    if missing:
        raise ValueError(f"no placement for tasks {missing}")
    addresses = {s.name: f"{placements[s.name].host}:{placements[s.name].port}" for s in slots}
    cluster = {
        role.value: [addresses[s.name] for s in slots if s.role is role]
        for role in _CLUSTER_ROLES
        if any(s.role is role for s in slots)
    }
    gpus = _split_gpus(spec, slots)
    tasks = []
    for slot in slots:
        place = placements[slot.name]
        tf_config = {"cluster": cluster, "task": {"type": slot.role.value, "index": slot.index}}
        checkpoint_dir = str(spec.shared_checkpoint_dir or posixpath.join(place.run_folder, "checkpoints"))
        env = _task_env(spec, run_id, slot, place, tf_config, checkpoint_dir, gpus.get(slot.name))
        tasks.append(
            TaskPlan(
                name=slot.name,
                role=slot.role,
                index=slot.index,
                host=place.host,
                address=addresses[slot.name],
                port=place.port,
                argv=_argv(spec, slot.role, place, checkpoint_dir=checkpoint_dir),
                env=env,
                cwd=place.cwd,
                in_cluster=slot.role in _CLUSTER_ROLES,
                host_index=slot.host_index,
            )
        )
    return LaunchPlan(
        spec.name,
        run_id,
        spec.strategy,
        spec.backend,
        cluster,
        tuple(tasks),
        role_policies(spec),
        state_plan(spec, slots),
        spec.secret_names(),
        spec.train.global_batch_size if spec.job.loop is not None and spec.train is not None else None,
    )


def _task_env(
    spec: ClusterSpec,
    run_id: str,
    slot: TaskSlot,
    place: Placement,
    tf_config: Mapping[str, Any],
    checkpoint_dir: str,
    gpus: str | None,
) -> dict[str, str]:
    """A task's environment: the spec's and its host's, the backend's, then ours (TF_CONFIG, where
    heartbeats go, the timeouts TensorFlow's own peer watch follows too)."""
    host = spec.hosts[slot.host_index]
    env = {
        **spec.job.env,
        **host.env,
        **place.env,
        "TF_CONFIG": json.dumps(tf_config, separators=(",", ":")),
        wire.ENV_RUN_ID: run_id,
        wire.ENV_RUN_DIR: place.run_folder,
        wire.ENV_TASK: slot.name,
        wire.ENV_COORDINATOR: place.coordinator_url,
        wire.ENV_HEARTBEAT_INTERVAL_S: repr(spec.health.heartbeat_interval_s),
        wire.ENV_CHECKPOINT_DIR: checkpoint_dir,
        # A task whose coordinator is gone this long exits by itself (no orphans holding GPUs).
        wire.ENV_COORDINATOR_TIMEOUT_S: repr(spec.health.heartbeat_timeout_s),
        # TensorFlow's own peer watch follows the same knobs, so the survivors fail fast too.
        wire.ENV_TF_HEARTBEAT_TIMEOUT_S: repr(spec.health.heartbeat_timeout_s),
        wire.ENV_TF_REGISTER_TIMEOUT_S: repr(spec.health.startup_timeout_s),
        "PYTHONUNBUFFERED": "1",
    }
    if spec.strategy is Strategy.PARAMETER_SERVER:
        # A call to a lost task fails at once instead of waiting for it (docs/architecture.md §7).
        env["GRPC_FAIL_FAST"] = "use_caller"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if place.pythonpath:  # a worker runtime copied beside the job comes first
        env["PYTHONPATH"] = ":".join([*place.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    return env


def state_plan(spec: ClusterSpec, slots: list[TaskSlot]) -> StatePlan:
    """The chief's checkpoints (worker-0's without a chief) are the truth. Readers: every training
    task of a synchronous strategy (each restores the same state), the chief alone under
    parameter_server (ps and workers hold no state of their own), and the evaluator."""
    names = [s.name for s in slots]
    owner = "chief-0" if "chief-0" in names else "worker-0"
    if spec.strategy is Strategy.PARAMETER_SERVER:
        readers = [s.name for s in slots if s.role in (Role.CHIEF, Role.EVALUATOR)]
    else:
        readers = [s.name for s in slots if s.role is not Role.PS]
    return StatePlan(shared=spec.shared_checkpoint_dir is not None, owner=owner, readers=tuple(readers))


def _job_path(spec: ClusterSpec, path: Path, place: Placement) -> str:
    if place.code_root is None:
        return str(path)
    rel = path.relative_to(job_files_root(spec)).as_posix()
    return posixpath.join(place.code_root, rel)


def _argv(spec: ClusterSpec, role: Role, place: Placement, *, checkpoint_dir: str) -> tuple[str, ...]:
    """Mode 1: every task runs the script. Mode 2: the training tasks run the loop; the evaluator
    scores its checkpoints; parameter_server's ps and worker tasks serve the chief."""
    job, python = spec.job, place.python
    if job.script is not None:
        script = _job_path(spec, job.script, place)
        return (*python, "-m", "worker", "run", "--script", script, "--", *job.args)
    assert job.loop is not None and spec.train is not None  # guaranteed by spec validation
    train = spec.train
    module = _job_path(spec, job.loop, place)
    if role is Role.EVALUATOR:
        return (*python, "-m", "worker", "evaluate", "--module", module, "--checkpoint-dir", checkpoint_dir)
    if spec.strategy is Strategy.PARAMETER_SERVER and role in (Role.PS, Role.WORKER):
        return (*python, "-m", "worker", "server")
    argv = [*python, "-m", "worker", "loop", "--module", module, "--strategy", spec.strategy.value]
    argv += ["--steps", str(train.steps)] if train.steps else ["--epochs", str(train.epochs)]
    argv += [
        "--global-batch-size",
        str(train.global_batch_size),
        "--checkpoint-every",
        str(train.checkpoint_every),
    ]
    argv += ["--checkpoint-dir", checkpoint_dir]
    if train.cpu_replicas:
        argv += ["--cpu-replicas", str(train.cpu_replicas)]
    return (*argv, "--", *job.args)


def _split_gpus(spec: ClusterSpec, slots: list[TaskSlot]) -> dict[str, str]:
    """Each host's GPUs, split into contiguous equal shares among its tasks (shared when too few)."""
    out = {}
    for h, host in enumerate(spec.hosts):
        if not host.gpus:
            continue
        mine = [s for s in slots if s.host_index == h]
        share = max(1, len(host.gpus) // len(mine))
        for i, slot in enumerate(mine):
            if len(host.gpus) >= len(mine):
                ids = host.gpus[i * share : (i + 1) * share]
            else:
                ids = [host.gpus[i % len(host.gpus)]]
            out[slot.name] = ",".join(str(g) for g in ids)
    return out
