"""Record room, read side: `orchestrate status`, `logs`, `wait` and `ls` on a run directory —
a detached run, or one started from another terminal.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LAUNCH, EXIT_OK, RunDirError, UsageError
from orchestrator.record.logtail import LogTailer, tail_lines
from orchestrator.record.quiet import collapse_redraws
from orchestrator.record.write import LOCK_NAME as _LOCK
from orchestrator.record.write import RUNS_DIR, read_json
from orchestrator.states import ClusterState

if TYPE_CHECKING:  # the spec's models (pydantic: 0.15 s) are not needed to read a run
    from orchestrator.spec.model import ClusterSpec
from worker.wire import MAX_FOLDERS


def resolve_run_dir(arg: str | None, starting_ok: bool = False) -> Path:
    """The run directory given, or the latest run under runs/. `starting_ok`: a folder whose
    coordinator is still starting (it holds the folder, no status.json yet) will do."""
    if arg is not None:
        path = Path(arg)
        if not (path / "status.json").exists() and not (path / "plan.json").exists():
            if starting_ok and (path / _LOCK).exists():
                return path
            raise RunDirError(f"{path} is not a run directory (no status.json or plan.json)")
        return path
    runs = list_run_dirs(RUNS_DIR)
    if not runs:
        raise RunDirError(f"no runs under {RUNS_DIR}/; give a run directory")
    return runs[-1]


def list_run_dirs(base: Path) -> list[Path]:
    """The run directories under `base`, oldest first (by their status.json's last change)."""
    try:
        runs = [p for p in base.iterdir() if (p / "status.json").is_file()]
    except OSError:
        return []
    return sorted(runs, key=lambda p: (p / "status.json").stat().st_mtime)


def run_summary(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """One run as `orchestrate ls` lists it."""
    now = time.time() if now is None else now
    try:
        status = read_status(run_dir)
    except RunDirError as exc:
        return {"run_dir": str(run_dir), "name": run_dir.name, "state": "UNREADABLE", "reason": str(exc)}
    state = str(status.get("state", "PENDING"))
    ended = has_ended(status)
    return {
        "run_dir": str(run_dir),
        "name": status.get("name"),
        "state": state,
        "stale": not ended and coordinator_alive(run_dir) is None,
        "started_at": status.get("started_at"),
        "age_s": max(0.0, now - (run_dir / "status.json").stat().st_mtime),
        "attempts": int(status.get("attempt", 0)) + 1,
        "restarts": status.get("restarts", 0),
        "reason": status.get("reason", ""),
    }


def lock_holder(run_dir: Path) -> int | None:
    """The pid of the coordinator holding `run_dir` (one starting, before its coordinator.json),
    read from the lock's file without taking the lock (taking it, even for an instant, could
    turn a starting coordinator away)."""
    try:
        path = run_dir / _LOCK
        pid = int(path.read_text(encoding="utf-8").split()[0])
        proc = psutil.Process(pid)
        # the pid was written by a process that had started by then: a later one reusing it is not it
        if proc.create_time() <= path.stat().st_mtime + 1 and proc.status() != psutil.STATUS_ZOMBIE:
            return pid
    except (OSError, ValueError, IndexError, psutil.Error):
        pass
    return None


def wait(run_dir: Path, timeout_s: float | None, poll_s: float = 0.5) -> tuple[int | None, str]:
    """Wait for a run to end: its exit code (that of `orchestrate up`) and a line saying how it
    ended; (None, why) when the timeout passes first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = _status_if_any(run_dir)
        if status is not None and has_ended(status):
            return exit_code_of(
                status
            ), f"run {status.get('name')}: {status['state']} ({status.get('reason', '')})"
        if coordinator_alive(run_dir) is None and lock_holder(run_dir) is None:
            time.sleep(poll_s)  # it may have written its last status as it went
            status = _status_if_any(run_dir)
            if status is not None and has_ended(status):
                continue
            if status is None:
                return EXIT_LAUNCH, f"{run_dir}: the run ended before it started{_log_hint(run_dir)}"
            return EXIT_FAILED, (
                f"run {status.get('name')}: its coordinator is gone, the run left {status.get('state')} "
                f"(its last recorded state); `orchestrate down {run_dir}` stops anything it left"
            )
        if deadline is not None and time.monotonic() >= deadline:
            state = status.get("state") if status else "starting"
            return None, f"{run_dir}: still {state} after {timeout_s:g} s"
        time.sleep(poll_s)


def has_ended(status: dict[str, Any]) -> bool:
    """Whether a status document's run has ended (SUCCEEDED, FAILED, INTERRUPTED); a state it does
    not know is not an end."""
    return status.get("state") in _ENDED


_ENDED = frozenset(s.value for s in ClusterState if s.is_terminal)


def _status_if_any(run_dir: Path) -> dict[str, Any] | None:
    return read_status(run_dir) if (run_dir / "status.json").exists() else None


def exit_code_of(status: dict[str, Any]) -> int:
    """An ended run's exit code: recorded since schema_version 1; derived from its state before."""
    code = status.get("exit_code")
    if isinstance(code, int):
        return code
    return {"SUCCEEDED": EXIT_OK, "INTERRUPTED": EXIT_INTERRUPTED}.get(str(status.get("state")), EXIT_FAILED)


def resume_command(run_dir: Path) -> str | None:
    """The exact command that continues the run (`orchestrate up SPEC --resume RUN_DIR …`), as its
    coordinator recorded it, with paths relative to here when they are below here."""
    try:
        argv = read_json(run_dir / "coordinator.json")["resume_argv"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return None
    return shlex.join(_relative(a) for a in argv)


def spec_path(run_dir: Path) -> str | None:
    """The spec file the run was started with, as its coordinator recorded it (relative to here
    when below here); None for a spec that was no file (the Python API's dict)."""
    try:
        argv = read_json(run_dir / "coordinator.json")["resume_argv"]
        return _relative(str(argv[2]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _relative(arg: str) -> str:
    if not os.path.isabs(arg):
        return arg
    try:
        return str(Path(arg).relative_to(Path.cwd()))
    except ValueError:
        return arg


def _log_hint(run_dir: Path) -> str:
    lines = tail_lines(run_dir / "coordinator.log", 5)
    return (": its coordinator.log ends\n" + "\n".join(f"  | {line}" for line in lines)) if lines else ""


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


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """events.jsonl's events (a line torn by a crash left out)."""
    out: list[dict[str, Any]] = []
    try:
        with open(run_dir / "events.jsonl", encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    out.append(event)
    except OSError:
        pass
    return out


def unconfirmed_tasks(run_dir: Path) -> list[str]:
    """Tasks whose exit the coordinator could not confirm (its `unconfirmed` events)."""
    out: list[str] = []
    for event in read_events(run_dir):
        if event.get("kind") == "unconfirmed":
            out += [str(t) for t in event.get("tasks", [])]
    return out


def read_record(run_dir: Path, name: str) -> dict[str, Any] | None:
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
        line = collapse_redraws(line)  # a Keras progress bar: its last state, not every redraw
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


def known_folders(run_dir: Path | None) -> list[str]:
    """The folders an earlier run learned its job checkpoints to (status.json), for its --resume."""
    try:
        folders = read_status(run_dir).get("checkpoint_folders") if run_dir is not None else None
    except RunDirError:
        return []
    if not isinstance(folders, list):
        return []
    return [f for f in folders if isinstance(f, str) and f.startswith("/")][:MAX_FOLDERS]


def diverged(status: Mapping[str, Any]) -> bool:
    """The run failed because its tasks started from different states: resuming it would meet the
    same checkpoints again, so `--resume` is not offered (supervise/restores.py)."""
    failures = status.get("failures")
    last = failures[-1] if isinstance(failures, list) and failures else None
    return isinstance(last, dict) and last.get("kind") == "diverged" and status.get("state") == "FAILED"


def resume_point(run_dir: Path | None, spec: ClusterSpec, spec_path: Path | None) -> tuple[str, int, int]:
    """The run id, attempt number and restart count a resumed run continues with: the same run
    goes on, its id names its folders on the hosts (and their checkpoints)."""
    if run_dir is None:
        raise UsageError("--resume needs the run directory")
    try:
        status = read_status(run_dir)
    except RunDirError as exc:
        raise UsageError(f"--resume {run_dir}: {exc}") from None
    if status.get("name") != spec.name:
        raise UsageError(
            f"--resume {run_dir}: that run is {status.get('name')!r}, this spec is {spec.name!r}; "
            "resume a run with the spec that started it"
        )
    state = ClusterState(status.get("state", "PENDING"))
    if not state.is_terminal and coordinator_alive(run_dir):
        raise UsageError(f"--resume {run_dir}: that run is still going (state {state.value})")
    if state is ClusterState.SUCCEEDED:
        raise UsageError(
            f"--resume {run_dir}: that run SUCCEEDED ({status.get('reason', '')}) "
            f"at {status.get('ended_at')}; "
            "there is nothing to resume — start a new run"
            + (f": orchestrate up {spec_path}" if spec_path is not None else "")
        )
    run_id = status.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise UsageError(f"--resume {run_dir}: its status.json records no run_id")
    return run_id, int(status.get("attempt", 0)) + 1, int(status.get("restarts", 0))
