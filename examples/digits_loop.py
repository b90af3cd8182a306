"""Handwritten digits for the built-in training loop (mode 2, `job.loop`): the loop module contract.

`orchestrate up cluster_specs/local-loop.yaml` trains it with MultiWorkerMirroredStrategy,
checkpoints every `train.checkpoint_every` steps, resumes after a failure, and saves the model to
`model/model.keras` in the run directory.
"""

from pathlib import Path

import numpy as np
import tensorflow as tf

_DATA = Path(__file__).parent / "data" / "digits.npz"


def _split():
    data = np.load(_DATA)
    images = data["images"].reshape(-1, 64).astype("float32") / 16.0
    labels = data["labels"].astype("int64")
    order = np.random.default_rng(0).permutation(len(images))
    return (images[order[360:]], labels[order[360:]]), (images[order[:360]], labels[order[:360]])


def build_model():
    return tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


def make_optimizer():
    return tf.keras.optimizers.Adam(0.01)


def make_dataset(input_context, global_batch_size):
    (x, y), _ = _split()
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.shuffle(len(x), seed=1).batch(batch, drop_remainder=True).prefetch(2)


def make_eval_dataset():
    _, (x, y) = _split()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(120)
