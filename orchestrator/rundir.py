"""Run record layer, read side: `orchestrate status`, `logs` and `down` on a run directory —
a detached run, or one started from another terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from orchestrator.errors import RunDirError
from orchestrator.launch.local import group_alive, signal_group
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
        return read_json(run_dir / "status.json")
    except FileNotFoundError:
        raise RunDirError(
            f"{run_dir} has no status.json yet (the run is starting, or never started)"
        ) from None
    except ValueError as exc:
        raise RunDirError(f"{run_dir}/status.json is unreadable: {exc}") from None


def coordinator_alive(run_dir: Path) -> int | None:
    """The pid of the run's coordinator process if it still runs (checked against its start time)."""
    try:
        info = read_json(run_dir / "coordinator.json")
        proc = psutil.Process(info["pid"])
        if abs(proc.create_time() - info["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
            return int(info["pid"])
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    return None


def live_task_groups(status: dict[str, Any]) -> list[int]:
    """Process groups of the run's tasks that still exist (pid and start time must match)."""
    groups = []
    for t in status.get("tasks", []):
        pgid, pid, created = t.get("pgid"), t.get("pid"), t.get("create_time")
        if not pgid or not group_alive(pgid):
            continue
        try:
            leader_ok = abs(psutil.Process(pid).create_time() - created) < 0.01
        except psutil.Error:
            leader_ok = False  # the leader is gone; the group lives on in its children
        try:
            same_run = leader_ok or any(
                os.getpgid(p.pid) == pgid and _env_run_id(p) == status.get("run_id")
                for p in psutil.process_iter()
            )
        except (ProcessLookupError, psutil.Error):
            same_run = False
        if same_run:
            groups.append(pgid)
    return groups


def _env_run_id(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("ORCHESTRATE_RUN_ID")
    except psutil.Error:
        return None


def down(run_dir: Path, grace_s: float = 10.0, out: Any = sys.stdout) -> int:
    """Stop a run from outside. Idempotent: a run already stopped is left as it is (exit 0)."""
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
    if (run_dir / "hosts.json").exists():  # ssh backend: the tasks ran on other machines
        return _down_remote(run_dir, status, out)
    groups = live_task_groups(status)
    if groups:
        out.write(f"coordinator gone; stopping {len(groups)} task process group(s) it left\n")
        for g in groups:
            signal_group(g, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
            time.sleep(0.1)
        for g in groups:
            signal_group(g, signal.SIGKILL)
    status = read_status(run_dir)
    out.write(f"run {status.get('name')}: {status.get('state')} ({status.get('reason', '')})\n")
    return 0


def _down_remote(run_dir: Path, status: dict[str, Any], out: Any) -> int:
    """The hosts are asked only when the coordinator may have left something: it died mid-run, or
    it could not confirm that a task on a cut-off host had exited."""
    events = run_dir / "events.jsonl"
    unconfirmed = events.exists() and "exit not confirmed" in events.read_text(encoding="utf-8")
    ok = True
    if not ClusterState(status.get("state", "PENDING")).is_terminal or unconfirmed:
        from orchestrator.launch.ssh import stop_leftovers

        out.write("asking the hosts to stop what is left of the run…\n")
        plan_tasks = read_json(run_dir / "plan.json")["tasks"]
        for line, reached in stop_leftovers(read_json(run_dir / "hosts.json"), plan_tasks):
            out.write(line + "\n")
            ok = ok and reached
    status = read_status(run_dir)
    out.write(f"run {status.get('name')}: {status.get('state')} ({status.get('reason', '')})\n")
    return 0 if ok else 1


def follow_logs(run_dir: Path, tasks: list[str], follow: bool, out: Any = sys.stdout) -> int:
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
        plan = read_json(run_dir / "plan.json")
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir}/plan.json is unreadable: {exc}") from None
    return [t["name"] for t in plan["tasks"]]
