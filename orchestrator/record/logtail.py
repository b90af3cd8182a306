"""Record room: follow the tasks' log files and hand each new line to the console view.

Tasks write their logs directly (see launch/local/); this thread only reads, so a slow console
never slows a task down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class LogTailer:
    def __init__(
        self,
        files: dict[str, Path],
        sink: Callable[[str, str], None],
        interval_s: float = 0.2,
        from_start: bool = False,
    ):
        self._files = files
        self._sink = sink
        # A poll reads every file: with many tasks, less often (console lines stay in order per task).
        self._interval_s = max(interval_s, len(files) / 1000)
        self._open: dict[str, BinaryIO] = {}  # kept open: one read per file and poll, no open/close
        self._start_at = {  # where each file's reading starts (what was there before is not replayed)
            n: (0 if from_start or not p.exists() else p.stat().st_size) for n, p in files.items()
        }
        self._partial = {name: b"" for name in files}
        self._lock = threading.Lock()  # poll() runs from the tailer's thread and the supervisor's
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="log-tailer", daemon=True)

    def start(self) -> LogTailer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Read what was written last, then close the files. Once: a second stop reads nothing
        again (a file reopened would be read from its start)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._closed:
            return
        self.poll()  # what was written last
        self.flush_partial()
        with self._lock:
            for f in self._open.values():
                f.close()
            self._open = {}
            self._closed = True

    def flush_partial(self) -> None:
        """Hand over a last line that has no newline yet."""
        for name, rest in self._partial.items():
            if rest:
                self._sink(name, rest.decode(errors="replace"))
                self._partial[name] = b""

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()

    def poll(self) -> None:
        with self._lock:
            if not self._closed:
                self._poll()

    def _poll(self) -> None:
        for name, path in self._files.items():
            f = self._open.get(name)
            if f is None:
                try:
                    f = self._open[name] = open(path, "rb")  # noqa: SIM115 - closed by stop()
                except FileNotFoundError:
                    continue
                f.seek(self._start_at[name])  # then the open file's position is ours
            data = f.read()
            if not data:
                continue
            *lines, self._partial[name] = (self._partial[name] + data).split(b"\n")
            for line in lines:
                self._sink(name, line.decode(errors="replace").rstrip("\r"))


def tail_lines(path: Path, count: int, since_marker: bool = True) -> list[str]:
    """The last `count` lines of a log (of its last attempt only, when `since_marker`)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            start = max(0, size - 256 * 1024)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    # lines end at a newline only: a carriage return or a form feed inside one is its own (Keras
    # redraws its progress bar with them: `collapse_redraws` shows its last state)
    lines = [line.rstrip("\r") for line in data.decode(errors="replace").split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    if start > 0 and len(lines) > 1:
        lines.pop(0)  # begun part way through (unless it is all there is: a bar redrawn for long)
    if since_marker:
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("===== orchestrate:"):
                lines = lines[i + 1 :]
                break
    return lines[-count:] if count > 0 else []
