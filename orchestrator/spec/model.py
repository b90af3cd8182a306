"""Spec layer: pydantic models of the cluster spec (docs/architecture.md §3). Unknown keys are errors.

Relative paths are resolved against the spec file's folder, passed in the validation context as
`base_dir`. Checks that involve several keys at once (role counts, ports, strategy/role fit) live
in `checks.py`, so each problem can be reported at the key the user must change.
"""

from __future__ import annotations

import enum
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)


class Strategy(str, enum.Enum):
    MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
    PARAMETER_SERVER = "parameter_server"
    MIRRORED = "mirrored"


class Backend(str, enum.Enum):
    LOCAL = "local"
    SSH = "ssh"
    SLURM = "slurm"


class Role(str, enum.Enum):
    """Task roles, in the order tasks are numbered and listed."""

    CHIEF = "chief"
    WORKER = "worker"
    PS = "ps"
    EVALUATOR = "evaluator"


class OnFailure(str, enum.Enum):
    RESTART_JOB = "restart_job"  # stop every task, restart all from the last checkpoint (the budget)
    RESTART_TASK = "restart_task"  # restart this task alone, same address; the others go on
    IGNORE = "ignore"  # report it; the job goes on without the task


class AtEnd(str, enum.Enum):
    WAIT = "wait"  # let the task finish by itself (bounded by health.final_wait_s)
    STOP = "stop"  # stop it (servers that never exit: ps, PS workers)


class HostKeyPolicy(str, enum.Enum):
    STRICT = "strict"
    ACCEPT_NEW = "accept-new"


def _env_value(value: Any) -> Any:
    # YAML turns `1` into an int and `yes` into a bool; a researcher writing `TF_USE_LEGACY_KERAS: 1`
    # means the string "1". Booleans are ambiguous ("True"? "1"?), so they must be quoted.
    if isinstance(value, bool):
        raise ValueError('environment values must be strings; quote it (e.g. "1" or "true")')
    if isinstance(value, (int, float)):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_env_value)]
EnvMap = dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], EnvValue]


def _resolve(value: Path | None, info: ValidationInfo) -> Path | None:
    if value is None:
        return None
    try:
        value = value.expanduser()
    except RuntimeError:  # `~name/…` of a user this machine does not have
        raise ValueError(f"{value}: {str(value).split('/')[0]} names no user of this machine") from None
    base = (info.context or {}).get("base_dir")
    if base is not None and not value.is_absolute():
        value = Path(base) / value
    return Path(os.path.normpath(value))


MAX_TASKS = 1024  # in all: every task's TF_CONFIG lists the whole cluster (the plan grows as N²)
MAX_HOSTS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class HostSpec(_Strict):
    address: str = Field(min_length=1, description="hostname or IP, reachable from the coordinator and peers")
    tasks: dict[Role, Annotated[int, Field(le=MAX_TASKS)]] = Field(
        description="task count per role, e.g. {worker: 2}"
    )
    base_port: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="TF ports of this host's tasks start here (default: free)",
    )
    gpus: list[Annotated[int, Field(ge=0, le=1023)]] = Field(
        default_factory=list, max_length=1024, description="GPU ids; split among this host's tasks"
    )
    # ssh only
    user: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    identity_file: Path | None = None
    python: str = Field(
        default="python3", min_length=1, description="the host's interpreter (with TensorFlow)"
    )
    workdir: str | None = Field(
        default=None, description="folder on the host for runs and the file cache (default ~/.orchestrate)"
    )
    env: EnvMap = Field(default_factory=dict)

    _resolve_identity = field_validator("identity_file")(_resolve)


class JobSpec(_Strict):
    script: Path | None = Field(default=None, description="mode 1: any TF program, run with TF_CONFIG set")
    loop: Path | None = Field(default=None, description="mode 2: a module for the built-in training loop")
    args: list[str] = Field(default_factory=list)
    env: EnvMap = Field(default_factory=dict)
    secret_env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list,
        description="env names whose values are secret (besides names like *TOKEN*, *PASSWORD*, *API_KEY*): "
        "written as <redacted> in the run's record and printed so",
    )
    files: Path | None = Field(
        default=None,
        description="ssh backend: the folder copied to every host (default: the script's folder)",
    )
    checkpoint_dir: Path | None = Field(
        default=None,
        description="mode 1: a folder every host shares (same path, same files), given to the tasks as "
        "ORCHESTRATE_CHECKPOINT_DIR; default: checkpoints/ of the run, copied between hosts by orchestrate",
    )

    _resolve_paths = field_validator("script", "loop", "files", "checkpoint_dir")(_resolve)

    @model_validator(mode="after")
    def _one_mode(self) -> JobSpec:
        if (self.script is None) == (self.loop is None):
            raise ValueError("give exactly one of job.script (any TF program) or job.loop (built-in loop)")
        return self


class TrainSpec(_Strict):
    steps: int | None = Field(default=None, gt=0)
    epochs: int | None = Field(default=None, gt=0)
    global_batch_size: int = Field(default=64, gt=0)
    checkpoint_every: int = Field(default=50, gt=0, description="steps between checkpoints")
    checkpoint_dir: Path | None = Field(
        default=None,
        description="a folder every host shares (same path, same files); default: checkpoints/ of the "
        "run, copied between hosts by orchestrate",
    )
    cpu_replicas: int | None = Field(
        default=None,
        ge=1,
        description="strategy mirrored on a host without GPUs: split its CPU into this many replicas",
    )

    _resolve_dir = field_validator("checkpoint_dir")(_resolve)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainSpec:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of train.steps or train.epochs")
        return self


class HealthSpec(_Strict):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_timeout_s: float = Field(default=10.0, gt=0, description="no heartbeat this long -> task LOST")
    stall_timeout_s: float = Field(default=120.0, gt=0, description="step not advancing this long -> stalled")
    startup_timeout_s: float = Field(default=120.0, gt=0, description="all tasks must be up within this")
    stop_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="on a stop, SIGTERM then this long (a final checkpoint) before SIGKILL",
    )
    final_wait_s: float = Field(
        default=120.0,
        ge=0,
        description="when training is done, how long tasks that end by themselves (the evaluator) may take",
    )

    @model_validator(mode="after")
    def _timeout_above_interval(self) -> HealthSpec:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                "health.heartbeat_timeout_s must be at least twice health.heartbeat_interval_s "
                "(one late heartbeat must not count as a lost task)"
            )
        return self


class RestartSpec(_Strict):
    max_restarts: int = Field(
        default=3, ge=0, description="whole-job restarts; also each task's own restarts (restart_task)"
    )
    backoff_s: float = Field(default=2.0, ge=0)


class RolePolicySpec(_Strict):
    """How the supervisor treats one role's tasks; unset fields keep the strategy's default."""

    decides: bool | None = Field(default=None, description="the job succeeds when these tasks all exit 0")
    on_failure: OnFailure | None = Field(default=None, description="restart_job | restart_task | ignore")
    at_end: AtEnd | None = Field(default=None, description="when the deciding tasks are done: wait | stop")


class SshSpec(_Strict):
    known_hosts: Path = Path("~/.ssh/known_hosts")
    host_key_policy: HostKeyPolicy = HostKeyPolicy.STRICT
    connect_timeout_s: float = Field(default=10.0, gt=0)
    coordinator_address: str | None = Field(
        default=None,
        pattern=r"^[^\s:/]+(:[0-9]{1,5})?$",
        description="host[:port] of this machine that the hosts can reach; heartbeats go there directly "
        "(default: through each SSH connection, which works behind NAT)",
    )
    shared_dirs: list[str] = Field(
        default_factory=list,
        description="absolute folders the job expects every host to share (a network file system); "
        "`orchestrate check` and `up` prove it by writing on one host and reading on the others",
    )

    @field_validator("known_hosts")
    @classmethod
    def _expand(cls, value: Path, info: ValidationInfo) -> Path:
        return _resolve(value, info) or value

    @field_validator("shared_dirs")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/") or "\0" in path:
                raise ValueError(f"{path!r}: give an absolute path, as every host mounts it")
        return [os.path.normpath(p) for p in value]


#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
SLURM_TIME = r"^([0-9]{1,5}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|[0-9]{1,7}(:[0-9]{1,2}){0,2})$"
RoleCounts = dict[Role, Annotated[int, Field(le=MAX_TASKS)]]


class SlurmSpec(_Strict):
    """backend: slurm — an allocation of `nodes` nodes on a Slurm cluster; the same tasks on each
    node used (or one entry per node), the rest kept as spares for a restart."""

    nodes: int = Field(ge=1, le=MAX_HOSTS, description="nodes to allocate (more than used: spares)")
    tasks_per_node: RoleCounts | Annotated[list[RoleCounts], Field(min_length=1, max_length=MAX_HOSTS)] = (
        Field(
            description="counts per role on every node used, e.g. {worker: 1}; or a list, one entry per "
            "node used, e.g. [{chief: 1, ps: 1}, {worker: 2}]"
        )
    )
    spare_nodes: int = Field(
        default=0,
        ge=0,
        description="with the mapping form of tasks_per_node: nodes kept free for a restart "
        "(the list form uses len(list) nodes and keeps the rest spare)",
    )
    partition: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.+-]+$", max_length=128)
    account: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.+-]+$", max_length=128)
    time: str | None = Field(
        default=None, pattern=SLURM_TIME, description='time limit of the allocation, e.g. "02:00:00"'
    )
    extra_args: list[Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=list, max_length=100, description="more salloc options, e.g. [--gres=gpu:1]"
    )
    queue_timeout_s: float = Field(
        default=600.0, gt=0, description="give up (and cancel the request) if not allocated within this"
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="how long a Slurm command may wait for slurmctld"
    )
    python: str | None = Field(
        default=None, min_length=1, description="interpreter on the nodes (default: the coordinator's own)"
    )
    coordinator_address: str | None = Field(
        default=None,
        pattern=r"^[^\s:/]+(:[0-9]{1,5})?$",
        description="host[:port] of this machine that the nodes reach (default: this machine's address "
        "on the route to the nodes)",
    )
    workdir: str | None = Field(
        default=None,
        pattern=r"^/[^\x00]*$",
        max_length=1000,
        description="where nodes that do not see this machine's files keep the run's copy "
        "(default /tmp/orchestrate-<uid>; unused on a shared filesystem)",
    )

    def time_s(self) -> float | None:
        """slurm.time in seconds (Slurm's formats: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
        if self.time is None:
            return None
        days, _, rest = self.time.rpartition("-")
        parts = [int(p) for p in rest.split(":")]
        if days:  # D-HH, D-HH:MM, D-HH:MM:SS
            parts += [0] * (3 - len(parts))
            hours, minutes, seconds = parts
            return float(((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds)
        scale = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(parts)]  # minutes | MM:SS | HH:MM:SS
        return float(sum(p * k for p, k in zip(parts, scale, strict=True)))

    @staticmethod
    def warning_lead_s(stop_grace_s: float) -> int:
        """How long before the time limit Slurm is asked to send SIGTERM (`--signal=TERM@lead`):
        the stop's grace period for a final checkpoint, and some margin (Slurm checks every ~30 s)."""
        return max(60, math.ceil(stop_grace_s) + 30)

    def layout(self) -> list[dict[Role, int]]:
        """The tasks of each node used, in node order."""
        if isinstance(self.tasks_per_node, list):
            return [dict(t) for t in self.tasks_per_node]
        return [dict(self.tasks_per_node) for _ in range(max(0, self.nodes - self.spare_nodes))]

    @model_validator(mode="after")
    def _fits(self) -> SlurmSpec:
        used = (
            len(self.tasks_per_node)
            if isinstance(self.tasks_per_node, list)
            else self.nodes - self.spare_nodes
        )
        if isinstance(self.tasks_per_node, list) and self.spare_nodes:
            raise ValueError(
                "slurm.spare_nodes goes with the mapping form of tasks_per_node; with a list, "
                "slurm.nodes beyond its length are the spares"
            )
        if used < 1:
            raise ValueError(
                f"slurm.spare_nodes ({self.spare_nodes}) leaves no node of slurm.nodes ({self.nodes})"
            )
        if used > self.nodes:
            raise ValueError(
                f"slurm.tasks_per_node lists {used} nodes, slurm.nodes allocates {self.nodes}; "
                "allocate at least as many"
            )
        return self


class RecordSpec(_Strict):
    share_with_group: bool = Field(
        default=False,
        description="the run directory readable by the owner's group (0750, files 0640); "
        "default: the owner's alone (0700, files 0600)",
    )


#: Environment names whose values are taken for secrets (never written to the record, nor printed).
SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|(^|_)AUTH(_|$)", re.IGNORECASE
)


class ClusterSpec(_Strict):
    name: str = Field(pattern=r"^[a-z0-9-]+$", max_length=63, description="names the run: [a-z0-9-]+")
    strategy: Strategy = Strategy.MULTI_WORKER_MIRRORED
    backend: str = Field(
        "local",
        description="where the tasks run: local | ssh | slurm, or a backend an installed package registers "
        "(entry-point group tf_orchestrate.backends)",
    )
    hosts: list[HostSpec] = Field(
        default_factory=list,
        max_length=MAX_HOSTS,
        description="backends local and ssh: the hosts and their tasks (backend slurm: see slurm)",
    )
    job: JobSpec
    train: TrainSpec | None = None
    health: HealthSpec = HealthSpec()
    restart: RestartSpec = RestartSpec()
    policy: dict[Role, RolePolicySpec] = Field(
        default_factory=dict, description="per role: decides, on_failure, at_end (defaults per strategy)"
    )
    ssh: SshSpec = SshSpec()
    slurm: SlurmSpec | None = None
    record: RecordSpec = RecordSpec()

    @model_validator(mode="after")
    def _slurm_nodes(self) -> ClusterSpec:
        # backend slurm: the nodes used stand where hosts stand for the others (the planner, the
        # checks and the placement rules read hosts); their addresses are known once allocated.
        if self.backend == Backend.SLURM and self.slurm is not None:
            nodes = [HostSpec(address=f"<node {i}>", tasks=t) for i, t in enumerate(self.slurm.layout(), 1)]
            object.__setattr__(self, "hosts", nodes)  # frozen: set once, while validating
        return self

    def role_count(self, role: Role) -> int:
        return sum(h.tasks.get(role, 0) for h in self.hosts)

    def secret_names(self) -> frozenset[str]:
        """The env names whose values are secret: job.secret_env, and those that look like it."""
        names = set(self.job.env).union(*(h.env for h in self.hosts))
        return frozenset(self.job.secret_env).union(n for n in names if SECRET_NAME.search(n))

    @property
    def shared_checkpoint_dir(self) -> Path | None:
        """The checkpoint folder the spec declares shared by every host (nothing is copied), if any."""
        if self.train is not None and self.train.checkpoint_dir is not None:
            return self.train.checkpoint_dir
        return self.job.checkpoint_dir
