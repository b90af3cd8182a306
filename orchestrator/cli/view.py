"""CLI room: how a run looks on the console.

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
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # rich is imported where it is drawn: a plain run's start never waits for it
    from rich.console import Console, Group
    from rich.table import Table

from orchestrator.record.progress import (
    EVENTS_SHOWN,
    TRAINING_ROLES,
    age_text,
    duration_text,
    elapsed_s,
    event_text,
    notable,
    notices,
    parse_time,
    progress_of,
    value_text,
)
from orchestrator.record.quiet import console_writes_anything

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

#: Rows the live view shows; the rest are counted by state.
MAX_ROWS = 16


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
    from rich.table import Table
    from rich.text import Text

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
    from rich.console import Group
    from rich.text import Text

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
    line = progress.parts(ended=bool(status.get("ended_at")), width=width)  # no ETA or rates once ended
    if progress.fraction is not None:
        step = line.pop(0)
        bar = max(10, min(40, width - len(step) - 1))
        done = round(progress.fraction * bar)
        parts.append(Text.assemble(("━" * done, "green"), ("─" * (bar - done), "dim"), " ", step))
    if line:
        parts.append(Text(" · ".join(line)))
    parts += [Text(_cut(n, width), style="yellow") for n in notices(status)]  # what runs degraded
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


class PlainView:
    """Plain lines: every state change and event with its reason, and a progress line every
    `progress_every_s` (0: never) while the run trains."""

    def __init__(
        self,
        out: TextIO | None = None,
        progress_every_s: float = 15.0,
        clock: Any = time.monotonic,
        width: int | None = None,
    ):
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}
        self._every_s = progress_every_s
        self._clock = clock
        self._progress_at: float | None = None
        # the progress line fits the terminal (piped: $COLUMNS, else 120), its metrics counted past it
        self._width = width or shutil.get_terminal_size((120, 24)).columns

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
                ages = progress.oldest_heartbeat_s
                beats = [f"heartbeats ≤ {age_text(ages)} old"] if ages is not None else []
                parts = progress.parts(width=self._width - len("orchestrate: progress "), tail=beats)
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
        from rich.console import Console
        from rich.live import Live

        self._console = console or Console()
        self._events: collections.deque[str] = collections.deque(maxlen=EVENTS_SHOWN)
        self._status: Mapping[str, Any] | None = None
        self._lock = threading.Lock()
        self._live = Live(
            get_renderable=self._render, console=self._console, refresh_per_second=4, transient=False
        )
        self._live.start()

    def log_line(self, task: str, line: str) -> None:
        from rich.markup import escape

        self._console.print(f"[dim]\\[{escape(task)}][/dim] {escape(line)}", highlight=False, soft_wrap=True)

    def event(self, event: Mapping[str, Any]) -> None:
        if notable(event):
            with self._lock:
                self._events.append(event_text(event))

    def notice(self, text: str) -> None:
        from rich.markup import escape

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
            from rich.text import Text

            return Text("starting…")
        return render_status(status, events, width=self._console.width)


def console_view(live: bool | None, progress_every_s: float) -> LiveView | PlainView:
    """The live view on a terminal (or when asked), plain lines otherwise."""
    console_writes_anything()
    on_tty = sys.stdout.isatty() if live is None else live
    return LiveView() if on_tty else PlainView(progress_every_s=progress_every_s)
