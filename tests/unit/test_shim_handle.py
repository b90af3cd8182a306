"""orchestrator/launch/shim.py: what a task's shim says on its stderr, and the one handle every
backend that runs tasks through the shim uses (ssh, slurm) — here over plain pipes, with the real
shim and the real worker runtime, no root and no host."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch.api import ProcessInfo, Sig
from orchestrator.launch.local.placement import local_placements
from orchestrator.launch.shim import ShimEvents, ShimHandle, Transport, shim_job
from orchestrator.plan.launch_plan import make_plan
from orchestrator.spec.load import parse_spec
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]


def test_started_then_exit_are_read_and_other_text_is_kept_for_a_reason() -> None:
    events = ShimEvents()
    events.feed("bash: python3: not found")
    events.feed(json.dumps({"event": "started", "pid": 7, "pgid": 7, "create_time": 1.5, "step": "12.3"}))
    assert events.wait_started(1.0, closed="gone") is None
    assert events.info == ProcessInfo(7, 7, 1.5) and events.step == "12.3"
    assert not events.ended.is_set()
    events.feed(json.dumps({"event": "exit", "code": -9}))
    assert events.exit_code == -9 and events.ended.is_set()
    assert events.messages == ["bash: python3: not found"]


def test_a_start_that_never_came_says_why() -> None:
    events = ShimEvents()
    assert events.wait_started(0.1, closed="gone") == "no answer within 0.1 s"
    events.close()
    assert events.wait_started(5.0, closed="its step ended") == "its step ended"  # at once
    events.feed(json.dumps({"event": "error", "message": "cannot start /x/python: No such file"}))
    assert events.wait_started(5.0, closed="gone") == "cannot start /x/python: No such file"


def test_only_the_latest_lines_are_kept_each_cut_to_size() -> None:
    events = ShimEvents()
    for i in range(100):
        events.feed(f"line {i} " + "x" * 1000)
    assert len(events.messages) == 20 and events.messages[-1].startswith("line 99 ")
    assert all(len(m) == 500 for m in events.messages)


# --- the one shim handle, over a transport of plain pipes: the real shim, the real worker runtime --


class Pipes(Transport):
    """The shim as a child process of the test, its streams as pipes (what srun and an SSH channel
    carry): the transport is all that differs from the ssh and slurm backends."""

    where = "this machine"

    def __init__(self, popen: subprocess.Popen[bytes]):
        self.popen = popen

    def send(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.write(data)
            self.popen.stdin.flush()

    def read_events(self) -> bytes:
        assert self.popen.stderr is not None
        return os.read(self.popen.stderr.fileno(), 65536)

    def read_output(self) -> bytes:
        assert self.popen.stdout is not None
        return os.read(self.popen.stdout.fileno(), 65536)

    def close(self, confirmed: bool, events: ShimEvents) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.popen.stdin is not None
            self.popen.stdin.close()
        if not confirmed:
            self.popen.kill()
        self.popen.wait(timeout=10)


def run_by_shim(tmp_path: Path, script: str, python: str = sys.executable) -> ShimHandle:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    spec = parse_spec(
        "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\njob: {script: job.py}\n",
        file="s.yaml",
        base_dir=tmp_path,
    )
    places = local_placements(
        spec,
        {"worker-0": 1},
        run_dir=tmp_path / "run",
        spec_dir=tmp_path,
        coordinator_url="http://127.0.0.1:9",  # nothing listens: every heartbeat is refused
        python=python,
    )
    task = make_plan(spec, "t-1", places).task("worker-0")
    env = {**os.environ, **task.launch_env(attempt=2, token="x")}
    job = shim_job(
        task,
        2,
        env,
        run_id="t-1",
        folder=str(tmp_path / "run"),
        log=str(tmp_path / "run" / "logs" / "on-host.log"),
        pidfile=str(tmp_path / "run" / "tasks" / "worker-0.json"),
        grace_s=2.0,
    )
    shim = subprocess.Popen(
        [sys.executable, "-S", str(REPO / "worker" / "host" / "shim.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    handle = ShimHandle(task, 2, tmp_path / "worker-0.log", Pipes(shim))
    handle.transport.send((json.dumps(job) + "\n").encode())
    handle.wait_started(30)
    return handle


def test_a_failed_tasks_error_file_comes_home_with_its_exit(tmp_path: Path) -> None:
    """Its heartbeats all refused, the task raises: the shim brings its error file home as an
    event before its exit, and the handle gives it (type, message, traceback, step)."""
    handle = run_by_shim(
        tmp_path,
        """
        import worker
        worker.report(step=1)
        worker.report(step=2)
        raise KeyError("label")
        """,
    )
    assert wait_until(lambda: handle.poll() is not None, 60), "the task never ended"
    assert handle.poll() == 1 and handle.exited
    written = handle.written_error()
    assert written is not None and written.step == 2
    assert written.error.type == "KeyError" and written.error.message == "'label'"
    assert "raise KeyError" in written.error.traceback
    handle.release()
    assert wait_until(lambda: b"KeyError: 'label'" in (tmp_path / "worker-0.log").read_bytes(), 10)


def test_a_stopped_task_wrote_no_error_and_says_none(tmp_path: Path) -> None:
    handle = run_by_shim(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    assert handle.process.pid > 0 and handle.where == "this machine" and handle.reachable
    handle.signal(Sig.TERM)
    assert wait_until(lambda: handle.poll() is not None, 30)
    assert handle.poll() != 0 and handle.written_error() is None
    handle.release()


def test_a_shim_that_cannot_start_its_task_says_why(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="cannot start worker-0 on this machine: cannot start /no/python"):
        run_by_shim(tmp_path, "", python="/no/python")


def test_a_shim_that_does_not_answer_a_stacks_request_is_said_unanswering_until_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shim stopped (SIGSTOP: a host cut off, its connection not known lost): the stacks
    request goes unanswered, and the handle says so (a stop after a lost heartbeat does not wait
    for it); the shim going on, its next answer clears that."""
    from orchestrator.stacks import record

    monkeypatch.setattr(record, "TRANSPORT_S", 0.2)
    handle = run_by_shim(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    shim = handle.transport.popen  # type: ignore[attr-defined]
    try:
        assert not handle.unanswering
        os.kill(shim.pid, signal.SIGSTOP)
        doc = handle.stacks(time.monotonic() + 0.3, native=False)
        assert doc["state"] == "unknown" and "no answer from this machine" in doc["notes"][0], doc
        assert handle.unanswering and handle.reachable
        os.kill(shim.pid, signal.SIGCONT)
        doc = handle.stacks(time.monotonic() + 20, native=False)
        assert doc["state"] != "unknown" and doc["threads"], doc
        assert not handle.unanswering
    finally:
        os.kill(shim.pid, signal.SIGCONT)
        handle.signal(Sig.TERM)
        wait_until(lambda: handle.poll() is not None, 30)
        handle.release()
