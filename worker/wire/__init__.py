"""The wire room, and its contract between a task and its coordinator: environment names, the
heartbeat format, its HTTP paths, headers and statuses, and the exit codes a task stops with.

The room holds what both sides of a process boundary read the same way: this contract, what a job
may report as text and JSON (values.py), a task's error file (failure.py), how a task dials its
coordinator (dial.py) and the small HTTP/1.1 server side heartbeats travel over (http1.py).
Both packages import it, so it stays light: the standard library only, no TensorFlow, nothing
else of worker/ or orchestrator/. The files that run alone on a host (host/shim.py,
host/relay.py, http1.py) keep copies of some values, which tests/unit/test_wire.py keeps equal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from worker.wire.values import NONFINITE as NONFINITE
from worker.wire.values import UNSAFE
from worker.wire.values import dumps as dumps
from worker.wire.values import loads as loads
from worker.wire.values import number as number
from worker.wire.values import safe_text as safe_text
from worker.wire.values import strict as strict

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
#: What may change from one attempt of a task to the next (ports, the attempt, its credential,
#: where it reports: a host's relay or tunnel may be new): a warm standby's task gets these with
#: its handover (TensorFlow reads none of them at import; docs/architecture.md §7).
PER_ATTEMPT_ENV = ("TF_CONFIG", ENV_ATTEMPT, ENV_TOKEN, ENV_COORDINATOR)

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

#: ORCHESTRATE_COORDINATOR "unix:PATH": heartbeats go to the Unix socket at PATH (local tasks in a
#: network namespace of their own); otherwise an http:// URL.
UNIX_SCHEME = "unix:"
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
#: The job's own checkpoint folders a task tells (worker/task/checkpoints.py), and a path's length.
MAX_FOLDERS = 16
MAX_PATH_CHARS = 4096
#: Names a point may not use: the coordinator writes them on every metrics.jsonl line.
RESERVED_POINT_KEYS = frozenset({"task", "attempt", "schema_version"})

#: A task's exit code when it stopped itself: its coordinator was unreachable for
#: ORCHESTRATE_COORDINATOR_TIMEOUT_S, or answered that its attempt is over.
EXIT_NO_COORDINATOR = 75
#: A task's exit code after it saved a checkpoint on a stop or preemption (TensorFlow's convention):
#: the coordinator restarts it without counting against the restart budget.
EXIT_PREEMPTED = 42
#: A warm standby's exit code when it cannot import TensorFlow (its log says why).
EXIT_STANDBY_FAILED = 76
#: A warm standby's line on stderr once TensorFlow is imported (then the seconds it took).
STANDBY_READY = "orchestrate-standby: ready"
#: A warm standby's line on stderr, before its ready line, where its host's spares cannot copy
#: their pages ahead of a handover (then why: worker/host/probe.py `page_copy`).
STANDBY_NO_PAGE_COPY = "orchestrate-standby: no page copy:"


@dataclass(frozen=True)
class TaskError:
    """An exception raised by the user's code, shown by the coordinator as the root cause."""

    type: str
    message: str
    traceback: str


#: A Restored's fingerprint when the task restored nothing (mode 1: no checkpoint before its first step).
RESTORED_NOTHING = "nothing"


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
    # False: said as the job restored (or found nothing to), before its first step; it may restore
    # again. True: where its first step starts from, the one compared (worker/task/checkpoints.py)
    final: bool = True


@dataclass(frozen=True)
class Dropped:
    """The metric names a task's reporter dropped so far (worker/task/metrics.py): how many
    distinct names, the first and why (over MAX_METRICS names, too long, one of ours)."""

    count: int
    first: str
    why: str


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
    restored: Restored | None = None  # where the task started this attempt from, once restored
    #: The folders the job writes its own checkpoints to (path: what writes there), mode 1.
    folders: dict[str, str] = field(default_factory=dict)
    #: The number of points this process reported before `points[0]`: a heartbeat sent again
    #: (its answer was lost) carries points the coordinator has, which it then skips.
    points_from: int = 0
    dropped: Dropped | None = None  # the metric names dropped so far, once one was

    def to_bytes(self) -> bytes:
        return dumps(asdict(self), separators=(",", ":")).encode()

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
        task, attempt, seq, sent_at, pid, rss, cpu, step, total, connecting, ready, done = _typed(
            raw, _SCALARS
        )
        metrics, points, error, frame, restored, points_from, busy, per_step, folders, dropped = _typed(
            raw, _PARTS
        )
        if len(task) > MAX_NAME_CHARS:
            raise ValueError("heartbeat field 'task' is too long")
        if len(metrics) > MAX_METRICS or len(points) > MAX_POINTS:
            raise ValueError(f"a heartbeat carries at most {MAX_METRICS} metrics and {MAX_POINTS} points")
        for name, value in metrics.items():
            if len(name) > MAX_NAME_CHARS or (type(value) not in _NUMBER and number(value) is None):
                short = safe_text(name[:MAX_NAME_CHARS])
                raise ValueError(f"metric {short!r}: a name of at most {MAX_NAME_CHARS} characters, a number")
        points = [_point(point) for point in points]
        try:
            return cls(
                task=task,
                attempt=attempt,
                seq=seq,
                sent_at=float(sent_at),
                pid=pid,
                rss_bytes=_bounded(rss),
                cpu_percent=float(cpu),
                connecting=connecting,
                ready=ready,
                step=_bounded(step),
                total_steps=_bounded(total),
                examples_per_step=_bounded(per_step),
                metrics={safe_text(k): number(v) for k, v in metrics.items()} if metrics else {},  # type: ignore[misc]
                points=points,
                done=done,
                user_frame=safe_text(frame[:MAX_FRAME_CHARS]) if frame else frame,
                busy=safe_text(busy[:MAX_NAME_CHARS]) if busy else None,
                error=_error(error) if error else None,
                restored=_restored(restored) if restored is not None else None,
                points_from=points_from,
                folders=_folders(folders),
                dropped=_dropped(dropped) if dropped is not None else None,
            )
        except (TypeError, KeyError, ValueError, OverflowError) as exc:  # an int too large for a float
            raise ValueError(f"malformed heartbeat: {exc}") from None


_INT64 = 2**63 - 1


def _bounded(value: int | None) -> Any:
    """A count as a 64-bit integer at most (what every reader of a document can hold)."""
    return value if value is None or -_INT64 <= value <= _INT64 else (_INT64 if value > 0 else -_INT64)


def _point(point: Any) -> dict[str, Any]:
    """A progress point: numbers by name (`time`, `step`, the reported values), a line of
    metrics.jsonl. The coordinator adds `task` and `attempt`: a point may not name them. Returned
    with its names as `safe_text` shows them and its values as `_taken` keeps them (the same dict
    when it needs neither: this runs for every point of every task)."""
    if type(point) is not dict or len(point) > MAX_METRICS + 2:
        raise ValueError(f"a point is a JSON object of at most {MAX_METRICS + 2} numbers")
    clean = True
    for name, value in point.items():
        if len(name) > MAX_NAME_CHARS or name in RESERVED_POINT_KEYS:
            raise ValueError(f"point value {safe_text(name[:MAX_NAME_CHARS])!r}: its name short and ours")
        if type(value) not in _NUMBER:
            if number(value) is None:
                raise ValueError(f"point value {safe_text(name)!r}: a number")
            clean = False
        elif clean and (UNSAFE.search(name) or type(value) is int and not -_INT64 <= value <= _INT64):
            clean = False
    if clean:
        return point
    return {safe_text(k): _taken(k, v) for k, v in point.items()}


def _taken(name: str, value: Any) -> Any:
    """A point's value as the record keeps it: NaN and ±inf's strings as floats, an integer past
    64 bits as ±inf (the step as the largest 64-bit count)."""
    if type(value) is int and not -_INT64 <= value <= _INT64:
        return _bounded(value) if name == "step" else number(value)
    return value if type(value) in _NUMBER else NONFINITE[value]


def _error(raw: dict[str, Any]) -> TaskError:
    # the task's own exception, shown in the summary: cut to size rather than refused
    return TaskError(
        type=safe_text(str(raw["type"])[:MAX_NAME_CHARS]),
        message=safe_text(str(raw["message"])[:MAX_MESSAGE_CHARS], lines=True),
        traceback=safe_text(str(raw["traceback"])[-MAX_TRACEBACK_CHARS:], lines=True),
    )


def _folders(raw: dict[str, Any]) -> dict[str, str]:
    """{absolute path: what writes there}: at most MAX_FOLDERS, short texts."""
    if len(raw) > MAX_FOLDERS or any(
        type(by) is not str or len(by) > MAX_NAME_CHARS or len(p) > MAX_PATH_CHARS or not p.startswith("/")
        for p, by in raw.items()
    ):
        raise ValueError(f"folders: at most {MAX_FOLDERS} absolute paths, each with a short text")
    return {safe_text(p): safe_text(by) for p, by in raw.items()}


def _dropped(raw: dict[str, Any]) -> Dropped:
    count, first, why = raw["count"], raw["first"], raw["why"]
    if type(count) is not int or not 0 < count <= _INT64 or type(first) is not str or type(why) is not str:
        raise ValueError("dropped: a positive count, the first name and why")
    return Dropped(count, safe_text(first[:MAX_NAME_CHARS]), safe_text(why[:MAX_NAME_CHARS]))


def _restored(raw: dict[str, Any]) -> Restored:
    step, fingerprint, source = raw["step"], raw["fingerprint"], raw.get("source")
    epoch, in_epoch, final = raw.get("epoch", 0), raw.get("step_in_epoch", 0), raw.get("final", True)
    if type(step) is not int or type(epoch) is not int or type(in_epoch) is not int:
        raise ValueError("restored: step, epoch and step_in_epoch must be integers")
    if type(final) is not bool:
        raise ValueError("restored: final must be true or false")
    if type(fingerprint) is not str or len(fingerprint) > 128 or type(source) not in _STR_OR_NONE:
        raise ValueError("restored: fingerprint must be a short string, source a string or null")
    if source is not None and len(source) > MAX_PATH_CHARS:
        raise ValueError(f"restored: a source of at most {MAX_PATH_CHARS} characters")
    source = safe_text(source) if source else source
    return Restored(step, safe_text(fingerprint), source, epoch, in_epoch, final)


# exact types (a JSON true/false is a bool, which isinstance would take for an int)
_STR, _INT, _BOOL, _DICT, _LIST = (str,), (int,), (bool,), (dict,), (list,)
_NUMBER = (int, float)
_INT_OR_NONE, _STR_OR_NONE, _DICT_OR_NONE = (int, type(None)), (str, type(None)), (dict, type(None))
_MISSING = object()
#: A heartbeat's fields: name, the types allowed, the value when absent (_MISSING: required).
_SCALARS: tuple[tuple[str, tuple[type, ...], Any], ...] = (
    ("task", _STR, _MISSING),
    ("attempt", _INT, _MISSING),
    ("seq", _INT, _MISSING),
    ("sent_at", _NUMBER, _MISSING),
    ("pid", _INT, _MISSING),
    ("rss_bytes", _INT, 0),
    ("cpu_percent", _NUMBER, 0.0),
    ("step", _INT_OR_NONE, None),
    ("total_steps", _INT_OR_NONE, None),
    ("connecting", _BOOL, False),
    ("ready", _BOOL, False),
    ("done", _BOOL, False),
)
_PARTS: tuple[tuple[str, tuple[type, ...], Any], ...] = (
    ("metrics", _DICT, {}),
    ("points", _LIST, []),
    ("error", _DICT_OR_NONE, None),
    ("user_frame", _STR_OR_NONE, None),
    ("restored", _DICT_OR_NONE, None),
    ("points_from", _INT, 0),
    ("busy", _STR_OR_NONE, None),
    ("examples_per_step", _INT_OR_NONE, None),
    ("folders", _DICT, {}),
    ("dropped", _DICT_OR_NONE, None),
)


def _typed(raw: dict[str, Any], fields: tuple[tuple[str, tuple[type, ...], Any], ...]) -> list[Any]:
    """The values of `fields` in `raw`, each of an allowed type (exact: a bool is no int here);
    ValueError naming the first that is missing or of the wrong type. A null metrics or points
    is taken for empty."""
    out = []
    for key, allowed, default in fields:
        value = raw.get(key, default)
        if value is _MISSING:
            raise ValueError(f"heartbeat lacks {key!r}")
        if value is None and key in ("metrics", "points"):
            value = default
        if type(value) not in allowed:
            raise ValueError(f"heartbeat field {key!r} has the wrong type")
        out.append(value)
    return out
