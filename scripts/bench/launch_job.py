"""Benchmark job for P1 (launch): a small MWMS job that prints, on worker 0, the wall time of its
first finished step (`first_step_wall=<seconds since the epoch>`). The same code runs under every
launcher compared: a bare Popen, `orchestrate up`, TensorFlow's multi_process_runner."""

import os
import sys
import time


def run(steps: int = 30) -> None:
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(16,)), tf.keras.layers.Dense(1)])
        optimizer = tf.keras.optimizers.SGD(0.01)
    x = tf.constant(np.random.default_rng(0).normal(size=(32, 16)).astype("float32"))

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    tf.reduce_mean(tf.square(model(x)), axis=-1), global_batch_size=64
                )
            optimizer.apply_gradients(
                zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True)
            )
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica), axis=None)

    first = None
    for _ in range(steps):
        float(step())
        if first is None:
            first = time.time()
    if '"index":0' in os.environ.get("TF_CONFIG", "").replace(" ", ""):
        print(f"first_step_wall={first:.6f}", flush=True)


if __name__ == "__main__":
    run(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
