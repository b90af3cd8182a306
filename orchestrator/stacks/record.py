"""Stacks layer: every task's stacks captured at once (each on its host, through its backend's
handle, in parallel, by one deadline), kept in the run record, found again and printed.

The record: `stacks/attempt-N/<task>.json` for the capture before attempt N's stop (the last one
of that attempt), `stacks/live/<task>.json` for the latest one asked of a live run
(`orchestrate stacks`, the page). Each is worker/host/stacks.py's document with the task, its attempt,
where it ran, when and why it was captured.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.record.write import make_private_dir, now_iso, read_json, write_json_atomic
from orchestrator.stacks.where import Where, where
from worker.host import stacks

FOLDER = "stacks"
BEFORE_STOP = "before the stop"
MAX_LINE = 4000  # characters of the places in a `stacks` event  # how a hung job's capture's `why` begins
LIVE = "live"
#: Given past the deadline to a host that captures on its own (a shim) to send its answer.
TRANSPORT_S = 2.0


class TaskHandle(Protocol):
    """A running task whose stacks can be read: what this room asks of the launch layer's
    handles (orchestrator/launch/api.py's TaskHandle), which sit above it."""

    @property
    def task(self) -> TaskPlan: ...

    @property
    def attempt(self) -> int: ...

    @property
    def where(self) -> str: ...

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Capture:
    """One capture of a set of tasks: per task its document, and how long it took."""

    docs: dict[str, dict[str, Any]]
    seconds: float
    why: str

    def then(self, fuller: Capture) -> Capture:
        """This capture, with each task's document from a fuller one (native frames) that read it."""
        docs = {
            t: fuller.docs[t] if fuller.docs.get(t, {}).get("threads") else d for t, d in self.docs.items()
        }
        return Capture(docs, self.seconds + fuller.seconds, self.why)

    def wheres(self) -> list[Where]:
        return [where(task, doc) for task, doc in self.docs.items()]

    def line(self) -> str:
        """The event's reason: how many, how long, and the place of each."""
        places = "; ".join(w.said(hung=self.why.startswith(BEFORE_STOP)) for w in self.wheres())
        if len(places) > MAX_LINE:  # a thousand tasks: the record has each; the event says the start
            places = places[: MAX_LINE - 1] + "…"
        return f"stacks of {len(self.docs)} tasks captured in {self.seconds:.1f} s ({self.why}): {places}"


def capture_all(handles: Sequence[TaskHandle], timeout_s: float, why: str, native: bool = True) -> Capture:
    """Every handle's stacks, all at once, by `timeout_s` from now; a task that cannot be read
    says why in its document."""
    from orchestrator.group import on_all

    start = time.monotonic()
    deadline = start + timeout_s

    def one(handle: TaskHandle) -> dict[str, Any]:
        doc = handle.stacks(deadline, native)
        if not isinstance(doc.get("seconds"), (int, float)):  # the host said none: as seen from here
            doc["seconds"] = round(time.monotonic() - start, 3)
        return doc

    docs: dict[str, dict[str, Any]] = {}
    for handle, doc in on_all(list(handles), one):
        if isinstance(doc, Exception):  # a bug of a backend's: said, never raised
            doc = {"state": "unknown", "threads": [], "notes": [f"capture failed: {doc}"]}
        docs[handle.task.name] = {
            **doc,
            "task": handle.task.name,
            "attempt": handle.attempt,
            "host": handle.where or "this machine",
            "captured_at": now_iso(),
            "why": why,
        }
    return Capture(docs, time.monotonic() - start, why)


def checked(doc: object) -> dict[str, Any]:
    """A document as it came from elsewhere (a host's shim): the fields of one, their types
    checked, bounded again; anything else is said as such."""
    if not isinstance(doc, dict):
        return {"state": "unknown", "threads": [], "notes": ["its host answered with no document"]}
    out: dict[str, Any] = {
        "pid": doc.get("pid") if isinstance(doc.get("pid"), int) else None,
        "state": stacks.text(doc.get("state") or "unknown"),
        "method": stacks.text(doc["method"]) if isinstance(doc.get("method"), str) else None,
        "native": doc.get("native") is True,
        "seconds": doc.get("seconds") if isinstance(doc.get("seconds"), (int, float)) else None,
        "notes": [stacks.text(n) for n in doc.get("notes") or [] if isinstance(n, str)][:8],
        "threads": [],
    }
    threads = doc.get("threads")
    for thread in threads if isinstance(threads, list) else []:
        if not isinstance(thread, dict) or not isinstance(thread.get("frames"), list):
            continue
        frames = [
            {
                "function": stacks.text(f.get("function")),
                "file": stacks.text(f.get("file")),
                "line": f.get("line") if isinstance(f.get("line"), int) else 0,
                "native": f.get("native") is True,
            }
            for f in thread["frames"]
            if isinstance(f, dict)
        ]
        entry = {
            key: thread.get(key)
            for key in ("id", "main", "active")
            if isinstance(thread.get(key), (int, bool))
        }
        entry.update(name=stacks.text(thread.get("name")), frames=frames)
        if isinstance(thread.get("executing"), str):
            entry["executing"] = stacks.text(thread["executing"])
        out["threads"].append(entry)
    return stacks.bounded(out)


def keep(run_dir: Path, capture: Capture, attempt: int | None) -> None:
    """Into the record: the attempt's folder (None: the live one)."""
    folder = run_dir / FOLDER / (LIVE if attempt is None else f"attempt-{attempt}")
    make_private_dir(folder)
    for task, doc in capture.docs.items():
        write_json_atomic(folder / f"{_safe(task)}.json", doc)


def places(run_dir: Path, attempt: int) -> list[str]:
    """One line per task of the capture before attempt N's stop (none if there was none)."""
    docs = [_read(p) for p in sorted((run_dir / FOLDER / f"attempt-{attempt}").glob("*.json"))]
    return [
        where(d["task"], d).said() for d in docs if isinstance(d, dict) and isinstance(d.get("task"), str)
    ]


def latest(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per task, its last captured document (live or before a stop), by capture time."""
    out: dict[str, dict[str, Any]] = {}
    folders = [*sorted((run_dir / FOLDER).glob("attempt-*")), run_dir / FOLDER / LIVE]
    for path in (p for folder in folders for p in sorted(folder.glob("*.json"))):
        doc = _read(path)
        if not isinstance(doc.get("task"), str):
            continue
        have = out.get(doc["task"])
        if have is None or str(doc.get("captured_at")) >= str(have.get("captured_at")):
            out[doc["task"]] = doc
    return out


def text(doc: Mapping[str, Any]) -> list[str]:
    """A document as people read it: a heading, the place, then each thread innermost first."""
    head = f"{doc.get('task')} (attempt {doc.get('attempt')}, pid {doc.get('pid')}, {doc.get('host')})"
    how = doc.get("method") or "not read"
    if doc.get("method") and not doc.get("native"):
        how += ", Python frames only"
    when = f"captured {doc.get('captured_at')} ({doc.get('why')}) by {how} in {doc.get('seconds')} s"
    lines = [f"== {head}: {when}"]
    lines.append(f"   {where(str(doc.get('task')), doc).said(hung(doc))}")
    lines += [f"   note: {note}" for note in doc.get("notes") or []]
    for thread in doc.get("threads") or []:
        flags = " (main)" if thread.get("main") else ""
        flags += " (active)" if thread.get("active") else ""
        running = f", executing {thread['executing']}" if thread.get("executing") else ""
        lines.append(f"   Thread {thread.get('id') or ''} {thread.get('name')!s}{flags}{running}")
        frames = thread.get("frames") or []
        cut = len(frames) - 20 if thread.get("frames_left_out") else None
        for i, frame in enumerate(frames):
            if i == cut:
                lines.append(f"       … {thread['frames_left_out']} frames left out …")
            native = bool(frame.get("native"))
            file = str(frame.get("file"))
            place = Path(file).name if native else f"{file}:{frame.get('line')}"
            lines.append(f"     {'~' if native else ' '} {frame.get('function')} ({place})")
    if doc.get("threads_left_out"):
        lines.append(f"   … {doc['threads_left_out']} more threads left out")
    return lines


def hung(doc: Mapping[str, Any]) -> bool:
    """Read before a hung job's stop (not asked for on a live run)."""
    return str(doc.get("why")).startswith(BEFORE_STOP)


def _read(path: Path) -> dict[str, Any]:
    """A kept document; {} for one that cannot be read (torn, or not ours)."""
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _safe(task: str) -> str:
    """A task's name as a file name (they are role-index: nothing to escape, but never a path)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in task).lstrip(".") or "task"
