"""CLI output layer: how a run looks on the console.

On a TTY, a live view: a head line (state, attempt, restarts, time), a progress bar with the
step, ETA, steps/s and examples/s, a table of the tasks (state, step, every reported metric —
the evaluator's on its own row —, heartbeat age), and the run's latest events with their causes
(a restart's cause stays on screen); the tasks' log lines scroll above it. It fits 60 columns:
columns are dropped, least useful first, when the terminal is narrow.

Otherwise plain lines, easy to grep and to pipe: `[worker-1] …` for log lines, `orchestrate: …`
for state changes and events, and a progress line every `progress_every_s`.

Everything here reads status.json's document and events.jsonl's lines, so `orchestrate status`
shows a finished or detached run the same way.
"""

from __future__ import annotations

import collections
import datetime as dt
import math
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from worker.wire import number

_STATE_STYLE = {
    "RUNNING": "green",
    "SUCCEEDED": "bold green",
    "FAILED": "bold red",
    "LOST": "bold red",
    "STOPPED": "yellow",
    "STARTING": "cyan",
    "INTERRUPTED": "yellow",
    "RESTARTING": "magenta",
    "STOPPING": "yellow",
}

#: Roles whose step count is training progress (a ps has none, an evaluator's is its own).
TRAINING_ROLES = ("chief", "worker")
#: Rows the live view shows; the rest are counted by state.
MAX_ROWS = 16
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

    def parts(self, ended: bool = False) -> list[str]:
        """`step 120/400 (30%)`, `ETA 0:42`, `12.3 steps/s`, `790 examples/s`, then the metrics
        (`ended`: the step and the metrics only)."""
        out = []
        if self.step is not None:
            if self.total:
                out.append(f"step {self.step}/{self.total} ({self.fraction:.0%})")
            else:
                out.append(f"step {self.step}")
        if self.eta_s is not None and not ended:
            out.append(f"ETA {duration_text(self.eta_s)}")
        if self.steps_per_s is not None and not ended:
            out.append(f"{self.steps_per_s:.3g} steps/s")
        if self.examples_per_s is not None and not ended:
            out.append(f"{self.examples_per_s:,.0f} examples/s")
        out += [f"{k} {value_text(v)}" for k, v in {**self.metrics, **self.eval_metrics}.items()]
        return out


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
_NOTABLE_KINDS = frozenset({"task_restart", "warning", "unconfirmed", "port", "results", "resume", "error"})


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


def recent_events(events: Iterable[Mapping[str, Any]], count: int = EVENTS_SHOWN) -> list[str]:
    return [event_text(e) for e in collections.deque((e for e in events if notable(e)), maxlen=count)]


# --- the table -------------------------------------------------------------------------------


def metric_names(tasks: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every metric some task reports, loss first, then in the order they first appear."""
    names: dict[str, None] = {}
    for t in tasks:
        for name in t.get("metrics") or {}:
            names.setdefault(name)
    return sorted(names, key=lambda n: (n != "loss", n.startswith("eval_"), list(names).index(n)))


def _columns(
    status: Mapping[str, Any], rows: list[Mapping[str, Any]], now: float
) -> list[tuple[str, list[str]]]:
    """Every column the table could show, most useful first: (header, one cell per row)."""

    def heartbeat(t: Mapping[str, Any]) -> str:
        at = parse_time(t.get("last_heartbeat_at"))
        return age_text(now - at) if at is not None and not _ended(t) else ""

    def rate(t: Mapping[str, Any]) -> str:
        ok = t.get("role") in TRAINING_ROLES and t.get("steps_per_s") is not None and not _ended(t)
        return f"{t['steps_per_s']:.3g}" if ok else ""

    cols: list[tuple[str, list[str]]] = [
        ("task", [str(t["task"]) for t in rows]),
        ("state", [_state(t) for t in rows]),
        ("step", ["" if t.get("last_step") is None else str(t["last_step"]) for t in rows]),
    ]
    for name in metric_names(rows):
        cols.append((name, [_metric(t, name) for t in rows]))
    cols += [
        ("heartbeat", [heartbeat(t) for t in rows]),
        ("steps/s", [rate(t) for t in rows]),
        ("restarts", [str(t.get("restarts") or "") for t in rows]),
        ("RSS", [f"{t['rss_bytes'] / 2**20:.0f} MiB" if t.get("rss_bytes") else "" for t in rows]),
        ("host", [str(t.get("host", "")) for t in rows]),
    ]
    return [(h, cells) for h, cells in cols if h in ("task", "state") or any(cells)]


def _priority(header: str, metrics: list[str]) -> tuple[int, int]:
    """Which columns a narrow terminal keeps first: task and state, the step, the loss, the
    heartbeat's age, the first eval metric, the other metrics, then the rest."""
    fixed = {"task": 0, "state": 0, "step": 1, "loss": 2, "heartbeat": 3}
    if header in fixed:
        return fixed[header], 0
    if header in metrics:
        first_eval = next((m for m in metrics if m.startswith("eval_")), None)
        return (4, 0) if header == first_eval else (5, metrics.index(header))
    return 6, ["steps/s", "restarts", "RSS", "host"].index(header)


def _state(t: Mapping[str, Any]) -> str:
    """RUNNING, or what a running task is busy with between its steps (`validating`)."""
    busy = t.get("busy")
    return str(busy) if busy and t.get("state") == "RUNNING" else str(t["state"])


def _metric(t: Mapping[str, Any], name: str) -> str:
    v = (t.get("metrics") or {}).get(name)
    return "" if v is None else value_text(v)


def _ended(t: Mapping[str, Any]) -> bool:
    return t.get("state") in ("SUCCEEDED", "FAILED", "LOST", "STOPPED")


def _fit(cols: list[tuple[str, list[str]]], width: int, metrics: list[str]) -> list[tuple[str, list[str]]]:
    """The columns that fit `width`, taken most useful first (task and state always), shown in
    their own order."""
    kept: set[str] = set()
    used = 0
    for header, cells in sorted(cols, key=lambda c: _priority(c[0], metrics)):
        need = max([len(header), *map(len, cells)]) + 2
        if header in ("task", "state") or used + need <= width:
            kept.add(header)
            used += need
    return [c for c in cols if c[0] in kept]


def task_table(
    status: Mapping[str, Any], width: int, now: float | None = None, max_rows: int | None = MAX_ROWS
) -> tuple[Table, str]:
    """The tasks' table at `width` columns, and a line counting the tasks it leaves out."""
    now = time.time() if now is None else now
    tasks = list(status.get("tasks", []))
    rows = tasks[:max_rows] if max_rows is not None else tasks
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    cols = _fit(_columns(status, rows, now), width, metric_names(rows))
    for header, _ in cols:
        table.add_column(
            header, justify="left" if header in ("task", "state", "host") else "right", no_wrap=True
        )
    for i in range(len(rows)):
        cells = [
            Text(cells[i], _STATE_STYLE.get(cells[i], "green") if h == "state" else "") for h, cells in cols
        ]
        table.add_row(*cells)
    more = ""
    if len(tasks) > len(rows):
        counts = collections.Counter(str(t["state"]) for t in tasks[len(rows) :])
        more = f"… and {len(tasks) - len(rows)} more: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    return table, more


def render_status(
    status: Mapping[str, Any],
    events: Iterable[str] = (),
    width: int = 100,
    now: float | None = None,
    max_rows: int | None = MAX_ROWS,
) -> Group:
    """The whole view of a run: head, progress, tasks, recent events, reason."""
    now = time.time() if now is None else now
    took = elapsed_s(status, now)
    head = Text.assemble(
        (f"{status['name']} ", "bold"),
        (status["state"], _STATE_STYLE.get(status["state"], "")),
        f" · attempt {status['attempt']} · restarts {status['restarts']}",
        f" · {duration_text(took)}" if took is not None else "",
    )
    parts: list[Any] = [head]
    progress = progress_of(status, now)
    line = progress.parts(ended=bool(status.get("ended_at")))  # no ETA or rates once it ended
    if progress.fraction is not None:
        step = line.pop(0)
        bar = max(10, min(40, width - len(step) - 1))
        done = round(progress.fraction * bar)
        parts.append(Text.assemble(("━" * done, "green"), ("─" * (bar - done), "dim"), " ", step))
    if line:
        parts.append(Text(" · ".join(line)))
    table, more = task_table(status, width, now, max_rows)
    parts.append(table)
    if more:
        parts.append(Text(more, style="dim"))
    shown = list(events)
    if shown:
        parts.append(Text("events:", style="bold"))
        parts += [Text(_cut(e, width), style="dim") for e in shown]
    if status.get("reason"):
        parts.append(Text(_cut(str(status["reason"]).splitlines()[0], width), style="dim"))
    return Group(*parts)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


# --- the views -------------------------------------------------------------------------------


class View(Protocol):
    """What the coordinator tells a view: the tasks' log lines, the record's events as written,
    and the status document after each change (and about once a second)."""

    def log_line(self, task: str, line: str) -> None: ...

    def event(self, event: Mapping[str, Any]) -> None: ...

    def notice(self, text: str) -> None: ...

    def update(self, status: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class SilentView:
    """Shows nothing (the Python API's default: the caller has the events and the record)."""

    def log_line(self, task: str, line: str) -> None:
        pass

    def event(self, event: Mapping[str, Any]) -> None:
        pass

    def notice(self, text: str) -> None:
        pass

    def update(self, status: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class PlainView:
    """Plain lines: every state change and event with its reason, and a progress line every
    `progress_every_s` (0: never) while the run trains."""

    def __init__(
        self, out: TextIO | None = None, progress_every_s: float = 15.0, clock: Any = time.monotonic
    ):
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}
        self._every_s = progress_every_s
        self._clock = clock
        self._progress_at: float | None = None

    def log_line(self, task: str, line: str) -> None:
        self._write(f"[{task}] {line}")

    def event(self, event: Mapping[str, Any]) -> None:
        if event.get("kind") not in ("run", "task") and notable(event):
            self._write(f"orchestrate: {event_text(event, with_time=False)}")

    def notice(self, text: str) -> None:
        self._write(f"orchestrate: {text}")

    def update(self, status: Mapping[str, Any]) -> None:
        changes = []
        for t in status["tasks"]:
            if self._last.get(t["task"]) != t["state"]:
                self._last[t["task"]] = t["state"]
                changes.append(f"orchestrate: {t['task']} {t['state']} ({t['reason']})")
        if self._last.get("") != status["state"]:
            self._last[""] = status["state"]
            changes.append(f"orchestrate: {status['name']} {status['state']} ({status['reason']})")
        now = self._clock()
        if self._progress_at is None or status["state"] != "RUNNING":
            self._progress_at = now  # the first line comes one interval into training
        elif self._every_s > 0 and now - self._progress_at >= self._every_s:
            self._progress_at = now
            progress = progress_of(status)
            if progress.step is not None or progress.eval_metrics:
                parts = progress.parts()
                if progress.oldest_heartbeat_s is not None:
                    parts.append(f"heartbeats ≤ {age_text(progress.oldest_heartbeat_s)} old")
                changes.append("orchestrate: progress " + " · ".join(parts))
        if changes:
            self._write("\n".join(changes))

    def close(self) -> None:
        self._out.flush()

    def _write(self, text: str) -> None:
        with self._lock:
            self._out.write(text + "\n")
            self._out.flush()


class LiveView:
    """The live view on a terminal (rich), refreshed 4 times a second and on every change."""

    def __init__(self, console: Console | None = None):
        self._console = console or Console()
        self._events: collections.deque[str] = collections.deque(maxlen=EVENTS_SHOWN)
        self._status: Mapping[str, Any] | None = None
        self._lock = threading.Lock()
        self._live = Live(
            get_renderable=self._render, console=self._console, refresh_per_second=4, transient=False
        )
        self._live.start()

    def log_line(self, task: str, line: str) -> None:
        self._console.print(f"[dim]\\[{escape(task)}][/dim] {escape(line)}", highlight=False, soft_wrap=True)

    def event(self, event: Mapping[str, Any]) -> None:
        if notable(event):
            with self._lock:
                self._events.append(event_text(event))

    def notice(self, text: str) -> None:
        self._console.print(escape(text), highlight=False, soft_wrap=True)

    def update(self, status: Mapping[str, Any]) -> None:
        with self._lock:
            self._status = status
        self._live.refresh()

    def close(self) -> None:
        self._live.stop()

    def _render(self) -> Any:
        with self._lock:
            status, events = self._status, list(self._events)
        if status is None:
            return Text("starting…")
        return render_status(status, events, width=self._console.width)
