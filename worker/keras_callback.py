"""Worker runtime: `worker.ReportCallback`, a Keras callback reporting every training batch.

Built on `tf.keras.callbacks.Callback`, so it fits whichever Keras `tf.keras` is: tf-keras when
TF_USE_LEGACY_KERAS=1 (needed for model.fit under MultiWorkerMirroredStrategy), else Keras 3.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from worker.reporter import keeps_points
from worker.runtime import reporter


class ReportCallback(tf.keras.callbacks.Callback):  # type: ignore[misc]
    """Reports step (the optimizer's iteration count, so a resumed run continues its count) and logs;
    in metrics.jsonl from the chief (worker 0) only, as every worker's logs are the same."""

    def __init__(self) -> None:
        super().__init__()
        self._step: int | None = None
        self._scale = 1.0
        self._report = reporter().report if keeps_points() else reporter().progress

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._step = None  # read after the first batch: BackupAndRestore may restore the count first
        self._scale = 1.0 / _summed_replicas(self.model)
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        if steps and epochs:
            reporter().set_total_steps(int(steps) * int(epochs))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._step is None:
            try:
                self._step = int(self.model.optimizer.iterations.numpy())
            except (AttributeError, ValueError, TypeError):
                self._step = 1
        else:
            self._step += 1
        values = logs or {}
        if self._scale != 1.0:
            values = {k: _scaled(v, self._scale) for k, v in values.items()}
        self._report(self._step, **values)


def _summed_replicas(model: Any) -> int:
    """How many copies tf-keras adds together in its per-batch logs.

    tf-keras reduces per-replica batch logs with "auto", which means "sum" on every strategy but
    TPU; each replica holds the same synchronized metric value, so with 2 workers the batch loss
    reads twice the true value (its epoch logs are right). We undo exactly that case.
    """
    strategy = getattr(model, "distribute_strategy", None)
    if not type(model).__module__.startswith("tf_keras") or strategy is None:
        return 1
    if getattr(model, "distribute_reduction_method", "auto") not in ("auto", "sum"):
        return 1
    if "TPU" in type(strategy).__name__:
        return 1
    return max(1, int(strategy.num_replicas_in_sync))


def _scaled(value: Any, scale: float) -> Any:
    try:
        return float(value) * scale
    except (TypeError, ValueError):
        return value
