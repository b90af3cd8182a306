"""Warm standbys: the worker's side (worker/warm/standby.py) as real processes whose `tensorflow` is a
small stand-in package put first on their path (the import a standby waits for is then quick and
can be made to fail); the local backend's (launch/local/standbys.py) and the rules every backend
shares (launch/standby.py). The real thing, with TensorFlow, is tests/e2e/test_recovery.py's."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from orchestrator.launch import standby
from orchestrator.launch.local.standbys import LocalStandbys
from orchestrator.launch.shim import ShimHandle
from orchestrator.launch.shim_standbys import ShimStandbys
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.spec import parse_spec
from orchestrator.spec.model import Role, Standby
from tests.conftest import wait_until
from tests.unit.test_shim_handle import Pipes
from worker import wire
from worker.wire import STANDBY_READY as READY

REPO = Path(__file__).resolve().parents[2]

# The stand-in records the policy of the thread that imports it (SCHED_IDLE: 5) and can sleep or fail.
FAKE_TF = """
import os, threading, time
IMPORTED_BY = (threading.get_native_id(), os.sched_getscheduler(threading.get_native_id()))
if os.environ.get("FAKE_TF_SLEEP_S"):
    time.sleep(float(os.environ["FAKE_TF_SLEEP_S"]))
if os.environ.get("FAKE_TF_FAILS"):
    raise ImportError("libtensorflow_framework.so.2: cannot open shared object file")
"""

SCRIPT = """
import json, os, sys, threading
import tensorflow
out = {
    "argv": sys.argv[1:],
    "tf_config": os.environ.get("TF_CONFIG"),
    "attempt": os.environ.get("ORCHESTRATE_ATTEMPT"),
    "kept": os.environ.get("KEPT"),
    "main_policy": os.sched_getscheduler(threading.get_native_id()),
    "import_policy": tensorflow.IMPORTED_BY[1],
    "imported_elsewhere": tensorflow.IMPORTED_BY[0] != threading.get_native_id(),
}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def fake_tf(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    (root / "tensorflow").mkdir(parents=True)
    (root / "tensorflow" / "__init__.py").write_text(FAKE_TF)
    (root / "keras").mkdir()
    (root / "keras" / "__init__.py").write_text("")
    return root


def start(fake_tf: Path, log: Path, **env: str) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATE_")}
    base["PYTHONPATH"] = f"{fake_tf}{os.pathsep}{REPO}"
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "standby"],
            env={**base, **env},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            start_new_session=True,
        )


def wait_for_line(path: Path, start: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        found = next((line for line in text.splitlines() if line.startswith(start)), None)
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError(f"{start!r} not in {path} within {timeout_s} s:\n{path.read_text()}")


def test_a_standby_becomes_its_task_with_the_attempts_variables(tmp_path: Path, fake_tf: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    own, task_log = tmp_path / "standby.log", tmp_path / "worker-0.log"
    proc = start(fake_tf, own, KEPT="from the start")
    assert wait_for_line(own, READY)
    env = {"TF_CONFIG": '{"cluster": {}}', wire.ENV_ATTEMPT: "1", wire.ENV_TOKEN: "t", "KEPT": "ignored"}
    assert proc.stdin is not None
    proc.stdin.write(
        standby.handover(["run", "--script", str(script), "--", "a b", "$(x)"], env, str(task_log))
    )
    proc.stdin.close()
    assert proc.wait(timeout=20) == 0, task_log.read_text()
    result: dict[str, Any] = json.loads(wait_for_line(task_log, "RESULT ")[len("RESULT ") :])
    assert (
        result["argv"] == ["a b", "$(x)"]
        and result["attempt"] == "1"
        and result["tf_config"] == '{"cluster": {}}'
    )
    assert result["kept"] == "from the start"  # only the per-attempt variables come with the handover
    assert result["imported_elsewhere"] and result["import_policy"] == os.SCHED_IDLE
    assert result["main_policy"] == os.SCHED_OTHER  # the task itself runs at its own priority
    assert "RESULT" not in own.read_text()  # the task's output is its log's, not the standby's


def test_a_standby_exits_at_once_when_its_coordinator_is_gone(tmp_path: Path, fake_tf: Path) -> None:
    proc = start(fake_tf, tmp_path / "standby.log", FAKE_TF_SLEEP_S="60")
    time.sleep(0.5)
    assert proc.stdin is not None
    began = time.monotonic()
    proc.stdin.close()  # what the coordinator's death (even by SIGKILL) does to the pipe
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - began < 5  # not after the 60 s import


def test_a_standby_that_cannot_import_tensorflow_says_why_at_once(tmp_path: Path, fake_tf: Path) -> None:
    own = tmp_path / "standby.log"
    proc = start(fake_tf, own, FAKE_TF_FAILS="1")
    assert proc.wait(timeout=20) == wire.EXIT_STANDBY_FAILED  # without waiting for a handover
    said = wait_for_line(own, "orchestrate-standby: cannot import tensorflow")
    assert "libtensorflow_framework.so.2" in said


def task_plan(tmp_path: Path, name: str = "worker-0", env: dict[str, str] | None = None) -> TaskPlan:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = (sys.executable, "-m", "worker", "run", "--script", str(script), "--")
    return TaskPlan(name, Role.WORKER, 0, "", "", 0, argv, env or {}, str(tmp_path), True)


def test_the_local_backend_says_a_broken_standby_once_and_then_starts_that_task_cold(
    tmp_path: Path, fake_tf: Path
) -> None:
    base = {**os.environ, "PYTHONPATH": f"{fake_tf}{os.pathsep}{REPO}", "FAKE_TF_FAILS": "1"}
    standbys = LocalStandbys(Standby.ON, standby.Verdict(True, ""), tmp_path / "standby")
    task = task_plan(tmp_path)
    [started] = standbys.prepare([task], base)
    assert started.startswith("warm standbys started for worker-0")
    deadline = time.monotonic() + 20
    news: list[str] = []
    while not news and time.monotonic() < deadline:
        news = standbys.news()
        time.sleep(0.05)
    assert len(news) == 1 and "worker-0 (this machine) exited 76" in news[0]
    assert "libtensorflow_framework.so.2" in news[0]
    assert standbys.news() == []  # said once
    assert standbys.status()[0]["state"] == "failed"
    popen, why = standbys.take(task, {**base, **task.launch_env(attempt=1, token="t")}, tmp_path / "w.log")
    assert popen is None and why == "its standby failed"
    assert standbys.status() == []  # the next one is prepared once the attempt is up


def test_a_standby_started_with_another_environment_is_not_used(tmp_path: Path, fake_tf: Path) -> None:
    base = {**os.environ, "PYTHONPATH": f"{fake_tf}{os.pathsep}{REPO}"}
    standbys = LocalStandbys(Standby.ON, standby.Verdict(True, ""), tmp_path / "standby")
    task = task_plan(tmp_path)
    standbys.prepare([task], base)
    deadline = time.monotonic() + 20
    while standbys.status()[0]["state"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = standbys.status()[0]["pid"]
    changed = {**base, "TF_CPP_MIN_LOG_LEVEL": "3", **task.launch_env(attempt=1, token="t")}
    popen, why = standbys.take(task, changed, tmp_path / "w.log")
    assert popen is None
    assert why == "its task's environment is not the one it was started with (TF_CPP_MIN_LOG_LEVEL)"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed, and reaped
    standbys.close()


def test_a_standby_still_importing_is_not_waited_for(tmp_path: Path, fake_tf: Path) -> None:
    """Its import runs at the lowest priority, which a task must not inherit: it starts cold."""
    base = {**os.environ, "PYTHONPATH": f"{fake_tf}{os.pathsep}{REPO}", "FAKE_TF_SLEEP_S": "60"}
    standbys = LocalStandbys(Standby.ON, standby.Verdict(True, ""), tmp_path / "standby")
    task = task_plan(tmp_path)
    standbys.prepare([task], base)
    assert standbys.status()[0]["state"] == "importing"
    popen, why = standbys.take(task, {**base, **task.launch_env(attempt=1, token="t")}, tmp_path / "w.log")
    assert popen is None and why.startswith("its standby was still importing TensorFlow")
    standbys.close()


FORKED = """
import json, os, sys, threading, time
import numpy, tensorflow
out = {
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "attempt": os.environ.get("ORCHESTRATE_ATTEMPT"),
    "main_policy": os.sched_getscheduler(threading.get_native_id()),
    "import_policy": tensorflow.IMPORTED_BY[1],
    "random": numpy.random.random(),
    "stack": [],
}
frame = sys._getframe()
while frame is not None:  # the Python frames beneath the job's code
    out["stack"].append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
    frame = frame.f_back
print("RESULT " + json.dumps(out), flush=True)
if os.environ["ORCHESTRATE_ATTEMPT"] == "3":
    time.sleep(60)
sys.exit(int(os.environ["ORCHESTRATE_ATTEMPT"]))
"""


def psutil_process(pid: int) -> psutil.Process:
    return psutil.Process(pid)


def ready_keeper(tmp_path: Path, fake_tf: Path) -> tuple[LocalStandbys, TaskPlan, dict[str, str]]:
    base = {**os.environ, "PYTHONPATH": f"{fake_tf}{os.pathsep}{REPO}"}
    standbys = LocalStandbys(Standby.ON, standby.Verdict(True, ""), tmp_path / "standby")
    task = task_plan(tmp_path)
    (tmp_path / "train.py").write_text(FORKED)
    standbys.prepare([task], base)
    deadline = time.monotonic() + 20
    while standbys.status()[0]["state"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standbys.status()[0]["state"] == "ready"
    return standbys, task, base


def exit_of(child: Any, timeout_s: float = 20.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while (code := child.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return code


def test_a_keeper_forks_each_attempts_task_and_stays_for_the_next(tmp_path: Path, fake_tf: Path) -> None:
    """Each restart is warm, a second one soon after the first included: the keeper is not used up."""
    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    keeper = standbys.status()[0]["pid"]
    results = []
    for attempt in (1, 2):
        log = tmp_path / f"w{attempt}.log"
        child, why = standbys.take(task, {**base, **task.launch_env(attempt=attempt, token="t")}, log)
        assert child is not None and why == ""
        assert exit_of(child) == attempt  # its own exit code, as its keeper reaped it
        results.append(json.loads(wait_for_line(log, "RESULT ")[len("RESULT ") :]))
        assert standbys.status() == [
            {
                "task": "worker-0",
                "host": "",
                "pid": keeper,
                "state": "ready",
                "rss_bytes": standbys.status()[0]["rss_bytes"],
            }
        ]
    first, second = results
    assert first["pid"] != second["pid"] and keeper not in (first["pid"], second["pid"])
    assert first["pgid"] == first["pid"] and second["pgid"] == second["pid"]  # a session of its own
    assert [r["attempt"] for r in results] == ["1", "2"]
    assert first["import_policy"] == os.SCHED_IDLE and first["main_policy"] == os.SCHED_OTHER
    assert first["random"] != second["random"]  # numpy's global state seeded anew, as in a new process
    standbys.close()


def test_a_keeper_hands_an_attempt_to_the_spare_it_made_ahead(tmp_path: Path, fake_tf: Path) -> None:
    """A spare is forked as soon as the keeper is ready and becomes the next attempt's task; the
    next is made SPARE_AFTER_S after that handover, not before; a spare that died is no task's end
    and not said, the handover then forked; the keeper's end is the spare's."""
    from worker.warm.spare import SPARE_AFTER_S

    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    keeper = psutil_process(standbys.status()[0]["pid"])
    assert wait_until(lambda: len(keeper.children()) == 1, timeout_s=10)
    spare = keeper.children()[0].pid

    def attempt(n: int) -> Any:
        log = tmp_path / f"w{n}.log"
        child, why = standbys.take(task, {**base, **task.launch_env(attempt=n, token="t")}, log)
        assert child is not None and why == "" and exit_of(child) == n
        assert json.loads(wait_for_line(log, "RESULT ")[len("RESULT ") :])["pid"] == child.pid
        return child

    assert attempt(1).pid == spare
    handed = time.monotonic()
    assert attempt(2).pid != spare  # forked then: no spare yet
    assert wait_until(lambda: len(keeper.children()) == 1, timeout_s=SPARE_AFTER_S + 10)
    assert time.monotonic() - handed >= SPARE_AFTER_S - 0.2  # not before: the task has the cores
    again = keeper.children()[0].pid
    os.kill(again, signal.SIGKILL)
    assert wait_until(lambda: not psutil.pid_exists(again), timeout_s=10)  # reaped by its keeper
    assert attempt(4).pid != again
    assert again not in standbys._ready["worker-0"]._events.exits and standbys.status()[0]["state"] == "ready"
    assert wait_until(lambda: len(keeper.children()) == 1, timeout_s=SPARE_AFTER_S + 10)
    last = keeper.children()[0].pid
    standbys.close()
    assert wait_until(lambda: not psutil.pid_exists(last), timeout_s=10)


def test_a_keepers_task_runs_beneath_the_frames_a_cold_task_runs_beneath(
    tmp_path: Path, fake_tf: Path
) -> None:
    """Taken by the spare or forked then, the task's job runs under the same Python frames as a
    cold task's (keeper.Become): CPython 3.11 maps and unmaps a 16 KiB chunk of frames each time a
    call crosses a chunk's start, so a task run deeper, inside the keeper's loop, crossed at other
    calls (a Keras first step: 7,400 crossings against 4,000 cold, issue 39); and a job's recursion
    limit is where it would be without us."""
    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    keeper = psutil_process(standbys.status()[0]["pid"])
    assert wait_until(lambda: len(keeper.children()) == 1, timeout_s=10)
    spare = keeper.children()[0].pid
    stacks = []
    for n in (1, 2):  # its spare, then a fork made at the handover (the next spare is not due yet)
        log = tmp_path / f"w{n}.log"
        child, why = standbys.take(task, {**base, **task.launch_env(attempt=n, token="t")}, log)
        assert child is not None and why == "" and exit_of(child) == n
        assert (child.pid == spare) == (n == 1)
        stacks.append(json.loads(wait_for_line(log, "RESULT ")[len("RESULT ") :])["stack"])
    standbys.close()
    cold = tmp_path / "cold.log"
    with open(cold, "wb") as out:
        env = {**base, **task.launch_env(attempt=1, token="t")}
        assert (
            subprocess.run(task.argv, env=env, cwd=task.cwd, stdout=out, timeout=60, check=False).returncode
            == 1
        )
    cold_stack = json.loads(wait_for_line(cold, "RESULT ")[len("RESULT ") :])["stack"]
    assert any(f.endswith("worker/__main__.py:<module>") for f in cold_stack)
    assert stacks == [cold_stack, cold_stack]


def test_a_keeper_stops_making_spares_that_keep_dying(monkeypatch: Any, capsys: Any) -> None:
    """A spare that dies unused is made again later; after GIVE_UP_AFTER in a row no more, said
    once; each handover is then forked by the keeper."""
    from worker.warm import spare

    monkeypatch.setattr(spare, "SPARE_AFTER_S", 0.0)
    made = []

    class Dead:
        def ended(self) -> bool:
            return True

    slot = spare.Slot(lambda: made.append(Dead()) or made[-1])
    for _ in range(10):
        slot.tend(closing=False)
    assert len(made) == spare.GIVE_UP_AFTER and slot.hand(b"{}\n") is None
    assert capsys.readouterr().err.count("spares in a row died unused") == 1


def test_a_spare_has_copied_the_pages_it_shared_with_its_keeper() -> None:
    """What a spare does before its handover (worker/warm/spare.py): pages its keeper wrote are its own
    afterwards (pagemap: exclusively mapped), so its task's first step does not fault on them."""
    from worker.warm import spare

    entries = b"".join(
        struct.pack("<Q", e) for e in (1 << 63, 1 << 63, (1 << 63) | (1 << 56), 0, 1 << 63, 1 << 63, 1 << 63)
    )
    assert spare.shared_runs(entries) == [(0, 2), (4, 3)]  # present and shared; exclusive or absent skipped
    memory = bytearray(64 * 4096)
    memory[::4096] = b"x" * 64  # written by this process: its own pages, shared once it forks
    first = -(-ctypes.addressof(ctypes.c_char.from_buffer(memory)) // 4096)  # whole pages inside
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            before = _exclusive_pages(first, 62)
            spare.own_pages()
            os.write(write, json.dumps([before, _exclusive_pages(first, 62)]).encode())
        finally:
            os._exit(0)
    os.close(write)
    before, after = json.loads(os.read(read, 4096))
    os.close(read)
    os.waitpid(pid, 0)
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    if release < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    assert before < 8 and after == 62  # shared after the fork; its own once copied


def _exclusive_pages(first: int, pages: int) -> int:
    """How many of these pages pagemap says are mapped by this process alone (bit 56)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read(pages * 8)
    return sum(bool((e >> 56) & 1) for (e,) in struct.iter_unpack("<Q", entries))


def test_a_keepers_task_dies_with_it_and_is_said_killed(tmp_path: Path, fake_tf: Path) -> None:
    """No task outlives the one process that can say how it ended."""
    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    log = tmp_path / "w3.log"
    child, _ = standbys.take(task, {**base, **task.launch_env(attempt=3, token="t")}, log)
    assert child is not None
    wait_for_line(log, "RESULT ")
    assert child.poll() is None
    os.killpg(standbys.status()[0]["pid"], 9)  # its own group, which the task is not in
    assert exit_of(child) == -9
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    standbys.close()


def test_a_keeper_whose_coordinator_is_gone_waits_for_its_task_then_exits(
    tmp_path: Path, fake_tf: Path
) -> None:
    """Its task stops itself when its coordinator is gone (and says how); the keeper is not its end."""
    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    keeper = psutil_process(standbys.status()[0]["pid"])
    log = tmp_path / "w3.log"
    child, _ = standbys.take(task, {**base, **task.launch_env(attempt=3, token="t")}, log)
    assert child is not None
    wait_for_line(log, "RESULT ")
    one = standbys._ready["worker-0"]
    assert one.popen.stdin is not None
    one.popen.stdin.close()  # what the coordinator's death does to the pipe
    time.sleep(0.5)
    assert keeper.is_running() and child.poll() is None
    os.kill(child.pid, 9)
    assert exit_of(child) == -9
    assert one.popen.wait(timeout=10) == 0
    standbys.close()


def test_standbys_are_for_runs_that_can_restart_and_jobs_that_leave_import_time_variables_alone(
    tmp_path: Path,
) -> None:
    def spec(restart: str, code: str = "import tensorflow\n") -> Any:
        (tmp_path / "train.py").write_text(code)
        text = "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\njob: {script: train.py}\n"
        text += restart
        return parse_spec(text, file="s.yaml", base_dir=tmp_path)

    assert standby.for_run(spec("")).on
    assert standby.for_run(spec("restart: {standby: off}\n")) == standby.Verdict(
        False, "restart.standby is off"
    )
    assert not standby.for_run(spec("restart: {max_restarts: 0}\n")).on
    assert standby.for_run(spec("restart: {max_restarts: 0, standby: on}\n")).on  # preemptions restart too
    sets = spec("", "import os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'\nimport tensorflow\n")
    verdict = standby.for_run(sets)
    assert not verdict.on and verdict.why.startswith(
        "train.py mentions TF_CPP_MIN_LOG_LEVEL, which TensorFlow"
    )


@pytest.mark.parametrize(
    ("mode", "tasks", "available", "on"),
    [
        (Standby.AUTO, 2, 8 * 2**30, True),
        (Standby.AUTO, 2, 2 * 2**30, False),  # 1.5 GiB of standbys would leave under 2 GiB
        (Standby.ON, 2, 2 * 2**30, True),
        (Standby.AUTO, 8, 6 * 2**30, False),
    ],
)
def test_auto_keeps_standbys_only_where_the_host_keeps_memory_available(mode, tasks, available, on) -> None:
    verdict = standby.for_host(mode, tasks, available, 16 * 2**30)
    assert verdict.on is on
    assert f"{tasks} × 750 MiB" in verdict.why


def test_a_tasks_command_splits_into_its_standbys_and_the_arguments_handed_to_it() -> None:
    argv = ("/venv/bin/python", "-m", "worker", "loop", "--module", "m.py")
    assert standby.command(argv) == (
        ("/venv/bin/python", "-m", "worker", "standby"),
        ("loop", "--module", "m.py"),
    )
    assert standby.command(("bash", "-c", "true")) is None
    assert (
        standby.differs({"A": "1", "TF_CONFIG": "x"}, {"A": "1", "TF_CONFIG": "y", wire.ENV_ATTEMPT: "2"})
        is None
    )
    changed = standby.differs({"A": "1"}, {"A": "2", "B": "3"})
    assert changed == "its task's environment is not the one it was started with (A, B)"


def shim_standby(
    tmp_path: Path, fake_tf: Path, env: dict[str, str] | None = None, read: bool = True, **part: Any
) -> tuple[subprocess.Popen[bytes], list[dict]]:
    """worker/host/shim.py in standby mode, as an ssh channel runs it: its module a copy named by its
    checksum (as in a host's cache); its events collected as they come."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "f00d").write_bytes((REPO / "worker" / "host" / "shim_standby.py").read_bytes())
    run = tmp_path / "run"
    job = {
        "cache": str(cache),
        "folder": str(run),
        "files": [],
        "argv": [sys.executable, "-m", "worker", "standby"],
        "env": {"PYTHONPATH": f"{fake_tf}{os.pathsep}{REPO}", "ORCHESTRATE_RUN_ID": "r-standby"}
        | (env or {}),
        "cwd": str(tmp_path),
        "run_id": "r-standby",
        "task": "worker-0",
        "grace_s": 2,
        "standby": {
            "module": str(cache / "f00d"),
            "log": str(run / "logs" / "standby" / "worker-0.log"),
            "need": None,
            "keep": None,
            **part,
        },
    }
    proc = subprocess.Popen(
        [sys.executable, "-S", str(REPO / "worker" / "host" / "shim.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write((json.dumps(job) + "\n").encode())
    proc.stdin.flush()
    said: list[dict] = []
    stderr = proc.stderr

    def read_all() -> None:
        for line in stderr:
            said.append(json.loads(line))

    if read:
        threading.Thread(target=read_all, daemon=True).start()
    return proc, said


def until(said: list[dict], event: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((e for e in said if e["event"] == event), None)
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError(f"no {event!r} within {timeout_s} s: {said}")


def kept_go(tmp_path: Path, attempt: int) -> dict[str, Any]:
    """What a GO line carries for a kept shim's worker-0 (its task: FORKED)."""
    (tmp_path / "train.py").write_text(FORKED)
    log = tmp_path / "run" / "logs" / "worker-0.log"
    env = {"TF_CONFIG": "{}", wire.ENV_ATTEMPT: str(attempt), wire.ENV_TOKEN: "secret"}
    return {
        "attempt": attempt,
        "log": str(log),
        "pidfile": str(tmp_path / "run" / "tasks" / "worker-0.json"),
        "handover": json.loads(
            standby.handover(["run", "--script", str(tmp_path / "train.py")], env, str(log))
        ),
    }


def test_a_shim_keeps_its_standby_and_forks_each_attempts_task_from_it(tmp_path: Path, fake_tf: Path) -> None:
    proc, said = shim_standby(tmp_path, fake_tf)
    waiting = until(said, "standby")
    until(said, "standby_ready")
    log = tmp_path / "run" / "logs" / "worker-0.log"
    assert proc.stdin is not None
    for attempt in (1, 2):
        error_file = tmp_path / "run" / "errors" / f"worker-0-{attempt}.json"
        go = kept_go(tmp_path, attempt) | {"error_file": str(error_file)}
        proc.stdin.write(f"GO {json.dumps(go)}\n".encode())
        proc.stdin.flush()
        started = until(said, "started")
        assert started["pid"] != waiting["pid"]  # forked from the standby, which stays
        assert until(said, "exit")["code"] == attempt  # the task's own exit code
        said.clear()
        recorded = json.loads((tmp_path / "run" / "tasks" / "worker-0.json").read_text())
        assert recorded["pgid"] == started["pid"] and recorded["run_id"] == "r-standby"
    text = log.read_text()
    assert "===== orchestrate: worker-0 attempt 2 started" in text
    results = [json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")]
    assert [r["attempt"] for r in results] == ["1", "2"] and results[0]["pid"] != results[1]["pid"]
    assert proc.poll() is None
    os.kill(waiting["pid"], 0)  # still there, for the next attempt
    proc.stdin.close()  # the coordinator done with it: stopped, and said
    assert until(said, "exit")["code"] == 0 and proc.wait(timeout=10) == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(waiting["pgid"], 0)


def test_a_kept_shim_between_attempts_answers_sigterm_itself(tmp_path: Path, fake_tf: Path) -> None:
    """The ended task's group is no one's to signal: sshd stopping the shim then stops the shim,
    and its standby follows (end of file)."""
    proc, said = shim_standby(tmp_path, fake_tf)
    waiting = until(said, "standby")
    until(said, "standby_ready")
    go = kept_go(tmp_path, 1)
    assert proc.stdin is not None
    proc.stdin.write(f"GO {json.dumps(go)}\n".encode())
    proc.stdin.flush()
    until(said, "started")
    assert until(said, "exit")["code"] == 1  # the task's own exit code
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert wait_until(lambda: _gone(waiting["pid"]), timeout_s=10)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_kept_shims_end_of_file_stops_the_task_it_runs_and_its_standby(
    tmp_path: Path, fake_tf: Path
) -> None:
    """As any shim's: a task never outlives its coordinator's connection."""
    proc, said = shim_standby(tmp_path, fake_tf)
    waiting = until(said, "standby")
    until(said, "standby_ready")
    go = kept_go(tmp_path, 3)
    log = Path(go["log"])
    assert proc.stdin is not None
    proc.stdin.write(f"GO {json.dumps(go)}\n".encode())
    proc.stdin.flush()
    task = until(said, "started")["pid"]
    wait_for_line(log, "RESULT ")  # it sleeps now
    proc.stdin.write(b"ALIVE\nTERM\n")  # passed on to the task's group
    proc.stdin.flush()
    assert until(said, "exit")["code"] == 143  # the runtime's own answer to SIGTERM
    said.clear()
    proc.stdin.write(f"GO {json.dumps(go)}\n".encode())
    proc.stdin.flush()
    again = until(said, "started")["pid"]
    wait_for_line(log, "RESULT ")
    proc.stdin.close()
    assert proc.wait(timeout=15) == 0
    assert [e["event"] for e in said] == ["started", "exit", "exit"]  # the task's, then the shim's
    for pid in (task, again, waiting["pid"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_each_attempt_of_a_kept_shim_has_a_handle_of_its_own(tmp_path: Path, fake_tf: Path) -> None:
    """The coordinator's side: each attempt's events and output go to its own handle, over the one
    transport; what the standby says stays with the first; an attempt's end lets go of it alone."""
    proc, _ = shim_standby(tmp_path, fake_tf, read=False)
    task = task_plan(tmp_path)
    (tmp_path / "train.py").write_text(FORKED)
    own = ShimHandle(task, 0, tmp_path / "standby-out.log", Pipes(proc))
    assert wait_until(lambda: own.events.standby_ready, 20)
    keeper = own.events.standby
    assert keeper is not None
    for attempt in (1, 2):
        log = tmp_path / f"attempt-{attempt}.log"
        handle = own.next_attempt(task, attempt, log)
        env = {"TF_CONFIG": "{}", wire.ENV_ATTEMPT: str(attempt), wire.ENV_TOKEN: "t"}
        on_host = tmp_path / "run" / "logs" / f"worker-0.{attempt}.log"
        go = {
            "attempt": attempt,
            "log": str(on_host),
            "pidfile": str(tmp_path / "run" / "tasks" / "worker-0.json"),
            "handover": json.loads(
                standby.handover(["run", "--script", str(tmp_path / "train.py")], env, str(on_host))
            ),
        }
        own.transport.send(f"GO {json.dumps(go)}\n".encode())
        handle.wait_started(20)
        assert handle.process.pid not in (0, keeper.pid)
        assert wait_until(lambda h=handle: h.poll() is not None, 20)
        assert handle.poll() == attempt and handle.exited, (handle.events.messages, on_host.read_text())
        said = f'"attempt": "{attempt}"'
        assert wait_until(lambda f=log, a=said: a in (f.read_text() if f.exists() else ""), 10)
        handle.release()  # the shim and its standby stay
        assert proc.poll() is None and own.poll() is None and not own.events.ended.is_set()
    assert own.events.standby == keeper and own.events.info is None
    own.transport.close(True, own.events)  # the run's end: the standby stopped, the shim gone
    assert wait_until(own.events.ended.is_set, 10) and own.events.exit_code == 0


def test_a_shim_reads_only_its_own_standbys_ready_line(tmp_path: Path, fake_tf: Path) -> None:
    """A task's standby log is appended to attempt after attempt: the previous standby's ready
    line in it says nothing of this one, still importing (it would be handed an attempt and make
    its task wait on an import at the lowest priority)."""
    log = tmp_path / "run" / "logs" / "standby" / "worker-0.log"
    log.parent.mkdir(parents=True)
    log.write_text("===== orchestrate: standby of worker-0 =====\norchestrate-standby: ready 3.10 s\n")
    proc, said = shim_standby(tmp_path, fake_tf, env={"FAKE_TF_SLEEP_S": "60"})
    until(said, "standby")
    time.sleep(1.5)  # the shim looks every 0.2 s
    assert not any(e["event"] == "standby_ready" for e in said), said
    assert proc.stdin is not None
    proc.stdin.close()  # the coordinator done with it: stopped
    assert proc.wait(timeout=10) == 0


def test_a_shim_refuses_a_standby_the_hosts_memory_cannot_keep(tmp_path: Path, fake_tf: Path) -> None:
    proc, said = shim_standby(tmp_path, fake_tf, need=2**60, keep=2**30)
    refused = until(said, "standby_refused")
    assert refused["available"] > 0 and refused["total"] >= refused["available"]
    assert proc.wait(timeout=10) == 0 and not any(e["event"] == "standby" for e in said)


def test_a_shim_whose_coordinator_falls_silent_stops_its_standby(tmp_path: Path, fake_tf: Path) -> None:
    """A cut host's sshd may never see its connection end: the coordinator's word is awaited."""
    proc, said = shim_standby(tmp_path, fake_tf, alive_s=1.5)
    waiting = until(said, "standby")
    assert proc.stdin is not None
    for _ in range(4):  # told it is there: it waits on
        proc.stdin.write(b"ALIVE\n")
        proc.stdin.flush()
        time.sleep(0.5)
    assert proc.poll() is None
    began = time.monotonic()
    assert until(said, "exit", timeout_s=10)["code"] == 0  # then silence: it stops
    assert proc.wait(timeout=10) == 0 and time.monotonic() - began < 5
    with pytest.raises(ProcessLookupError):
        os.killpg(waiting["pgid"], 0)


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.ended = self.closed = False

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def end_input(self) -> None:
        self.ended = True

    def close(self, *args: Any) -> None:
        self.closed = True


def _shim_handle() -> Any:
    """What ShimStandbys reads of a shim's handle (the real ones are tests/e2e's): a ready standby."""
    events = SimpleNamespace(
        ended=threading.Event(), standby_failed=None, standby_refused=None, standby_ready=True, standby=None
    )
    handle = SimpleNamespace(transport=_Transport(), events=events, attempts=[])
    handle.next_attempt = lambda task, attempt, log: handle.attempts.append(attempt) or f"attempt {attempt}"
    return handle


def test_shim_standbys_start_hosts_in_parallel_on_a_thread_of_their_own(tmp_path: Path) -> None:
    """A host slow to answer (its connection renewed) never holds up the supervisor that asked;
    one that fails is said; one started after the run ended is stopped at once."""
    (tmp_path / "train.py").write_text("import tensorflow\n")
    text = "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 3}}]\njob: {script: train.py}\n"
    spec = parse_spec(text + "restart: {max_restarts: 1, standby: on}\n", file="s.yaml", base_dir=tmp_path)
    tasks = [task_plan(tmp_path, f"worker-{i}") for i in range(3)]
    slow, handles = threading.Event(), {}

    def open_one(task: TaskPlan) -> Any:
        if task.name == "worker-2":
            raise OSError("No route to host")
        if task.name == "worker-1":
            assert slow.wait(20)
        handles[task.name] = _shim_handle()
        return handles[task.name], dict(task.env), "h0"

    standbys = ShimStandbys(spec)
    began = time.monotonic()
    assert standbys.prepare(tasks, open_one) == []  # said later, with the news
    assert time.monotonic() - began < 1.0 and standbys.status() == []
    assert standbys.prepare(tasks, open_one) == []  # asked again meanwhile: nothing started twice
    slow.set()
    news: list[str] = []
    deadline = time.monotonic() + 20
    while len(news) < 2 and time.monotonic() < deadline:
        news += standbys.news()
        time.sleep(0.02)
    assert news == [
        "the standby of worker-2 could not be started: No route to host",
        "warm standbys started for worker-0, worker-1 (at the lowest CPU priority)",
    ]
    assert [s["task"] for s in standbys.status()] == ["worker-0", "worker-1"]
    # a standby handed an attempt has a handle for it, and stays for the next
    log = tmp_path / "w.log"
    assert standbys.take(tasks[0], dict(tasks[0].env), "h0", {"attempt": 1}, log)[0] == "attempt 1"
    assert handles["worker-0"].transport.sent == [b'GO {"attempt": 1}\n']
    assert handles["worker-0"].attempts == [1] and len(standbys.status()) == 2
    standbys.take(tasks[1], {"OTHER": "1"}, "h0", {"attempt": 1}, log)  # not used: stopped
    assert handles["worker-1"].transport.ended and [s["task"] for s in standbys.status()] == ["worker-0"]
    handles["worker-0"].events.standby_failed = "MemoryError\nKilled"  # ready, then gone: said so
    assert standbys.news() == [
        "the standby of worker-0 on h0 exited after importing TensorFlow: MemoryError | Killed"
    ]
    # the run ends while a standby is still being started: it is stopped once it is there
    slow.clear()
    standbys.prepare(tasks[1:2], open_one)
    first = handles["worker-1"]
    standbys.close()
    slow.set()
    deadline = time.monotonic() + 20
    while handles["worker-1"] is first and time.monotonic() < deadline:
        time.sleep(0.02)
    while not handles["worker-1"].transport.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert handles["worker-1"].transport.ended and standbys.status() == []
    assert handles["worker-0"].transport.ended  # kept standbys end with the run


def test_a_keeper_lets_its_task_answer_a_sigterm_sent_to_both(tmp_path: Path, fake_tf: Path) -> None:
    """Slurm signals every process of a step (a time limit, a preemption): the task saves and
    exits as it would; its keeper stays, and its task is not killed with it."""
    standbys, task, base = ready_keeper(tmp_path, fake_tf)
    keeper = standbys.status()[0]["pid"]
    log = tmp_path / "w3.log"
    child, _ = standbys.take(task, {**base, **task.launch_env(attempt=3, token="t")}, log)
    assert child is not None
    wait_for_line(log, "RESULT ")
    os.kill(keeper, signal.SIGTERM)
    os.kill(child.pid, signal.SIGTERM)
    assert exit_of(child) == 143  # the runtime's own answer, not its keeper's end (-9)
    assert standbys.status()[0]["state"] == "ready"
    standbys.close()


def test_a_pid_used_again_is_not_taken_for_the_old_tasks_end() -> None:
    """A keeper's events: an exit belongs to the task of that pid until a fork says the pid again."""
    from worker.host.shim_standby import KeeperEvents

    read, write = os.pipe()
    try:
        events = KeeperEvents(read)
        os.write(write, b'{"event": "started", "pid": 100}\n{"event": "exit", "pid": 100, "code": 3}\n')
        assert events.read(5.0) and events.started == [100]
        assert events.exit_of(100, wait=False) == 3
        os.write(write, b'{"event": "started", "pid": 100}\nnot json\n')
        assert events.read(5.0) and events.started == [100, 100]
        assert events.exit_of(100, wait=False) is None  # the new task runs
        os.write(write, b'{"event": "exit", "pid": 100, "code": -9}\n')
        assert events.exit_of(100, wait=True) == -9
    finally:
        os.close(read)
        os.close(write)


def test_a_hosts_standbys_without_their_page_copy_are_said_once_per_host() -> None:
    """The shim's word (its standby's log line, wire.STANDBY_NO_PAGE_COPY) taken, hostile text
    shown safely; each host said once however many standbys wait there."""
    from orchestrator.launch.shim import ShimEvents
    from orchestrator.launch.standby import PageCopies

    events = ShimEvents()
    events.feed(
        json.dumps({"event": "standby_ready", "page_copy": "this kernel (4.18\u202e) refuses it" + "x" * 900})
    )
    assert events.standby_ready and events.page_copy is not None
    assert events.page_copy.startswith("this kernel (4.18\\u202e) refuses it") and len(events.page_copy) < 600
    plain = ShimEvents()
    plain.feed(json.dumps({"event": "standby_ready", "page_copy": None}))
    assert plain.standby_ready and plain.page_copy is None
    copies = PageCopies()
    said = copies.said("lab-2", events.page_copy) + copies.said("lab-2", "again") + copies.said("lab-3", None)
    assert [(d.what, d.where) for d in said] == [("page_copy", "lab-2")]
    assert said[0].said.startswith("warm standbys on lab-2 hand over without their page copy (this kernel")


def test_check_says_a_kernel_without_the_page_copy_before_any_run(tmp_path) -> None:
    """`orchestrate check` of a local spec under a kernel that refuses MADV_POPULATE_WRITE (for
    real: tests/seccomp.py): the warning, its cause and the fix; none where the kernel has it."""
    from tests import seccomp

    if not seccomp.SUPPORTED:
        pytest.skip("the seccomp filter of tests/seccomp.py is x86_64's")
    (tmp_path / "job.py").write_text("")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\njob: {script: job.py}\n")
    check = [sys.executable, "-m", "orchestrator", "check", str(spec)]
    refused = subprocess.run(
        [sys.executable, seccomp.__file__, "no-populate-write", "--", *check],
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = (
        "warning: this machine: warm standbys hand over without their page copy (this kernel ("
        f"{os.uname().release}) refuses madvise(MADV_POPULATE_WRITE): Linux 5.14 and later have it)"
    )
    assert said in refused.stdout, refused.stdout + refused.stderr
    plain = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert "page copy" not in plain.stdout, plain.stdout
