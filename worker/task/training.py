"""What the built-in loop's trainers and its evaluator share about the user's module.

The synchronous trainer (loop.py), the ParameterServerStrategy chief (ps.py) and the evaluator
(evaluate.py) each load the module, take its loss and optimizer, and agree on where checkpoints go
and how the end of training is marked. Kept apart from those three so that none imports another.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from worker import wire
from worker.task.tensorboard import scalar

FINAL_MARKER = "final.json"  # in the checkpoint folder: the last step, written when training is done


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


def user_optimizer(tf: Any, user: ModuleType) -> Any:
    """The module's make_optimizer(), or Adam."""
    return user.make_optimizer() if hasattr(user, "make_optimizer") else tf.keras.optimizers.Adam()


def user_loss(tf: Any, user: ModuleType) -> Any:
    """The module's per-example make_loss(), or sparse categorical cross-entropy from logits."""
    return user.make_loss() if hasattr(user, "make_loss") else _default_loss(tf)


def _default_loss(tf: Any) -> Any:
    def sparse_categorical_crossentropy(labels: Any, logits: Any) -> Any:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)

    return sparse_categorical_crossentropy


def build_optimizer(optimizer: Any, model: Any) -> None:
    """Create the optimizer's variables for the model's (Keras 3 and tf-keras optimizers build
    lazily, on their first step). An optimizer that cannot is left to build itself."""
    build = getattr(optimizer, "build", None)
    if callable(build) and model.trainable_variables and not getattr(optimizer, "built", False):
        build(model.trainable_variables)


def replica_step(tf: Any, model: Any, optimizer: Any, per_example_loss: Any, global_batch_size: int) -> Any:
    """One replica's training step: the loss scaled by the *global* batch (so the replicas' sum is the
    batch mean whatever their number), regularization scaled likewise, gradients applied."""

    def step(features: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            per_example = per_example_loss(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step


def checkpoint_write_dir(checkpoint_dir: Path, is_chief: bool, task_type: str | None, task_id: int) -> Path:
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
    # Non-chief workers must save too (the save is a collective), but where nobody reads it: a
    # folder of their own beside the real checkpoints (invisible to latest_checkpoint), emptied
    # first, so what a killed attempt left there goes with the next one.
    own = checkpoint_dir / f".{task_type}-{task_id}"
    shutil.rmtree(own, ignore_errors=True)
    try:
        own.mkdir(parents=True)
    except OSError:
        own = Path(tempfile.mkdtemp(prefix=f"orchestrate-ckpt-{task_type}-{task_id}-"))
    return own


def write_final_marker(checkpoint_dir: Path, step: int) -> None:
    """Tell an evaluator that training is over and which checkpoint is the last one."""
    tmp = checkpoint_dir / f".{FINAL_MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "run_id": os.environ.get(wire.ENV_RUN_ID)}))
    os.replace(tmp, checkpoint_dir / FINAL_MARKER)


def tensorboard_scalar(tf: Any, name: str, value: float) -> None:
    """A TensorBoard scalar at the writer's current step (worker/task/tensorboard.py writes it)."""
    scalar(tf, name, value)
