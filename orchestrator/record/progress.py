"""Record room, as people read it: what a run's status says, in words — ages, durations and values as people
read them, the training's progress and ETA, and the events a person must not miss. The console
views (view.py), `orchestrate status`, the summary and the run's page all say it this way.
"""

from __future__ import annotations

import collections
import datetime as dt
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.wire import number

#: Roles whose step count is training progress (a ps has none, an evaluator's is its own).
TRAINING_ROLES = ("chief", "worker")
#: Events kept on screen.
EVENTS_SHOWN = 5


# --- numbers as people read them -------------------------------------------------------------


def age_text(seconds: float | None) -> str:
    """`4 s`, `3 min`, `2 h`, `5 d` (an age or a heartbeat's)."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{max(0, int(seconds))} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} d"


def duration_text(seconds: float | None) -> str:
    """`0:42`, `12:05`, `1:02:03`."""
    if seconds is None:
        return ""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def value_text(v: Any) -> str:
    """A reported value as the views show it: `0.1234`, `NaN`, `inf`, `-inf` (a document's
    "NaN"/"Infinity"/"-Infinity" too); blank for anything else."""
    x = number(v)
    if x is None:
        return ""
    return "NaN" if math.isnan(x) else f"{x:.4g}"


def parse_time(iso: str | None) -> float | None:
    """status.json's `2026-12-01T12:00:00.123Z` as seconds since the epoch."""
    if not iso:
        return None
    try:
        return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def elapsed_s(status: Mapping[str, Any], now: float | None = None) -> float | None:
    """How long the run took (or has taken so far)."""
    start = parse_time(status.get("started_at"))
    end = parse_time(status.get("ended_at")) or (time.time() if now is None else now)
    return None if start is None else max(0.0, end - start)


# --- the run's progress, from status.json ----------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Where the training stands: what the bar, the plain progress line and the summary say."""

    step: int | None = None
    total: int | None = None
    steps_per_s: float | None = None
    examples_per_s: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)  # the leading training task's
    eval_metrics: Mapping[str, float] = field(default_factory=dict)  # the evaluator's
    oldest_heartbeat_s: float | None = None  # of the live tasks: the longest silence

    @property
    def eta_s(self) -> float | None:
        if self.step is None or not self.total or not self.steps_per_s or self.steps_per_s <= 0:
            return None
        return max(0, self.total - self.step) / self.steps_per_s

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.total:
            return None
        return min(1.0, self.step / self.total)

    def parts(self, ended: bool = False, width: int | None = None, tail: Sequence[str] = ()) -> list[str]:
        """`step 120/400 (30%)`, `ETA 0:42`, `12.3 steps/s`, `790 examples/s`, the metrics, then
        `tail` (`ended`: the step and the metrics only). Within `width` columns joined by ` · `:
        what fits, most useful first (the step, the rate, the loss, the ETA, `tail`, the rest), the
        metrics left out counted (`+60 more metrics`)."""
        out: list[tuple[int, str]] = []  # (priority: lower kept first, text), in the order shown
        if self.step is not None:
            out.append(
                (
                    0,
                    f"step {self.step}/{self.total} ({self.fraction:.0%})"
                    if self.total
                    else f"step {self.step}",
                )
            )
        if self.eta_s is not None and not ended:
            out.append((4, f"ETA {duration_text(self.eta_s)}"))
        if self.steps_per_s is not None and not ended:
            out.append((2, f"{self.steps_per_s:.3g} steps/s"))
        if self.examples_per_s is not None and not ended:
            out.append((6, f"{self.examples_per_s:,.0f} examples/s"))
        metrics = [f"{k} {value_text(v)}" for k, v in {**self.metrics, **self.eval_metrics}.items()]
        first = len(out)
        out += [(3 if i == 0 else 7 + i, m) for i, m in enumerate(metrics)]
        out += [(5, t) for t in tail]
        if width is None:
            return [text for _, text in out]
        kept: set[int] = set()
        for i in sorted(range(len(out)), key=lambda i: out[i][0]):
            trial = kept | {i}
            if not kept or len(" · ".join(_shown(out, trial, first, len(metrics)))) <= width:
                kept = trial
        return _shown(out, kept, first, len(metrics))


def _shown(out: list[tuple[int, str]], kept: set[int], first: int, metrics: int) -> list[str]:
    """The parts kept, in order, and how many metrics were left out after the metrics shown."""
    left = metrics - sum(1 for i in kept if first <= i < first + metrics)
    shown = [text for i, (_, text) in enumerate(out) if i in kept and i < first + metrics]
    more = [f"+{left} more metric{'s' if left > 1 else ''}"] if left else []
    return shown + more + [text for i, (_, text) in enumerate(out) if i in kept and i >= first + metrics]


def progress_of(status: Mapping[str, Any], now: float | None = None) -> Progress:
    now = time.time() if now is None else now
    tasks = status.get("tasks", [])
    training = [t for t in tasks if t.get("role") in TRAINING_ROLES and t.get("last_step") is not None]
    # the chief leads when there is one (it alone reports under ParameterServerStrategy); else the
    # furthest worker
    lead = max(training, key=lambda t: (t["role"] == "chief", t["last_step"]), default=None)
    evaluators = [t for t in tasks if t.get("role") == "evaluator" and t.get("metrics")]
    ages = [
        now - at
        for t in tasks
        if t.get("state") in ("STARTING", "RUNNING") and (at := parse_time(t.get("last_heartbeat_at")))
    ]
    if lead is None:
        return Progress(
            eval_metrics=dict(evaluators[0]["metrics"]) if evaluators else {},
            oldest_heartbeat_s=max(ages) if ages else None,
        )
    rate = lead.get("steps_per_s")
    per_step = lead.get("examples_per_step") or status.get("examples_per_step")
    total = max((t.get("total_steps") or 0 for t in training), default=0) or None
    return Progress(
        step=lead["last_step"],
        total=total,
        steps_per_s=rate,
        examples_per_s=rate * per_step if rate is not None and per_step else None,
        metrics=dict(lead.get("metrics") or {}),
        eval_metrics=dict(evaluators[0]["metrics"]) if evaluators else {},
        oldest_heartbeat_s=max(ages) if ages else None,
    )


# --- events worth keeping on screen ----------------------------------------------------------

_NOTABLE_RUN = frozenset({"STOPPING", "RESTARTING", "FAILED", "INTERRUPTED", "SUCCEEDED"})
_NOTABLE_TASK = frozenset({"FAILED", "LOST"})
_NOTABLE_KINDS = frozenset(
    {
        "task_restart",
        "warning",
        "unconfirmed",
        "port",
        "results",
        "resume",
        "error",
        "environment",
        "degraded",
    }
)


def notable(event: Mapping[str, Any]) -> bool:
    """A transition a person must not miss (a failure, a restart and its cause, the end) or a note."""
    kind = event.get("kind")
    if kind == "run":
        return event.get("new") in _NOTABLE_RUN
    if kind == "task":
        return event.get("new") in _NOTABLE_TASK
    return kind in _NOTABLE_KINDS


def event_text(event: Mapping[str, Any], with_time: bool = True) -> str:
    """One line: `12:01:03 worker-1 FAILED: was killed by SIGKILL` (the reason's first line; the
    time is UTC, as in events.jsonl)."""
    when = str(event.get("time", ""))[11:19] + " " if with_time else ""
    reason = str(event.get("reason", "")).strip().splitlines()
    first = reason[0] if reason else ""
    kind = event.get("kind")
    if kind in ("run", "task"):
        who = f"{event.get('task')} " if kind == "task" else ""
        return f"{when}{who}{event.get('new')}: {first}"
    if kind == "task_restart":
        return f"{when}{event.get('task')} restarting alone: {first}"
    return f"{when}{first}"


def notices(status: Mapping[str, Any]) -> list[str]:
    """What of the run works less well than asked, kept in sight while it lasts (the live view,
    the page, `orchestrate status`, the summary): each of status.json's `degraded` with its fix,
    and the metric names the tasks dropped, in one line with the count so far."""
    out = []
    for d in status.get("degraded") or []:
        fix = f" (hint: {d.get('fix')})" if d.get("fix") else ""
        out.append(f"degraded: {d.get('said')}{fix}")
    dropping = [t for t in status.get("tasks") or [] if t.get("metrics_dropped")]
    if dropping:
        task = max(dropping, key=lambda t: int(t["metrics_dropped"].get("count") or 0))
        others = len(dropping) - 1
        more = f" (and {others} other task{'s' if others > 1 else ''})" if others else ""
        out.append(dropped_text(task) + more)
    return out


def dropped_text(task: Mapping[str, Any]) -> str:
    """`worker-0: 64 of 3,000 metric names kept, the rest dropped: first dropped `loss_64` (over 64
    metric names)` — a task's status row whose `metrics_dropped` is set."""
    dropped = task["metrics_dropped"]
    kept, count = len(task.get("metrics") or {}), int(dropped.get("count") or 0)
    why = f" ({dropped['why']})" if dropped.get("why") else ""
    return (
        f"{task.get('task')}: {kept:,} of {kept + count:,} metric names kept, the rest dropped: first "
        f"dropped `{dropped.get('first')}`{why}"
    )


def recent_events(events: Iterable[Mapping[str, Any]], count: int = EVENTS_SHOWN) -> list[str]:
    return [event_text(e) for e in collections.deque((e for e in events if notable(e)), maxlen=count)]


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
