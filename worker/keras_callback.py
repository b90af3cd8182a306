"""Worker runtime: `worker.ReportCallback`, a Keras callback reporting every training batch.

Built on `tf.keras.callbacks.Callback`, so it fits whichever Keras `tf.keras` is: tf-keras when
TF_USE_LEGACY_KERAS=1 (needed for model.fit under MultiWorkerMirroredStrategy), else Keras 3.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from worker.runtime import reporter


class ReportCallback(tf.keras.callbacks.Callback):  # type: ignore[misc, name-defined]
    """Reports step (the optimizer's iteration count, so a resumed run continues its count) and logs."""

    def __init__(self) -> None:
        super().__init__()
        self._step = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        try:
            self._step = int(self.model.optimizer.iterations.numpy())
        except (AttributeError, ValueError, TypeError):
            self._step = 0
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        if steps and epochs:
            reporter().set_total_steps(int(steps) * int(epochs))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._step += 1
        reporter().report(self._step, **(logs or {}))
