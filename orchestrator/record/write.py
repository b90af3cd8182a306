"""Record room, write side: the run directory (docs/architecture.md §5) — spec.yaml, plan.json, status.json,
events.jsonl, metrics.jsonl, logs/, coordinator.json (who supervises this run) and backend.json
(where its tasks run), the last two for `down`.

status.json is replaced atomically (write a temporary file, then rename), so a reader never sees
half of one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from orchestrator.errors import UsageError
from worker.wire import dumps

log = logging.getLogger("orchestrator.record.write")

RUNS_DIR = Path("runs")

#: The version of the record's documents (status.json, every events.jsonl and metrics.jsonl
#: line): raised when a field changes meaning or goes; new fields keep it. Their JSON Schemas:
#: `orchestrate schema status|event|metrics` (orchestrator/record/schemas.py).
SCHEMA_VERSION = 1


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_second_cache: tuple[int, str] = (-1, "")


def iso_time(t: float) -> str:
    """Seconds since the epoch as `2026-11-30T12:00:00.123Z` (UTC). Called for every progress
    point the tasks report, so the date part is formatted once per second."""
    global _second_cache
    second = int(t // 1)
    cached_second, prefix = _second_cache
    if second != cached_second:
        prefix = dt.datetime.fromtimestamp(second, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        _second_cache = (second, prefix)
    return f"{prefix}.{min(999, round((t - second) * 1e6) // 1000):03d}Z"  # 100.1 → .100, not .099


def new_run_id(name: str) -> str:
    """A run's identity on every host: `<name>-<time>-<random>`, never a folder's name. Processes
    and remote folders are matched by it, so two runs (two test suites side by side, two users
    with the same run folder name) can never be taken for each other."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(4)}"


def new_run_dir(name: str, base: Path = RUNS_DIR) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = base / (f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=_MODES[1])
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run directory under {base}")


#: The modes of a run directory's files and folders: the owner's alone, unless the spec shares
#: them with the owner's group (record.share_with_group).
_MODES = [0o600, 0o700]


def share_with_group(on: bool) -> None:
    """Set by `up` from the spec, before the run directory is made."""
    _MODES[:] = [0o640, 0o750] if on else [0o600, 0o700]


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, _MODES[0])


def private_open(path: Path, mode: str = "ab") -> IO[Any]:
    """Open a record file for writing, created 0600 (a run's logs, metrics and env values are the
    user's alone), never through a symlink someone planted."""
    if "b" in mode:
        return open(path, mode, opener=_private)
    return open(path, mode, encoding="utf-8", opener=_private)


def make_private_dir(path: Path) -> None:
    """A run directory (and its parents) created 0700; one that exists keeps its mode."""
    path.mkdir(mode=_MODES[1], parents=True, exist_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, dumps(data, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with private_open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: the old file stays whole, no half-written one beside it
        raise


def status_text(status: dict[str, Any]) -> str:
    """status.json's text: indented, one line per task. (json's indenting encoder is pure Python,
    the compact one C: a thousand tasks cost ~30 ms indented, ~3 ms this way.) Strict JSON: a NaN
    or ±inf value as its string (worker.wire.NONFINITE), as in every document of the record."""
    head = dumps({k: v for k, v in status.items() if k != "tasks"}, indent=2)[:-2]
    tasks = ",\n".join("    " + dumps(t) for t in status.get("tasks", []))
    return f'{head},\n  "tasks": [\n{tasks}\n  ]\n}}\n' if tasks else f'{head},\n  "tasks": []\n}}\n'


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


#: Kept free for the record's last words: on a full disk it is given back, and the final events
#: and status.json are written in its room (status.json of 1,000 tasks is ~0.2 MB).
RESERVE_BYTES = 1024 * 1024
_RESERVE = ".reserve"
LOCK_NAME = _LOCK = ".lock"


class RunDirBusy(UsageError):
    """Another coordinator, alive, holds the run directory."""


class _Lines:
    """An append-only JSONL file whose every write is whole lines or nothing: a write that fails
    part way (a full disk) is cut back to where it began, so no reader ever meets a torn line."""

    def __init__(self, path: Path):
        self._fd = _private(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def write(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def close(self) -> None:
        os.close(self._fd)


class RunRecord:
    """The run directory, written by one coordinator at a time (a lock it holds while it lives).

    A write that fails (a read-only or full disk) never raises into the supervisor or the heartbeat
    server: the record is marked `broken` with the reason, its reserve is given back, and the
    coordinator stops the job cleanly; what was written before stays whole."""

    def __init__(self, run_dir: Path):
        """Raises RunDirBusy when a live coordinator holds `run_dir`, OSError when it cannot be written."""
        self.dir = run_dir
        self.logs_dir = run_dir / "logs"
        make_private_dir(run_dir)
        self._lock_fd = _take_lock(run_dir / _LOCK)
        try:
            self.logs_dir.mkdir(mode=_MODES[1], parents=True, exist_ok=True)
            if _MODES[1] != 0o700:  # shared: whatever the umask (our own folders only)
                for folder in (run_dir, self.logs_dir):
                    if folder.stat().st_uid == os.getuid():
                        folder.chmod(_MODES[1])
            self._lock = threading.Lock()
            self._events = _Lines(run_dir / "events.jsonl")
            self._metrics = _Lines(run_dir / "metrics.jsonl")
            self._reserve = run_dir / _RESERVE
            _fill(self._reserve, RESERVE_BYTES)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._pending: list[str] = []  # metrics lines, written by flush()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._last_status: Any = None
        self.broken: str | None = None  # why the record could not be written, once it could not
        self.closed = False

    def log_path(self, log_name: str) -> Path:
        return self.logs_dir / log_name

    def write_spec(self, text: str) -> None:
        self._write(lambda: write_text_atomic(self.dir / "spec.yaml", text), "spec.yaml")

    def write_plan(self, plan_json: dict[str, Any]) -> None:
        self._write(lambda: write_json_atomic(self.dir / "plan.json", plan_json), "plan.json")

    def write_backend(self, info: dict[str, Any]) -> None:
        """Where the tasks run, for `orchestrate down` once the coordinator is gone (launch.reattach)."""
        self._write(lambda: write_json_atomic(self.dir / "backend.json", info), "backend.json")

    def write_coordinator(self, info: dict[str, Any]) -> None:
        self._write(lambda: write_json_atomic(self.dir / "coordinator.json", info), "coordinator.json")

    def write_status(self, status: dict[str, Any]) -> None:
        if status != self._last_status:
            text = status_text(status)
            if self._write(lambda: write_text_atomic(self.dir / "status.json", text), "status.json"):
                self._last_status = status

    def event(self, **fields: Any) -> None:
        event = {"schema_version": SCHEMA_VERSION, "time": now_iso(), **fields}
        line = (dumps(event) + "\n").encode()
        with self._lock:
            self._write(lambda: self._events.write(line), "events.jsonl")
        for listener in self._listeners:
            try:
                listener(dict(event))
            except Exception:  # noqa: BLE001 - a view's or a caller's bug never stops the run
                log.exception("an event listener failed")

    def listen(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener` with every event as it is written (the view, the Python API's callback)."""
        self._listeners.append(listener)

    def metrics(self, task: str, attempt: int, points: list[dict[str, Any]]) -> None:
        """Called from the heartbeat server's threads; written by `flush()` once per supervisor step."""
        lines = []
        for p in points:
            when = _point_time(p.pop("time", None))
            line = {"schema_version": SCHEMA_VERSION, "time": when, "task": task, "attempt": attempt}
            line.update(p)
            # never a point's own (wire refuses them)
            line["task"], line["attempt"], line["schema_version"] = task, attempt, SCHEMA_VERSION
            lines.append(dumps(line))
        with self._lock:
            self._pending.extend(lines)

    def flush(self) -> None:
        with self._lock:
            lines, self._pending = self._pending, []
            if lines:
                data = ("\n".join(lines) + "\n").encode()
                self._write(lambda: self._metrics.write(data), "metrics.jsonl")

    def close(self) -> None:
        if self.closed:
            return
        self.flush()
        self.closed = True
        with self._lock:
            self._metrics.close()
            self._events.close()
            with contextlib.suppress(OSError):
                self._reserve.unlink()
            os.close(self._lock_fd)  # after the last word: the next coordinator may take the folder

    def _write(self, write: Callable[[], None], what: str) -> bool:
        """Run one write. When it fails the record is broken (the first reason is kept: the job is
        to stop), the reserve is given back, and the write tried once more in its room. Whether
        it was written."""
        if self.closed:  # its files are closed, their descriptors perhaps another file's by now
            return False
        try:
            write()
            return True
        except OSError as exc:
            if self.broken is None:
                self.broken = f"cannot write {what} in {self.dir}: {exc.strerror or exc}"
        try:
            self._reserve.unlink()
        except OSError:
            return False  # given back already (or never made): nothing more to try
        try:
            write()
            return True
        except OSError:
            return False


def ensure_free(run_dir: Path) -> None:
    """Raise RunDirBusy when a live coordinator holds `run_dir` (`up --detach` asks before it
    starts one in the background, which would only find out in its log)."""
    if (run_dir / _LOCK).exists():
        os.close(_take_lock(run_dir / _LOCK, write_pid=False))


def _take_lock(path: Path, write_pid: bool = True) -> int:
    """The run directory's lock, held for the coordinator's life (the kernel lets go when it dies)."""
    fd = _private(str(path), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(
            f"{path.parent} is in use by a live coordinator (pid {holder}): "
            "`orchestrate down` it, or choose another --run-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    if write_pid:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _fill(path: Path, size: int) -> None:
    """A file of `size` bytes that really holds its room on disk."""
    fd = _private(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, bytes(size))  # a filesystem without fallocate
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _point_time(t: Any) -> str:
    """A point's own time (the task's clock), or now when it has none we can write."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        with contextlib.suppress(OverflowError, ValueError, OSError):
            return iso_time(t)
    return now_iso()
