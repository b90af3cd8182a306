"""A job's own checkpoints (issue 24): TensorFlow's distributed tutorials as their users run them,
checkpointing to paths of their own (`/tmp/backup`, a relative folder, `/tmp/ckpt`), on hosts
that share no disk (each lab host has its own /tmp and its own job folder), with a worker killed
-9 mid-run: one restart, every task resumes from the same checkpoint. And a start that differs
between tasks is caught before it trains, explained, and not retried.

Real SSH, real TensorFlow, real kill -9; the lab as tests/lab.py makes it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_processes, wait_until
from tests.e2e.test_ssh import SshJob
from tests.lab import make_lab, why_no_lab

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e
needs_lab = pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or "")

#: The multi-worker Keras tutorial's main.py (mnist_setup's dataset made here: no network), with
#: its fault-tolerance section as written: BackupAndRestore to /tmp/backup every 30 batches. A
#: callback slows each batch and says where it is, so that the test can kill a worker mid-epoch.
KERAS_TUTORIAL = """
    import hashlib, json, os, time
    import numpy as np
    import tensorflow as tf

    def mnist_dataset(batch_size):
        rng = np.random.default_rng(0)
        x_train = rng.normal(size=(2048, 28, 28)).astype("float32")
        y_train = rng.integers(0, 10, size=2048).astype("int64")
        dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=1)
        return dataset.repeat().batch(batch_size)

    def build_and_compile_cnn_model():
        model = tf.keras.Sequential([
            tf.keras.layers.InputLayer(input_shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(4, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(10),
        ])
        model.compile(
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
            metrics=["accuracy"],
        )
        return model

    per_worker_batch_size = 16
    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()

    class Where(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if os.environ.get("ORCHESTRATE_ATTEMPT") == "0":  # slow until the kill, then at full speed
                time.sleep(0.04)
            if batch % 10 == 0:
                print(f"AT epoch {self._epoch} batch {batch}", flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir="/tmp/backup", save_freq=30), Where()]
    multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70, callbacks=callbacks, verbose=0)
    weights = multi_worker_model.get_weights()
    print("WEIGHTS", hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(), flush=True)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if why_no_lab() is not None:
        pytest.skip(why_no_lab() or "")
    lab = make_lab(tmp_path_factory.mktemp("lab"), 2)
    if not getattr(lab, "separate_disks", False):
        lab.close()
        pytest.skip("hosts with disks of their own need mount namespaces (root)")
    yield lab
    lab.close()


@pytest.fixture
def jobs():
    made: list = []
    yield made
    for job in made:
        for proc in run_processes(job.run_id):
            proc.kill()


def lab_job(lab, root: Path, script: str, jobs: list) -> SshJob:
    job = SshJob(lab, root, script)
    data = yaml.safe_load(job.spec.read_text())
    data["job"]["env"] = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
    data["health"]["heartbeat_timeout_s"] = 5
    data["restart"] = {"max_restarts": 3, "backoff_s": 0.5}
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    return job


def logged(job: SshJob, task: str, pattern: str) -> list[re.Match[str]]:
    try:
        text = (job.run_dir / "logs" / f"{task}.log").read_text(errors="replace")
    except FileNotFoundError:
        return []
    return list(re.finditer(pattern, text))


def kill_when(job: SshJob, task: str, pattern: str, timeout_s: float = 150) -> None:
    assert wait_until(lambda: logged(job, task, pattern), timeout_s, 0.2), job.status()
    os.kill(job.task(task)["pid"], signal.SIGKILL)  # on its host; pids are global in the lab


def run_killing(job: SshJob, task: str, pattern: str) -> str:
    """`up`; `task` killed -9 once its log says `pattern`; the output of a run that succeeded."""
    proc = job.start()
    try:
        kill_when(job, task, pattern)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    return out


def after_restart(job: SshJob) -> dict[str, str]:
    """What each task printed in attempt 1; its final weights the same on both hosts."""
    logs = {
        t: (job.run_dir / "logs" / f"{t}.log").read_text(errors="replace") for t in ("worker-0", "worker-1")
    }
    second = {t: text.split("attempt 1 started", 1)[1] for t, text in logs.items()}
    weights = [w for text in second.values() for w in re.findall(r"WEIGHTS (\w+)", text)]
    assert len(weights) == 2 and weights[0] == weights[1], weights
    return second


@needs_lab
def test_the_keras_tutorials_backup_to_tmp_resumes_on_both_hosts_after_a_kill(lab, tmp_path, jobs):
    job = lab_job(lab, tmp_path / "keras", KERAS_TUTORIAL, jobs)
    run_killing(job, "worker-1", r"AT epoch 0 batch 50")  # backed up at batch 30, killed after
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status["failures"]
    assert status["checkpoint_folders"] == ["/tmp/backup", "/tmp/backup/chief"]
    # both started attempt 1 from the chief's backup, which host 1 got only through the coordinator
    starts = [t["restored"] for t in status["tasks"]]
    assert starts[0] == starts[1] and starts[0]["source"].startswith("/tmp/backup/chief/ckpt-"), starts
    assert (starts[0]["epoch"], starts[0]["step_in_epoch"]) >= (0, 29), starts
    shipped = [e["reason"] for e in job.events() if e.get("kind") == "state"]
    assert any(
        f"/tmp/backup of worker-0 → hosts[1] {lab.hosts[1].address} /tmp/backup: 3 file(s)" in s
        for s in shipped
    ), shipped
    said = [e["reason"] for e in job.events() if e.get("kind") == "checkpoints"]
    assert said and said[0].startswith(
        "worker-0 checkpoints to /tmp/backup (tf_keras.callbacks.BackupAndRestore)"
    )
    # resumed mid-epoch 0 on both hosts (not from the beginning), and ended with the same model
    for task, second in after_restart(job).items():
        first_at = re.search(r"AT epoch (\d+) batch (\d+)", second)
        assert first_at and (int(first_at[1]), int(first_at[2])) != (0, 0), (task, second[:2000])
    assert job.hosts_empty(), job.host_pids()


#: One task restores a checkpoint only it has (planted: as a host whose disk kept an old one), the
#: other starts fresh; their collectives match, so TensorFlow would train on, two models averaged.
PLANTED = """
    import os, time
    import tensorflow as tf

    task = os.environ["ORCHESTRATE_TASK"]
    planted = os.path.join(os.environ["ORCHESTRATE_RUN_DIR"], "planted-" + task, "ckpt")

    def build():
        return tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if task == "worker-1":  # outside the strategy's scope: this task's own variables
        tf.train.Checkpoint(model=build()).write(planted)
    with strategy.scope():
        model = build()
        optimizer = tf.keras.optimizers.SGD(0.1)
    checkpoint = tf.train.Checkpoint(model=model)
    if os.path.exists(planted + ".index"):
        checkpoint.restore(planted)

    @tf.function
    def train_step(x):
        def step_fn(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(step_fn, args=(x,))

    for i in range(600):
        train_step(tf.ones((2, 4)))
        print(f"STEP {i}", flush=True)
        time.sleep(0.05)
"""


def test_a_start_that_differs_between_tasks_fails_at_once_explained_and_not_retried(job_factory):
    job = job_factory(PLANTED, "restart: {max_restarts: 3, backoff_s: 0.5}\n")
    text = job.spec.read_text().replace(
        'TF_CPP_MIN_LOG_LEVEL: "2"', 'TF_CPP_MIN_LOG_LEVEL: "2", TF_USE_LEGACY_KERAS: "1"'
    )
    job.spec.write_text(text)
    res = job.up(timeout_s=180)
    assert res.returncode == 1, res.stdout
    status = job.status()
    assert status["state"] == "FAILED" and status["restarts"] == 0 and status["attempt"] == 0, status
    (failure,) = status["failures"]
    assert failure["kind"] == "diverged" and failure["tasks"] == ["worker-1"]
    planted = f"{job.run_dir}/planted-worker-1"
    assert f"worker-0 restored nothing; worker-1 restored {planted}/ckpt" in failure["reason"]
    assert f"{planted} differs between the hosts" in failure["reason"]
    assert status["reason"].endswith("not restarted"), status["reason"]
    assert "hint: orchestrate keeps $ORCHESTRATE_CHECKPOINT_DIR" in res.stdout  # the fix, said once
    assert res.stdout.count("ORCHESTRATE_CHECKPOINT_DIR") == 1
    assert "continue it from its checkpoints" not in res.stdout  # a --resume would meet the same
    # caught before a step: the workers compare their starts before the first (RestoreMismatch, if
    # the coordinator, comparing their reports, has not stopped them first)
    for task in ("worker-0", "worker-1"):
        assert "STEP " not in (job.run_dir / "logs" / f"{task}.log").read_text()


#: A Keras job that resumes the way many do: ModelCheckpoint's weights in a folder relative to the
#: job (on each host, its own), and at start `load_weights` of the newest, with initial_epoch.
MODEL_CHECKPOINT = """
    import glob, hashlib, os, re, time
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        layers = [tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(8), tf.keras.layers.Dense(1)]
        model = tf.keras.Sequential(layers)
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(512, 4)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32).repeat()

    def epoch_of(path):
        return int(re.search(r"w-(\\d+)", path)[1])

    saved = sorted(glob.glob("ckpts/w-*.weights.h5"), key=epoch_of)
    initial_epoch = 0
    if saved:
        model.load_weights(saved[-1])
        initial_epoch = epoch_of(saved[-1])
    print(f"STARTS at epoch {initial_epoch}", flush=True)

    class Where(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.05)

        def on_epoch_begin(self, epoch, logs=None):
            print(f"EPOCH {epoch}", flush=True)

    save = tf.keras.callbacks.ModelCheckpoint("ckpts/w-{epoch}.weights.h5", save_weights_only=True)
    callbacks = [save, Where()]
    model.fit(dataset, epochs=5, steps_per_epoch=10, initial_epoch=initial_epoch, callbacks=callbacks,
              verbose=0)
    weights = model.get_weights()
    print("WEIGHTS", hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(), flush=True)
"""


@needs_lab
def test_model_checkpoint_and_load_weights_in_a_relative_folder_resume_on_both_hosts(lab, tmp_path, jobs):
    job = lab_job(lab, tmp_path / "weights", MODEL_CHECKPOINT, jobs)
    run_killing(job, "worker-1", r"EPOCH 2")  # epochs 1 and 2 saved by the chief, on its disk only
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status["failures"]
    (folder,) = status["checkpoint_folders"]
    assert folder.endswith("/ckpts"), folder
    starts = [t["restored"] for t in status["tasks"]]
    assert starts[0]["fingerprint"] == starts[1]["fingerprint"] and starts[0]["source"].endswith(
        ".weights.h5"
    )
    for task, second in after_restart(job).items():
        begun = re.findall(r"STARTS at epoch (\d+)", second)
        assert begun and int(begun[0]) >= 2, (task, begun)  # not from the beginning, on both hosts
    assert job.hosts_empty(), job.host_pids()


#: The custom training loop tutorial's checkpointing as written (write_filepath, _get_temp_dir:
#: the chief to its folder, the others to temporary ones they delete; every task restores from
#: the chief's), with its folder fixed at /tmp/ckpt (the tutorial's `util.get_temp_dir()` is a new
#: folder in every process: no restart could find it).
CUSTOM_LOOP = """
    import hashlib, json, os, time
    import numpy as np
    import tensorflow as tf

    tf_config = json.loads(os.environ["TF_CONFIG"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    cluster_spec = strategy.cluster_resolver.cluster_spec()
    global_batch_size = 16 * len(tf_config["cluster"]["worker"])

    def dataset_fn(input_context):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1024, 6)).astype("float32")
        y = (x @ rng.normal(size=(6, 1))).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(input_context.get_per_replica_batch_size(global_batch_size))

    with strategy.scope():
        layers = [tf.keras.layers.Input(shape=(6,)), tf.keras.layers.Dense(1)]
        multi_worker_model = tf.keras.Sequential(layers)
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.01)
    multi_worker_dataset = strategy.distribute_datasets_from_function(dataset_fn)

    @tf.function
    def train_step(iterator):
        def step_fn(inputs):
            x, y = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.square(multi_worker_model(x, training=True) - y),
                                                  global_batch_size=global_batch_size)
            grads = tape.gradient(loss, multi_worker_model.trainable_variables)
            optimizer.apply_gradients(zip(grads, multi_worker_model.trainable_variables))
            return loss
        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    def _is_chief(task_type, task_id, cluster_spec):
        return (task_type is None or task_type == "chief"
                or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict()))

    def _get_temp_dir(dirpath, task_id):
        base_dirpath = "workertemp_" + str(task_id)
        temp_dir = os.path.join(dirpath, base_dirpath)
        tf.io.gfile.makedirs(temp_dir)
        return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
        dirpath = os.path.dirname(filepath)
        base = os.path.basename(filepath)
        if not _is_chief(task_type, task_id, cluster_spec):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="epoch")
    step_in_epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="step_in_epoch")
    checkpoint_dir = "/tmp/ckpt"
    checkpoint = tf.train.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
    checkpoint_manager = tf.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)
    print(f"STARTS at epoch {epoch.numpy()}", flush=True)

    num_epochs, num_steps_per_epoch = 4, 20
    while epoch.numpy() < num_epochs:
        iterator = iter(multi_worker_dataset)
        print(f"EPOCH {epoch.numpy()}", flush=True)
        while step_in_epoch.numpy() < num_steps_per_epoch:
            train_step(iterator)
            step_in_epoch.assign_add(1)
            time.sleep(0.05)
        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            tf.io.gfile.rmtree(write_checkpoint_dir)
        epoch.assign_add(1)
        step_in_epoch.assign(0)
    weights = multi_worker_model.get_weights()
    print("WEIGHTS", hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(), flush=True)
"""


@needs_lab
def test_the_custom_loop_tutorials_checkpoint_manager_resumes_on_both_hosts(lab, tmp_path, jobs):
    job = lab_job(lab, tmp_path / "loop", CUSTOM_LOOP, jobs)
    run_killing(job, "worker-1", r"EPOCH 2")
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status["failures"]
    assert status["checkpoint_folders"] == ["/tmp/ckpt"]  # the workers' temporary ones are not kept
    starts = [t["restored"] for t in status["tasks"]]
    assert starts[0] == starts[1] and starts[0]["source"].startswith("/tmp/ckpt/ckpt-"), starts
    # saved as the tutorial saves: at an epoch's end, before its count goes up
    assert starts[0]["epoch"] >= 1 and starts[0]["step_in_epoch"] == 20, starts
    for second in after_restart(job).values():
        assert re.findall(r"STARTS at epoch (\d+)", second)[0] == str(starts[0]["epoch"]), second[:1500]
    assert job.hosts_empty(), job.host_pids()


def test_the_workers_compare_their_starts_themselves_before_the_first_step(tmp_path):
    """Without a coordinator to stop them (`python -m worker run` by hand, TF_CONFIG written as
    the tutorials do): the workers compare what they restored over their own collectives at the
    first step, and neither trains."""
    (tmp_path / "job.py").write_text(textwrap.dedent(PLANTED))
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATE_")},
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_USE_LEGACY_KERAS": "1",
            "ORCHESTRATE_TASK": f"worker-{i}",
            "ORCHESTRATE_RUN_DIR": str(tmp_path),
            "PYTHONPATH": str(REPO),
        }
        argv = [sys.executable, "-m", "worker", "run", "--script", str(tmp_path / "job.py")]
        procs.append(
            subprocess.Popen(
                argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 1, out[-3000:]
        assert "RestoreMismatch: the workers restored different states" in out and "STEP " not in out
    assert f"this one: {tmp_path}/planted-worker-1/ckpt" in outs[1] and "this one: nothing" in outs[0]
