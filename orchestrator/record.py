"""Run record layer: the run directory (DESIGN §5) — spec.yaml, plan.json, status.json,
events.jsonl, metrics.jsonl, logs/, coordinator.json (who supervises this run) and backend.json
(where its tasks run), the last two for `down`.

status.json is replaced atomically (write a temporary file, then rename), so a reader never sees
half of one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import threading
from pathlib import Path
from typing import IO, Any

RUNS_DIR = Path("runs")


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
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a run directory under {base}")


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def private_open(path: Path, mode: str = "ab") -> IO[Any]:
    """Open a record file for writing, created 0600 (a run's logs, metrics and env values are the
    user's alone), never through a symlink someone planted."""
    if "b" in mode:
        return open(path, mode, opener=_private)
    return open(path, mode, encoding="utf-8", opener=_private)


def make_private_dir(path: Path) -> None:
    """A run directory (and its parents) created 0700; one that exists keeps its mode."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


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
    the compact one C: a thousand tasks cost ~30 ms indented, ~3 ms this way.)"""
    head = json.dumps({k: v for k, v in status.items() if k != "tasks"}, indent=2)[:-2]
    tasks = ",\n".join("    " + json.dumps(t) for t in status.get("tasks", []))
    return f'{head},\n  "tasks": [\n{tasks}\n  ]\n}}\n' if tasks else f'{head},\n  "tasks": []\n}}\n'


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class RunRecord:
    def __init__(self, run_dir: Path):
        self.dir = run_dir
        self.logs_dir = run_dir / "logs"
        self.logs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Held open for the run's lifetime (appended on every event); closed by close().
        self._events = private_open(run_dir / "events.jsonl", "a")
        self._metrics = private_open(run_dir / "metrics.jsonl", "a")
        self._last_status: Any = None

    def log_path(self, log_name: str) -> Path:
        return self.logs_dir / log_name

    def write_spec(self, text: str) -> None:
        write_text_atomic(self.dir / "spec.yaml", text)

    def write_plan(self, plan_json: dict[str, Any]) -> None:
        write_json_atomic(self.dir / "plan.json", plan_json)

    def write_backend(self, info: dict[str, Any]) -> None:
        """Where the tasks run, for `orchestrate down` once the coordinator is gone (launch.reattach)."""
        write_json_atomic(self.dir / "backend.json", info)

    def write_coordinator(self, info: dict[str, Any]) -> None:
        write_json_atomic(self.dir / "coordinator.json", info)

    def write_status(self, status: dict[str, Any]) -> None:
        if status != self._last_status:
            write_text_atomic(self.dir / "status.json", status_text(status))
            self._last_status = status

    def event(self, **fields: Any) -> None:
        with self._lock:
            self._events.write(json.dumps({"time": now_iso(), **fields}) + "\n")
            self._events.flush()

    def metrics(self, task: str, attempt: int, points: list[dict[str, Any]]) -> None:
        """Called from the heartbeat server's threads; flushed by `flush()` once per supervisor step."""
        with self._lock:
            lines = []
            for p in points:
                when = _point_time(p.pop("time", None))
                line = {"time": when, "task": task, "attempt": attempt}
                line.update(p)
                line["task"], line["attempt"] = task, attempt  # never a point's own (wire refuses them)
                lines.append(json.dumps(line))
            lines.append("")
            self._metrics.write("\n".join(lines))

    def flush(self) -> None:
        with self._lock:
            self._metrics.flush()

    def close(self) -> None:
        with self._lock:
            self._metrics.close()
            self._events.close()


def _point_time(t: Any) -> str:
    """A point's own time (the task's clock), or now when it has none we can write."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        with contextlib.suppress(OverflowError, ValueError, OSError):
            return iso_time(t)
    return now_iso()
