"""The evaluator sidecar of the built-in loop (`python -m worker evaluate`).

It trains nothing and joins no cluster (its TF_CONFIG names the training cluster only to tell
TensorFlow what it is). It watches the checkpoint folder; each new checkpoint is restored into
`build_model()` and scored on `make_eval_dataset()` — mean loss (the job's `make_loss()`), plus
accuracy when the model outputs class scores for integer labels. Results go to the coordinator
(`eval_loss`, `eval_accuracy` at the checkpoint's step) and to TensorBoard (`tensorboard/eval`).
When the chief marks training done (`final.json` in the checkpoint folder, naming this run and
the last step), the evaluator scores that last checkpoint and exits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from worker import wire
from worker.task.runtime import reporter
from worker.task.training import FINAL_MARKER, LoopError, load_module, tensorboard_scalar, user_loss

POLL_S = 1.0


def run(module: Path, checkpoint_dir: Path) -> None:
    user = load_module(module)
    if not callable(getattr(user, "make_eval_dataset", None)):
        raise LoopError(
            f"{module} must define make_eval_dataset() for the evaluator (or leave the evaluator out)"
        )
    import tensorflow as tf

    model = user.build_model()
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    checkpoint = tf.train.Checkpoint(model=model, step=step)
    loss_fn = user_loss(tf, user)
    dataset = user.make_eval_dataset()
    run_dir = os.environ.get(wire.ENV_RUN_DIR)
    writer = tf.summary.create_file_writer(str(Path(run_dir) / "tensorboard" / "eval")) if run_dir else None
    rep = reporter()
    rep.mark_ready()
    run_id = os.environ.get(wire.ENV_RUN_ID)
    evaluated: str | None = None
    last_step = -1
    print(f"[orchestrate] evaluator watching {checkpoint_dir}", flush=True)
    while True:
        latest = tf.train.latest_checkpoint(str(checkpoint_dir))
        if latest is not None and latest != evaluated:
            checkpoint.restore(latest).expect_partial()
            metrics = _score(tf, model, dataset, loss_fn)
            last_step, evaluated = int(step.numpy()), latest
            rep.report(last_step, **{f"eval_{k}": v for k, v in metrics.items()})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            print(f"[orchestrate] evaluated {Path(latest).name} (step {last_step}): {shown}", flush=True)
            if writer is not None:
                with writer.as_default(step=last_step):
                    for k, v in metrics.items():
                        tensorboard_scalar(tf, k, v)
                writer.flush()
            continue  # another checkpoint may have come meanwhile
        final = _final_step(checkpoint_dir / FINAL_MARKER, run_id)
        if final is not None and last_step >= final:
            print(
                f"[orchestrate] training is done; the final checkpoint (step {final}) is evaluated",
                flush=True,
            )
            return
        time.sleep(POLL_S)


def _score(tf: Any, model: Any, dataset: Any, loss_fn: Any) -> dict[str, float]:
    total_loss, correct, count = 0.0, 0.0, 0
    classify = True
    for features, labels in dataset:
        predictions = model(features, training=False)
        per_example = loss_fn(labels, predictions)
        n = int(tf.shape(per_example)[0])
        total_loss += float(tf.reduce_sum(per_example))
        count += n
        if classify and predictions.shape.rank == 2 and labels.dtype.is_integer and labels.shape.rank == 1:
            hits = tf.equal(tf.argmax(predictions, axis=-1, output_type=labels.dtype), labels)
            correct += float(tf.reduce_sum(tf.cast(hits, tf.float32)))
        else:
            classify = False
    if count == 0:
        raise ValueError("make_eval_dataset() returned an empty dataset")
    metrics = {"loss": total_loss / count}
    if classify:
        metrics["accuracy"] = correct / count
    return metrics


def _final_step(marker: Path, run_id: str | None) -> int | None:
    """The last step of this run's training, once the chief has written it (else None)."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if run_id is not None and data.get("run_id") not in (None, run_id):
        return None  # left by another run that used the same checkpoint folder
    return int(data["step"])
