"""Web layer: a run directory read as it grows — status.json when it changes, events.jsonl and
metrics.jsonl from where the last read stopped (whole lines only), a task's log tail on demand.
The same for a live run (its coordinator writes the files) and a finished one (`orchestrate show`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from orchestrator.record.logtail import tail_lines
from orchestrator.record.progress import notices, progress_of
from orchestrator.record.quiet import collapse_redraws
from orchestrator.record.read import coordinator_alive, has_ended
from orchestrator.stacks import record as stacks
from orchestrator.stacks.where import where
from orchestrator.web.curves import Curves
from worker.wire import loads, safe_text

#: Events kept for the page (the newest; events.jsonl keeps them all).
MAX_EVENTS = 1_000
#: Bytes read from a growing file per poll: a huge metrics.jsonl is taken in over several.
READ_CHUNK = 8 * 1024 * 1024


class _Tail:
    """New whole lines of one append-only file."""

    def __init__(self, path: Path):
        self._path, self._offset, self._partial = path, 0, b""

    def lines(self) -> list[bytes]:
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            size = os.fstat(fd).st_size
            if size < self._offset:  # replaced (never by us): read it again from the start
                self._offset, self._partial = 0, b""
            data = os.pread(fd, min(READ_CHUNK, size - self._offset), self._offset)
        finally:
            os.close(fd)
        self._offset += len(data)
        data = self._partial + data
        *whole, self._partial = data.split(b"\n")
        return whole


class RunReader:
    def __init__(self, run_dir: Path, min_interval_s: float = 0.5):
        self.dir = run_dir
        self.curves = Curves()
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._event_count = 0
        self._event_tail = _Tail(run_dir / "events.jsonl")
        self._metric_tail = _Tail(run_dir / "metrics.jsonl")
        self._status: dict[str, Any] = {}
        self._status_key: tuple[int, int] | None = None
        self._stale = False
        self._lock = threading.Lock()
        self._polled_at = 0.0
        self._min_interval_s = min_interval_s  # many open pages cost one read per interval
        self._stacks: dict[str, dict[str, Any]] = {}  # per task, its last read stacks
        self._stacks_key: tuple[tuple[str, int], ...] = ()

    def poll(self) -> None:
        """Take in what the run wrote since the last poll (at most once per interval)."""
        with self._lock:
            now = time.monotonic()
            if now - self._polled_at < self._min_interval_s:
                return
            self._polled_at = now
            self._read_status()
            # the stale rule of `orchestrate status --json`: not ended, and its coordinator gone
            self._stale = (
                bool(self._status) and not has_ended(self._status) and coordinator_alive(self.dir) is None
            )
            for line in self._event_tail.lines():
                event = _json(line)
                if event is not None:
                    self._events.append(event)
                    self._event_count += 1
            self._read_stacks()
            for line in self._metric_tail.lines():
                point = _json(line)
                if point is not None and isinstance(point.get("task"), str):
                    attempt = point.get("attempt")
                    self.curves.add(point["task"], attempt if type(attempt) is int else 0, [point])

    def _read_status(self) -> None:
        path = self.dir / "status.json"
        try:
            st = os.stat(path, follow_symlinks=False)
            key = (st.st_mtime_ns, st.st_size)
            if key == self._status_key:
                return
            with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
                status = loads(f.read())
        except (OSError, ValueError):
            return  # not written yet, or being replaced: the last one stands
        tasks = status.get("tasks") if isinstance(status, dict) else None
        if isinstance(tasks, list) and all(isinstance(t, dict) for t in tasks):  # else not ours
            self._status, self._status_key = status, key

    def _read_stacks(self) -> None:
        """The stacks folder read again only when a capture changed it (a folder's time moves as
        its files are replaced): a document can be half a megabyte."""
        try:
            with os.scandir(self.dir / stacks.FOLDER) as entries:
                folders = [e for e in entries if e.is_dir(follow_symlinks=False)]
                key = tuple(sorted((e.name, e.stat(follow_symlinks=False).st_mtime_ns) for e in folders))
        except OSError:
            return
        if key != self._stacks_key:
            self._stacks, self._stacks_key = stacks.latest(self.dir), key

    def stacks(self) -> dict[str, dict[str, Any]]:
        """Per task, the place its last read stacks show, and when and why they were read."""
        with self._lock:
            docs = self._stacks
        out = {}
        for task, doc in docs.items():
            place = where(task, doc)
            out[task] = {
                "line": safe_text(place.said(stacks.hung(doc))),
                "culprit": place.culprit and stacks.hung(doc),
                "attempt": doc.get("attempt"),
                "captured_at": doc.get("captured_at"),
                "why": safe_text(str(doc.get("why"))),
            }
        return out

    def stacks_text(self, task: str) -> list[str] | None:
        """A task's last read stacks as `orchestrate stacks` prints them; None if none were read
        (or the run has no such task)."""
        with self._lock:
            doc = self._stacks.get(task)
        return [safe_text(line) for line in stacks.text(doc)] if doc is not None else None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self._status

    def stale(self) -> bool:
        """The run never ended and its coordinator is gone: what it shows is its last record."""
        return self._stale

    def recorded_at(self) -> float | None:
        """When status.json was last written (seconds since the epoch), once read."""
        return self._status_key[0] / 1e9 if self._status_key else None

    def events(self, since: int) -> tuple[list[dict[str, Any]], int]:
        """The events after the first `since` ever read (as many as are kept), and the new count."""
        with self._lock:
            count, kept = self._event_count, list(self._events)
        new = max(0, min(count - since, len(kept)))
        return (kept[len(kept) - new :] if new else []), count

    def tasks(self) -> list[str]:
        return [str(t.get("task")) for t in self.status().get("tasks", [])]

    def log_tail(self, task: str, lines: int = 40) -> list[str] | None:
        """The task's last log lines (this attempt's), as the console shows them: a redrawn
        progress bar as its last state, a control or bidi character as its escape (tabs kept).
        None for a task the run does not have (the name is never used as a path unless it is one
        of the run's tasks)."""
        if task not in self.tasks():
            return None
        path = self.dir / "logs" / f"{task}.log"
        return [safe_text(collapse_redraws(line).replace("\t", "    ")) for line in tail_lines(path, lines)]


def _json(line: bytes) -> dict[str, Any] | None:
    try:
        value = loads(line)
    except ValueError:
        return None  # a line torn by a crash
    return value if isinstance(value, dict) else None


def state_document(reader: RunReader, since: int, rows: int, tensorboard: dict[str, Any]) -> dict[str, Any]:
    """What the page is told each time it asks (`/api/state`): the run's status with its first
    `rows` tasks (not a thousand tasks' every second: P6 with a page open), the counts of all, the
    progress, the events after the `since`-th, where each task shown was by its last read stacks."""
    events, count = reader.events(since)
    status = reader.status()
    tasks = status.get("tasks", [])
    progress = progress_of(status)
    shown = {str(t.get("task")) for t in tasks[:rows]}
    return {
        "status": {**status, "tasks": tasks[:rows]},
        "task_count": len(tasks),
        "task_states": dict(Counter(str(t.get("state")) for t in tasks)),
        "progress": {
            "step": progress.step,
            "total": progress.total,
            "steps_per_s": progress.steps_per_s,
            "examples_per_s": progress.examples_per_s,
            "eta_s": progress.eta_s,
        },
        "notices": notices(status),  # what runs degraded, the metric names dropped (every task's)
        "events": events[-200:],
        "event_count": count,
        "curves_version": reader.curves.version,
        # its coordinator is gone and it never ended: the last record, not a live run
        "stale": reader.stale(),
        "recorded_at": reader.recorded_at(),
        "now": time.time(),
        "tensorboard": tensorboard,
        # where each task was, by its last read stacks (a hung job's, or asked for)
        "stacks": {t: s for t, s in reader.stacks().items() if t in shown},
    }
