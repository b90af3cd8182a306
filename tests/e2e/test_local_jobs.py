"""End to end: the real `orchestrate up` CLI, real TensorFlow processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import psutil
import pytest

from orchestrator.record.quiet import noise
from tests.conftest import run_processes, wait_until

pytestmark = pytest.mark.e2e

MWMS_JOB = """
    import os
    import tensorflow as tf
    import worker

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    print(f"num_replicas_in_sync={strategy.num_replicas_in_sync}", flush=True)
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step():
        strategy.run(lambda: v.assign_add(1.0))

    for i in range(1, 21):
        step()
        worker.report(step=i, loss=1.0 / i)
    print("value", float(v.numpy()), flush=True)
"""


def test_two_worker_mwms_job_succeeds(job_factory):
    job = job_factory(MWMS_JOB)
    out = job.up(timeout_s=180)
    assert out.returncode == 0, out.stdout + out.stderr
    for i in range(2):
        log = (job.run_dir / "logs" / f"worker-{i}.log").read_text()
        assert "num_replicas_in_sync=2" in log
        assert "attempt 0 started" in log
    assert out.stdout.count("[worker-0] num_replicas_in_sync=2") == 1  # prefixed lines, each once
    # TF's start-up noise stays in the log files, off the console
    logged = (job.run_dir / "logs" / "worker-0.log").read_text().splitlines()
    assert all(f"[worker-0] {line}\n" not in out.stdout for line in logged if noise(line))
    assert "  took 0:" in out.stdout and "  final: step 20" in out.stdout and "loss 0.05" in out.stdout
    status = json.loads((job.run_dir / "status.json").read_text())
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 0
    assert {t["task"]: (t["state"], t["exit_code"], t["last_step"]) for t in status["tasks"]} == {
        "worker-0": ("SUCCEEDED", 0, 20),
        "worker-1": ("SUCCEEDED", 0, 20),
    }
    points = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(p["step"] for p in points if p["task"] == "worker-1") == list(range(1, 21))
    plan = json.loads((job.run_dir / "plan.json").read_text())
    assert plan["tasks"][1]["tf_config"]["task"] == {"type": "worker", "index": 1}
    assert (job.run_dir / "spec.yaml").read_text() == job.spec.read_text()
    events = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["new"] for e in events if e["kind"] == "run"] == [
        "LAUNCHING",
        "RUNNING",
        "STOPPING",
        "SUCCEEDED",
    ]
    assert run_processes(job.run_id) == []


def test_exception_in_script_fails_with_root_cause(job_factory):
    job = job_factory(
        """
        import os
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        if os.environ["ORCHESTRATE_TASK"] == "worker-1":
            raise ValueError("bad learning rate: -3")
        """,
        "restart: {max_restarts: 3, backoff_s: 0}\n",
    )
    t0 = time.monotonic()
    out = job.up(timeout_s=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "first failure: worker-1 raised ValueError: bad learning rate: -3" in out.stdout
    assert "not restarted" in out.stdout  # an error in user code is not retried
    # the traceback starts at the job's own code; the log tail is the job's, not TF's start-up
    summary = out.stdout.split("first failure:", 1)[1]
    tb = summary.split("  traceback:\n", 1)[1].splitlines()
    assert tb[0] == "    Traceback (most recent call last):" and "job.py" in tb[1], tb
    assert "    ValueError: bad learning rate: -3" in tb, tb
    assert "run_reported" not in summary and "runpy" not in summary, summary
    # the job printed nothing of its own before it raised: no log tail of TensorFlow's chatter
    assert "last lines of" not in summary and "cudart_stub" not in summary, summary
    assert "attempts 1 · restarts 0" in out.stdout
    assert time.monotonic() - t0 < 60
    assert run_processes(job.run_id) == []


#: A job that cuts its own heartbeat channel (as a pulled cable would: every later heartbeat is
#: refused) and then raises. No TensorFlow: the runtime's reporting is what is tested.
CUT_THEN_RAISE = """
    import dataclasses, os, time
    import worker
    from worker.task import runtime
    for i in range(1, 4):
        worker.report(step=i)
        time.sleep(0.3)
    if os.environ["ORCHESTRATE_TASK"] == "worker-1":
        rep = runtime.reporter()
        rep._config = dataclasses.replace(rep._config, url="http://127.0.0.1:9")  # nothing listens
        rep._close()
        time.sleep(1.5)
        raise KeyError("label")
    time.sleep(60)
"""


def test_an_exception_whose_heartbeat_is_lost_is_still_the_root_cause(job_factory):
    """The durable error: the task's last heartbeat (which carries its exception) never arrives,
    and its exception is still named, with its step, from the error file it wrote as it died."""
    job = job_factory(CUT_THEN_RAISE, "restart: {max_restarts: 0}\n")
    out = job.up(timeout_s=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "first failure: worker-1 raised KeyError: 'label'" in out.stdout, out.stdout
    written = json.loads((job.run_dir / "errors" / "worker-1.0.json").read_text())
    assert written["type"] == "KeyError" and written["step"] == 3
    assert "KeyError: 'label'" in written["traceback"]
    assert (job.run_dir / "errors" / "worker-1.0.json").stat().st_mode & 0o777 == 0o600
    events = [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e.get("task") == "worker-1" and e.get("new") == "FAILED"]
    assert failed and "raised KeyError" in failed[0]["reason"]
    assert run_processes(job.run_id) == []


def test_worker_that_never_starts_fails_at_startup_deadline(job_factory):
    job = job_factory(
        """
        import os, time
        if os.environ["ORCHESTRATE_TASK"] == "worker-1":
            time.sleep(3600)  # never joins the cluster
        import tensorflow as tf
        tf.distribute.MultiWorkerMirroredStrategy()
        """,
        "health: {startup_timeout_s: 12}\nrestart: {max_restarts: 0}\n",
    )
    t0 = time.monotonic()
    out = job.up(timeout_s=120)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    assert "first failure: worker-1 not up within health.startup_timeout_s = 12 s" in out.stdout
    assert "worker-0 waited for it" in out.stdout
    assert 12 <= took < 40
    assert run_processes(job.run_id) == []


SLEEPER = """
    import time
    import worker
    for i in range(1, 100000):
        worker.report(step=i)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_coordinator_stops_everything_and_exits_130(job_factory, sig):
    job = job_factory(SLEEPER, "restart: {max_restarts: 0}\n")
    proc = job.start()
    try:
        assert wait_until(lambda: len(run_processes(job.run_id)) == 2, 30)
        assert wait_until(lambda: '"state": "RUNNING"' in _read(job.run_dir / "status.json"), 30)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "INTERRUPTED" in out
    assert "continue it from its checkpoints: orchestrate up spec.yaml --resume run\n" in out
    assert run_processes(job.run_id) == []
    assert json.loads((job.run_dir / "status.json").read_text())["state"] == "INTERRUPTED"


def namespace_holders(network: str) -> list[str]:
    """Every process in the network namespace `network` (net:[inode]) or holding a descriptor of it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/net") == network:
                found.append(f"{pid} in it")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == network:
                        found.append(f"{pid} holds it")
    return found


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_tasks_exit_by_themselves_when_coordinator_is_killed(job_factory):
    job = job_factory(SLEEPER, "health: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 3}\n")
    proc = job.start()
    try:
        assert wait_until(lambda: len(run_processes(job.run_id)) == 2, 30)
        assert wait_until(lambda: '"state": "RUNNING"' in _read(job.run_dir / "status.json"), 30)
        network = os.readlink(f"/proc/{job.task('worker-0')['pid']}/ns/net")
        assert network != os.readlink("/proc/self/ns/net")  # the run's own network namespace
        assert namespace_holders(network), "the namespace is held"
        # its outgoing network (pasta, where installed) and the guard that holds it: the coordinator's
        stack = psutil.Process(proc.pid).children(recursive=True)
        stack = [p for p in stack if "--no-map-gw" in p.cmdline() or "--no-map-gw" in p.parent().cmdline()]
        assert len(stack) == (2 if shutil.which("pasta") else 0), stack
        proc.kill()  # SIGKILL: no teardown at all
        proc.wait(timeout=10)
        t0 = time.monotonic()
        assert wait_until(lambda: run_processes(job.run_id) == [], 15), "orphans survived their coordinator"
        assert time.monotonic() - t0 < 3 + 5
        assert wait_until(lambda: [p for p in stack if alive(p)] == [], 5), "its network outlived it"
        assert namespace_holders(network) == []  # no holder process, no descriptor: it is gone
    finally:
        proc.kill()
    log = (job.run_dir / "logs" / "worker-0.log").read_text()
    assert "no coordinator reachable" in log


def test_down_stops_a_detached_run(job_factory):
    import subprocess
    import sys

    job = job_factory(SLEEPER)
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "up",
            str(job.spec),
            "--run-dir",
            str(job.run_dir),
            "--detach",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=job.root,
    )
    assert started.returncode == 0, started.stderr
    assert str(job.run_dir) in started.stdout
    assert wait_until(lambda: len(run_processes(job.run_id)) == 2, 30)
    status = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0 and "worker-1" in status.stdout
    for _ in range(2):  # idempotent
        down = subprocess.run(
            [sys.executable, "-m", "orchestrator", "down", str(job.run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "INTERRUPTED" in down.stdout
    assert run_processes(job.run_id) == []
    coordinator = json.loads((job.run_dir / "coordinator.json").read_text())["pid"]
    assert not psutil.pid_exists(coordinator) or psutil.Process(coordinator).status() == psutil.STATUS_ZOMBIE


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_plain_python_run_of_a_script_using_worker_api_works_without_coordinator(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text("import worker\nworker.report(step=1, loss=0.5)\nprint('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATE_")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok"


SLOW_PHASES_JOB = """
    import time
    import numpy as np
    import tensorflow as tf
    import worker

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.05), loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    class SlowSave(tf.keras.callbacks.Callback):  # a checkpoint that takes longer than the stall limit
        def on_epoch_end(self, epoch, logs=None):
            time.sleep(4)

    report = worker.ReportCallback()
    model.fit(
        x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0, callbacks=[SlowSave(), report]
    )
    model.evaluate(x, y, verbose=0, callbacks=[report])  # then still "done training", not training
    time.sleep(4)  # saving the model after fit
    with worker.busy("exporting"):
        time.sleep(4)
    print("all phases done", flush=True)
"""


def test_validation_saving_and_what_follows_fit_are_not_stalls(job_factory):
    job = job_factory(
        SLOW_PHASES_JOB,
        "health: {stall_timeout_s: 2, heartbeat_interval_s: 0.5}\nrestart: {max_restarts: 0}\n",
        workers=1,
    )
    job.spec.write_text(
        job.spec.read_text().replace(
            'TF_CPP_MIN_LOG_LEVEL: "2"', 'TF_CPP_MIN_LOG_LEVEL: "2", TF_USE_LEGACY_KERAS: "1"'
        )
    )
    proc = job.start()
    seen = set()
    try:
        while proc.poll() is None:
            busy = job.task("worker-0").get("busy")
            if busy:
                seen.add(busy)
            time.sleep(0.2)
        out = proc.stdout.read() if proc.stdout else ""
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "all phases done" in (job.run_dir / "logs" / "worker-0.log").read_text()
    assert {"ending the epoch", "done training", "exporting"} <= seen, seen
    assert job.status()["restarts"] == 0
    # the chief's reported points as TensorBoard scalars too (mode 1), next to metrics.jsonl
    (events,) = (job.run_dir / "tensorboard" / "worker-0").glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert b"loss" in data and b"val_loss" in data and b"scalars" in data
