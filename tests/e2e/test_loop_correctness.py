"""The built-in loop is correct for several workers: 2 workers train to the same weights as 1,
for the same data and global batch size (the seed's loop summed unscaled losses: this would fail)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

MODULE = """
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
        return tf.keras.optimizers.SGD(0.05)

    def make_loss():
        return lambda labels, predictions: tf.reduce_mean(tf.square(labels - predictions), axis=-1)

    def make_dataset(ctx, global_batch_size):
        rng = np.random.default_rng(7)
        x = rng.normal(size=(960, 6)).astype("float32")
        y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_replica_batch_size(global_batch_size), drop_remainder=True)
"""


def _run_loop(root, train: str, workers: int):
    """Run MODULE with the built-in loop; returns the finished Job."""
    from tests.conftest import Job, run_processes

    job = Job(root, "", f"train: {train}\n", workers=workers)
    (job.root / "train.py").write_text(textwrap.dedent(MODULE))
    job.spec.write_text(job.spec.read_text().replace("script: job.py", "loop: train.py"))
    try:
        out = job.up(timeout_s=180)
    finally:
        for proc in run_processes(job.run_id):
            proc.kill()
    assert out.returncode == 0, out.stdout
    return job


def _train(root, workers: int) -> list[np.ndarray]:
    import tensorflow as tf  # only to read the saved model back

    job = _run_loop(root, "{steps: 30, global_batch_size: 32, checkpoint_every: 10}", workers)
    model = tf.keras.models.load_model(job.run_dir / "model" / "model.keras")
    return [w.copy() for w in model.get_weights()]


def test_two_workers_train_to_the_same_weights_as_one(tmp_path_factory):
    one = _train(tmp_path_factory.mktemp("one"), workers=1)
    two = _train(tmp_path_factory.mktemp("two"), workers=2)
    assert len(one) == len(two) == 4
    user: dict = {}
    exec(textwrap.dedent(MODULE), user)  # the same seeded initial weights, untrained
    initial = user["build_model"]().get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one, initial, strict=True))
    assert moved > 1e-2  # training changed the weights, so the equality below means something
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_epochs_mode_runs_whole_epochs_and_leaves_no_worker_checkpoints(tmp_path):
    job = _run_loop(tmp_path, "{epochs: 2, global_batch_size: 32, checkpoint_every: 10}", workers=2)
    status = json.loads((job.run_dir / "status.json").read_text())
    assert [t["last_step"] for t in status["tasks"]] == [2 * 960 // 32] * 2
    checkpoints = job.run_dir / "checkpoints"
    assert (checkpoints / "ckpt-60.index").exists()
    hidden = [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
    assert hidden == []  # worker-1's own copies are removed at the end
