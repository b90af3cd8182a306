"""Run record layer, read side: `orchestrate status`, `logs` and `down` on a run directory —
a detached run, or one started from another terminal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from orchestrator import launch
from orchestrator.errors import RunDirError
from orchestrator.logtail import LogTailer
from orchestrator.record import RUNS_DIR, read_json
from orchestrator.supervise.states import ClusterState


def resolve_run_dir(arg: str | None) -> Path:
    if arg is not None:
        path = Path(arg)
        if not (path / "status.json").exists() and not (path / "plan.json").exists():
            raise RunDirError(f"{path} is not a run directory (no status.json or plan.json)")
        return path
    runs = [p for p in RUNS_DIR.glob("*/") if (p / "status.json").exists()] if RUNS_DIR.exists() else []
    if not runs:
        raise RunDirError(f"no runs under {RUNS_DIR}/; give a run directory")
    return max(runs, key=lambda p: (p / "status.json").stat().st_mtime)


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        status = read_json(run_dir / "status.json")
    except FileNotFoundError:
        raise RunDirError(
            f"{run_dir} has no status.json yet (the run is starting, or never started)"
        ) from None
    except ValueError as exc:
        raise RunDirError(f"{run_dir}/status.json is unreadable: {exc}") from None
    if not isinstance(status, dict):
        raise RunDirError(f"{run_dir}/status.json is not a JSON object")
    return status


def coordinator_alive(run_dir: Path) -> int | None:
    """The pid of the run's coordinator process if it still runs (checked against its start time)."""
    try:
        info = read_json(run_dir / "coordinator.json")
        proc = psutil.Process(info["pid"])
        if abs(proc.create_time() - info["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        pass
    return None


def down(run_dir: Path, grace_s: float = 10.0, out: Any = None) -> int:
    """Stop a run from outside. Idempotent: a run already stopped is left as it is (exit 0).

    Its coordinator is asked first. The places its tasks ran (launch.reattach, from the backend's
    record) are asked only when the coordinator may have left something: it died mid-run, or it
    could not confirm that a task had exited (a host cut off)."""
    out = out if out is not None else sys.stdout
    pid = coordinator_alive(run_dir)
    if pid is not None:
        out.write(f"asking the coordinator (pid {pid}) to stop the run…\n")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 20
        while time.monotonic() < deadline and coordinator_alive(run_dir) is not None:
            time.sleep(0.1)
        if coordinator_alive(run_dir) is not None:
            os.kill(pid, signal.SIGTERM)  # second signal: immediate teardown
            time.sleep(3)
    status = read_status(run_dir)
    ok = True
    if not ClusterState(status.get("state", "PENDING")).is_terminal or unconfirmed_tasks(run_dir):
        record = _read_record(run_dir, "backend.json")
        if record is not None:  # without it, nothing was started
            out.write("coordinator gone; stopping what is left of the run…\n")
            plan = _read_record(run_dir, "plan.json") or {}
            for line, reached in launch.reattach(record, status, plan).stop(grace_s):
                out.write(line + "\n")
                ok = ok and reached
    status = read_status(run_dir)
    out.write(f"run {status.get('name')}: {status.get('state')} ({status.get('reason', '')})\n")
    return 0 if ok else 1


def unconfirmed_tasks(run_dir: Path) -> list[str]:
    """Tasks whose exit the coordinator could not confirm (its `unconfirmed` events)."""
    out: list[str] = []
    try:
        with open(run_dir / "events.jsonl", encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash
                if isinstance(event, dict) and event.get("kind") == "unconfirmed":
                    out += [str(t) for t in event.get("tasks", [])]
    except FileNotFoundError:
        pass
    return out


def _read_record(run_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        data = read_json(run_dir / name)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir}/{name} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise RunDirError(f"{run_dir}/{name} is not a JSON object")
    return data


def follow_logs(run_dir: Path, tasks: list[str], follow: bool, out: Any = None) -> int:
    out = out if out is not None else sys.stdout
    files = {t: run_dir / "logs" / f"{t}.log" for t in tasks}
    missing = [t for t, p in files.items() if not p.exists()]
    if missing:
        raise RunDirError(f"no log for {', '.join(missing)} in {run_dir}/logs")
    prefix = len(files) > 1

    def emit(task: str, line: str) -> None:
        out.write(f"[{task}] {line}\n" if prefix else line + "\n")
        out.flush()

    tailer = LogTailer(files, emit, from_start=True)
    tailer.poll()
    if follow:
        try:
            while True:
                time.sleep(0.3)
                tailer.poll()
                if coordinator_alive(run_dir) is None and read_status(run_dir).get("ended_at"):
                    tailer.poll()
                    break
        except KeyboardInterrupt:
            pass
    tailer.flush_partial()
    return 0


def task_names(run_dir: Path) -> list[str]:
    try:
        return [str(t["name"]) for t in read_json(run_dir / "plan.json")["tasks"]]
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir}/plan.json is unreadable: {exc}") from None
    except (KeyError, TypeError):
        raise RunDirError(f"{run_dir}/plan.json lists no tasks") from None
