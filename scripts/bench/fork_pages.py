"""Issue 39: what a task forked from its keeper pays in its first step, and what its spare saves.

1. A copy-on-write fault's cost: a child of a 200 MiB process writes a byte per page, alone, then
   with one other thread of its own running on another core (as TensorFlow's are during a first
   step: the copy's TLB shootdown reaches that core). Microseconds per fault, that thread's CPU.
2. The first step itself (a tf.data pipeline with a `tf.numpy_function` map skipping 1,500 batches,
   as a resumed epoch does, then one Keras training step in a `tf.function`), measured inside the
   process, in three kinds of process interleaved round by round: `cold` (a fresh interpreter
   that imports TensorFlow), `fork` (forked from a keeper-like parent that imported it on a
   SCHED_IDLE thread, worker/warm/standby.py's way) and `spare` (the same fork after
   worker/warm/spare.py's `own_pages`, which a spare does before its handover). Medians of the
   rounds: wall and CPU seconds, minor faults; `fork` and `spare` as ratios to `cold`.

`python scripts/bench/fork_pages.py [--rounds 8]` prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[2]

STEP = """
import os, resource, sys, threading, time
sys.path.insert(0, {repo!r})

def usage():
    t = os.times()
    return time.monotonic(), t.user + t.system, resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def first_step():
    import numpy as np, tensorflow as tf
    before = usage()
    x = np.random.rand(1797, 64).astype(np.float32)
    y = np.random.randint(0, 10, 1797)
    def augment(v):
        return (v + np.float32(0.0)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    ds = ds.map(lambda v, w: (tf.ensure_shape(tf.numpy_function(augment, [v], tf.float32), v.shape), w))
    batches = iter(ds.skip(1500))
    model = tf.keras.Sequential([
        tf.keras.layers.Input((64,)), tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(10)
    ])
    optimizer = tf.keras.optimizers.Adam()

    @tf.function
    def step(v, w):
        with tf.GradientTape() as tape:
            logits = model(v)
            losses = tf.keras.losses.sparse_categorical_crossentropy(w, logits, from_logits=True)
            loss = tf.reduce_mean(losses)
        weights = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss

    step(*next(batches)).numpy()
    after = usage()
    print("RESULT", after[0] - before[0], after[1] - before[1], after[2] - before[2], flush=True)

kind = sys.argv[1]
if kind == "cold":
    import numpy, tensorflow, keras
    first_step()
    os._exit(0)
import numpy

def imports():
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    import tensorflow, keras

loading = threading.Thread(target=imports)
loading.start()
loading.join()
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    if kind == "spare":
        from worker.warm import spare
        spare.own_pages()
    first_step()
    os._exit(0)
os.waitpid(pid, 0)
"""


def fault_cost(threaded: bool) -> float:
    """Microseconds of the faulting thread's CPU per copy-on-write fault."""
    size = 200 << 20
    memory = bytearray(size)
    for i in range(0, size, 4096):
        memory[i] = 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        stop = threading.Event()
        if threaded:
            blob = b"x" * (64 << 20)

            def spin() -> None:
                import hashlib

                while not stop.is_set():
                    hashlib.sha256(blob).digest()  # off the GIL, on the other core

            threading.Thread(target=spin, daemon=True).start()
            time.sleep(0.2)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        began = time.thread_time()
        for i in range(0, size, 4096):
            memory[i] = 2
        spent = time.thread_time() - began
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        os.write(write, f"{spent / max(1, faults) * 1e6:.2f}".encode())
        stop.set()
        os._exit(0)
    os.close(write)
    answer = os.read(read, 64)
    os.waitpid(pid, 0)
    os.close(read)
    return float(answer)


def one(kind: str) -> tuple[float, float, int]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(
        [sys.executable, "-c", STEP.format(repo=str(REPO)), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env=env,
        check=False,
    ).stdout
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{kind}: no result\n{out[-2000:]}")
    wall, cpu, faults = line.split()[1:]
    return float(wall), float(cpu), int(faults)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    ns = parser.parse_args()
    out: dict = {
        "cow_fault_us": {
            "alone": median(fault_cost(False) for _ in range(3)),
            "another_thread_running": median(fault_cost(True) for _ in range(3)),
        }
    }
    kinds = ("cold", "fork", "spare")
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
    for _ in range(ns.rounds):  # interleaved: each round meets the machine as it is then
        for kind in kinds:
            runs[kind].append(one(kind))
    for kind in kinds:
        wall, cpu, faults = (median(r[i] for r in runs[kind]) for i in range(3))
        out[kind] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "minor_faults": int(faults)}
        out[kind]["walls"] = [round(r[0], 2) for r in runs[kind]]
    for kind in ("fork", "spare"):
        out[kind]["wall_vs_cold"] = round(out[kind]["wall_s"] / out["cold"]["wall_s"], 2)
        slower = sum(a[0] > c[0] for a, c in zip(runs[kind], runs["cold"], strict=True))
        out[kind]["rounds_slower_than_cold"] = f"{slower} of {ns.rounds}"
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
