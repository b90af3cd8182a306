"""Handwritten digits (8×8, the UCI set that scikit-learn bundles; shipped here as data/digits.npz)
trained with Keras `model.fit` under MultiWorkerMirroredStrategy, then scored on held-out digits.

Runs as any TF program would: TF_CONFIG (set by orchestrate) tells each worker its cluster.
Fault tolerant: Keras' BackupAndRestore backs the training state up every 10 steps into the run
directory, so when orchestrate restarts the job after a failure, it resumes mid-epoch.
`model.fit` under MWMS needs tf-keras with TF_USE_LEGACY_KERAS=1 (set in cluster_specs/local.yaml):
Keras 3's fit fails there on TF 2.21.
"""

import argparse
import os
from pathlib import Path

import numpy as np
import tensorflow as tf

import worker

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--global-batch-size", type=int, default=64)
args = parser.parse_args()

data = np.load(Path(__file__).parent / "data" / "digits.npz")
images = data["images"].reshape(-1, 64).astype("float32") / 16.0
labels = data["labels"].astype("int64")
order = np.random.default_rng(0).permutation(len(images))  # the same split on every worker
test, train = order[:360], order[360:]

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print(f"num_replicas_in_sync={strategy.num_replicas_in_sync}", flush=True)

options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
train_ds = (
    tf.data.Dataset.from_tensor_slices((images[train], labels[train]))
    .shuffle(len(train), seed=1)
    .repeat()
    .batch(args.global_batch_size)
    .with_options(options)
)
test_ds = tf.data.Dataset.from_tensor_slices((images[test], labels[test])).batch(120).with_options(options)

with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=tf.keras.optimizers.Adam(0.003),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

steps_per_epoch = len(train) // args.global_batch_size
chief = os.environ.get("ORCHESTRATE_TASK", "worker-0") in ("worker-0", "chief-0")
# A folder on this task's own host that orchestrate keeps consistent: before a restart, the
# chief's latest backup is copied to every host that lacks it (lab machines share no disk).
checkpoints = Path(os.environ.get("ORCHESTRATE_CHECKPOINT_DIR", "checkpoints"))
backup = tf.keras.callbacks.BackupAndRestore(backup_dir=str(checkpoints / "backup"), save_freq=10)
model.fit(
    train_ds,
    epochs=args.epochs,
    steps_per_epoch=steps_per_epoch,
    callbacks=[backup, worker.ReportCallback(global_batch_size=args.global_batch_size)],
    verbose=2 if chief else 0,
)
loss, accuracy = model.evaluate(test_ds, verbose=0)
print(f"held-out accuracy: {accuracy:.3f} (loss {loss:.3f}) on {len(test)} digits", flush=True)
