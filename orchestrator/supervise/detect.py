"""Supervision layer: the detectors — pure functions of the task group as polled once per
supervisor iteration and the clock. Each says what it sees (a task's new state with its reason,
and the failure when it is one); the supervisor applies it, the policy decides what to do.

- process exit (0: done; non-zero: an exception the task reported, or a plain exit/signal);
- heartbeat timeout (a frozen process, a host cut off) — not while the task waits for its peers
  inside a MultiWorkerMirroredStrategy constructor, which holds the GIL: the startup deadline
  covers that;
- stall: alive, step not advancing (the evaluator waits on the chief's checkpoints: never);
- the startup deadline, naming the task the others wait for;
- a frozen peer, when the survivors report losing one;
- a diverged start (restores.py): the training tasks of one attempt restored different states.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from orchestrator.health.store import TaskHealth
from orchestrator.states import FailureKind, TaskState
from orchestrator.supervise import restores
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.policy import Failure
from orchestrator.supervise.records import describe_exit


class TaskView(NamedTuple):
    """One live task as polled this iteration (a tuple: made for every task at every poll, it
    costs a fifth of a frozen dataclass)."""

    name: str
    state: TaskState
    in_cluster: bool  # False for the evaluator
    launched_at: float
    exit_code: int | None
    health: TaskHealth | None


@dataclass(frozen=True)
class Verdict:
    """What a detector saw of one task: its new state, why, and the failure if it is one."""

    task: str
    state: TaskState
    reason: str
    failure: Failure | None = None


#: The least silence that loses a task still starting. Its heartbeat thread needs the GIL, and
#: `import tensorflow` holds it for up to 0.7 s at a time on an idle machine, 1.0 s with both cores
#: busy (measured, TF 2.21), longer with several imports on one loaded host: a short
#: health.heartbeat_timeout_s (fine for a running task) lost starting tasks that were only slow.
#: With a cold page cache (a first run, or a host that dropped its cache) loading TensorFlow's
#: libraries held it for over 10 s: both tasks of the README's demo were taken for lost at 10 s
#: (measured twice on this machine). A task frozen while starting is still found within 30 s, and
#: the start-up deadline bounds the rest.
STARTING_SILENCE_S = 30.0


def first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line of `text`, cut at `limit` characters; `…` says there was more."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if len(first) > limit:
        return first[: limit - 1] + "…"
    return first + (" …" if len(lines) > 1 else "")


def last_heard(h: TaskHealth | None, launched_at: float) -> float:
    """When a task was last heard from: its last heartbeat, else its launch."""
    return h.last_heartbeat_at if h is not None and h.last_heartbeat_at is not None else launched_at


def check_task(task: TaskView, now: float, config: SupervisorConfig, attempt: int) -> list[Verdict]:
    """Every state change of one live task this iteration (at most: up, then failed or lost)."""
    h, me = task.health, (task.name,)
    code = task.exit_code
    if code is not None:
        if code == 0:
            return [Verdict(task.name, TaskState.SUCCEEDED, "exit code 0")]
        error = h.error if h is not None else None
        if error is not None and error.type != "SystemExit":
            # the first line only: a reason is one line in every event and status (a Keras error can
            # run to 2,000 characters); the whole message and traceback are in the error and the log
            detail, kind = f"raised {error.type}: {first_line(error.message)}", FailureKind.EXCEPTION
            if error.type.endswith("RestoreMismatch"):  # the workers compared their starts themselves
                kind = FailureKind.DIVERGED
            elif restores.collective_mismatch(error):
                detail, kind = restores.mismatch_detail(detail), FailureKind.DIVERGED
        else:
            detail, kind = describe_exit(code), FailureKind.EXIT
        step = h.step if h is not None else None
        failure = Failure(me, kind, attempt, detail, exit_code=code, error=error, step=step)
        return [Verdict(task.name, TaskState.FAILED, detail, failure)]
    out, state = [], task.state
    if state is TaskState.STARTING and h is not None and h.ready_at is not None:
        out.append(Verdict(task.name, TaskState.RUNNING, "strategy up"))
        state = TaskState.RUNNING
    silent_s = now - last_heard(h, task.launched_at)
    in_strategy = state is TaskState.STARTING and h is not None and h.connecting_at is not None
    limit = config.heartbeat_timeout_s
    if state is TaskState.STARTING:
        limit = max(limit, STARTING_SILENCE_S)
    if silent_s > limit and not in_strategy:
        configured = config.heartbeat_timeout_s
        detail = f"sent no heartbeat for {silent_s:.1f} s (health.heartbeat_timeout_s = {configured:g}"
        detail += f"; {limit:g} s while starting)" if limit != configured else ")"
        return [
            *out,
            Verdict(task.name, TaskState.LOST, detail, Failure(me, FailureKind.LOST, attempt, detail)),
        ]
    if (
        state is TaskState.RUNNING
        and task.in_cluster  # the evaluator's step is the last checkpoint's: it waits on the chief
        and h is not None
        and h.step is not None
        and h.step_changed_at is not None
        and not h.done
        and h.busy is None  # validating, saving, …: the step stands still for a reason
        and now - max(h.step_changed_at, h.busy_changed_at or 0.0) > config.stall_timeout_s
    ):
        since = now - max(h.step_changed_at, h.busy_changed_at or 0.0)
        where = f", busy in {h.user_frame}" if h.user_frame else ", waiting inside TensorFlow"
        detail = (
            f"stalled at step {h.step} for {since:.1f} s while alive{where} "
            f"(health.stall_timeout_s = {config.stall_timeout_s:g})"
        )
        failure = Failure(me, FailureKind.STALLED, attempt, detail, step=h.step, where=h.user_frame)
        return [*out, Verdict(task.name, TaskState.FAILED, detail, failure)]
    return out


def frozen_peer(
    tasks: Iterable[TaskView], now: float, config: SupervisorConfig, attempt: int
) -> Verdict | None:
    """When the survivors report losing a peer, the peer may be alive but frozen (SIGSTOP, a host
    cut off): still running, yet silent for several heartbeats. Name it, not the survivor."""
    quiet_s = max(2.5 * config.heartbeat_interval_s, 1.5)
    for task in tasks:
        h = task.health
        if task.state.is_terminal or h is None or h.last_heartbeat_at is None:
            continue
        if now - h.last_heartbeat_at > quiet_s:
            detail = f"went silent {now - h.last_heartbeat_at:.1f} s ago and its peers lost contact with it"
            failure = Failure((task.name,), FailureKind.LOST, attempt, detail)
            return Verdict(task.name, TaskState.LOST, detail, failure)
    return None


def startup_failure(late: Sequence[TaskView], config: SupervisorConfig, attempt: int) -> Failure:
    """The training tasks still starting at the deadline: a task that never began creating its
    strategy is the one the others wait for."""
    never = [t for t in late if t.health is None or t.health.connecting_at is None]
    culprits = never or list(late)
    waiting = [t.name for t in late if t not in culprits]
    head = f"not up within health.startup_timeout_s = {config.startup_timeout_s:g} s"
    if never and not waiting and all(t.health is not None and t.health.last_heartbeat_at for t in never):
        # every task runs (it reports) and none began creating a strategy: the job's code does not
        return Failure(
            tuple(t.name for t in never),
            FailureKind.NO_STRATEGY,
            attempt,
            f"{head}: running, but never created a tf.distribute strategy — create it (e.g. "
            "tf.distribute.MultiWorkerMirroredStrategy()) before training, report progress with "
            "worker.report(), or raise health.startup_timeout_s if the strategy comes later",
        )
    if never:
        waited = f"; {', '.join(waiting)} waited for it" if waiting else ""
        detail = f"{head} (never created its distribution strategy{waited})"
    else:
        detail = f"{head} (its cluster never connected)"
    return Failure(tuple(t.name for t in culprits), FailureKind.STARTUP_TIMEOUT, attempt, detail)
