"""P12 a job's own checkpoint folder on hosts that share no disk (issue 24): what keeping it the
same on every host adds to a restart.

On the network-namespace lab (each host its own disk and /tmp, tests/lab.py), a mode-1 job (the
custom-loop tutorial's checkpointing: the chief's CheckpointManager to its folder, the others to
temporary ones; every task restores the chief's) on K hosts, one worker each; worker-1 is killed
with SIGKILL after a checkpoint. Restart time = the kill → the first step of attempt 1, which
includes the copy of the chief's folder home and to the other hosts. The baseline, measured in the
same run (interleaved), is the same job with its folder on the lab's shared folder (an NFS mount:
proven shared by a nonce, nothing is copied). Models of ~1 MB and ~100 MB (checkpoint size; SGD,
so the checkpoint is the weights), K = 2 and 4. Also the copy itself (LAUNCHING → first task
started, attempt 1).

Needs root and openssh-server: `sudo .venv/bin/python scripts/bench/own_checkpoints.py`.

`--backend slurm` (issue 40): the same on 2 nodes of the Slurm lab (tests/slurm_lab.py), whose run
directory is on the cluster's shared file system and whose /tmp is each node's own; the baseline's
folder is on the shared file system. `--tutorial`: the Keras tutorial's own
`BackupAndRestore('/tmp/backup')` there, worker-1 killed -9 mid-epoch: how the run ends, its
attempts and seconds (`BENCH_CODE=<checkout>`: orchestrate from that checkout, to measure before).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import events, iso_to_s, status, wait_for  # noqa: E402
from scripts.bench.ship_state import WIDTHS, compare_restarts  # noqa: E402
from tests.lab import NetnsLab, can_netns, why_no_lab  # noqa: E402
from tests.slurm_lab import SlurmLab, why_no_slurm  # noqa: E402

JOB = """
import os
import numpy as np
import tensorflow as tf
import worker

WIDTH, EVERY, FOLDER = int(os.environ["WIDTH"]), int(os.environ["EVERY"]), os.environ["FOLDER"]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
resolver = strategy.cluster_resolver
chief = resolver.task_type == "worker" and resolver.task_id == 0
with strategy.scope():
    init = tf.keras.initializers.RandomNormal(stddev=0.01, seed=1)
    model = tf.keras.Sequential([
        tf.keras.layers.Input(shape=(WIDTH,)),
        tf.keras.layers.Dense(WIDTH, kernel_initializer=init),
        tf.keras.layers.Dense(1, kernel_initializer=init),
    ])
    optimizer = tf.keras.optimizers.SGD(0.001)
step = tf.Variable(0, dtype=tf.int64, name="step")
checkpoint = tf.train.Checkpoint(model=model, step=step)
folder = FOLDER if chief else os.path.join(os.path.dirname(FOLDER), f"workertemp_{resolver.task_id}", "ckpt")
manager = tf.train.CheckpointManager(checkpoint, folder, max_to_keep=1)
latest = tf.train.latest_checkpoint(FOLDER)
if latest:
    checkpoint.restore(latest)
x = tf.constant(np.random.default_rng(0).normal(size=(8, WIDTH)).astype("float32"))

@tf.function
def train_step():
    def fn():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(fn)

while True:
    train_step()
    step.assign_add(1)
    worker.report(step=int(step.numpy()))
    if int(step.numpy()) % EVERY == 0:
        manager.save()
"""


def spec_for(lab: NetnsLab, root: Path, k: int, width: int, every: int, shared: bool) -> Path:
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "train.py").write_text(JOB)
    tag = secrets.token_hex(3)
    folder = str(lab.shared / f"own-{tag}" / "ckpt") if shared else f"/tmp/own-{tag}/ckpt"
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1", "WIDTH": str(width)}
    data = {
        "name": "bench-own",
        "backend": "ssh",
        "hosts": [lab.host_spec(i) for i in range(k)],
        "job": {"script": "job/train.py", "env": {**env, "EVERY": str(every), "FOLDER": folder}},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10, "stop_grace_s": 10},
        "restart": {"max_restarts": 1, "backoff_s": 0},
        "ssh": lab.ssh_spec(),
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


SLURM = {"nodes": 2, "tasks_per_node": {"worker": 1}, "queue_timeout_s": 60, "connect_timeout_s": 10}


def slurm_spec_for(lab: SlurmLab, root: Path, k: int, width: int, every: int, shared: bool) -> Path:
    """The same job on k Slurm nodes; its folder on the shared file system (`root`) or on each
    node's own /tmp."""
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "train.py").write_text(JOB)
    tag = secrets.token_hex(3)
    folder = str(root / f"own-{tag}" / "ckpt") if shared else f"/tmp/own-{tag}/ckpt"
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1", "WIDTH": str(width)}
    data = {
        "name": "bench-own",
        "backend": "slurm",
        "slurm": {
            "nodes": k,
            "tasks_per_node": {"worker": 1},
            "queue_timeout_s": 60,
            "connect_timeout_s": 10,
        },
        "job": {"script": "job/train.py", "env": {**env, "EVERY": str(every), "FOLDER": folder}},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10, "stop_grace_s": 10},
        "restart": {"max_restarts": 1, "backoff_s": 0},
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def tutorial(lab: SlurmLab, root: Path) -> dict[str, Any]:
    """The Keras tutorial as written (`BackupAndRestore('/tmp/backup')`) on 2 nodes, worker-1
    killed -9 at epoch 0 batch 50 (backed up at 30): how the run ended, in how long."""
    from tests.e2e.test_job_checkpoints import KERAS_TUTORIAL

    root.mkdir(parents=True)
    (root / "job.py").write_text(textwrap.dedent(KERAS_TUTORIAL))
    data = {
        "name": "bench-tutorial",
        "backend": "slurm",
        "slurm": {
            "nodes": 2,
            "tasks_per_node": {"worker": 1},
            "queue_timeout_s": 60,
            "connect_timeout_s": 10,
        },
        "job": {"script": "job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5, "stop_grace_s": 3},
        "restart": {"max_restarts": 3, "backoff_s": 0.5},
    }
    (root / "spec.yaml").write_text(yaml.safe_dump(data))
    run = root / "run"
    cwd = os.environ.get("BENCH_CODE")  # `-m orchestrator` from that checkout
    argv = [
        sys.executable,
        "-m",
        "orchestrator",
        "up",
        str(root / "spec.yaml"),
        "--run-dir",
        str(run),
        "--plain",
    ]
    said = root / "up.out"
    with open(said, "w") as sink:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
    log = run / "logs" / "worker-1.log"
    try:
        wait_for(lambda: log.exists() and "AT epoch 0 batch 50" in log.read_text(errors="replace"), 240)
        pid = next(t["pid"] for t in status(run)["tasks"] if t["task"] == "worker-1")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=600)
        ended = time.time()
    finally:
        proc.kill()
    out = said.read_text(errors="replace")
    if os.environ.get("BENCH_KEEP"):  # the run's record, to read after
        shutil.copytree(root, Path(os.environ["BENCH_KEEP"]) / root.name, dirs_exist_ok=True)
    last = status(run)
    first = [e for e in events(run) if e.get("new") == "RUNNING" and (e.get("attempt") or 0) >= 1]
    lines = [ln for ln in out.splitlines() if re.search(r"SUCCEEDED|FAILED", ln)]
    return {
        "code": cwd or "this checkout",
        "state": last["state"],
        "attempts": last["attempt"] + 1,
        "restarts": last.get("restarts"),
        "kill_to_end_s": round(ended - killed, 1),
        "kill_to_attempt_1_running_s": round(iso_to_s(first[0]["time"]) - killed, 1) if first else None,
        "said": lines[-1][:600] if lines else out[-600:],
        "state_events": [e["reason"] for e in events(run) if e.get("kind") == "state"],
    }


def on_slurm(args: argparse.Namespace) -> int:
    if why_no_slurm():
        print(json.dumps({"metric": "P12 a job's own folder, Slurm", "skipped": why_no_slurm()}))
        return 0
    code = [Path(os.environ["BENCH_CODE"])] if "BENCH_CODE" in os.environ else []
    with tempfile.TemporaryDirectory(prefix="bench-own-") as tmp, contextlib.ExitStack() as labs:
        root = Path(tmp)
        lab = labs.enter_context(SlurmLab(nodes=2, shared=[root, *code]))
        lab.wait_ready(timeout_s=30)
        os.environ["SLURM_CONF"] = str(lab.conf)
        if args.tutorial:
            out = [tutorial(lab, root / f"tutorial-{i}") for i in range(args.repeats)]
            print(json.dumps({"metric": "the Keras tutorial's /tmp/backup on Slurm", "runs": out}, indent=2))
            return 0
        cases = [("1 MB", 2)] if args.quick else [(size, 2) for size in WIDTHS]
        rows = compare_restarts(lab, root, cases, args.repeats, slurm_spec_for)  # type: ignore[arg-type]
        print(
            json.dumps(
                {"metric": "P12 a job's own folder, Slurm", "runs": args.repeats, "rows": rows}, indent=2
            )
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 MB on 2 hosts only")
    parser.add_argument("--backend", choices=("ssh", "slurm"), default="ssh")
    parser.add_argument("--tutorial", action="store_true", help="slurm: the Keras tutorial's /tmp/backup")
    args = parser.parse_args()
    if args.backend == "slurm":
        return on_slurm(args)
    if why_no_lab() or not can_netns():
        print(json.dumps({"metric": "P12 a job's own folder", "skipped": why_no_lab() or "needs root"}))
        return 0
    cases = [("1 MB", 2)] if args.quick else [(size, k) for size in WIDTHS for k in (2, 4)]
    with tempfile.TemporaryDirectory(prefix="bench-own-") as tmp:
        root = Path(tmp)
        lab = NetnsLab(root / "lab", 4)
        try:
            rows = compare_restarts(lab, root, cases, args.repeats, spec_for)
            print(
                json.dumps({"metric": "P12 a job's own folder", "runs": args.repeats, "rows": rows}, indent=2)
            )
        finally:
            lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
