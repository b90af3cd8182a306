"""The wire contract between a task and its coordinator: environment names, the heartbeat format,
its HTTP paths, headers and statuses, and the exit codes a task stops with.

Both packages import this module, so it must stay light: stdlib only, no TensorFlow. The files that
run alone on a host (shim.py, relay.py, http1.py) keep copies of some values, which
tests/unit/test_wire.py keeps equal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

ENV_RUN_ID = "ORCHESTRATE_RUN_ID"
ENV_RUN_DIR = "ORCHESTRATE_RUN_DIR"
ENV_TASK = "ORCHESTRATE_TASK"
ENV_ATTEMPT = "ORCHESTRATE_ATTEMPT"
ENV_COORDINATOR = "ORCHESTRATE_COORDINATOR"
ENV_TOKEN = "ORCHESTRATE_TOKEN"
ENV_HEARTBEAT_INTERVAL_S = "ORCHESTRATE_HEARTBEAT_INTERVAL_S"
#: A folder on the task's own host that the orchestrator keeps consistent across hosts and
#: attempts (the chief's latest state is copied to the other hosts before a restart): mode-1
#: checkpoints (BackupAndRestore, CheckpointManager) go there; the built-in loop uses it too.
ENV_CHECKPOINT_DIR = "ORCHESTRATE_CHECKPOINT_DIR"
ENV_COORDINATOR_TIMEOUT_S = "ORCHESTRATE_COORDINATOR_TIMEOUT_S"
#: TensorFlow's own coordination service: peer heartbeat and cluster registration timeouts.
ENV_TF_HEARTBEAT_TIMEOUT_S = "ORCHESTRATE_TF_HEARTBEAT_TIMEOUT_S"
ENV_TF_REGISTER_TIMEOUT_S = "ORCHESTRATE_TF_REGISTER_TIMEOUT_S"

#: Set by the orchestrator for every task; a spec may not set them.
RESERVED_ENV = (
    "TF_CONFIG",
    ENV_RUN_ID,
    ENV_RUN_DIR,
    ENV_TASK,
    ENV_ATTEMPT,
    ENV_COORDINATOR,
    ENV_TOKEN,
    ENV_HEARTBEAT_INTERVAL_S,
    ENV_CHECKPOINT_DIR,
    ENV_COORDINATOR_TIMEOUT_S,
    ENV_TF_HEARTBEAT_TIMEOUT_S,
    ENV_TF_REGISTER_TIMEOUT_S,
)

HEARTBEAT_PATH = "/v1/heartbeat"
#: A host's relay posts its tasks' heartbeats here as one JSON list; the answer lists their statuses.
BATCH_PATH = "/v1/heartbeats"
TOKEN_HEADER = "X-Orchestrate-Token"
#: Set ("1") on a heartbeat that changes the task's phase: a relay forwards it at once.
FLUSH_HEADER = "X-Orchestrate-Flush"
#: A relay's answer: seconds until the task should post its next heartbeat.
POST_IN_HEADER = "X-Orchestrate-Post-In"
#: The heartbeat endpoint's answers (the coordinator's, or a relay's on its behalf). Only OK_STATUS
#: means the heartbeat was taken.
OK_STATUS = 200
BAD_REQUEST_STATUS = 400  # not a heartbeat
BAD_TOKEN_STATUS = 401
FORBIDDEN_STATUS = 403  # a credential speaking for another task (or host) than its own
NOT_FOUND_STATUS = 404  # an unknown path, or a task the coordinator's attempt does not hold
#: A heartbeat from another process than the one that first spoke for the task this attempt.
CONFLICT_STATUS = 409
#: The coordinator answers a heartbeat of an attempt it has already left behind with this status,
#: telling the task to exit.
STALE_ATTEMPT_STATUS = 410

#: The largest heartbeat a task may post, and the largest batch a relay may (its tasks' heartbeats).
MAX_HEARTBEAT_BYTES = 1024 * 1024
MAX_BATCH_BYTES = 8 * 1024 * 1024
#: What one heartbeat may carry. A task has at most MAX_METRICS metric names in all (more are
#: dropped, said once); a point is a line of metrics.jsonl.
MAX_NAME_CHARS = 100
MAX_METRICS = 64
MAX_POINTS = 1000
MAX_FRAME_CHARS = 500
MAX_MESSAGE_CHARS = 16 * 1024
MAX_TRACEBACK_CHARS = 64 * 1024
#: Names a point may not use: the coordinator writes them on every metrics.jsonl line.
RESERVED_POINT_KEYS = frozenset({"task", "attempt", "schema_version"})

#: A task's exit code when it stopped itself: its coordinator was unreachable for
#: ORCHESTRATE_COORDINATOR_TIMEOUT_S, or answered that its attempt is over.
EXIT_NO_COORDINATOR = 75
#: A task's exit code after it saved a checkpoint on a stop or preemption (TensorFlow's convention):
#: the coordinator restarts it without counting against the restart budget.
EXIT_PREEMPTED = 42


@dataclass(frozen=True)
class TaskError:
    """An exception raised by the user's code, shown by the coordinator as the root cause."""

    type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Restored:
    """Where a training task starts an attempt from: the position it restored (0 and no source
    when it found no checkpoint) and a fingerprint of its state (SHA-256 of every checkpointed
    variable, in order). Tasks of one synchronous job must agree, or they train different models."""

    step: int
    fingerprint: str
    source: str | None = None  # the checkpoint restored (a path on the task's host)
    epoch: int = 0
    step_in_epoch: int = 0


@dataclass(frozen=True)
class Heartbeat:
    """One report from a task: liveness, resources, progress since the last one, and its phase.

        `points` carries every progress point reported since the previous heartbeat (batched, so a
        training step never waits on the network). `connecting` becomes true when the task starts creating
    its distribution strategy (it waits there for its peers); `ready` becomes true once the task's
    distribution
        strategy is up (its cluster connected) or it reported a step. `done` is sent once, when the
        user's program returned normally; `error` when it raised.
    """

    task: str
    attempt: int
    seq: int
    sent_at: float  # the task's wall clock, seconds since the epoch
    pid: int
    rss_bytes: int = 0
    cpu_percent: float = 0.0
    connecting: bool = False
    ready: bool = False
    step: int | None = None
    total_steps: int | None = None
    examples_per_step: int | None = None  # the global batch, when the job said (examples/s)
    metrics: dict[str, float] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    error: TaskError | None = None
    user_frame: str | None = None  # where a thread is executing the job's own code ("train.py:23 in wait")
    #: What the task does between training steps — validating, saving, … (None: training). Not
    #: a stall, however long: its step stands still for a reason.
    busy: str | None = None
    restored: Restored | None = None  # the built-in loop's starting point, once restored
    #: The number of points this process reported before `points[0]`: a heartbeat sent again
    #: (its answer was lost) carries points the coordinator has, which it then skips.
    points_from: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, body: bytes) -> Heartbeat:
        """Parse and check a heartbeat; raises ValueError on anything malformed."""
        return cls.from_dict(loads(body))

    @classmethod
    def from_dict(cls, raw: Any) -> Heartbeat:
        """Check a parsed heartbeat; raises ValueError on anything malformed. On the coordinator's
        hot path (every task, every second), hence plain checks of exact types rather than a
        schema library."""
        if type(raw) is not dict:
            raise ValueError("heartbeat must be a JSON object")
        for key in _REQUIRED:
            if key not in raw:
                raise ValueError(f"heartbeat lacks {key!r}")
        get = raw.get
        task, attempt, seq, sent_at, pid = raw["task"], raw["attempt"], raw["seq"], raw["sent_at"], raw["pid"]
        rss, cpu, step, total = get("rss_bytes", 0), get("cpu_percent", 0.0), get("step"), get("total_steps")
        connecting, ready, done = get("connecting", False), get("ready", False), get("done", False)
        metrics, points, error, frame, restored, points_from = (
            get("metrics") or {},
            get("points") or [],
            get("error"),
            get("user_frame"),
            get("restored"),
            get("points_from", 0),
        )
        busy, per_step = get("busy"), get("examples_per_step")
        for key, value, allowed in (
            ("task", task, _STR),
            ("attempt", attempt, _INT),
            ("seq", seq, _INT),
            ("sent_at", sent_at, _NUMBER),
            ("pid", pid, _INT),
            ("rss_bytes", rss, _INT),
            ("cpu_percent", cpu, _NUMBER),
            ("step", step, _INT_OR_NONE),
            ("total_steps", total, _INT_OR_NONE),
            ("connecting", connecting, _BOOL),
            ("ready", ready, _BOOL),
            ("done", done, _BOOL),
            ("metrics", metrics, _DICT),
            ("points", points, _LIST),
            ("error", error, _DICT_OR_NONE),
            ("user_frame", frame, _STR_OR_NONE),
            ("restored", restored, _DICT_OR_NONE),
            ("points_from", points_from, _INT),
            ("busy", busy, _STR_OR_NONE),
            ("examples_per_step", per_step, _INT_OR_NONE),
        ):
            if type(value) not in allowed:
                raise ValueError(f"heartbeat field {key!r} has the wrong type")
        if len(task) > MAX_NAME_CHARS:
            raise ValueError("heartbeat field 'task' is too long")
        if len(metrics) > MAX_METRICS or len(points) > MAX_POINTS:
            raise ValueError(f"a heartbeat carries at most {MAX_METRICS} metrics and {MAX_POINTS} points")
        for name, value in metrics.items():
            if len(name) > MAX_NAME_CHARS or type(value) not in _NUMBER:
                short = name[:MAX_NAME_CHARS]
                raise ValueError(f"metric {short!r}: a name of at most {MAX_NAME_CHARS} characters, a number")
        for point in points:
            _check_point(point)
        try:
            return cls(
                task=task,
                attempt=attempt,
                seq=seq,
                sent_at=float(sent_at),
                pid=pid,
                rss_bytes=rss,
                cpu_percent=float(cpu),
                connecting=connecting,
                ready=ready,
                step=step,
                total_steps=total,
                examples_per_step=per_step,
                metrics={k: float(v) for k, v in metrics.items()} if metrics else {},
                points=points,
                done=done,
                user_frame=frame[:MAX_FRAME_CHARS] if frame else frame,
                busy=busy[:MAX_NAME_CHARS] if busy else None,
                error=_error(error) if error else None,
                restored=_restored(restored) if restored is not None else None,
                points_from=points_from,
            )
        except (TypeError, KeyError, ValueError, OverflowError) as exc:  # an int too large for a float
            raise ValueError(f"malformed heartbeat: {exc}") from None


def _check_point(point: Any) -> None:
    """A progress point: numbers by name (`time`, `step`, the reported values), a line of
    metrics.jsonl. The coordinator adds `task` and `attempt`: a point may not name them."""
    if type(point) is not dict or len(point) > MAX_METRICS + 2:
        raise ValueError(f"a point is a JSON object of at most {MAX_METRICS + 2} numbers")
    for name, value in point.items():
        if type(value) not in _NUMBER or len(name) > MAX_NAME_CHARS or name in RESERVED_POINT_KEYS:
            raise ValueError(f"point value {name[:MAX_NAME_CHARS]!r}: a number, its name short and ours")


def _error(raw: dict[str, Any]) -> TaskError:
    # the task's own exception, shown in the summary: cut to size rather than refused
    return TaskError(
        type=str(raw["type"])[:MAX_NAME_CHARS],
        message=str(raw["message"])[:MAX_MESSAGE_CHARS],
        traceback=str(raw["traceback"])[-MAX_TRACEBACK_CHARS:],
    )


def _restored(raw: dict[str, Any]) -> Restored:
    step, fingerprint, source = raw["step"], raw["fingerprint"], raw.get("source")
    epoch, in_epoch = raw.get("epoch", 0), raw.get("step_in_epoch", 0)
    if type(step) is not int or type(epoch) is not int or type(in_epoch) is not int:
        raise ValueError("restored: step, epoch and step_in_epoch must be integers")
    if type(fingerprint) is not str or len(fingerprint) > 128 or type(source) not in _STR_OR_NONE:
        raise ValueError("restored: fingerprint must be a short string, source a string or null")
    return Restored(step, fingerprint, source, epoch, in_epoch)


def loads(body: bytes) -> Any:
    """JSON from a request body; ValueError when it is not (or nests too deep to parse)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("not JSON we read: nested too deep") from None


_REQUIRED = ("task", "attempt", "seq", "sent_at", "pid")
# exact types (a JSON true/false is a bool, which isinstance would take for an int)
_STR, _INT, _BOOL, _DICT, _LIST = (str,), (int,), (bool,), (dict,), (list,)
_NUMBER = (int, float)
_INT_OR_NONE, _STR_OR_NONE, _DICT_OR_NONE = (int, type(None)), (str, type(None)), (dict, type(None))
