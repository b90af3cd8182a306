"""Benchmark job: a small MWMS training loop that times its own steps (after a warm-up).

`--report` calls worker.report() every step (what the built-in loop does); without it the task
never touches the reporting API. Prints `steps_per_s=<value>` on worker 0, and on every worker the
CPU time its process (all threads: TensorFlow's, the heartbeat thread) spent per measured step,
`cpu_ms_per_step=<value>` — steadier than wall time on a shared machine.
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--warmup", type=int, default=50)
parser.add_argument("--report", action="store_true")
args = parser.parse_args()

if args.report:
    import worker

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = tf.keras.Sequential(
        [tf.keras.layers.Input(shape=(32,)), tf.keras.layers.Dense(64), tf.keras.layers.Dense(1)]
    )
    optimizer = tf.keras.optimizers.SGD(0.01)
x = tf.constant(np.random.default_rng(0).normal(size=(32, 32)).astype("float32"))
y = tf.constant(np.zeros((32, 1), "float32"))


@tf.function
def step():
    def replica():
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                tf.reduce_mean(tf.square(model(x) - y), axis=-1), global_batch_size=64
            )
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
        )
        return loss

    return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica), axis=None)


for i in range(1, args.steps + 1):
    if i == args.warmup:
        t0, cpu0 = time.perf_counter(), time.process_time()
    loss = float(step())
    if args.report:
        worker.report(step=i, loss=loss)
rate = (args.steps - args.warmup) / (time.perf_counter() - t0)
cpu_ms = 1000 * (time.process_time() - cpu0) / (args.steps - args.warmup)
print(f"cpu_ms_per_step={cpu_ms:.4f}", flush=True)
if os.environ.get("ORCHESTRATE_TASK", "worker-0") == "worker-0" or '"index":0' in os.environ.get(
    "TF_CONFIG", ""
):
    print(f"steps_per_s={rate:.2f}", flush=True)
print(f"cpu_total_s={time.process_time():.3f}", flush=True)  # the whole process, start-up included
