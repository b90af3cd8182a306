"""Hung jobs end to end (issue 26): five planted hangs in real TensorFlow jobs; for each, the
stacks read before the stop name the right task and the right frame, in the summary and in the
record; `orchestrate stacks` prints them again, and reads a live run's without disturbing it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import run_processes, wait_until

pytestmark = pytest.mark.e2e

# Two MWMS workers; `train_step` all-reduces; {plant} decides where one of them hangs.
JOB = """
import os, threading, time
import tensorflow as tf
import worker
task = os.environ["ORCHESTRATE_TASK"]
{before}
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    v = tf.Variable(0.0)

@tf.function
def train_step():
    per = strategy.run(lambda: v.assign_add(1.0))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)

{plant}
"""


def spec(stall: float = 4, lost: float = 60, up: float = 60, read: float = 5) -> str:
    health = f"stall_timeout_s: {stall}, heartbeat_interval_s: 0.5, heartbeat_timeout_s: {lost}"
    health += f", startup_timeout_s: {up}, stacks_timeout_s: {read}"
    return f"health: {{{health}}}\nrestart: {{max_restarts: 0}}\n"


def line_of(script: str, text: str) -> int:
    """The line of `text` in the job's file (as written: the job starts with a blank line)."""
    return next(i for i, line in enumerate(script.splitlines(), 1) if text in line)


def summary_place(out: str, task: str) -> str:
    """The summary's line for `task` under "where each task was"."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "where each task was" in line)
    return next(line.strip() for line in lines[start + 1 :] if line.strip().startswith(f"{task}:"))


def stacks_cli(job, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "stacks", str(job.run_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=job.root,
        env=job.env(),
    )


def test_a_worker_deadlocked_in_its_own_python_is_named_with_its_frame(job_factory):
    plant = """
lock = threading.Lock()
def wait_for_lock():
    lock.acquire()
    lock.acquire()  # the planted deadlock

for i in range(1, 1000):
    if task == "worker-1" and i == 10:
        wait_for_lock()
    train_step()
    worker.report(step=i)
"""
    script = JOB.format(before="", plant=plant)
    # long enough for py-spy's native frames: it reads TensorFlow's symbols, 2-6 s per task here
    job = job_factory(script, spec(read=30))
    out = job.up(timeout_s=150)
    assert out.returncode == 1, out.stdout
    one = summary_place(out.stdout, "worker-1")
    assert f"in wait_for_lock (job.py:{line_of(script, 'the planted deadlock')})" in one, out.stdout
    assert "the one the others wait for" in one
    zero = summary_place(out.stdout, "worker-0")
    assert "waiting in TensorFlow: the tf.function train_step" in zero, out.stdout
    assert f"(job.py:{line_of(script, '    train_step()')})" in zero and "wait for" not in zero
    assert "first failure: worker-1" in out.stdout
    # the record keeps every thread, native frames included; `orchestrate stacks` prints them
    doc = json.loads((job.run_dir / "stacks" / "attempt-0" / "worker-0.json").read_text())
    assert doc["method"] == "py-spy" and doc["native"] is True, doc["notes"]
    assert any("ProcessFunctionLibraryRuntime" in f["function"] for f in doc["threads"][0]["frames"])
    shown = stacks_cli(job, "worker-1")
    assert shown.returncode == 0 and "wait_for_lock" in shown.stdout and "== worker-0" not in shown.stdout
    assert run_processes(job.run_id) == []


def test_an_endless_loop_in_a_tf_data_map_function_is_found_on_its_thread(job_factory):
    plant = """
def endless(x):
    n = 0
    while int(x) == 10:  # the planted endless loop, on a tf.data thread
        n += 1
    return x

def element(x):
    return x + 1 if task != "worker-1" else tf.py_function(endless, [x], tf.int64)

data = iter(tf.data.Dataset.range(10_000).map(element))
for i in range(1, 1000):
    next(data)
    train_step()
    worker.report(step=i)
"""
    script = JOB.format(before="", plant=plant)
    job = job_factory(script, spec())
    out = job.up(timeout_s=150)
    assert out.returncode == 1, out.stdout
    one = summary_place(out.stdout, "worker-1")
    loop = line_of(script, "the planted endless loop")  # its test, or its body: where it was read
    assert any(f"in endless (job.py:{n})" in one for n in (loop, loop + 1)), out.stdout
    assert "on a TensorFlow thread" in one
    assert "while its main thread is waiting in the input pipeline (IteratorGetNext)" in one
    assert "the one the others wait for" in one and "first failure: worker-1" in out.stdout
    assert run_processes(job.run_id) == []


def test_a_stopped_worker_is_said_stopped_and_named(job_factory):
    plant = """
for i in range(1, 100000):
    train_step()
    worker.report(step=i)
"""
    script = JOB.format(before="", plant=plant)
    job = job_factory(script, spec(stall=30, lost=3))
    proc = job.start()
    try:
        assert wait_until(lambda: (job.task("worker-1").get("last_step") or 0) >= 5, 60)
        os.kill(job.task("worker-1")["pid"], signal.SIGSTOP)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    one = summary_place(out, "worker-1")
    assert "stopped (state T, SIGSTOP?)" in one and "the one the others wait for" in one, out
    assert "first failure: worker-1" in out
    assert run_processes(job.run_id) == []


def test_a_peer_that_never_starts_leaves_the_other_waiting_for_its_cluster(job_factory):
    before = """
if task == "worker-1":
    time.sleep(3600)  # the planted late start
"""
    script = JOB.format(before=before, plant="train_step()\nworker.report(step=1)\n")
    job = job_factory(script, spec(up=10))
    out = job.up(timeout_s=150)
    assert out.returncode == 1, out.stdout
    zero = summary_place(out.stdout, "worker-0")
    assert "waiting for its cluster to connect" in zero, out.stdout
    assert f"(job.py:{line_of(script, 'strategy = tf.distribute')})" in zero
    one = summary_place(out.stdout, "worker-1")
    assert f"job.py:{line_of(script, 'the planted late start')}" in one and "the one the others" in one
    assert "first failure: worker-1" in out.stdout
    assert run_processes(job.run_id) == []


def test_one_all_reduce_more_than_its_peer_is_named_with_the_op(job_factory):
    plant = """
for i in range(1, 11):
    train_step()
    worker.report(step=i)
if task == "worker-0":
    strategy.reduce(tf.distribute.ReduceOp.SUM, v.read_value(), axis=None)  # the planted extra all-reduce
"""
    script = JOB.format(before="", plant=plant)
    job = job_factory(script, spec())
    out = job.up(timeout_s=150)
    assert out.returncode == 1, out.stdout
    zero = summary_place(out.stdout, "worker-0")
    assert "waiting in an all-reduce (CollectiveReduceV2)" in zero, out.stdout
    assert f"(job.py:{line_of(script, 'the planted extra all-reduce')})" in zero
    assert "first failure: worker-0" in out.stdout
    assert run_processes(job.run_id) == []
