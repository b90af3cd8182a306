"""Stacks layer: `orchestrate stacks` on a live run — asked through the run directory, answered
by its coordinator, which alone holds the tasks (and, for remote ones, their shims).

The asker writes `stacks/requests/<id>.json` ({"task": name or null, "native": bool}); the
coordinator's `Answerer` (a thread) finds it within POLL_S, reads the tasks' stacks (Python frames
only unless `native`: never pausing them, so the run goes on as it was), keeps them in
`stacks/live/`, and writes `stacks/answers/<id>.json` with the documents. Only the run's owner can
write there (the run directory is private). One capture at a time; a request that is not ours
(a name, a size, a symlink) is removed unread, an answer nobody collected is removed after a while.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.record.write import make_private_dir, write_json_atomic

if TYPE_CHECKING:
    from orchestrator.stacks.record import TaskHandle

FOLDER = "stacks"  # as orchestrator/stacks/record.py's (the asker imports no more than this module)

log = logging.getLogger("orchestrator.stacks")

POLL_S = 0.2
_ID = re.compile(r"^[A-Za-z0-9_-]{8,64}\.json$")
_MAX_REQUEST = 4096
_UNCOLLECTED_S = 120.0


def request(run_dir: Path, task: str | None, native: bool, timeout_s: float) -> dict[str, Any] | str:
    """Ask the run's coordinator for its tasks' stacks now: its answer, or why there is none."""
    folder = run_dir / FOLDER / "requests"
    ident = secrets.token_urlsafe(12)
    try:
        make_private_dir(folder)
        make_private_dir(run_dir / FOLDER / "answers")
        write_json_atomic(folder / f"{ident}.json", {"task": task, "native": native})
    except OSError as exc:
        return f"cannot ask the run's coordinator through {folder}: {exc.strerror or exc}"
    answer = run_dir / FOLDER / "answers" / f"{ident}.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answer.exists():
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(answer.read_text(encoding="utf-8"))
                answer.unlink()
                return data if isinstance(data, dict) else "its answer is not a JSON object"
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        (folder / f"{ident}.json").unlink()
    return f"the run's coordinator did not answer within {timeout_s:g} s"


class Answerer:
    """The coordinator's side: a thread answering requests until `close`."""

    def __init__(self, run_dir: Path, handles: Callable[[], Sequence[TaskHandle]], timeout_s: float):
        self._folder = run_dir / FOLDER
        self._run_dir = run_dir
        self._handles = handles  # the live tasks' handles, read on this thread
        self._timeout_s = timeout_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stacks")

    def start(self) -> Answerer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self._timeout_s + 5.0)

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self._answer_all()
            except OSError:  # a full disk, a folder removed: the next poll tries again
                continue
            except Exception:  # a bug of ours: said, and the next request is answered still
                log.exception("answering orchestrate stacks")

    def _answer_all(self) -> None:
        requests = self._folder / "requests"
        try:
            # (a name with a dot first is a request being written: write_json_atomic's own)
            names = sorted(e.name for e in os.scandir(requests) if not e.name.startswith("."))[:16]
        except FileNotFoundError:
            return
        make_private_dir(self._folder / "answers")
        for name in names:
            asked = self._take(requests / name)
            if asked is not None and _ID.match(name):
                write_json_atomic(self._folder / "answers" / name, self._answer(*asked))
        self._forget_uncollected()

    @staticmethod
    def _take(path: Path) -> tuple[str | None, bool] | None:
        """A request, read (never through a symlink, 4 KiB at most) and removed; None if not one."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_REQUEST + 1)
        except OSError:
            data = b""
        with contextlib.suppress(OSError):
            path.unlink()
        if not _ID.match(path.name) or len(data) > _MAX_REQUEST:
            return None
        try:
            asked = json.loads(data)
        except ValueError:
            return None
        if not isinstance(asked, dict):
            return None
        task = asked.get("task")
        return (task if isinstance(task, str) else None), asked.get("native") is True

    def _answer(self, task: str | None, native: bool) -> dict[str, Any]:
        handles = [h for h in self._handles() if task is None or h.task.name == task]
        if not handles:
            return {"error": f"no live task {task}" if task else "no task is running now", "docs": {}}
        from orchestrator.stacks.record import capture_all, keep

        capture = capture_all(handles, self._timeout_s, "asked: orchestrate stacks", native=native)
        keep(self._run_dir, capture, None)
        return {"docs": capture.docs, "seconds": capture.seconds}

    def _forget_uncollected(self) -> None:
        now = time.time()
        with contextlib.suppress(FileNotFoundError), os.scandir(self._folder / "answers") as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > _UNCOLLECTED_S:
                        os.unlink(entry.path)
