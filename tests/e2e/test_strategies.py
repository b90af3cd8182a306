"""ParameterServerStrategy, MirroredStrategy and the evaluator end to end: real TensorFlow processes
on the local backend, real signals."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import CliRun, run_processes, wait_until

pytestmark = pytest.mark.e2e

# A small classification task: 8 features, 4 classes, learnable in a few dozen steps.
LOOP = """
    import numpy as np
    import tensorflow as tf

    def _data(n, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(n, 8)).astype("float32")
        y = (x[:, :4].argmax(axis=1)).astype("int64")
        return x, y

    def build_model():
        layers = tf.keras.layers
        hidden = layers.Dense(16, activation="relu")
        return tf.keras.Sequential([layers.Input(shape=(8,)), hidden, layers.Dense(4)])

    def make_optimizer():
        return tf.keras.optimizers.Adam(0.02)

    def make_dataset(ctx, global_batch_size):
        x, y = _data(2048, 0)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        batch = ctx.get_per_replica_batch_size(global_batch_size)
        return ds.shuffle(2048, seed=1).batch(batch, drop_remainder=True)

    def make_eval_dataset():
        {eval_body}
"""
EVAL_OK = "x, y = _data(256, 1)\n        return tf.data.Dataset.from_tensor_slices((x, y)).batch(64)"
EVAL_CRASH = "raise RuntimeError('the eval data is missing')"


class LoopJob(CliRun):
    def __init__(
        self, root: Path, strategy: str, tasks: str, *, steps: int, eval_body: str = EVAL_OK, extra: str = ""
    ):
        self.root = root
        self.run_dir = root / "run"
        (root / "loop.py").write_text(textwrap.dedent(LOOP.replace("{eval_body}", eval_body)))
        self.spec = root / "spec.yaml"
        self.spec.write_text(
            textwrap.dedent(
                f"""\
                name: s
                strategy: {strategy}
                hosts:
                  - address: 127.0.0.1
                    tasks: {tasks}
                job:
                  loop: loop.py
                  env: {{TF_CPP_MIN_LOG_LEVEL: "2", TF_USE_LEGACY_KERAS: "1"}}
                train: {{steps: {steps}, global_batch_size: 64, checkpoint_every: 20}}
                health: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: 10, final_wait_s: 60}}
                restart: {{max_restarts: 2, backoff_s: 0.5}}
                """
            )
            + textwrap.dedent(extra)
        )

    def metrics(self, task: str) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [m for m in map(json.loads, lines) if m["task"] == task]

    def log(self, task: str) -> str:
        return (self.run_dir / "logs" / f"{task}.log").read_text()


@pytest.fixture
def loop_job(tmp_path):
    made: list[LoopJob] = []

    def make(*args, **kw) -> LoopJob:
        job = LoopJob(tmp_path, *args, **kw)
        made.append(job)
        return job

    yield make
    for job in made:
        for proc in run_processes(job.run_id):
            proc.kill()


PS_TASKS = "{chief: 1, worker: 2, ps: 1, evaluator: 1}"


def test_parameter_server_job_trains_evaluates_and_leaves_no_server_behind(loop_job):
    job = loop_job("parameter_server", PS_TASKS, steps=60)
    res = job.up(timeout_s=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["reason"].startswith("chief-0 exited 0")
    states = {t["task"]: t["state"] for t in status["tasks"]}
    assert states == {
        "chief-0": "SUCCEEDED",
        "evaluator-0": "SUCCEEDED",  # it scored the final checkpoint, then ended by itself
        "worker-0": "STOPPED",
        "worker-1": "STOPPED",
        "ps-0": "STOPPED",
    }
    assert job.task("chief-0")["last_step"] == 60
    assert job.task("chief-0")["restored"] == {  # a first attempt: nothing to restore
        "step": 0,
        "fingerprint": "nothing",
        "source": None,
        "epoch": 0,
        "step_in_epoch": 0,
        "final": True,
    }
    assert run_processes(job.run_id) == []
    # the evaluator scored the final checkpoint and reported it
    scored = job.metrics("evaluator-0")
    assert scored and scored[-1]["step"] == 60 and "eval_loss" in scored[-1]
    assert scored[-1]["eval_accuracy"] > 0.5  # 4 classes: chance is 0.25
    assert (job.run_dir / "model" / "model.keras").exists()
    assert (job.run_dir / "tensorboard" / "eval").is_dir()


def kill_mid_training(job: LoopJob, victim: str, at_step: int, timeout_s: float) -> tuple[int, str]:
    """Run the job, SIGKILL one task once the chief has passed `at_step`; (exit code, output)."""
    proc = job.start()
    try:
        assert wait_until(lambda: (job.task("chief-0").get("last_step") or 0) >= at_step, 120), job.status()
        os.kill(job.task(victim)["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def test_parameter_server_worker_killed_is_restarted_alone_while_the_chief_goes_on(loop_job):
    job = loop_job("parameter_server", "{chief: 1, worker: 2, ps: 1}", steps=400)
    code, out = kill_mid_training(job, "worker-1", at_step=30, timeout_s=240)
    assert code == 0, out[-3000:]
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 0 and status["attempt"] == 0
    events = job.events()
    restart = next(e for e in events if e.get("kind") == "task_restart")
    assert restart["task"] == "worker-1" and "SIGKILL" in restart["reason"]
    assert any(e.get("task") == "worker-1" and "restarted alone" in e.get("reason", "") for e in events)
    assert "restarted alone: worker-1 was killed by SIGKILL" in out
    assert job.task("chief-0")["last_step"] == 400
    assert run_processes(job.run_id) == []


def test_parameter_server_ps_killed_restarts_the_job_from_the_chiefs_checkpoint(loop_job):
    job = loop_job("parameter_server", "{chief: 1, worker: 2, ps: 1}", steps=400)
    code, out = kill_mid_training(job, "ps-0", at_step=50, timeout_s=300)
    assert code == 0, out[-3000:]
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1
    stopping = next(e for e in job.events() if e.get("new") == "STOPPING")
    assert stopping["reason"].startswith("ps-0 was killed by SIGKILL"), stopping  # not the chief's error
    log = job.log("chief-0")
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert resumed and int(resumed[-1].rsplit("step ", 1)[1]) >= 40  # from a checkpoint, not from 0
    # the chief reports what it restored, so the restart's timeline has a restore phase
    restored = job.task("chief-0")["restored"]
    assert restored["step"] == int(resumed[-1].rsplit("step ", 1)[1]), restored
    assert restored["source"] == resumed[-1].split("resumed from ", 1)[1].split(" at step")[0]
    assert len(restored["fingerprint"]) == 16 and restored["fingerprint"] != "nothing"
    [recovery] = [e for e in job.events() if e.get("kind") == "recovery"]
    assert " restore —" not in recovery["reason"] and " restore " in recovery["reason"], recovery
    assert job.task("chief-0")["last_step"] == 400
    assert run_processes(job.run_id) == []


def test_evaluator_crash_is_reported_and_the_job_still_succeeds(loop_job):
    job = loop_job("multi_worker_mirrored", "{worker: 1, evaluator: 1}", steps=40, eval_body=EVAL_CRASH)
    res = job.up(timeout_s=240)
    assert res.returncode == 0, res.stdout[-3000:]
    status = job.status()
    assert status["state"] == "SUCCEEDED"
    evaluator = job.task("evaluator-0")
    assert evaluator["state"] == "FAILED" and "the eval data is missing" in evaluator["reason"]
    assert (
        "reported, did not stop the job: evaluator-0 raised RuntimeError: the eval data is missing"
        in res.stdout
    )
    assert any(e.get("kind") == "warning" and e.get("task") == "evaluator-0" for e in job.events())


def test_mirrored_with_two_logical_cpu_devices_trains_two_replicas(loop_job):
    job = loop_job("mirrored", "{worker: 1}", steps=40, extra="")
    text = job.spec.read_text().replace("checkpoint_every: 20}", "checkpoint_every: 20, cpu_replicas: 2}")
    job.spec.write_text(text)
    res = job.up(timeout_s=240)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "MirroredStrategy: num_replicas_in_sync=2" in job.log("worker-0")
    assert job.status()["state"] == "SUCCEEDED" and job.task("worker-0")["last_step"] == 40
    assert (job.run_dir / "model" / "model.keras").exists()


PS_SCRIPT = """
    import tensorflow as tf
    import worker

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):  # as TensorFlow's tutorial: blocked in C++ until killed
        tf.distribute.Server(
            resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id, protocol="grpc"
        ).join()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        # as the tutorial (its 10): Keras calls a batch-level callback once per execution
        model.compile(tf.keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=5)

    def dataset_fn(input_context):
        x = tf.random.stateless_normal((64, 4), seed=(1, 2))
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

    model.fit(
        tf.keras.utils.experimental.DatasetCreator(dataset_fn),
        epochs=3,
        steps_per_epoch=10,
        callbacks=[worker.ReportCallback()],  # batch-level: accepted under ParameterServerStrategy
        verbose=0,
    )
    print("FIT DONE", int(model.optimizer.iterations.numpy()), flush=True)
"""


def test_parameter_server_mode_1_script_runs_on_every_task(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent(PS_SCRIPT))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        textwrap.dedent(
            """\
            name: ps1
            strategy: parameter_server
            hosts:
              - address: 127.0.0.1
                tasks: {chief: 1, worker: 2, ps: 1}
            job:
              script: job.py
              env: {TF_CPP_MIN_LOG_LEVEL: "2", TF_USE_LEGACY_KERAS: "1"}
            """
        )
    )
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    # the servers count as up by themselves (their tf.distribute.Server started): no startup deadline
    up = {e["task"] for e in events if e.get("new") == "RUNNING" and e.get("kind") == "task"}
    assert up == {"chief-0", "worker-0", "worker-1", "ps-0"}
    assert "FIT DONE 30" in (run_dir / "logs" / "chief-0.log").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    chief = next(t for t in status["tasks"] if t["task"] == "chief-0")
    # the step Keras counts (the optimizer's), not the callback's calls (one per 5 steps): a finished
    # job's last report is its last step
    assert chief["last_step"] == 30 and chief["total_steps"] == 30 and "loss" in chief["metrics"]
    assert "step 30/30 (100%)" in res.stdout
    points = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [p["step"] for p in points if "loss" in p] == [10, 20, 30]  # the epochs' metrics
    stopping = next(e for e in events if e.get("new") == "STOPPING")
    done = next(e for e in events if e.get("new") == "SUCCEEDED" and e.get("kind") == "run")

    def seconds(event: dict) -> float:
        return dt.datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()

    # servers in join() never see SIGTERM: they save nothing, so no grace period is waited out
    assert seconds(done) - seconds(stopping) < 5
    assert run_processes(run_dir.name) == []
