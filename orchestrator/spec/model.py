"""Spec layer: pydantic models of the cluster spec (docs/architecture.md §3). Unknown keys are errors.

Relative paths are resolved against the spec file's folder, passed in the validation context as
`base_dir`. Checks that involve several keys at once (role counts, ports, strategy/role fit) live
in `checks.py`, so each problem can be reported at the key the user must change.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from orchestrator.spec.base import Strict, resolve_path
from orchestrator.spec.environment import EnvironmentSpec


class Strategy(str, enum.Enum):
    MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
    PARAMETER_SERVER = "parameter_server"
    MIRRORED = "mirrored"


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


class Standby(str, enum.Enum):
    AUTO = "auto"  # on where the host has the memory for it (docs/architecture.md §6)
    ON = "on"
    OFF = "off"


class AtEnd(str, enum.Enum):
    WAIT = "wait"  # let the task finish by itself (bounded by health.final_wait_s)
    STOP = "stop"  # stop it (servers that never exit: ps, PS workers)


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


MAX_TASKS = 1024  # in all: every task's TF_CONFIG lists the whole cluster (the plan grows as N²)
MAX_HOSTS = 1024


def yaml_switch(value: Any) -> Any:
    """An `auto | on | off` key's value: YAML 1.1 reads a bare `on` / `off` as a boolean."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class HostSpec(Strict):
    address: str = Field(min_length=1, description="hostname or IP, reachable from the coordinator and peers")
    tasks: dict[Role, Annotated[int, Field(le=MAX_TASKS)]] = Field(
        default_factory=dict, description="task count per role, e.g. {worker: 2} (none on a spare)"
    )
    spare: bool = Field(
        default=False,
        description="ssh: a host with no tasks, kept to take the tasks of a host that is lost",
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

    _resolve_identity = field_validator("identity_file")(resolve_path)


class JobSpec(Strict):
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
        description="the folder copied to hosts that share no disk with this machine (default: the "
        "script's folder)",
    )
    checkpoint_dir: Path | None = Field(
        default=None,
        description="mode 1: a folder every host shares (same path, same files), given to the tasks as "
        "ORCHESTRATE_CHECKPOINT_DIR; default: checkpoints/ of the run, copied between hosts by orchestrate",
    )

    _resolve_paths = field_validator("script", "loop", "files", "checkpoint_dir")(resolve_path)

    @model_validator(mode="after")
    def _one_mode(self) -> JobSpec:
        if (self.script is None) == (self.loop is None):
            raise ValueError("give exactly one of job.script (any TF program) or job.loop (built-in loop)")
        return self


class TrainSpec(Strict):
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

    _resolve_dir = field_validator("checkpoint_dir")(resolve_path)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainSpec:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of train.steps or train.epochs")
        return self


class HealthSpec(Strict):
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
    stacks_timeout_s: float = Field(
        default=5.0,
        ge=0,
        le=60,
        description="before stopping a hung job (stalled, lost, not up in time): at most this long to read "
        "every task's stacks, kept in the run record (0: never)",
    )

    @model_validator(mode="after")
    def _timeout_above_interval(self) -> HealthSpec:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                "health.heartbeat_timeout_s must be at least twice health.heartbeat_interval_s "
                "(one late heartbeat must not count as a lost task)"
            )
        return self


class RestartSpec(Strict):
    max_restarts: int = Field(
        default=3, ge=0, description="whole-job restarts; also each task's own restarts (restart_task)"
    )
    backoff_s: float = Field(
        default=2.0, ge=0, description="before a restart after an attempt that trained no step; doubles"
    )
    standby: Standby = Field(
        default=Standby.AUTO,
        description="a warm process per task, TensorFlow imported, for the next attempt: auto (on where "
        "the host keeps enough memory available with them; off when max_restarts is 0) | on | off",
    )

    shrink: bool = Field(
        default=False,
        description="with no spare host left, go on without a lost host's workers (their indexes "
        "renumbered, the global batch split over the replicas left)",
    )
    min_workers: int = Field(
        default=1, ge=1, le=MAX_TASKS, description="shrinking stops at this many worker tasks"
    )

    _yaml_switch = field_validator("standby", mode="before")(yaml_switch)


class RolePolicySpec(Strict):
    """How the supervisor treats one role's tasks; unset fields keep the strategy's default."""

    decides: bool | None = Field(default=None, description="the job succeeds when these tasks all exit 0")
    on_failure: OnFailure | None = Field(default=None, description="restart_job | restart_task | ignore")
    at_end: AtEnd | None = Field(default=None, description="when the deciding tasks are done: wait | stop")


class RecordSpec(Strict):
    share_with_group: bool = Field(
        default=False,
        description="the run directory readable by the owner's group (0750, files 0640); "
        "default: the owner's alone (0700, files 0600)",
    )


#: Environment names whose values are taken for secrets (never written to the record, nor printed).
SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|(^|_)AUTH(_|$)", re.IGNORECASE
)


class ClusterSpec(Strict):
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
        description="the hosts and their tasks (where the backend's own section does not place them)",
    )
    job: JobSpec
    train: TrainSpec | None = None
    health: HealthSpec = HealthSpec()
    restart: RestartSpec = RestartSpec()
    policy: dict[Role, RolePolicySpec] = Field(
        default_factory=dict, description="per role: decides, on_failure, at_end (defaults per strategy)"
    )
    record: RecordSpec = RecordSpec()
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="the job's Python environment, made by us on every host (default: the hosts' own)",
    )

    #: The sections of backends (`ssh:`, `slurm:`, a plugin's), validated by their backends
    #: (spec/sections.py): name -> model. Not a field: the spec's keys are the backends' names.
    _sections: dict[str, BaseModel] = PrivateAttr(default_factory=dict)
    #: Whether the backend's section placed the tasks (`hosts` came from it, not from the spec).
    _hosts_from_section: bool = PrivateAttr(default=False)
    #: This attempt's layout (`laid_out`): hosts[p]'s tasks run on hosts[runs[p]] (a spare), or
    #: nowhere (None: left out, the job shrunk). A host not named runs its own tasks.
    _runs: dict[int, int | None] = PrivateAttr(default_factory=dict)

    def section(self, name: str) -> BaseModel | None:
        """The spec's section of the backend `name` (its top-level key), None where it has none."""
        return self._sections.get(name)

    def with_sections(self, sections: dict[str, BaseModel], hosts: list[HostSpec] | None) -> ClusterSpec:
        """This spec with its backends' sections, and the hosts the backend's section stands for
        (its tasks placed by the section: slurm's nodes, known by number until allocated)."""
        spec = self.model_copy(update={} if hosts is None else {"hosts": hosts})
        spec._sections = dict(sections)
        spec._hosts_from_section = hosts is not None
        return spec

    def laid_out(self, runs: Mapping[int, int | None]) -> ClusterSpec:
        """This spec for an attempt whose hosts changed: hosts[p]'s tasks run on hosts[runs[p]]
        (a spare that took them) or are left out (None). Tasks are numbered in the order of the
        hosts that give them (spec/roles.py `task_slots`): a task moved keeps its name, those after
        a host left out are renumbered, as TensorFlow requires."""
        spec = self.model_copy()
        spec._sections = dict(self._sections)
        spec._hosts_from_section = self._hosts_from_section
        spec._runs = {p: h for p, h in runs.items() if h != p}
        return spec

    def runs_on(self, position: int) -> int | None:
        """The host that runs hosts[position]'s tasks this attempt (None: left out)."""
        return self._runs.get(position, position)

    @property
    def runs(self) -> dict[int, int | None]:
        """The hosts whose tasks run elsewhere or nowhere this attempt (`laid_out`)."""
        return dict(self._runs)

    def as_data(self) -> dict[str, Any]:
        """The spec as data that validates to it again (its sections included)."""
        data = self.model_dump(mode="json", exclude_none=True)
        if self._hosts_from_section:
            del data["hosts"]
        for name, section in self._sections.items():
            data[name] = section.model_dump(mode="json", exclude_none=True)
        return data

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
