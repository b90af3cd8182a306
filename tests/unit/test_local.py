"""The local launcher with real (non-TensorFlow) processes: process groups, logs, teardown."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

from orchestrator.launch.local import LocalLauncher, group_alive
from orchestrator.plan import TaskPlan
from orchestrator.spec.model import Role


def task(tmp_path: Path, body: str, name: str = "worker-0") -> TaskPlan:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(body))
    return TaskPlan(
        name=name,
        role=Role.WORKER,
        index=0,
        host="127.0.0.1",
        address="127.0.0.1:1",
        port=1,
        argv=(sys.executable, str(script)),
        env={"ORCHESTRATE_TASK": name, "PYTHONUNBUFFERED": "1"},
        cwd=str(tmp_path),
        in_cluster=True,
    )


STUBBORN = """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", ignore])
    print("child", child.pid, flush=True)
    time.sleep(600)
"""


def _child_pid(log: Path) -> int:
    for _ in range(100):
        for line in log.read_text().splitlines():
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"no child pid in {log.read_text()!r}")


def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    launcher = LocalLauncher()
    log = tmp_path / "w.log"
    handle = launcher.start(task(tmp_path, STUBBORN), 0, "tok", log)
    child = _child_pid(log)
    assert handle.process.pgid == handle.process.pid  # its own process group
    assert handle.poll() is None
    t0 = time.monotonic()
    launcher.stop([handle], grace_s=0.5)
    took = time.monotonic() - t0
    assert handle.poll() == -9
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not group_alive(handle.process.pgid)
    assert took < 5


def test_hurry_skips_the_grace_period(tmp_path):
    launcher = LocalLauncher()
    handle = launcher.start(task(tmp_path, STUBBORN), 0, "tok", tmp_path / "w.log")
    _child_pid(tmp_path / "w.log")
    hurry = threading.Event()
    hurry.set()
    t0 = time.monotonic()
    launcher.stop([handle], grace_s=30, hurry=hurry)
    assert time.monotonic() - t0 < 5
    assert not group_alive(handle.process.pgid)


def test_log_gets_attempt_marker_output_and_exit_code(tmp_path):
    launcher = LocalLauncher()
    log = tmp_path / "w.log"
    body = (
        "import os, sys\nprint('hello', os.environ['ORCHESTRATE_ATTEMPT'], os.environ['ORCHESTRATE_TOKEN'])\n"
    )
    body += "print('oops', file=sys.stderr)\nsys.exit(3)\n"
    for attempt in (0, 1):
        handle = launcher.start(task(tmp_path, body), attempt, "s3cret", log)
        deadline = time.monotonic() + 20
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.poll() == 3
    text = log.read_text()
    assert "worker-0 attempt 0 started" in text and "worker-0 attempt 1 started" in text
    assert "hello 0 s3cret" in text and "hello 1 s3cret" in text and text.count("oops") == 2


def test_sigterm_ends_a_normal_task_within_grace(tmp_path):
    launcher = LocalLauncher()
    handle = launcher.start(task(tmp_path, "import time\ntime.sleep(600)\n"), 0, "t", tmp_path / "w.log")
    time.sleep(0.2)
    launcher.stop([handle], grace_s=10)
    assert handle.poll() == -15


def test_unstartable_program_is_a_launch_error(tmp_path):
    import pytest

    from orchestrator.errors import LaunchError

    plan = task(tmp_path, "")
    bad = TaskPlan(**{**plan.__dict__, "argv": (str(tmp_path / "no-such-python"),)})
    with pytest.raises(LaunchError, match="cannot start worker-0"):
        LocalLauncher().start(bad, 0, "t", tmp_path / "w.log")
