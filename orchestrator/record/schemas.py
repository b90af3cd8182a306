"""Record room: the documented shape of what a run writes — status.json, an events.jsonl line,
a metrics.jsonl line — as pydantic models, whose JSON Schemas `orchestrate schema status|event|
metrics` prints for scripts and dashboards.

The coordinator writes plain dicts (a thousand tasks' status.json once a second must stay cheap);
the tests hold every document it writes to these models (`extra="forbid"`: a field added to the
record and not here fails them). `schema_version` (record.SCHEMA_VERSION) rises when a field
changes meaning or goes; a new field keeps it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.states import ClusterState, FailureKind, TaskState

_Strict = ConfigDict(extra="forbid")

#: A reported value in every document: a number, or NaN and ±inf as these strings (JSON has no
#: number for them; `worker.wire.NONFINITE`). A reported name shows a control, bidi or lone
#: surrogate character as its escape (`bad\\ud800name`; `worker.wire.safe_text`).
_NONFINITE = ["NaN", "Infinity", "-Infinity"]
Reported = Annotated[
    float | Literal["NaN", "Infinity", "-Infinity"],
    Field(description='a number; NaN, +inf and -inf as the strings "NaN", "Infinity", "-Infinity"'),
]


class TaskError(BaseModel):
    model_config = _Strict
    type: str = Field(description="the exception's type, e.g. `ValueError`")
    message: str = Field(description="its first line")


class Restored(BaseModel):
    model_config = _Strict
    step: int = Field(description="the training step it starts from (0: unknown or none)")
    fingerprint: str = Field(
        description="of the restored variables (the built-in loop) or of the checkpoint restored (a job's "
        "own, or a parameter_server chief's: SHA-256 of its index), `nothing` when it restored none: "
        "equal on every training task"
    )
    source: str | None = Field(description="the checkpoint it came from (a path on its host), null if none")
    epoch: int = Field(0, description="the epoch it starts in, where the checkpoint says")
    step_in_epoch: int = Field(0, description="the batch within that epoch, where the checkpoint says")
    final: bool = Field(
        True, description="false: said as the job restored, before its first step (it may again)"
    )


class MetricsDropped(BaseModel):
    model_config = _Strict
    count: int = Field(description="distinct names dropped")
    first: str
    why: str


class TaskStatus(BaseModel):
    model_config = _Strict
    task: str = Field(description="`<role>-<index>`, e.g. `worker-1`")
    role: Literal["chief", "worker", "ps", "evaluator"]
    index: int
    host: str
    state: TaskState
    reason: str = Field(description="why it is in this state")
    pid: int | None = Field(description="of its process (on its host) in the current attempt")
    pgid: int | None
    create_time: float | None = Field(description="its process's start, seconds since the epoch")
    exit_code: int | None = Field(description="negative: killed by that signal")
    restarts: int = Field(0, description="restarts of this task alone (its role's policy restart_task)")
    last_step: int | None
    total_steps: int | None = Field(description="when the task said (the built-in loop, Keras' fit)")
    examples_per_step: int | None = Field(
        None,
        description="the global batch, when the job said (worker.set_total_steps(…, global_batch_size=…))",
    )
    metrics: dict[str, Reported] = Field(
        description='its latest reported values, e.g. {"loss": 0.12}; NaN and ±inf as "NaN", "Infinity", '
        '"-Infinity"'
    )
    steps_per_s: float | None
    busy: str | None = Field(None, description="between training steps: validating, saving, … (not a stall)")
    rss_bytes: int | None
    last_heartbeat_at: str | None = Field(description="UTC, e.g. 2026-12-01T12:00:00.123Z")
    error: TaskError | None = Field(None, description="the exception its code raised, if any")
    restored: Restored | None = Field(
        None,
        description="what it restored before its first step this attempt (reported by every training task)",
    )
    metrics_dropped: MetricsDropped | None = Field(
        None,
        description="the metric names its reporter dropped so far (64 names a task at most): how many, "
        "the first and why; null while none was",
    )


class FailureStatus(BaseModel):
    model_config = _Strict
    attempt: int
    kind: FailureKind
    tasks: list[str] = Field(description="the tasks it names (the first is the cause)")
    reason: str
    exit_code: int | None


_Phase = Literal["stop", "wait", "start", "connect", "restore", "first_step"]


class RecoveryStatus(BaseModel):
    model_config = _Strict
    attempt: int = Field(description="the attempt this restart started")
    cause: str = Field(description="in a few words: `worker-1 died`")
    noticed_at: str = Field(description="when the failure was noticed (UTC)")
    phases_s: dict[Literal["stop", "wait", "start", "connect", "restore", "first_step"], float | None] = (
        Field(
            description="seconds of each phase, by the coordinator's clock: stop (failure noticed → old "
            "attempt stopped), wait (backoff), start (the attempt prepared, its checkpoint copied, its "
            "tasks started), connect (→ every strategy up), restore (→ every deciding task restored), "
            "first_step (→ every deciding task reported a step); null: not (yet) reported"
        )
    )
    training_again_s: float | None = Field(description="failure noticed → first step; null until then")
    complete: bool = Field(description="false while the restart is under way")
    line: str = Field(description="the summary's and the page's line")


class StandbyStatus(BaseModel):
    model_config = _Strict
    task: str = Field(description="the task it will become at the next restart")
    host: str = Field(description='where it waits ("" on this machine)')
    pid: int | None
    state: Literal["importing", "ready", "failed", "gone"] = Field(
        description="importing TensorFlow (at the lowest CPU priority) · ready · failed (its import: "
        "an event says why) · gone"
    )
    rss_bytes: int | None


class DegradedStatus(BaseModel):
    model_config = _Strict
    what: str = Field(
        description="the promise that fell back: network (TF ports open to others), outbound (the "
        "tasks offline), names (not resolved in the run), page_copy (a host's standbys without it)"
    )
    where: str = Field(description='"this machine", a host')
    said: str = Field(description="what happened and why, in the kernel's or the tool's words")
    fix: str = Field(description="what makes it whole again")
    since: str | None = Field(description="UTC, where it began mid-run")


class MachineStatus(BaseModel):
    model_config = _Strict
    host: str = Field(description="its address")
    state: Literal["in use", "spare", "lost"] = Field(
        description="runs tasks of the attempt · a spare, kept for a lost host · lost (not used)"
    )
    tasks: list[str] = Field(description="the tasks it runs this attempt")
    lost: str | None = Field(description="why it was lost, and since when, as it was last seen")


class AttemptStatus(BaseModel):
    model_config = _Strict
    attempt: int
    workers: int = Field(description="its worker tasks (fewer after a shrink: restart.shrink)")
    changes: list[str] = Field(description="the hosts it ran on anew: a task moved to a spare, left out")


class NetworkStatus(BaseModel):
    model_config = _Strict
    isolated: bool = Field(description="the tasks in a network of the run's own (local: a network namespace)")
    reachable_from: str = Field(
        description="who can connect to the tasks' TF ports (TensorFlow's are unauthenticated)"
    )
    why: str = Field(description="why so: where isolation was not possible, the kernel's or the tool's words")
    outbound: str | None = Field(
        default=None,
        description="what the tasks reach outside the run: `pasta: …` (local.outbound), `offline: …` "
        "and why (install passt), this machine's own network; null where the backend does not say",
    )
    names: str | None = Field(
        default=None,
        description="`not resolved in the run: …` and why, where the run's tasks cannot resolve names "
        "(this machine's resolver on its loopback and no resolv.conf of the run's own); null: as promised",
    )


class CoordinatorStatus(BaseModel):
    model_config = _Strict
    pid: int | None
    alive: bool


class Status(BaseModel):
    """status.json, rewritten atomically on every change while the run lives (`orchestrate status
    --json` prints it, with `coordinator` and `stale` added)."""

    model_config = _Strict
    schema_version: Literal[1] = Field(description="raised when a field changes meaning or goes")
    name: str
    run_id: str = Field(description="`<name>-<time>-<random>`: unique, kept by --resume")
    state: ClusterState
    attempt: int = Field(description="0, 1, … (each whole-job restart is a new attempt)")
    restarts: int = Field(description="whole-job restarts counted against restart.max_restarts")
    reason: str = Field(description="why the run is in this state")
    started_at: str
    ended_at: str | None
    exit_code: int | None = Field(
        description="once ended, `orchestrate up`'s exit code: 0 ok, 1 failed, 3 not launched, "
        "130 interrupted"
    )
    examples_per_step: int | None = Field(
        None, description="the global batch size when known (the built-in loop): examples/s = steps/s × this"
    )
    failures: list[FailureStatus] = Field(
        description="the cause of every failed attempt, in order; the first is the run's root cause"
    )
    task_restarts: list[FailureStatus] = Field(description="failures answered by restarting one task alone")
    tasks: list[TaskStatus]
    checkpoint_folders: list[str] = Field(
        default_factory=list,
        description="the folders the job writes its own checkpoints to, as the owner told them (besides "
        "ORCHESTRATE_CHECKPOINT_DIR): kept the same on every host that has a disk of its own",
    )
    recoveries: list[RecoveryStatus] = Field(
        default_factory=list, description="every whole-job restart's timeline, in order"
    )
    machines: list[MachineStatus] = Field(
        default_factory=list,
        description="the run's machines (ssh hosts, Slurm nodes) as last seen before an attempt: in use, "
        "spare, lost; empty until a later attempt asked",
    )
    attempts: list[AttemptStatus] = Field(
        default_factory=list, description="each attempt's workers, and the hosts it ran on anew"
    )
    standbys: list[StandbyStatus] = Field(
        default_factory=list,
        description="the warm standbys waiting for the next attempt (restart.standby), one per task at most",
    )
    network: NetworkStatus | None = Field(
        None, description="from where the run's TF ports can be reached (local: its own network namespace)"
    )
    degraded: list[DegradedStatus] = Field(
        default_factory=list,
        description="what of the run works less well than asked and goes on so (a fallback), with its "
        "fix; each also an event of kind `degraded` when it began",
    )
    urls: dict[str, str] | None = Field(
        None,
        description="while the run lives: `page` (its web page, with the token) and `metrics` "
        "(Prometheus; send `Authorization: Bearer TOKEN`)",
    )
    coordinator: CoordinatorStatus | None = Field(None, description="added by `orchestrate status --json`")
    stale: bool | None = Field(
        None,
        description="added by `orchestrate status --json`: true when the run has not ended but its "
        "coordinator is gone (this is its last recorded state)",
    )


class Event(BaseModel):
    """One events.jsonl line: a transition of the run or a task, or a note (a port moved, results
    brought home, a task restarted alone, an exit that could not be confirmed)."""

    model_config = ConfigDict(extra="allow")
    schema_version: Literal[1]
    time: str = Field(description="UTC, e.g. 2026-12-01T12:00:00.123Z")
    kind: str = Field(
        description="run · task · task_restart · recovery (a restart's timeline: `phases_s`) · standby · "
        "stacks (a hung job's, read before its stop: where each task was; `seconds`: how long; the "
        "documents in stacks/attempt-N/) · environment (its making, per host) · warning · unconfirmed · "
        "port · results · resume · state · error · degraded (a fallback: `what`, `where`; status.json's "
        "`degraded` lists those that last)"
    )
    reason: str = ""
    attempt: int | None = None
    task: str | None = Field(None, description="the task, for task events")
    old: str | None = Field(None, description="the state before, for run and task events")
    new: str | None = Field(None, description="the state after, for run and task events")


class Metrics(BaseModel):
    """One metrics.jsonl line: a progress point a task reported, with every value it carried."""

    model_config = ConfigDict(extra="allow")
    schema_version: Literal[1]
    time: str
    task: str
    attempt: int
    step: int | None = None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        schema = cls.model_json_schema()
        schema["additionalProperties"] = {
            "anyOf": [{"type": "number"}, {"enum": _NONFINITE, "type": "string"}],
            "description": 'a reported metric: a number; NaN and ±inf as "NaN", "Infinity", "-Infinity"',
        }
        return schema


SCHEMAS: dict[str, type[BaseModel]] = {"status": Status, "event": Event, "metrics": Metrics}


def json_schema(name: str) -> dict[str, Any]:
    model = SCHEMAS[name]
    if model is Metrics:
        return Metrics.describe()
    return model.model_json_schema()
