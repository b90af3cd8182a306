"""A hung job's stacks (issue 26), without TensorFlow: the reader on real processes (py-spy and the
runtime's own dump, a stopped one, one gone, one whose job took the signal, a deep recursion), the
document's bounds, where each task was in one line, whom the policy blames, the supervisor's
capture before a stop, and a live run's requests through its run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch.api import ProcessInfo, Sig, TaskHandle
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.stacks import live, record
from orchestrator.stacks.record import Capture, capture_all, checked
from orchestrator.stacks.where import where
from orchestrator.states import ClusterState, FailureKind
from orchestrator.supervise import policy
from orchestrator.supervise.policy import Action, Decision, Failure
from tests.conftest import REPO, wait_until
from tests.unit.test_supervisor import SPEC, beat, make, plan_of, start_running
from worker.host import stacks

PY_SPY = stacks.find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")

# A job without TensorFlow, under the worker runtime (its dump registered), that hangs as asked.
JOB = """
import os, signal, sys, threading, time
if os.environ.get("OWN_HANDLER"):
    signal.signal(signal.SIGRTMIN + 6, lambda *_: print("the job's handler ran", flush=True))
if os.environ.get("RESET_HANDLER"):
    signal.signal(signal.SIGRTMIN + 6, signal.SIG_DFL)
lock = threading.Lock()
def wait_for_lock():
    lock.acquire()
    lock.acquire()  # deadlock
def deep(n):
    return deep(n - 1) if n else wait_for_lock()
def spin():
    n = 0
    while True:
        n += 1
threading.Thread(target=spin, name="spinner", daemon=True).start()
print("ready", flush=True)
deep(int(os.environ.get("DEPTH", "0")))
"""


@pytest.fixture
def hung(tmp_path):
    """Start the job under the runtime; (process, its stacks file)."""
    made: list[subprocess.Popen[str]] = []
    (tmp_path / "job.py").write_text(JOB)

    def start(**env: str) -> tuple[subprocess.Popen[str], str]:
        run = {
            "ORCHESTRATE_RUN_DIR": str(tmp_path),
            "ORCHESTRATE_TASK": "worker-1",
            "ORCHESTRATE_ATTEMPT": "0",
        }
        job = str(tmp_path / "job.py")
        code = (
            "import runpy; from worker.task import runtime; "
            f"runtime.run_reported(lambda: runpy.run_path({job!r}))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, **run, **env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        made.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.2)  # into the lock
        return proc, stacks.path(str(tmp_path), "worker-1", 0)

    yield start
    for proc in made:
        proc.kill()
        proc.wait()


def main_frames(doc: dict[str, Any]) -> list[str]:
    main = next(t for t in doc["threads"] if t["main"])
    return [f["function"] for f in main["frames"] if not f["native"]]


@needs_py_spy
def test_py_spy_reads_every_thread_with_its_native_frames(hung):
    proc, dumps = hung()
    doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=PY_SPY)
    assert doc["method"] == "py-spy" and doc["native"] is True and doc["state"] == "running", doc["notes"]
    assert main_frames(doc)[:2] == ["wait_for_lock", "deep"]
    spinner = next(t for t in doc["threads"] if t["name"] == "spinner")
    assert spinner["active"] is True and spinner["frames"][0]["function"] == "spin"
    assert any(f["native"] and "acquire" in f["function"] for f in doc["threads"][0]["frames"])
    deadlock = JOB.splitlines().index("    lock.acquire()  # deadlock") + 1
    assert where("worker-1", doc).line.startswith(f"in wait_for_lock (job.py:{deadlock}), not in TensorFlow")


def test_without_py_spy_the_runtimes_own_dump_answers(hung):
    proc, dumps = hung()
    doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=None)
    assert doc["method"] == "faulthandler" and doc["native"] is False, doc["notes"]
    assert main_frames(doc)[:2] == ["wait_for_lock", "deep"]
    assert any(t["frames"][0]["function"] == "spin" for t in doc["threads"])
    assert proc.poll() is None  # the dump left it running


def test_the_runtimes_dump_file_keeps_one_dump_at_most(hung):
    proc, dumps = hung()
    header = Path(dumps).read_text()
    for _ in range(3):
        doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=None)
        assert doc["method"] == "faulthandler"
        assert Path(dumps).read_text() == header  # read, then cut back: a live read once a second
    assert Path(dumps).stat().st_mode & 0o777 == 0o600


def test_py_spy_threads_without_their_os_id_python_before_3_11():
    raw = [
        {"pid": 7, "thread_id": 11, "thread_name": "Thread-1", "os_thread_id": None, "active": True,
         "frames": [{"name": "poll", "filename": "/j/train.py", "line": 5, "module": None}]},
        {"pid": 7, "thread_id": 12, "thread_name": "MainThread", "os_thread_id": None, "active": True,
         "frames": [{"name": "quick_execute", "filename": f"{SITE}/eager/execute.py", "line": 53,
                     "module": None, "locals": [{"name": "op_name", "repr": '"IteratorGetNext"'}]}]},
    ]  # fmt: skip
    threads = stacks._threads(raw, stacks._ops(raw))
    assert [t["main"] for t in threads] == [False, True]
    assert [t["active"] for t in threads] == [None, None]  # py-spy's guess without the OS thread
    assert threads[1]["executing"] == "IteratorGetNext" and "executing" not in threads[0]


def test_a_job_that_handles_the_signal_itself_keeps_its_handler_and_the_dump_still_comes(hung):
    proc, dumps = hung(OWN_HANDLER="1")
    doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=None)
    assert doc["method"] == "faulthandler" and main_frames(doc)[0] == "wait_for_lock"
    assert proc.stdout is not None and proc.stdout.readline() == "the job's handler ran\n"


def test_a_job_that_resets_the_signal_is_never_sent_it(hung):
    proc, dumps = hung(RESET_HANDLER="1")
    # the runtime dumps on it still (a job's SIG_DFL would end the task at the first capture)
    doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=None)
    assert doc["method"] == "faulthandler" and proc.poll() is None


def test_a_process_whose_runtime_has_no_dump_is_never_signalled(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "x.txt").write_text("orchestrate stacks of pid 1\n")  # another process's file
        doc = stacks.capture(proc.pid, time.monotonic() + 2, stacks_file=str(tmp_path / "x.txt"), py_spy=None)
        assert doc["threads"] == [] and "not this process's" in doc["notes"][0]
        time.sleep(0.2)
        assert proc.poll() is None  # a real-time signal it does not catch would have ended it
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_process_is_said_stopped_and_read_without_pausing_it(hung):
    proc, dumps = hung()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: stacks.process_state(proc.pid) == "stopped", 5)
        doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=None)
        assert doc["state"] == "stopped" and doc["threads"] == [] and "stopped (state T)" in doc["notes"][0]
        assert where("worker-1", doc).culprit
        if PY_SPY is not None:
            doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=PY_SPY)
            assert doc["state"] == "stopped" and main_frames(doc)[0] == "wait_for_lock"
            assert where("worker-1", doc).line.startswith("stopped (state T, SIGSTOP?) in wait_for_lock")
        assert stacks.process_state(proc.pid) == "stopped"  # left as it was
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_a_process_gone_or_a_zombie_is_said_so(hung):
    proc, dumps = hung()
    proc.kill()
    assert wait_until(lambda: stacks.process_state(proc.pid) == "zombie", 5)
    doc = stacks.capture(proc.pid, time.monotonic() + 2, stacks_file=dumps, py_spy=PY_SPY)
    assert doc["state"] == "zombie" and "exited" in doc["notes"][0]
    proc.wait()
    doc = stacks.capture(proc.pid, time.monotonic() + 2, stacks_file=dumps, py_spy=PY_SPY)
    assert doc["state"] == "gone" and where("worker-1", doc).kind == "exited"


def test_a_task_that_exits_while_being_read_is_said_so(hung, tmp_path):
    proc, dumps = hung()
    # a py-spy that finds the task ending under it (as one killed mid-read would), then fails
    ends_it = tmp_path / "py-spy"
    said = "echo 'Error: No such process' >&2"
    ends_it.write_text(f"#!/bin/sh\nkill -9 {proc.pid}\nsleep 0.2\n{said}\nexit 1\n")
    ends_it.chmod(0o700)
    start = time.monotonic()
    doc = stacks.capture(proc.pid, time.monotonic() + 5, stacks_file=dumps, py_spy=str(ends_it))
    assert time.monotonic() - start < 2  # no wait for a dump that cannot come
    assert doc["threads"] == [] and doc["state"] in ("gone", "zombie"), doc
    assert where("worker-1", doc).kind in ("exited", "unknown")
    assert any("No such process" in n for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize("py_spy", [PY_SPY, None], ids=["py-spy", "runtime"])
def test_a_deep_recursion_is_kept_to_its_ends(hung, py_spy):
    proc, dumps = hung(DEPTH="900")
    doc = stacks.capture(proc.pid, time.monotonic() + 10, stacks_file=dumps, py_spy=py_spy)
    main = next(t for t in doc["threads"] if t["main"])
    assert len(main["frames"]) == stacks.MAX_INNER + stacks.MAX_OUTER
    assert main["frames_left_out"] > 0 if py_spy else main["frames"][0]["function"] == "wait_for_lock"
    assert len(json.dumps(doc)) < stacks.MAX_DOC_BYTES
    text = "\n".join(record.text({**doc, "task": "worker-1"}))
    assert "frames left out" in text or py_spy is None


def test_huge_documents_are_cut_to_one_line_of_the_shims():
    frame = {"function": "f" * 500, "file": "/x/" + "d" * 500 + ".py", "line": 1, "native": False}
    doc = {"threads": [{"name": f"t{i}", "main": i == 0, "frames": [frame] * 1000} for i in range(200)]}
    out = stacks.bounded(doc)
    assert len(json.dumps(out)) < stacks.MAX_DOC_BYTES and out["threads"][0]["main"]
    assert out["threads_left_out"] >= 200 - stacks.MAX_THREADS


def test_a_document_from_a_host_is_checked_field_by_field():
    assert checked("nonsense")["notes"] == ["its host answered with no document"]
    doc = checked(
        {
            "pid": "1; rm -rf /",
            "state": "running",
            "threads": [
                {
                    "name": "\u202eevil",
                    "id": 3,
                    "main": True,
                    "frames": [{"function": 1, "line": "x"}, "junk"],
                },
                "junk",
                {"frames": "not a list"},
            ],
            "notes": ["a" * 10_000, 5],
        }
    )
    assert doc["pid"] is None and len(doc["threads"]) == 1
    assert doc["threads"][0]["frames"] == [{"function": "1", "file": "", "line": 0, "native": False}]
    assert len(doc["notes"]) == 1 and len(doc["notes"][0]) == stacks.MAX_TEXT


FAULTHANDLER = """Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f2 (most recent call first):
  File "/home/me/train.py", line 27 in wait_for_lock
  File "/home/me/train.py", line 41 in <module>
  File "<frozen runpy>", line 88 in _run_code
"""


def test_the_runtimes_dump_is_parsed_and_its_main_thread_found():
    threads = stacks.parse_dump(FAULTHANDLER)
    assert [t["main"] for t in threads] == [False, True]
    assert threads[1]["frames"][0] == {
        "function": "wait_for_lock",
        "file": "/home/me/train.py",
        "line": 27,
        "native": False,
    }


# ---------------------------------------------------------------- where each task was, in one line

SITE = "/venv/lib/python3.11/site-packages/tensorflow/python"


def frame(function: str, file: str, line: int = 1, native: bool = False) -> dict[str, Any]:
    return {"function": function, "file": file, "line": line, "native": native}


def doc_of(*threads: dict[str, Any], state: str = "running") -> dict[str, Any]:
    return {"state": state, "threads": list(threads), "notes": []}


def thread(
    *frames: dict[str, Any], main: bool = False, active: bool | None = False, **kw: Any
) -> dict[str, Any]:
    return {
        "name": "MainThread" if main else "t",
        "main": main,
        "active": active,
        "frames": list(frames),
        **kw,
    }


RUNPY = frame("_run_code", "<frozen runpy>", 88)


def test_waiting_in_a_tf_function_names_the_function_and_the_jobs_line():
    main = thread(
        frame(
            "tensorflow::ProcessFunctionLibraryRuntime::RunSync",
            "/venv/libtensorflow_framework.so.2",
            0,
            True,
        ),
        frame("quick_execute", f"{SITE}/eager/execute.py", 53),
        frame("<module>", "/home/me/train.py", 41),
        RUNPY,
        main=True,
        executing="__inference_train_step_133",
    )
    w = where("worker-0", doc_of(main))
    assert (w.kind, w.line) == (
        "tensorflow",
        "waiting in TensorFlow: the tf.function train_step, called from <module> (train.py:41)",
    )
    assert not w.culprit


def test_an_eager_all_reduce_on_tensorflows_pool_thread_is_named():
    main = thread(
        frame("Condition.wait", "/usr/lib/python3.11/threading.py", 327),
        frame("CollectiveAllReduce._all_reduce_per_replica_values", f"{SITE}/distribute/cross_device_ops.py"),
        frame("<module>", "/home/me/train.py", 21),
        main=True,
    )
    pool = thread(frame("collective_reduce_v2", f"{SITE}/ops/gen_collective_ops.py", 1267))
    w = where("worker-0", doc_of(main, pool))
    assert w.line == "waiting in an all-reduce (CollectiveReduceV2), called from <module> (train.py:21)"


def test_waiting_for_the_cluster_and_being_in_ones_own_code():
    connecting = thread(
        frame("Context.ensure_initialized", f"{SITE}/eager/context.py", 745),
        frame("<module>", "/j/train.py", 10),
        main=True,
    )
    assert where("worker-0", doc_of(connecting)).kind == "cluster"
    own = thread(
        frame("Queue.get", "/usr/lib/python3.11/queue.py", 171), frame("load", "/j/train.py", 30), main=True
    )
    w = where("worker-1", doc_of(own))
    assert w.culprit and w.line == "in Queue.get (queue.py:171) from load (train.py:30), not in TensorFlow"


def test_job_code_on_a_tensorflow_thread_is_the_place_not_the_main_threads_wait():
    main = thread(
        frame("iterator_get_next", f"{SITE}/ops/gen_dataset_ops.py"),
        frame("<module>", "/j/train.py", 28),
        main=True,
    )
    worker_thread = thread(
        frame("endless", "/j/train.py", 19),
        frame("EagerFunc.__call__", f"{SITE}/ops/script_ops.py"),
        active=False,  # asleep in it: its pipeline waits on it all the same
    )
    w = where("worker-1", doc_of(main, worker_thread))
    assert w.culprit and w.line.startswith(
        "in endless (train.py:19), the job's own code on a TensorFlow thread"
    )
    assert "while its main thread is waiting in the input pipeline (IteratorGetNext)" in w.line
    # the job's function as AutoGraph converted it (a tf.data map's): named as the job wrote it
    converted = frame(
        "outer_factory.<locals>.inner_factory.<locals>.tf__stick.<locals>.wait.<locals>.if_body.<locals>.loop_body",
        "/tmp/__autograph_generated_filet1lqmk6o.py",
        32,
    )
    worker_thread["frames"][0] = converted
    w = where("worker-1", doc_of(main, worker_thread))
    assert w.line.startswith("in stick.wait (as AutoGraph converted it), the job's own code"), w.line
    idle_job_thread = thread(
        frame("poll", "/j/train.py", 5), frame("run", "/usr/lib/python3.11/threading.py")
    )
    assert not where("worker-1", doc_of(main, idle_job_thread)).culprit  # a thread of the job's, idle


def test_what_could_not_be_read_is_said():
    w = where("worker-0", {"state": "unknown", "threads": [], "notes": ["no answer from host1 within 7.0 s"]})
    assert (w.kind, w.line) == (
        "unknown",
        "stacks not read: no answer from host1 within 7.0 s",
    ) and not w.culprit


# ---------------------------------------------------------------- whom the policy blames


def stalled(task: str, where: str | None = None) -> Decision:
    f = Failure(
        (task,), FailureKind.STALLED, 0, "stalled at step 9 for 4.0 s while alive", step=9, where=where
    )
    return Decision(Action.RESTART_JOB, f, f"{f.describe()}; restart 1 of 2")


def test_the_stacks_name_the_task_the_others_wait_for():
    own = where("worker-1", doc_of(thread(frame("wait_for_lock", "/j/train.py", 17), main=True)))
    waiting = where("worker-0", doc_of(thread(frame("quick_execute", f"{SITE}/eager/execute.py"), main=True)))
    training = {"worker-0", "worker-1"}
    d = policy.blame_by_stacks(stalled("worker-0"), [waiting, own], training)
    assert d.failure.tasks == ("worker-1",) and d.action is Action.RESTART_JOB
    assert d.reason.startswith(
        "worker-1 in wait_for_lock (train.py:17), not in TensorFlow (its stacks): worker-0 waited"
    )
    assert d.reason.endswith("; restart 1 of 2")
    # named already: its place is added; said by its heartbeat already: as it was
    d = policy.blame_by_stacks(stalled("worker-0"), [waiting], training)
    assert d.failure.tasks == ("worker-0",) and "its stacks: waiting in TensorFlow" in d.failure.detail
    same = stalled("worker-1", where="train.py:17 in wait_for_lock")
    assert policy.blame_by_stacks(same, [waiting, own], training) is same
    # a task whose stacks could not be read (its host cut off) keeps the blame; so does one whose
    # only rival is not training (an evaluator idling in its own code)
    unread = where("worker-0", {"state": "unknown", "threads": [], "notes": ["no answer from hosts[0]"]})
    d = policy.blame_by_stacks(stalled("worker-0"), [unread, own], training)
    assert d.failure.tasks == ("worker-0",) and "stacks not read: no answer" in d.failure.detail
    evaluator = where(
        "evaluator-0", doc_of(thread(frame("wait_for_checkpoint", "/j/train.py", 60), main=True))
    )
    d = policy.blame_by_stacks(stalled("worker-0"), [waiting, evaluator], training)
    assert d.failure.tasks == ("worker-0",)


# ---------------------------------------------------------------- the supervisor reads them before the stop


def test_a_stall_is_looked_at_before_the_stop_and_blames_by_the_stacks(tmp_path):
    asked: list[tuple[list[str], float, bool]] = []

    def capture(handles: list[TaskHandle], timeout_s: float, why: str, native: bool) -> Capture:
        asked.append(([h.task.name for h in handles], timeout_s, native))
        docs = {
            "worker-0": doc_of(thread(frame("quick_execute", f"{SITE}/eager/execute.py"), main=True)),
            "worker-1": doc_of(thread(frame("wait_for_lock", "/j/train.py", 17), main=True)),
        }
        return Capture(docs, 0.5, why)

    kept: list[int] = []
    sup, launcher, store, clock, sink = make(tmp_path, max_restarts=1)
    read_at: list[float] = []

    def slow_capture(handles: list[TaskHandle], timeout_s: float, why: str, native: bool) -> Capture:
        read_at.append(clock.now)
        clock.advance(2.0)  # the reading takes its time: the restart's clock runs meanwhile
        return capture(handles, timeout_s, why, native)

    sup._capture, sup._keep_stacks = slow_capture, lambda c, attempt: kept.append(attempt)
    start_running(sup, launcher, store, clock)
    for _ in range(5):
        beat(store, "worker-0", step=7)  # both in TensorFlow, as their heartbeats say
        beat(store, "worker-1", step=7)
        clock.advance(8)
        sup.step()
        if sup.state is not ClusterState.RUNNING:
            break
    assert sup.state is ClusterState.STOPPING and asked == []  # said at once; read in the stop
    sup.step()
    # a restart follows and the Python frames name the one: no C++ frames to wait for
    assert asked == [(["worker-0", "worker-1"], 5.0, False)] and kept == [0]
    # the restart's clock started when the stall was noticed; the reading is in its stop phase
    current = sup.timeline.current
    assert current is not None and current.noticed <= read_at[0] and current.stopped is not None
    assert current.stopped - current.noticed >= 2.0 and "worker-1" in current.cause
    assert sup.root_cause.tasks == ("worker-1",) and "wait_for_lock (train.py:17)" in sup.root_cause.detail
    said = next(e for e in sink.events if e.get("kind") == "stacks")
    assert (
        "worker-1: in wait_for_lock (train.py:17), not in TensorFlow — the one the others wait for"
        in said["reason"]
    )


def test_native_frames_are_read_too_where_the_job_ends_or_no_task_is_named(tmp_path):
    for restarts, own_code, natively in ((0, True, True), (1, False, True), (1, True, False)):
        asked: list[tuple[float, bool]] = []

        def capture(handles, timeout_s, why, native, asked=asked, own_code=own_code):  # type: ignore[no-untyped-def]
            asked.append((timeout_s, native))
            place = frame("wait_for_lock", "/j/train.py", 17) if own_code else frame("f", f"{SITE}/x.py")
            docs = {h.task.name: doc_of(thread(place, main=True)) for h in handles}
            return Capture(docs, 0.5, why)

        sup, launcher, store, clock, sink = make(tmp_path, max_restarts=restarts)
        sup._capture = capture
        start_running(sup, launcher, store, clock)
        for _ in range(5):
            beat(store, "worker-0", step=7)
            beat(store, "worker-1", step=7)
            clock.advance(8)
            sup.step()
        assert asked == [(5.0, False), (4.5, True)] if natively else [(5.0, False)], (restarts, own_code)


def test_an_exit_is_not_looked_at_nor_anything_when_the_bound_is_zero(tmp_path):
    for cfg, fail in (({}, "exit"), ({"stacks_timeout_s": 0}, "stall")):
        asked: list[str] = []
        sup, launcher, store, clock, _ = make(tmp_path, max_restarts=0, **cfg)
        sup._capture = lambda handles, timeout_s, why, native, asked=asked: asked.append(why)  # type: ignore
        start_running(sup, launcher, store, clock)
        if fail == "exit":
            launcher.handles["worker-1"].code = 1
        for _ in range(6):
            beat(store, "worker-0", step=3)
            beat(store, "worker-1", step=3)
            clock.advance(8)
            sup.step()
        assert sup.state.is_terminal and asked == []


# ---------------------------------------------------------------- a live run's requests


def task_plans(tmp_path: Path, count: int) -> list[TaskPlan]:
    spec = SPEC.format(workers=count)
    return list(plan_of(tmp_path, spec, {f"worker-{i}": 20000 + i for i in range(count)}).tasks)


class ReadHandle(TaskHandle):
    """A task whose stacks are a canned document."""

    def __init__(self, plan: TaskPlan, answer: dict[str, Any]):
        super().__init__(plan, 0, Path("/dev/null"))
        self.answer = answer

    @property
    def process(self) -> ProcessInfo:
        return ProcessInfo(1, 1, 0.0)

    def poll(self) -> int | None:
        return None

    def signal(self, sig: Sig) -> None:
        raise AssertionError("reading stacks signals nothing")

    @property
    def exited(self) -> bool:
        return False

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        return {**self.answer, "native": native}


def test_capture_all_reads_in_parallel_by_one_deadline_and_says_each(tmp_path):
    def slow(deadline: float, native: bool) -> dict[str, Any]:
        time.sleep(0.3)
        return doc_of(thread(frame("f", "/j/x.py"), main=True))

    handles = [ReadHandle(plan, {}) for plan in task_plans(tmp_path, 8)]
    for h in handles:
        h.stacks = slow  # type: ignore[method-assign]
    start = time.monotonic()
    cap = capture_all(handles, 5.0, "asked")
    assert time.monotonic() - start < 1.5  # eight 0.3 s reads at once, not one after another
    assert sorted(cap.docs) == [f"worker-{i}" for i in range(8)]
    assert all(d["why"] == "asked" and d["host"] == "this machine" for d in cap.docs.values())


def test_a_live_run_is_asked_through_its_run_directory(tmp_path):
    handles = [ReadHandle(task_plans(tmp_path, 1)[0], doc_of(thread(frame("f", "/j/x.py"), main=True)))]
    answerer = live.Answerer(tmp_path, lambda: handles, 5.0).start()
    try:
        got = live.request(tmp_path, None, native=False, timeout_s=10)
        assert isinstance(got, dict) and got["docs"]["worker-0"]["native"] is False
        assert (
            live.request(tmp_path, "worker-9", native=True, timeout_s=10)["error"] == "no live task worker-9"
        )
        # not ours: a symlink, a huge file, a name of another shape; removed unread
        requests = tmp_path / "stacks" / "requests"
        (requests / "evil1234.json").symlink_to("/etc/passwd")
        (requests / "big12345.json").write_text("x" * 10_000)
        (requests / "../requests/odd name.json").write_text("{}")
        assert wait_until(lambda: list(requests.iterdir()) == [], 5)
        assert not list((tmp_path / "stacks" / "answers").iterdir())
    finally:
        answerer.close()
    assert record.latest(tmp_path)["worker-0"]["why"] == "asked: orchestrate stacks"
    no_one = live.request(tmp_path, None, native=False, timeout_s=0.5)
    assert no_one == "the run's coordinator did not answer within 0.5 s"
