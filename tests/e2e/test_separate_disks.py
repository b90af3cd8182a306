"""Hosts that share no disk (as two lab machines): recovery, results and checkpoints.

On the network-namespace lab every host has its own /tmp, home and scratch folder (tests/lab.py),
so whatever only worked because hosts shared a disk fails here. Real SSH, real TensorFlow,
real kill -9.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import run_processes, wait_until
from tests.e2e.test_ssh import SshJob
from tests.lab import make_lab, why_no_lab

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or "")]

# Deterministic: seeded weights, data in a fixed order; Adam, so optimizer state matters too.
# Each step sleeps a little (in its loss, not its data: a resumed epoch skips batches at once),
# so a test can kill a task mid-run.
LOOP = """
    import os
    import time
    import numpy as np
    import tensorflow as tf

    def build_model():
        init = tf.keras.initializers.GlorotUniform(seed=1)
        return tf.keras.Sequential([
            tf.keras.layers.Input(shape=(6,)),
            tf.keras.layers.Dense(8, activation="tanh", kernel_initializer=init),
            tf.keras.layers.Dense(1, kernel_initializer=init),
        ])

    def make_optimizer():
        return tf.keras.optimizers.Adam(0.01)

    def make_loss():
        pause = float(os.environ.get("STEP_PAUSE_S", "0.03"))
        if os.environ.get("ORCHESTRATE_ATTEMPT") == "0":  # slower until the kill, where a test asks
            pause = float(os.environ.get("FIRST_ATTEMPT_PAUSE_S", pause))

        def loss(labels, predictions):
            tf.numpy_function(lambda: time.sleep(pause) or np.float32(0), [], tf.float32)
            return tf.reduce_mean(tf.square(labels - predictions), axis=-1)

        return loss

    def make_dataset(ctx, global_batch_size):
        rng = np.random.default_rng(7)
        x = rng.normal(size=(960, 6)).astype("float32")
        y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.batch(ctx.get_per_replica_batch_size(global_batch_size), drop_remainder=True)
        return ds
"""
TRAIN = {"steps": 90, "global_batch_size": 32, "checkpoint_every": 10}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = make_lab(tmp_path_factory.mktemp("lab"), 2)
    yield lab
    lab.close()


@pytest.fixture
def jobs(lab, tmp_path):
    made: list = []
    yield made
    for job in made:
        for proc in run_processes(job.run_id):
            proc.kill()


def needs_separate_disks(lab) -> None:
    if not getattr(lab, "separate_disks", False):
        pytest.skip("hosts with disks of their own need mount namespaces (root)")


def loop_job(lab, root: Path, jobs: list, **spec: object) -> SshJob:
    job = SshJob(lab, root, LOOP)
    data = yaml.safe_load(job.spec.read_text())
    data["job"] = {"loop": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}}
    data["train"] = dict(TRAIN)
    data["health"]["heartbeat_timeout_s"] = 5
    data.update(spec)
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    return job


def final_weights(run_dir: Path) -> list[np.ndarray]:
    import tensorflow as tf  # only to read the model back

    model = tf.keras.models.load_model(run_dir / "model" / "model.keras")
    return [w.copy() for w in model.get_weights()]


def test_a_worker_killed_on_separate_disks_resumes_from_the_chiefs_checkpoint(
    lab, tmp_path, jobs, uninterrupted_loop_weights
):
    needs_separate_disks(lab)
    job = loop_job(lab, tmp_path / "killed", jobs, restart={"max_restarts": 2, "backoff_s": 3})
    data = yaml.safe_load(job.spec.read_text())
    data["job"]["env"]["FIRST_ATTEMPT_PAUSE_S"] = "0.25"  # long enough for its standbys to be ready
    job.spec.write_text(yaml.safe_dump(data))
    proc = job.start()
    try:
        assert wait_until(lambda: (job.task("worker-1").get("last_step") or 0) >= 35, 120), job.status()
        # each task's warm standby waits on its host (its pid said by its shim)
        assert wait_until(lambda: [s["state"] for s in job.status()["standbys"]] == ["ready"] * 2, 90)
        standbys = {s["task"]: (s["host"], s["pid"]) for s in job.status()["standbys"]}
        # the chief's host has a half-written checkpoint (as a save cut short leaves)
        host0 = lab.hosts[0]
        folder = host0.path(host0.workdir / "runs" / job.run_id / "checkpoints")
        (folder / "ckpt-999.data-00000-of-00001").write_bytes(os.urandom(5000))
        (folder / "ckpt-999.index").write_bytes(b"\x00half")
        os.kill(job.task("worker-1")["pid"], signal.SIGKILL)  # on host 1; pids are global here
        assert wait_until(lambda: any(e["kind"] == "recovery" for e in job.events()), 90), job.events()[-5:]
        kept = {s["task"]: (s["host"], s["pid"]) for s in job.status()["standbys"]}
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status
    assert [t["last_step"] for t in status["tasks"]] == [90, 90]
    # both workers started attempt 1 from the chief's checkpoint, with one state, bit for bit
    starts = [t["restored"] for t in status["tasks"]]
    assert starts[0]["step"] == starts[1]["step"] >= 30, starts
    assert starts[0]["fingerprint"] == starts[1]["fingerprint"], starts
    assert "ckpt-999" not in starts[0]["source"]  # the previous complete checkpoint was used
    # attempt 1's tasks were forked by the standbys on their hosts, which stayed for the next
    # attempt; the restart's timeline was said
    attempt_1 = {
        e["task"]: e["reason"] for e in job.events() if e.get("new") == "STARTING" and e["attempt"] == 1
    }
    assert kept == standbys and set(attempt_1) == set(standbys), (kept, attempt_1)
    for task, (host, pid) in standbys.items():
        assert attempt_1[task].endswith(f" on {host}") and attempt_1[task] != f"pid {pid} on {host}"
    assert "started cold" not in (job.run_dir / "logs" / "worker-1.log").read_text()
    [recovery] = [e for e in job.events() if e["kind"] == "recovery"]
    assert recovery["reason"].startswith("attempt 1 training again") and recovery["reason"] in out
    host1 = lab.hosts[1]
    log1 = (job.run_dir / "logs" / "worker-1.log").read_text()
    assert f"resumed from {starts[1]['source']} at step {starts[1]['step']}" in log1
    # ... which host 1's own disk got only from the chief's, through the coordinator
    shipped = [e["reason"] for e in job.events() if e.get("kind") == "state"]
    assert any(host1.address in line and "file(s)" in line for line in shipped), shipped
    # the chief's checkpoints came home while worker-1's stop was still under way, not after
    assert any(line.endswith("(as soon as the owner had exited)") for line in shipped), shipped
    remote_ckpt = host1.path(Path(starts[1]["source"]).parent)
    assert (remote_ckpt / "checkpoint").exists()
    assert not lab.hosts[0].path(Path(starts[1]["source"]).parent / ".worker-1").exists()
    # the results came home: model, TensorBoard, the chief's latest checkpoint
    assert (job.run_dir / "model" / "model.keras").exists()
    assert any((job.run_dir / "tensorboard").iterdir())
    assert (job.run_dir / "checkpoints" / "ckpt-90.index").exists()
    said = out.split(f"brought home from the hosts into {job.run_dir}:\n", 1)[1]
    assert "    model/ from worker-0" in said and "    checkpoints/ from worker-0" in said
    assert job.hosts_empty(), job.host_pids()

    # the killed and resumed run ends with the model of an uninterrupted one
    resumed = final_weights(job.run_dir)
    for a, b in zip(resumed, uninterrupted_loop_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


KERAS_FIT = """
    import os, sys, time
    import numpy as np
    import tensorflow as tf
    import worker

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32).repeat()
    task = os.environ["ORCHESTRATE_TASK"]

    class Say(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            print(f"EPOCH {epoch} BEGINS on {task}", flush=True)

        def on_epoch_end(self, epoch, logs=None):
            worker.report(step=epoch + 1)
            time.sleep(1.0)

    backup = tf.keras.callbacks.BackupAndRestore(os.environ["ORCHESTRATE_CHECKPOINT_DIR"] + "/backup")
    model.fit(ds, epochs=6, steps_per_epoch=4, callbacks=[backup, Say()], verbose=0)
    print("DONE", flush=True)
"""


def test_keras_backup_and_restore_resumes_on_both_hosts_after_a_kill(lab, tmp_path, jobs):
    needs_separate_disks(lab)
    job = SshJob(lab, tmp_path / "fit", KERAS_FIT)
    data = yaml.safe_load(job.spec.read_text())
    data["job"]["env"] = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
    data["health"]["heartbeat_timeout_s"] = 5
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    proc = job.start()
    try:
        # epochs 1 and 2 are done (and backed up by the chief) once worker-1 reports step 2
        assert wait_until(lambda: (job.task("worker-1").get("last_step") or 0) >= 2, 120), job.status()
        os.kill(job.task("worker-1")["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert job.status()["restarts"] == 1
    for name in ("worker-0", "worker-1"):
        log = (job.run_dir / "logs" / f"{name}.log").read_text()
        second = log.split("attempt 1 started", 1)[1]
        begun = [int(line.split()[1]) for line in second.splitlines() if line.startswith("EPOCH ")]
        # resumed after the last epoch backed up (2 or, if the kill came late, 3), on both hosts
        assert begun and begun[0] >= 2 and begun[-1] == 5, (name, begun)
        assert "DONE" in second
    assert job.hosts_empty(), job.host_pids()


PLAIN = """
    import time
    import worker
    for i in range(1, 100000):
        worker.report(step=i)
        time.sleep(0.05)
"""


def orchestrate_check(spec: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "check", str(spec)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "250"},  # the table in one line per host
    )


def test_a_checkpoint_folder_declared_shared_but_not_is_caught_before_anything_starts(lab, tmp_path, jobs):
    needs_separate_disks(lab)
    private = lab.scratch / "ckpt"  # the same path on both hosts, each its own disk
    job = SshJob(lab, tmp_path / "private", PLAIN)
    data = yaml.safe_load(job.spec.read_text())
    data["job"]["checkpoint_dir"] = str(private)
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    check = orchestrate_check(job.spec)
    assert check.returncode == 3, check.stdout + check.stderr
    assert f"{private} is not shared" in check.stdout and "NOT SHARED" in check.stdout
    assert "hosts[0]" in check.stdout and "hosts[1]" in check.stdout and "job.checkpoint_dir" in check.stdout
    res = job.up(timeout_s=60)
    assert res.returncode == 3 and f"{private} is not shared" in res.stderr, res.stdout + res.stderr
    assert job.hosts_empty(), job.host_pids()
    # the lab's shared folder (a network file system) passes, and leaves no nonce behind
    data["job"]["checkpoint_dir"] = str(lab.shared / "ckpt")
    job.spec.write_text(yaml.safe_dump(data))
    check = orchestrate_check(job.spec)
    assert check.returncode == 0, check.stdout + check.stderr
    assert list((lab.shared / "ckpt").iterdir()) == []
    # ...unless one host mounts it read-only: its tasks could not write their checkpoints there
    ro = lab.shared / "ro"
    ro.mkdir()
    data["job"]["checkpoint_dir"] = str(ro)
    data["ssh"] = {**data["ssh"], "shared_dirs": [str(lab.shared)]}
    job.spec.write_text(yaml.safe_dump(data))
    on_host1 = lab.hosts[1].exec_prefix()
    subprocess.run([*on_host1, "mount", "--bind", str(ro), str(ro)], check=True)
    subprocess.run([*on_host1, "mount", "-o", "remount,bind,ro", str(ro)], check=True)
    try:
        check = orchestrate_check(job.spec)
    finally:
        subprocess.run([*on_host1, "umount", str(ro)], check=False)
    assert check.returncode == 3, check.stdout + check.stderr
    problems = [line for line in check.stdout.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1, problems  # host 1, this folder; ssh.shared_dirs passes
    assert "hosts[1]" in problems[0] and f"cannot write in {ro} (job.checkpoint_dir)" in problems[0]
    assert list(ro.iterdir()) == [] and not [p for p in lab.shared.iterdir() if p.name.startswith(".")]


def test_a_host_without_room_for_the_checkpoint_is_a_clear_error_and_keeps_its_old_one(lab, tmp_path):
    needs_separate_disks(lab)
    from orchestrator.errors import LaunchError
    from orchestrator.launch.ssh import ship
    from orchestrator.launch.ssh.hosts import Host, close_all, connect
    from orchestrator.launch.ssh.spec import SshSpec

    # a small disk of its own on host 1 (a tmpfs in its mount namespace), holding an older checkpoint
    small = lab.scratch / "small"
    host1 = lab.hosts[1]
    subprocess.run(
        [*host1.exec_prefix(), "sh", "-c", f"mkdir -p {small} && mount -t tmpfs -o size=512k tmpfs {small}"],
        check=True,
    )
    (host1.path(small) / "checkpoint").write_text('model_checkpoint_path: "ckpt-10"\n')
    (host1.path(small) / "ckpt-10.index").write_bytes(b"old")
    home = tmp_path / "home"
    home.mkdir()
    (home / "ckpt-20.data-00000-of-00001").write_bytes(os.urandom(2 * 1024 * 1024))
    (home / "ckpt-20.index").write_bytes(b"new")
    (home / "checkpoint").write_text('model_checkpoint_path: "ckpt-20"\n')
    host = Host(1, host1.address, host1.ssh_port, None, lab.client_key, (sys.executable,))
    conn = connect(host, SshSpec(known_hosts=lab.known_hosts))
    try:
        with pytest.raises(LaunchError) as info:
            ship.push(conn, host, home, str(small))
        said = str(info.value)
        assert "hosts[1]" in said and "no room for the checkpoint" in said and "free" in said, said
        # the failed copy left the old checkpoint in use
        assert (host1.path(small) / "checkpoint").read_text() == 'model_checkpoint_path: "ckpt-10"\n'
        (home / "ckpt-20.data-00000-of-00001").write_bytes(os.urandom(300 * 1024))  # it fits now
        started = time.monotonic()
        sent = ship.push(conn, host, home, str(small))
        assert sent.files == 3 and sent.removed == 1 and time.monotonic() - started < 30
        assert (host1.path(small) / "checkpoint").read_text() == 'model_checkpoint_path: "ckpt-20"\n'
        assert sorted(p.name for p in host1.path(small).iterdir()) == sorted(p.name for p in home.iterdir())
    finally:
        close_all({1: conn})
        subprocess.run([*host1.exec_prefix(), "umount", str(small)], check=False)


def test_an_evaluator_on_another_host_scores_every_checkpoint_shipped_to_it(lab, tmp_path, jobs):
    needs_separate_disks(lab)
    module = LOOP + (
        "\n    def make_eval_dataset():\n"
        "        x = np.random.default_rng(3).normal(size=(64, 6)).astype('float32')\n"
        "        return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)\n"
    )
    job = SshJob(lab, tmp_path / "eval", module)
    data = yaml.safe_load(job.spec.read_text())
    data.update(
        strategy="mirrored",
        hosts=[lab.host_spec(0), lab.host_spec(1, tasks={"evaluator": 1})],
        job={"loop": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
        train=TRAIN,
    )
    data["health"].update(heartbeat_timeout_s=5, final_wait_s=60)
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    res = job.up(timeout_s=180)
    assert res.returncode == 0, res.stdout + res.stderr
    status = job.status()
    assert {t["task"]: t["state"] for t in status["tasks"]} == {
        "worker-0": "SUCCEEDED",
        "evaluator-0": "SUCCEEDED",
    }
    points = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [p["step"] for p in points if p["task"] == "evaluator-0" and "eval_loss" in p]
    assert scored and scored[-1] == 90, scored  # it saw the final checkpoint, on its own disk
    assert any((job.run_dir / "tensorboard" / "eval").iterdir())  # its output came home
    assert job.hosts_empty(), job.host_pids()


def test_a_host_cut_off_while_its_checkpoint_is_copied_fails_in_bounded_time(lab, tmp_path):
    needs_separate_disks(lab)
    from orchestrator.errors import LaunchError
    from orchestrator.launch.ssh import ship
    from orchestrator.launch.ssh.hosts import Host, close_all, connect
    from orchestrator.launch.ssh.spec import SshSpec

    home = tmp_path / "home"
    home.mkdir()
    (home / "ckpt-20.data-00000-of-00001").write_bytes(os.urandom(1024 * 1024))
    (home / "checkpoint").write_text('model_checkpoint_path: "ckpt-20"\n')
    host1 = lab.hosts[1]
    folder = str(lab.scratch / "cut")
    host = Host(1, host1.address, host1.ssh_port, None, lab.client_key, (sys.executable,))
    conn = connect(host, SshSpec(known_hosts=lab.known_hosts, connect_timeout_s=2))
    lab.cut(1)
    try:
        started = time.monotonic()
        with pytest.raises(LaunchError) as info:
            ship.push(conn, host, home, folder, timeout_s=3)
        took = time.monotonic() - started
    finally:
        lab.restore(1)
        close_all({1: conn})
    assert "hosts[1]" in str(info.value), info.value
    assert took < 3 * 3 + 2, took  # bounded: never paramiko's hour for a channel that never opens
    conn = connect(host, SshSpec(known_hosts=lab.known_hosts, connect_timeout_s=2))
    try:  # back on the network: the next copy goes through, and nothing half-done is left there
        assert ship.push(conn, host, home, folder, timeout_s=10).files == 2
    finally:
        close_all({1: conn})
    assert sorted(p.name for p in host1.path(Path(folder)).iterdir()) == sorted(
        p.name for p in home.iterdir()
    )
