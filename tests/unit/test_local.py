"""Launch layer, local backend, with real (non-TensorFlow) processes: ports reserved on opening,
process groups, logs, the TERM → grace → KILL routine (api.stop_all), leftovers found again from
status.json, a port taken between attempts."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.errors import LaunchError
from orchestrator.health.credentials import Credentials
from orchestrator.launch import api
from orchestrator.launch.api import Heartbeats, Prepared, TaskHandle, stop_all
from orchestrator.launch.local.backend import LocalBackend, LocalLeftovers, group_alive
from orchestrator.launch.local.ports import default_lock_dir
from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.plan.placement import Placement
from orchestrator.spec import ClusterSpec, parse_spec

RUN_ID = "t-20250101-000000"
# nothing listens: these tasks never post
HEARTBEATS = Heartbeats("127.0.0.1", 9, "http://127.0.0.1:9", Credentials())


def spec_of(tmp_path: Path, tasks: str) -> ClusterSpec:
    (tmp_path / "train.py").write_text("")
    text = f"name: t\nhosts:\n  - address: 10.0.0.1\n    tasks: {tasks}\njob:\n  script: train.py\n"
    return parse_spec(text, file="spec.yaml", base_dir=tmp_path)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what or predicate}")


def line_of(log: Path, word: str, timeout_s: float = 10.0) -> list[str]:
    """The first line of `log` that starts with `word`, split (waits for the task to write it)."""

    def find() -> list[str] | None:
        text = log.read_text() if log.exists() else ""
        return next((ln.split() for ln in text.splitlines() if ln.startswith(word)), None)

    return wait_for(find, timeout_s, f"{word!r} in {log}")  # type: ignore[no-any-return]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # reparented, never reaped: not running
    except psutil.NoSuchProcess:
        return True


def lock_held(port: int) -> bool:
    """True while some open file (the backend's reservation) holds the port's lock."""
    fd = os.open(default_lock_dir() / f"{port}.lock", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a lock we took goes with it
    return False


@dataclasses.dataclass
class Local:
    """An opened LocalBackend, its plan, and what each test started (stopped at its end)."""

    spec: ClusterSpec
    backend: LocalBackend
    placements: dict[str, Placement]
    plan: LaunchPlan
    folder: Path
    handles: list[TaskHandle] = dataclasses.field(default_factory=list)

    def start(self, body: str, name: str = "worker-0", attempt: int = 0) -> TaskHandle:
        """The plan's task (its env, its folder), running a small script instead of the worker."""
        script = self.folder / f"{name}.py"
        script.write_text(textwrap.dedent(body))
        task = dataclasses.replace(self.plan.task(name), argv=(sys.executable, str(script)))
        handle = self.backend.start(task, attempt, "s3cret", self.log(name))
        self.handles.append(handle)
        return handle

    def log(self, name: str = "worker-0") -> Path:
        return self.folder / f"{name}.log"


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Local]:
    spec = spec_of(tmp_path, "{worker: 2}")
    backend = LocalBackend(spec, tmp_path / "run", tmp_path)
    placements = backend.open(HEARTBEATS)
    made = Local(spec, backend, placements, make_plan(spec, RUN_ID, placements), tmp_path)
    yield made
    stop_all(made.handles, grace_s=0)  # whatever a test did, leave nothing running
    backend.close()


TRAPS_TERM = """
    import signal, sys, time
    def bye(*_):
        print("got TERM", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, bye)
    print("ready", flush=True)
    time.sleep(600)
"""

STUBBORN = """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", ignore])
    time.sleep(0.2)  # the child's handler is set by then (it is not our concern if not: KILL ends both)
    print("child", child.pid, flush=True)
    time.sleep(600)
"""

# The task exits at once on TERM; its grandchild (same process group) takes 0.8 s to finish.
SLOW_GRANDCHILD = """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if os.fork() == 0:
        def slowly(*_):
            time.sleep(0.8)
            os._exit(0)
        signal.signal(signal.SIGTERM, slowly)
        print("grandchild", os.getpid(), flush=True)
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
"""

# The task leaves at once; its grandchild (same group, same env) goes on.
LEAVES_A_GRANDCHILD = """
    import os, time
    if os.fork() == 0:
        print("grandchild", os.getpid(), flush=True)
        time.sleep(600)
        os._exit(0)
"""


# ---------------------------------------------------------------- opening and closing


def test_open_reserves_a_locked_port_per_task_and_places_them_here(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "{chief: 1, worker: 2}")
    backend = LocalBackend(spec, tmp_path / "run", tmp_path, python="/opt/py")
    try:
        places = backend.open(HEARTBEATS)
        assert list(places) == ["chief-0", "worker-0", "worker-1"]
        ports = [p.port for p in places.values()]
        assert len(set(ports)) == 3 and all(lock_held(port) for port in ports)
        for p in places.values():  # the spec's address is for the ssh backend: every task runs here
            assert (p.host, p.run_folder, p.cwd) == (
                "127.0.0.1",
                str((tmp_path / "run").resolve()),
                str(tmp_path),
            )
            assert (p.python, p.coordinator_url) == (("/opt/py",), HEARTBEATS.url)
        assert backend.record() == {"backend": "local"}
    finally:
        backend.close()
    assert not any(lock_held(port) for port in ports)  # close() let the ports go
    backend.close()  # a second close is harmless


def test_log_gets_attempt_marker_output_and_exit_code(local: Local) -> None:
    body = """
        import os, sys
        env = os.environ
        print("hello", env["ORCHESTRATE_ATTEMPT"], env["ORCHESTRATE_TOKEN"], env["ORCHESTRATE_TASK"])
        print("oops", file=sys.stderr)
        sys.exit(3)
    """
    for attempt in (0, 1):
        handle = local.start(body, attempt=attempt)
        assert wait_for(lambda h=handle: h.exited, what="the task's exit")  # type: ignore[misc]
        assert handle.poll() == 3 and handle.attempt == attempt
    text = local.log().read_text()
    assert "worker-0 attempt 0 started" in text and "worker-0 attempt 1 started" in text
    assert "hello 0 s3cret worker-0" in text and "hello 1 s3cret worker-0" in text and text.count("oops") == 2


def test_unstartable_program_is_a_launch_error(local: Local) -> None:
    bad = dataclasses.replace(local.plan.task("worker-0"), argv=(str(local.folder / "no-such-python"),))
    with pytest.raises(LaunchError, match="cannot start worker-0"):
        local.backend.start(bad, 0, "t", local.log())


# ---------------------------------------------------------------- stopping (api.stop_all)


def test_term_ends_a_task_that_handles_it(local: Local) -> None:
    handle = local.start(TRAPS_TERM)
    line_of(local.log(), "ready")
    assert handle.process.pgid == handle.process.pid  # its own process group
    assert handle.poll() is None and not handle.exited
    assert handle.where == "" and handle.reachable
    t0 = time.monotonic()
    assert stop_all([handle], grace_s=10) == []
    assert time.monotonic() - t0 < 2
    assert handle.poll() == 7 and handle.exited  # its own exit, not a KILL
    assert "got TERM" in local.log().read_text()
    assert not group_alive(handle.process.pgid)


def test_a_task_ignoring_term_is_killed_after_the_grace(local: Local) -> None:
    handle = local.start(STUBBORN)
    child = int(line_of(local.log(), "child")[1])
    t0 = time.monotonic()
    assert stop_all([handle], grace_s=0.5) == []
    took = time.monotonic() - t0
    assert 0.5 <= took < 2.5
    assert handle.poll() == -signal.SIGKILL
    assert gone(child) and not group_alive(handle.process.pgid)  # the whole group


def test_a_stopped_task_still_gets_to_handle_term(local: Local) -> None:
    handle = local.start(TRAPS_TERM)
    line_of(local.log(), "ready")
    os.kill(handle.process.pid, signal.SIGSTOP)
    proc = psutil.Process(handle.process.pid)
    wait_for(lambda: proc.status() == psutil.STATUS_STOPPED, what="the task stopped")
    t0 = time.monotonic()
    assert stop_all([handle], grace_s=5) == []
    # continued, it handled TERM itself (exit 7) at once, instead of being KILLed after the grace
    assert handle.poll() == 7 and time.monotonic() - t0 < 2


def test_stop_all_waits_until_the_whole_group_is_gone(local: Local) -> None:
    handle = local.start(SLOW_GRANDCHILD)
    grandchild = int(line_of(local.log(), "grandchild")[1])
    assert os.getpgid(grandchild) == handle.process.pgid
    t0 = time.monotonic()
    assert stop_all([handle], grace_s=5) == []
    took = time.monotonic() - t0
    # the task's own exit came at once; stop_all went on waiting for its grandchild's
    assert handle.poll() == 0 and gone(grandchild)
    assert 0.6 <= took < 2.5


def test_a_quick_task_gets_a_short_grace_while_the_others_keep_theirs(local: Local) -> None:
    server = local.start(STUBBORN)  # a server in join(): it never sees TERM
    line_of(local.log(), "child")
    trainer = local.start(TRAPS_TERM, name="worker-1")
    line_of(local.log("worker-1"), "ready")
    t0 = time.monotonic()
    assert stop_all([server, trainer], grace_s=30, quick=[server]) == []
    took = time.monotonic() - t0
    assert api.QUICK_GRACE_S <= took < api.QUICK_GRACE_S + 2.5  # not the 30 s
    assert server.poll() == -signal.SIGKILL and trainer.poll() == 7  # the other ended by its own TERM


def test_hurry_shortens_the_grace(local: Local) -> None:
    handle = local.start(STUBBORN)
    line_of(local.log(), "child")
    hurry = threading.Event()
    timer = threading.Timer(0.3, hurry.set)
    timer.start()
    t0 = time.monotonic()
    try:
        assert stop_all([handle], grace_s=30, hurry=hurry) == []
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 2.5
    assert handle.poll() == -signal.SIGKILL and not group_alive(handle.process.pgid)


# ---------------------------------------------------------------- leftovers (`orchestrate down`)


def status_of(handle: TaskHandle, run_id: str = RUN_ID, create_time: float | None = None) -> dict[str, Any]:
    """status.json as the coordinator wrote it for this one task."""
    p = handle.process
    row = {"task": handle.task.name, "pid": p.pid, "pgid": p.pgid, "create_time": p.create_time}
    if create_time is not None:
        row["create_time"] = create_time
    return {"run_id": run_id, "tasks": [row]}


def test_leftovers_stop_a_group_recorded_in_status(local: Local) -> None:
    handle = local.start(TRAPS_TERM)
    line_of(local.log(), "ready")
    lines = LocalLeftovers({"backend": "local"}, status_of(handle)).stop(grace_s=5)
    assert len(lines) == 1 and lines[0][1] is True
    assert "stopped 1 task process group" in lines[0][0] and "worker-0" in lines[0][0]
    assert wait_for(lambda: handle.poll() is not None, 2) and handle.poll() == 7
    assert not group_alive(handle.process.pgid)
    assert LocalLeftovers({"backend": "local"}, status_of(handle)).stop(grace_s=5) == []  # nothing left


def test_leftovers_find_a_group_whose_leader_is_gone_by_its_run_id(local: Local) -> None:
    handle = local.start(LEAVES_A_GRANDCHILD)
    grandchild = int(line_of(local.log(), "grandchild")[1])
    wait_for(lambda: handle.poll() is not None, what="the leader's exit")  # reaped: its pid is free
    lines = LocalLeftovers({"backend": "local"}, status_of(handle)).stop(grace_s=5)
    assert [ok for _, ok in lines] == [True] and gone(grandchild)


def test_leftovers_leave_a_recycled_pid_of_another_run_alone(local: Local) -> None:
    handle = local.start(TRAPS_TERM)
    line_of(local.log(), "ready")
    # the recorded start time is not this process's (its pid was recycled), and nothing in its
    # group carries the recorded run's id: it is not ours to stop
    status = status_of(handle, run_id="another-run", create_time=handle.process.create_time - 100)
    assert LocalLeftovers({"backend": "local"}, status).stop(grace_s=5) == []
    assert handle.poll() is None and group_alive(handle.process.pgid)
    # with the right run id, the same group is found by what its members carry
    status = status_of(handle, create_time=handle.process.create_time - 100)
    assert [ok for _, ok in LocalLeftovers({"backend": "local"}, status).stop(grace_s=5)] == [True]


# ---------------------------------------------------------------- between attempts


def test_before_attempt_moves_a_port_taken_meanwhile(local: Local) -> None:
    old = local.placements["worker-1"]
    assert local.backend.before_attempt(local.plan, 1) == Prepared()  # nothing taken: nothing moves
    with socket.socket() as squatter:  # another program, on every interface (as TF binds)
        squatter.bind(("0.0.0.0", old.port))
        squatter.listen()
        assert local.backend.before_attempt(local.plan, 0) == Prepared()  # the first attempt: as opened
        prepared = local.backend.before_attempt(local.plan, 1)
    assert list(prepared.moved) == ["worker-1"]
    new = prepared.moved["worker-1"]
    assert new.port != old.port and new == dataclasses.replace(old, port=new.port)
    assert lock_held(new.port) and not lock_held(old.port)  # the new one is ours, the old one let go
    assert new.port != local.placements["worker-0"].port
    # the next plan (made from the moved placement) is what the next attempt starts
    replanned = make_plan(local.spec, RUN_ID, {**local.placements, **prepared.moved})
    assert replanned.task("worker-1").port == new.port
    assert local.backend.before_attempt(replanned, 2) == Prepared()  # moved once, not again
    local.backend.close()
    assert not lock_held(new.port) and not lock_held(local.placements["worker-0"].port)


def test_leftovers_are_found_while_other_processes_come_and_go(
    local: Local, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = local.start(LEAVES_A_GRANDCHILD)
    grandchild = int(line_of(local.log(), "grandchild")[1])
    wait_for(lambda: handle.poll() is not None, what="the leader's exit")
    # a process that exits between being listed and being looked at (here: one already reaped)
    passing = subprocess.Popen([sys.executable, "-c", "pass"])
    listed = psutil.Process(passing.pid)
    passing.wait(timeout=10)
    every = psutil.process_iter

    def with_one_gone(*args: Any, **kwargs: Any) -> Iterator[psutil.Process]:
        if not args and not kwargs:  # the run-id search; group_alive's own listing is left as is
            yield listed
        yield from every(*args, **kwargs)

    monkeypatch.setattr(psutil, "process_iter", with_one_gone)
    lines = LocalLeftovers({"backend": "local"}, status_of(handle)).stop(grace_s=5)
    assert [ok for _, ok in lines] == [True] and gone(grandchild)
