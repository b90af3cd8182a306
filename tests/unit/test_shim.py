"""worker/host/shim.py with real processes on this machine: the shim as an SSH channel would run it,
its stdin and stdout being pipes here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import run_processes, wait_until

SHIM = Path(__file__).resolve().parents[2] / "worker" / "host" / "shim.py"


def job(tmp_path: Path, code: str, run_id: str = "shim-test", **extra: object) -> dict:
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "abc").write_text(code)
    return {
        "cache": str(cache),
        "folder": str(tmp_path / "run"),
        "files": [["code/task.py", "abc", 0o644]],
        "argv": [sys.executable, "code/task.py"],
        "env": {"ORCHESTRATE_RUN_ID": run_id, "QUOTED": "$(echo no) 'x'"},
        "cwd": str(tmp_path / "run"),
        "log": str(tmp_path / "run" / "logs" / "worker-0.log"),
        "pidfile": str(tmp_path / "run" / "tasks" / "worker-0.json"),
        "run_id": run_id,
        "task": "worker-0",
        "attempt": 0,
        "grace_s": 2,
        **extra,
    }


def start(spec: dict) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-S", str(SHIM)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(spec) + "\n").encode())
    proc.stdin.flush()
    return proc


def finish(proc: subprocess.Popen[bytes]) -> bytes:
    """Wait for the shim to end with its stdin still open (closing it means: stop the task)."""
    proc.wait(timeout=30)
    assert proc.stdout is not None
    return proc.stdout.read()


def events(proc: subprocess.Popen[bytes]) -> list[dict]:
    assert proc.stderr is not None
    return [json.loads(line) for line in proc.stderr.read().decode().splitlines()]


def test_runs_the_task_streams_its_log_and_reports_its_exit(tmp_path: Path) -> None:
    code = "import os, sys\nprint('env', os.environ['QUOTED'])\nprint('to stderr', file=sys.stderr)\n"
    code += "sys.exit(3)\n"
    proc = start(job(tmp_path, code))
    out = finish(proc)
    assert proc.returncode == 3
    assert b"env $(echo no) 'x'" in out and b"to stderr" in out  # streamed back, value untouched
    kinds = [e["event"] for e in events(proc)]
    assert kinds == ["started", "exit"]
    log = (tmp_path / "run" / "logs" / "worker-0.log").read_text()
    assert log.startswith("===== orchestrate: worker-0 attempt 0 started") and "to stderr" in log


def test_closing_stdin_stops_the_task_and_its_children(tmp_path: Path) -> None:
    # the task ignores SIGTERM and has a child: both must go (SIGKILL after grace_s)
    code = (
        "import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = start(job(tmp_path, code, run_id="shim-eof"))
    assert wait_until(lambda: len(run_processes("shim-eof")) == 2, 15)
    assert proc.stdin is not None
    closed = time.monotonic()
    proc.stdin.close()  # the SSH channel is gone
    proc.wait(timeout=15)
    assert wait_until(lambda: run_processes("shim-eof") == [], 5)
    assert 2 <= time.monotonic() - closed < 8  # grace_s, then SIGKILL
    assert events(proc)[-1] == {"event": "exit", "code": -9}


def test_a_previous_attempt_still_running_is_stopped_first(tmp_path: Path) -> None:
    old = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        start_new_session=True,
        env={**os.environ, "ORCHESTRATE_RUN_ID": "shim-stale"},
    )
    (tmp_path / "run" / "tasks").mkdir(parents=True)
    (tmp_path / "run" / "tasks" / "worker-0.json").write_text(json.dumps({"pid": old.pid, "pgid": old.pid}))
    proc = start(job(tmp_path, "print('new attempt')\n", run_id="shim-stale", attempt=1))
    finish(proc)
    assert proc.returncode == 0
    assert old.wait(timeout=5) is not None  # stopped by the new attempt's shim
    log = (tmp_path / "run" / "logs" / "worker-0.log").read_text()
    assert f"stopped a previous attempt still running here (process group {old.pid})" in log
    record = json.loads((tmp_path / "run" / "tasks" / "worker-0.json").read_text())
    assert record["run_id"] == "shim-stale" and record["pid"] != old.pid  # now the new attempt's


def test_stop_mode_leaves_a_group_that_is_not_this_runs_alone(tmp_path: Path) -> None:
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        start_new_session=True,
        env={**os.environ, "ORCHESTRATE_RUN_ID": "someone-else"},
    )

    def stop(run_id: str) -> dict:
        res = subprocess.run(
            [sys.executable, "-S", str(SHIM), "--stop", run_id, "5", str(pidfile)],
            capture_output=True,
            check=True,
        )
        return json.loads(res.stdout)

    try:
        pidfile = tmp_path / "worker-0.json"
        pidfile.write_text(json.dumps({"pgid": other.pid}))
        answer = stop("my-run")
        assert "not this run's" in answer[str(pidfile)] and other.poll() is None
        answer = stop("someone-else")
        assert answer[str(pidfile)].startswith("stopped process group")
        assert other.wait(timeout=10) is not None
    finally:
        other.kill()
        other.wait()
