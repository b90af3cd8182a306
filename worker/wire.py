"""The wire contract between a task and its coordinator: environment names and the heartbeat format.

Both packages import this module (and only this one across the boundary). It must stay light:
stdlib only, no TensorFlow.
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
    ENV_COORDINATOR_TIMEOUT_S,
    ENV_TF_HEARTBEAT_TIMEOUT_S,
    ENV_TF_REGISTER_TIMEOUT_S,
)

HEARTBEAT_PATH = "/v1/heartbeat"
TOKEN_HEADER = "X-Orchestrate-Token"
#: The coordinator answers a heartbeat of an attempt it has already left behind with this status,
#: telling the task to exit.
STALE_ATTEMPT_STATUS = 410

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class TaskError:
    """An exception raised by the user's code, shown by the coordinator as the root cause."""

    type: str
    message: str
    traceback: str


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
    metrics: dict[str, float] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    error: TaskError | None = None
    user_frame: str | None = None  # where a thread is executing the job's own code ("train.py:23 in wait")

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, body: bytes) -> Heartbeat:
        """Parse and check a heartbeat; raises ValueError on anything malformed."""
        try:
            raw = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("heartbeat must be a JSON object")
        try:
            error = raw.get("error")
            hb = cls(
                task=_typed(raw, "task", str),
                attempt=_typed(raw, "attempt", int),
                seq=_typed(raw, "seq", int),
                sent_at=float(_typed(raw, "sent_at", (int, float))),
                pid=_typed(raw, "pid", int),
                rss_bytes=_typed(raw, "rss_bytes", int, 0),
                cpu_percent=float(_typed(raw, "cpu_percent", (int, float), 0.0)),
                connecting=_typed(raw, "connecting", bool, False),
                ready=_typed(raw, "ready", bool, False),
                step=_typed(raw, "step", (int, type(None)), None),
                total_steps=_typed(raw, "total_steps", (int, type(None)), None),
                metrics={str(k): float(v) for k, v in _typed(raw, "metrics", dict, {}).items()},
                points=[dict(p) for p in _typed(raw, "points", list, [])],
                done=_typed(raw, "done", bool, False),
                user_frame=_typed(raw, "user_frame", (str, type(None)), None),
                error=TaskError(**{k: str(error[k]) for k in ("type", "message", "traceback")})
                if error
                else None,
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed heartbeat: {exc}") from None
        return hb


def _typed(raw: dict[str, Any], key: str, types: Any, *default: Any) -> Any:
    if key not in raw:
        if default:
            return default[0]
        raise ValueError(f"heartbeat lacks {key!r}")
    value = raw[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValueError(f"heartbeat field {key!r} has the wrong type")
    if not isinstance(value, types):
        raise ValueError(f"heartbeat field {key!r} has the wrong type")
    return value
