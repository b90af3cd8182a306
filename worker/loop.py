"""Worker runtime: the built-in training loop (mode 2, `job.loop`), the seed's loop done right.

The user's module defines `build_model()` (called under `strategy.scope()`),
`make_dataset(input_context, global_batch_size)` (per-replica batches, sharded by the context),
and optionally `make_loss()` (per-example loss `(labels, predictions) -> [batch]`) and
`make_optimizer()`. The loop distributes the dataset with `distribute_datasets_from_function`,
scales the loss with `tf.nn.compute_average_loss(..., global_batch_size=...)`, runs `strategy.run`
inside a `tf.function`, reduces the loss with `strategy.reduce`, checkpoints every
`checkpoint_every` steps (every worker saves: the chief into the real directory, the others into
temporary ones, or the save deadlocks), and resumes from the latest checkpoint, at the exact step
and position in the epoch it was taken.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from worker import wire
from worker.runtime import reporter


@dataclass(frozen=True)
class LoopConfig:
    module: Path
    strategy: str  # multi_worker_mirrored | mirrored
    steps: int | None
    epochs: int | None
    global_batch_size: int
    checkpoint_every: int
    checkpoint_dir: Path
    run_dir: Path | None


class LoopError(Exception):
    """A problem with the user's loop module or the loop's configuration (not retried)."""


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("orchestrate_user_loop", path)
    if spec is None or spec.loader is None:
        raise LoopError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [name for name in ("build_model", "make_dataset") if not callable(getattr(module, name, None))]
    if missing:
        raise LoopError(f"{path} must define {' and '.join(missing)}() (see the job.loop contract)")
    return module


def run(config: LoopConfig) -> None:
    user = load_module(config.module)
    import tensorflow as tf  # after the module loaded: its own env tweaks come first

    strategy = _make_strategy(tf, config.strategy)
    resolver = strategy.cluster_resolver
    task_type = getattr(resolver, "task_type", None)
    task_id = getattr(resolver, "task_id", 0) or 0
    is_chief = _is_chief(task_type, task_id, resolver)
    write_dir = _write_dir(config.checkpoint_dir, is_chief, task_type, task_id)

    with strategy.scope():
        model = user.build_model()
        optimizer = user.make_optimizer() if hasattr(user, "make_optimizer") else tf.keras.optimizers.Adam()
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_in_epoch")
    per_example_loss = user.make_loss() if hasattr(user, "make_loss") else _default_loss(tf)

    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, step=step, epoch=epoch, step_in_epoch=step_in_epoch
    )
    manager = tf.train.CheckpointManager(checkpoint, str(write_dir), max_to_keep=3)
    latest = tf.train.latest_checkpoint(str(config.checkpoint_dir))
    if latest:
        checkpoint.restore(latest)
        print(f"[orchestrate] resumed from {latest} at step {int(step.numpy())}", flush=True)

    gbs = config.global_batch_size
    dataset = strategy.distribute_datasets_from_function(lambda ctx: user.make_dataset(ctx, gbs))

    @tf.function
    def train_step(batch: Any) -> Any:
        def replica_step(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                loss = tf.nn.compute_average_loss(per_example_loss(labels, predictions), global_batch_size=gbs)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        per_replica = strategy.run(replica_step, args=batch)
        # each replica's loss is already divided by the global batch: their sum is the batch mean
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    rep = reporter()
    rep.set_total_steps(config.steps)
    writer = tf.summary.create_file_writer(str(config.run_dir / "tensorboard")) if is_chief and config.run_dir else None
    last_time, last_step = time.monotonic(), int(step.numpy())
    try:
        while not _finished(config, int(step.numpy()), int(epoch.numpy())):
            iterator = iter(dataset)
            for _ in range(int(step_in_epoch.numpy())):  # resume mid-epoch at the same batch
                if not iterator.get_next_as_optional().has_value():
                    break
            trained_this_epoch = False
            while not _finished(config, int(step.numpy()), int(epoch.numpy())):
                batch = iterator.get_next_as_optional()
                if not batch.has_value():
                    break
                loss = float(train_step(batch.get_value()))
                trained_this_epoch = True
                step.assign_add(1)
                step_in_epoch.assign_add(1)
                now_step = int(step.numpy())
                rep.report(now_step, loss=loss)
                if writer is not None and (now_step % 10 == 0 or now_step == config.steps):
                    now = time.monotonic()
                    with writer.as_default(step=now_step):
                        _scalar(tf, "loss", loss)
                        _scalar(tf, "steps_per_s", (now_step - last_step) / max(now - last_time, 1e-9))
                    last_time, last_step = now, now_step
                if now_step % config.checkpoint_every == 0:
                    manager.save(checkpoint_number=now_step)
                    if is_chief:
                        total = f"/{config.steps}" if config.steps else ""
                        print(f"[orchestrate] step {now_step}{total}: loss {loss:.4f}, checkpoint saved", flush=True)
            else:
                continue  # steps reached inside the epoch
            if not trained_this_epoch and int(step_in_epoch.numpy()) == 0:
                raise LoopError("make_dataset() returned an empty dataset: nothing to train on")
            epoch.assign_add(1)
            step_in_epoch.assign(0)
        if manager.latest_checkpoint is None or not manager.latest_checkpoint.endswith(f"-{int(step.numpy())}"):
            manager.save(checkpoint_number=int(step.numpy()))
    finally:
        if writer is not None:
            writer.close()
        if not is_chief:
            shutil.rmtree(write_dir, ignore_errors=True)
    if is_chief and config.run_dir is not None:
        model_dir = config.run_dir / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        model.save(str(model_dir / "model.keras"))
        print(f"[orchestrate] saved the trained model to {model_dir / 'model.keras'}", flush=True)


def _scalar(tf: Any, name: str, value: float) -> None:
    """A TensorBoard scalar, written without the tensorboard package (tf.summary.scalar needs it;
    the file format does not): a float tensor tagged for TensorBoard's "scalars" plugin."""
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(name, tf.constant(value, dtype=tf.float32), metadata=metadata)


def _finished(config: LoopConfig, step: int, epoch: int) -> bool:
    if config.steps is not None:
        return step >= config.steps
    return epoch >= (config.epochs or 0)


def _make_strategy(tf: Any, name: str) -> Any:
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    raise LoopError(f"the built-in loop does not support strategy {name!r} yet")


def _is_chief(task_type: str | None, task_id: int, resolver: Any) -> bool:
    if task_type in (None, "chief"):
        return True
    has_chief = resolver is not None and "chief" in resolver.cluster_spec().as_dict()
    return task_type == "worker" and task_id == 0 and not has_chief


def _write_dir(checkpoint_dir: Path, is_chief: bool, task_type: str | None, task_id: int) -> Path:
    if is_chief:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            probe = checkpoint_dir / f".write-test-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise LoopError(
                f"checkpoint directory {checkpoint_dir} is not writable ({exc.strerror or exc}); "
                "fix its permissions or free space, or set train.checkpoint_dir"
            ) from None
        return checkpoint_dir
    # Non-chief workers must save too (the save is a collective), but where nobody reads it.
    return Path(tempfile.mkdtemp(prefix=f"orchestrate-ckpt-{task_type}-{task_id}-"))


def _default_loss(tf: Any) -> Any:
    def sparse_categorical_crossentropy(labels: Any, logits: Any) -> Any:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)

    return sparse_categorical_crossentropy


def config_from_args(ns: Any) -> LoopConfig:
    run_dir = os.environ.get(wire.ENV_RUN_DIR)
    return LoopConfig(
        module=Path(ns.module),
        strategy=ns.strategy,
        steps=ns.steps,
        epochs=ns.epochs,
        global_batch_size=ns.global_batch_size,
        checkpoint_every=ns.checkpoint_every,
        checkpoint_dir=Path(ns.checkpoint_dir),
        run_dir=Path(run_dir) if run_dir else None,
    )
