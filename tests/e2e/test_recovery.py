"""Recovery end to end: real processes, real signals; the restart policy and every detector."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import textwrap
import time

import pytest

from tests import seccomp
from tests.conftest import run_processes, wait_until

pytestmark = pytest.mark.e2e

# A job that needs no TensorFlow: the detectors and the policy do not care what the task runs.
PLAIN = """
    import os, sys, time
    import worker
    task, attempt = os.environ["ORCHESTRATE_TASK"], int(os.environ["ORCHESTRATE_ATTEMPT"])
    {body}
"""


def plain(body: str) -> str:
    return PLAIN.format(body=body.strip())


def status(job) -> dict:
    try:
        return json.loads((job.run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def events(job) -> list[dict]:
    return [json.loads(line) for line in (job.run_dir / "events.jsonl").read_text().splitlines()]


def test_stalled_task_is_detected_named_and_the_job_restarted(job_factory):
    # MWMS: worker-1 is stuck in its own Python code, so worker-0 waits in a collective forever
    job = job_factory(
        plain(
            """
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(0.0)
    step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
    for i in range(1, 41):
        if task == "worker-1" and attempt == 0 and i == 10:
            while True:          # alive, heartbeats flowing, no progress
                time.sleep(0.1)
        step()
        worker.report(step=i)
    """
        ),
        "health: {stall_timeout_s: 4}\nrestart: {max_restarts: 2, backoff_s: 0.5}\n",
    )
    out = job.up(timeout_s=120)
    assert out.returncode == 0, out.stdout
    st = status(job)
    assert st["state"] == "SUCCEEDED" and st["restarts"] == 1
    reasons = [e["reason"] for e in events(job) if e.get("new") == "STOPPING"]
    assert any("worker-1 stalled at step 9" in r and "busy in job.py" in r for r in reasons), reasons
    assert run_processes(job.run_id) == []


def test_sigstop_is_detected_by_heartbeat_timeout_then_restarted(job_factory):
    job = job_factory(
        plain(
            """
    for i in range(1, 61):
        worker.report(step=i)
        time.sleep(0.05)
    """
        ),
        "health: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 3}\n"
        "restart: {max_restarts: 1, backoff_s: 0}\n",
    )
    proc = job.start()
    try:
        assert wait_until(lambda: ((status(job).get("tasks") or [{}])[-1].get("last_step") or 0) >= 5, 30)
        victim = status(job)["tasks"][1]["pid"]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert wait_until(lambda: status(job).get("state") in ("STOPPING", "RESTARTING", "LAUNCHING"), 10)
        detected_s = time.monotonic() - stopped_at
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert detected_s <= 3 + 1, detected_s  # within heartbeat_timeout_s (+1 s)
    lost = [e for e in events(job) if e.get("new") == "LOST"]
    assert lost and lost[0]["task"] == "worker-1"
    assert status(job)["restarts"] == 1
    assert run_processes(job.run_id) == []


LOOP_MODULE = """
    import os
    import numpy as np
    import tensorflow as tf

    def build_model():
        {build_extra}
        layers = tf.keras.layers
        hidden = layers.Dense(16, activation="relu")
        return tf.keras.Sequential([layers.Input(shape=(8,)), hidden, layers.Dense(4)])

    def make_dataset(ctx, global_batch_size):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(512, 8)).astype("float32")
        y = (x[:, :4].argmax(1)).astype("int64")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(global_batch_size), drop_remainder=True)
"""

# Python in the input pipeline, as real jobs have (augmentation, decoding), on a stream that never
# ends: a restart resumes deep into its epoch, and tf.data skips the batches trained before.
PY_MAP = """
    _plain = make_dataset
    def make_dataset(ctx, global_batch_size):
        def augment(x):
            return x + np.float32(0.0)
        ds = _plain(ctx, global_batch_size).repeat()
        return ds.map(lambda x, y: (tf.ensure_shape(tf.numpy_function(augment, [x], tf.float32), x.shape), y))
"""

LOOP_SPEC = """
train: {{steps: {steps}, global_batch_size: 32, checkpoint_every: {every}}}
health: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: 4}}
restart: {{max_restarts: 3, backoff_s: 0.5}}
"""


def loop_job(job_factory, steps=300, every=20, build_extra="pass", extra=""):
    job = job_factory("", LOOP_SPEC.format(steps=steps, every=every))
    module = textwrap.dedent(LOOP_MODULE.format(build_extra=build_extra)) + textwrap.dedent(extra)
    (job.root / "train.py").write_text(module)
    job.spec.write_text(job.spec.read_text().replace("script: job.py", "loop: train.py"))
    return job


def test_kill_9_at_a_random_step_resumes_from_checkpoint_and_finishes_exactly(job_factory):
    job = loop_job(job_factory, steps=300, every=20)
    rng = random.Random()
    kill_at, victim = rng.randrange(40, 160), rng.randrange(2)  # the chief (it writes checkpoints) or not
    proc = job.start()
    try:

        def progressed() -> bool:
            tasks = status(job).get("tasks") or []
            return bool(tasks) and (tasks[victim].get("last_step") or 0) >= kill_at

        assert wait_until(progressed, 90)
        st = status(job)
        killed_at_step = st["tasks"][victim]["last_step"]
        os.kill(st["tasks"][victim]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    st = status(job)
    assert st["state"] == "SUCCEEDED" and st["restarts"] >= 1
    assert f"worker-{victim} was killed by SIGKILL" in " ".join(e["reason"] for e in events(job))
    assert [t["last_step"] for t in st["tasks"]] == [300, 300]  # the final step count is exact
    log = (job.run_dir / "logs" / "worker-0.log").read_text()
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert resumed, "attempt 1 did not resume from a checkpoint"
    resumed_step = int(resumed[0].rsplit("at step ", 1)[1])
    # the last checkpoint attempt 0 said it saved, or the one it was saving when killed (the step
    # read from status.json can lag the task's by more than a checkpoint interval: a heartbeat)
    first_attempt = log.split("attempt 1 started")[0]
    said = [
        int(m)
        for m in re.findall(r"\[orchestrate\] step (\d+)/300: loss \S+, checkpoint saved", first_attempt)
    ]
    assert said and resumed_step in (said[-1], said[-1] + 20), (said, resumed_step)
    assert killed_at_step - resumed_step < 20 + 20  # lost at most a checkpoint interval (+ report lag)
    assert (job.run_dir / "model" / "model.keras").exists()
    assert run_processes(job.run_id) == []


def test_a_kill_9_is_recovered_by_the_warm_standbys_and_its_timeline_said(job_factory):
    """Attempt 1's tasks are forked by attempt 0's standbys (keepers), and so are attempt 2's when
    worker-1 is killed again at attempt 1's first step: a keeper is not used up. Killing the
    keepers kills their tasks, and attempt 3 starts cold. Each resumes from the same checkpoint,
    deep into a stream with Python in its pipeline: the forked first step is within a generous
    ratio of the cold one (a noisy 2-core machine; docs/architecture.md §6)."""
    job = loop_job(job_factory, steps=100000, every=1000, extra=PY_MAP)
    proc = job.start()
    try:

        def ready() -> bool:
            st = status(job)
            standbys = [s["state"] for s in st.get("standbys") or []]
            return standbys == ["ready", "ready"] and (st["tasks"][0].get("last_step") or 0) > 1000

        def restarts(n: int) -> bool:
            return sum(e["kind"] == "recovery" for e in events(job)) == n

        assert wait_until(ready, 120), status(job)  # a standby still importing is not used
        st = status(job)
        keepers = {s["task"]: s["pid"] for s in st["standbys"]}
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)
        assert wait_until(lambda: restarts(1), 90), events(job)[-5:]
        os.kill(status(job)["tasks"][1]["pid"], signal.SIGKILL)  # before its next checkpoint
        assert wait_until(lambda: restarts(2), 90), events(job)[-5:]
        assert {s["task"]: s["pid"] for s in status(job)["standbys"]} == keepers  # the same, kept
        for pid in keepers.values():
            os.killpg(pid, signal.SIGKILL)  # and their tasks with them
        assert wait_until(lambda: restarts(3), 90), events(job)[-5:]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # attempts 1 and 2 forked by the keepers, the timeline complete and in the summary
    pids = {
        (e["attempt"], e["task"]): int(e["reason"][4:]) for e in events(job) if e.get("new") == "STARTING"
    }
    assert {pids[1, t] for t in keepers} & set(keepers.values()) == set()  # forks, not the keepers
    warm, again, cold = [e for e in events(job) if e["kind"] == "recovery"]
    assert warm["reason"].startswith("attempt 1 training again ") and "after worker-1 died" in out
    assert all(v is not None for v in warm["phases_s"].values()), warm
    assert warm["reason"] in out
    log = (job.run_dir / "logs" / "worker-1.log").read_text()
    assert "started cold" not in log.split("attempt 3 started")[0]
    assert "started cold: its standby failed" in log.split("attempt 3 started")[1]
    # the same batch resumed each time, and the first step after a fork as fast as a cold one's
    resumed = re.findall(r"\[orchestrate\] resumed at batch (\d+) of epoch 0: \1 batches skipped in", log)
    assert len(resumed) == 3 and len(set(resumed)) == 1 and int(resumed[0]) >= 1000, log
    for forked in (warm, again):
        assert forked["phases_s"]["connect"] < cold["phases_s"]["connect"], (forked, cold)
        assert forked["phases_s"]["first_step"] <= 1.5 * cold["phases_s"]["first_step"] + 0.5, (forked, cold)
    assert run_processes(job.run_id) == []


def test_exception_in_build_model_fails_fast_without_restarts(job_factory):
    job = loop_job(job_factory, build_extra='raise RuntimeError("no GPU memory for layer 3")')
    t0 = time.monotonic()
    out = job.up(timeout_s=120)
    assert out.returncode == 1, out.stdout
    assert "raised RuntimeError: no GPU memory for layer 3" in out.stdout
    assert "not restarted" in out.stdout and "attempts 1 · restarts 0" in out.stdout
    assert time.monotonic() - t0 < 45
    assert run_processes(job.run_id) == []


def test_unwritable_checkpoint_directory_is_a_clear_error(job_factory):
    job = loop_job(job_factory)
    (job.root / "not-a-dir").write_text("a file where the checkpoints should go")
    job.spec.write_text(
        job.spec.read_text().replace(
            "checkpoint_every: 20}", "checkpoint_every: 20, checkpoint_dir: not-a-dir/ckpt}"
        )
    )
    out = job.up(timeout_s=120)
    assert out.returncode == 1, out.stdout
    assert "checkpoint directory" in out.stdout and "is not writable" in out.stdout
    assert "train.checkpoint_dir" in out.stdout
    assert "restarts 0" in out.stdout


def test_ctrl_c_saves_a_final_checkpoint_and_resume_continues_from_it(job_factory):
    job = loop_job(job_factory, steps=100000, every=1000)  # no periodic checkpoint before the stop
    proc = job.start()
    try:
        assert wait_until(lambda: ((status(job).get("tasks") or [{}])[-1].get("last_step") or 0) >= 30, 90)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    st = status(job)
    assert st["state"] == "INTERRUPTED"
    assert [t["exit_code"] for t in st["tasks"]] == [42, 42]  # both saved, then exited
    saved = sorted(p.name for p in (job.run_dir / "checkpoints").glob("ckpt-*.index"))
    assert len(saved) == 1, saved
    saved_step = int(saved[0].split("-")[1].split(".")[0])
    assert saved_step >= 30
    assert run_processes(job.run_id) == []

    # the same spec, with a reachable end, resumed in the same run directory
    job.spec.write_text(job.spec.read_text().replace("steps: 100000", f"steps: {saved_step + 40}"))
    resumed = __import__("subprocess").run(
        [*job.command()[:-3], "--resume", str(job.run_dir), "--plain"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=job.root,
    )
    assert resumed.returncode == 0, resumed.stdout
    assert (
        f"resumed from {job.run_dir / 'checkpoints'}/ckpt-{saved_step} at step {saved_step}" in resumed.stdout
    )
    st = status(job)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 1
    assert [t["last_step"] for t in st["tasks"]] == [saved_step + 40] * 2


def test_sigterm_to_one_worker_is_a_preemption_restart_outside_the_budget(job_factory):
    job = loop_job(job_factory, steps=400, every=1000)
    job.spec.write_text(job.spec.read_text().replace("max_restarts: 3", "max_restarts: 0"))
    proc = job.start()
    try:
        assert wait_until(lambda: ((status(job).get("tasks") or [{}])[-1].get("last_step") or 0) >= 30, 90)
        os.kill(status(job)["tasks"][1]["pid"], signal.SIGTERM)  # e.g. a host's maintenance
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    st = status(job)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 1 and st["restarts"] == 0
    assert [t["last_step"] for t in st["tasks"]] == [400, 400]
    assert "preempted" in " ".join(e["reason"] for e in events(job))
    assert "resumed from" in (job.run_dir / "logs" / "worker-1.log").read_text()


def test_model_fit_with_backup_and_restore_resumes_mid_training_after_kill(job_factory, tmp_path):
    import shutil

    from tests.conftest import REPO

    job = job_factory("", "restart: {max_restarts: 2, backoff_s: 0.5}\n")
    shutil.copy(REPO / "examples" / "digits_fit.py", job.root / "job.py")
    (job.root / "data").mkdir()
    shutil.copy(REPO / "examples" / "data" / "digits.npz", job.root / "data" / "digits.npz")
    spec = job.spec.read_text().replace('env: {TF_CPP_MIN_LOG_LEVEL: "2"}', 'env: {TF_USE_LEGACY_KERAS: "1"}')
    job.spec.write_text(spec.replace("script: job.py", 'script: job.py\n  args: ["--epochs", "8"]'))
    proc = job.start()
    try:
        assert wait_until(lambda: ((status(job).get("tasks") or [{}])[-1].get("last_step") or 0) >= 50, 90)
        os.kill(status(job)["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    st = status(job)
    assert st["state"] == "SUCCEEDED" and st["restarts"] == 1
    assert [t["last_step"] for t in st["tasks"]] == [8 * 22] * 2  # exactly the planned steps
    points = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    first_after_restart = min(p["step"] for p in points if p["attempt"] == 1)
    assert first_after_restart > 40, first_after_restart  # resumed mid-training, not from step 1
    assert "held-out accuracy" in (job.run_dir / "logs" / "worker-0.log").read_text()


def test_workers_that_start_from_different_states_never_train_on(job_factory):
    # worker-1 changes its own copy of the weights after they were made equal (as a worker whose
    # disk lacked the checkpoint would restore nothing): caught before the first step
    job = loop_job(job_factory, steps=100)
    module = (
        (job.root / "train.py")
        .read_text()
        .replace(
            "    return tf.keras.Sequential([layers.Input(shape=(8,)), hidden, layers.Dense(4)])",
            "    model = tf.keras.Sequential([layers.Input(shape=(8,)), hidden, layers.Dense(4)])\n"
            '    if os.environ["ORCHESTRATE_TASK"] == "worker-1":\n'
            "        hidden.kernel.assign(hidden.kernel.numpy() + 1.0)\n"
            "    return model",
        )
    )
    assert "worker-1" in module
    (job.root / "train.py").write_text(module)
    res = job.up(timeout_s=120)
    assert res.returncode == 1, res.stdout
    st = status(job)
    assert st["state"] == "FAILED" and st["restarts"] == 0, st  # never restarted
    assert "different" in st["reason"] and "not restarted" in st["reason"], st["reason"]
    said = "restored no checkpoint (fresh weights, state"  # which task restored what: two states
    assert f"worker-0 {said}" in res.stdout and f"worker-1 {said}" in res.stdout
    assert all((t["last_step"] or 0) == 0 for t in st["tasks"]), st["tasks"]  # not one step trained
    assert run_processes(job.run_id) == []


def test_the_coordinators_sigkill_leaves_no_standby_and_no_task_behind(job_factory):
    """A standby waits on a pipe from its coordinator: its end (even by SIGKILL) ends the standby
    at once, mid-import or not; the tasks stop themselves once the coordinator is out of reach."""
    job = job_factory(
        plain(
            """
            for step in range(1, 100000):
                worker.report(step=step)
                time.sleep(0.05)
            """
        ),
        "health: {heartbeat_timeout_s: 3}\n",
    )
    proc = job.start()
    try:
        assert wait_until(lambda: len(status(job).get("standbys") or []) == 2, 60), status(job)
        standbys = {s["pid"] for s in status(job)["standbys"]}
        proc.kill()  # no teardown at all
        proc.wait(timeout=10)
        assert wait_until(lambda: not standbys & {p.pid for p in run_processes(job.run_id)}, 5)
        assert wait_until(lambda: run_processes(job.run_id) == [], 30), run_processes(job.run_id)
    finally:
        if proc.poll() is None:
            proc.kill()


STEPS_UNTIL_TOLD = """
    import os, time
    from pathlib import Path
    import worker
    step, deadline = 0, time.monotonic() + 120
    while not Path(os.environ["STOP_FILE"]).exists() and time.monotonic() < deadline:
        step += 1
        worker.report(step=step)
        time.sleep(0.05)
"""


def test_a_kernel_without_madv_populate_write_is_said_once_for_this_machine(job_factory):
    """The kernel refusing madvise(MADV_POPULATE_WRITE) as one before 5.14 does (a seccomp filter
    on the coordinator and all it starts, tests/seccomp.py): each standby says so as it is ready,
    the run once for this machine — the console, status.json's `degraded`, an event."""
    if not seccomp.SUPPORTED:
        pytest.skip("the seccomp filter of tests/seccomp.py is x86_64's")
    job = job_factory(STEPS_UNTIL_TOLD)
    stop = job.root / "stop"
    job.spec.write_text(job.spec.read_text().replace("env: {", f'env: {{STOP_FILE: "{stop}", '))
    command = job.command
    job.command = lambda: [sys.executable, seccomp.__file__, "no-populate-write", "--", *command()]
    proc = job.start()
    try:
        ready = lambda: [s["state"] for s in status(job).get("standbys") or []] == ["ready", "ready"]  # noqa: E731
        assert wait_until(ready, 120), status(job)
        assert wait_until(lambda: status(job).get("degraded"), 10), status(job)
        stop.touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    said = (
        "warm standbys on this machine hand over without their page copy (this kernel ("
        f"{os.uname().release}) refuses madvise(MADV_POPULATE_WRITE): Linux 5.14 and later have it): a task "
        "handed over copies the pages it shares with its standby as it first writes them"
    )
    assert out.count(f"orchestrate: {said}") == 1 and out.count(f"degraded: {said}") == 1, out  # the summary
    assert [(d["what"], d["where"]) for d in status(job)["degraded"]] == [("page_copy", "this machine")]
    assert [e["what"] for e in events(job) if e["kind"] == "degraded"] == ["page_copy"]
    assert run_processes(job.run_id) == []
