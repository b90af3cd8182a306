"""CLI output layer: how a run looks on the console.

On a TTY, a live table (task, state, step, loss, steps/s, RSS, last heartbeat) with a progress
bar when the total is known, and the tasks' log lines scrolling above it. Otherwise plain lines:
`[worker-1] …` for log lines and `orchestrate: …` for state changes, easy to grep and to pipe.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

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


class PlainView:
    def __init__(self, out: TextIO = sys.stdout):
        self._out = out
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}

    def log_line(self, task: str, line: str) -> None:
        with self._lock:
            self._out.write(f"[{task}] {line}\n")
            self._out.flush()

    def update(self, status: dict[str, Any]) -> None:
        changes = []
        for t in status["tasks"]:
            if self._last.get(t["task"]) != t["state"]:
                self._last[t["task"]] = t["state"]
                changes.append(f"orchestrate: {t['task']} {t['state']} ({t['reason']})")
        if self._last.get("") != status["state"]:
            self._last[""] = status["state"]
            changes.append(f"orchestrate: {status['name']} {status['state']} ({status['reason']})")
        if changes:
            with self._lock:
                self._out.write("\n".join(changes) + "\n")
                self._out.flush()

    def close(self) -> None:
        self._out.flush()


class LiveView:
    def __init__(self, console: Console | None = None):
        self._console = console or Console()
        self._live = Live(Text("starting…"), console=self._console, refresh_per_second=4, transient=False)
        self._live.start()
        self._started = time.monotonic()

    def log_line(self, task: str, line: str) -> None:
        self._console.print(f"[dim]\\[{escape(task)}][/dim] {escape(line)}", highlight=False, soft_wrap=True)

    def update(self, status: dict[str, Any]) -> None:
        self._live.update(render_status(status, time.monotonic() - self._started))

    def close(self) -> None:
        self._live.stop()


def render_status(status: dict[str, Any], elapsed_s: float | None = None) -> Group:
    head = Text.assemble(
        (f"{status['name']} ", "bold"),
        (status["state"], _STATE_STYLE.get(status["state"], "")),
        f"  attempt {status['attempt']}  restarts {status['restarts']}",
        f"  {elapsed_s:.0f} s" if elapsed_s is not None else "",
    )
    table = Table(box=None, pad_edge=False)
    for col in ("task", "state", "step", "loss", "steps/s", "RSS", "last heartbeat"):
        table.add_column(col, justify="right" if col in ("step", "loss", "steps/s", "RSS") else "left")
    done = total = 0
    for t in status["tasks"]:
        loss = t["metrics"].get("loss")
        table.add_row(
            t["task"],
            Text(t["state"], _STATE_STYLE.get(t["state"], "")),
            "" if t["last_step"] is None else str(t["last_step"]),
            "" if loss is None else f"{loss:.4g}",
            "" if t.get("steps_per_s") is None else f"{t['steps_per_s']:.1f}",
            "" if not t.get("rss_bytes") else f"{t['rss_bytes'] / 2**20:.0f} MiB",
            (t.get("last_heartbeat_at") or "")[11:23],
        )
        if t.get("total_steps"):
            total = max(total, t["total_steps"])
            done = max(done, t["last_step"] or 0)
    parts: list[Any] = [head, table]
    if total:
        parts.append(
            Group(ProgressBar(total=total, completed=done, width=50), Text(f"step {done} of {total}"))
        )
    if status["reason"]:
        parts.append(Text(status["reason"], style="dim"))
    return Group(*parts)
