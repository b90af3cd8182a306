"""`worker.ReportCallback`, a Keras callback reporting training progress.

Built on `tf.keras.callbacks.Callback`, so it fits whichever Keras `tf.keras` is: tf-keras when
TF_USE_LEGACY_KERAS=1 (needed for model.fit under MultiWorkerMirroredStrategy), else Keras 3.

Under ParameterServerStrategy, Keras refuses batch-level callbacks unless they take its logs as
they are (RemoteValues, not yet computed): this one says so (`_supports_tf_logs`), counts the
steps it schedules without reading those values, and reports the metrics at each epoch's end.
Validation, evaluate, predict, the end of an epoch (where checkpoints are saved) and what follows
`fit` are reported as what the task is busy with, so their standing step is never a stall.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from worker.task.process import keeps_points
from worker.task.runtime import reporter

_TRAINING = None  # reporter().set_busy(None): training


class ReportCallback(tf.keras.callbacks.Callback):  # type: ignore[misc]
    """Reports step (the optimizer's iteration count, so a resumed run continues its count) and logs;
    in metrics.jsonl from the chief (worker 0) only, as every worker's logs are the same."""

    def __init__(self, global_batch_size: int | None = None) -> None:
        """`global_batch_size`: the examples one step takes across the cluster, for examples/s."""
        super().__init__()
        self._global_batch_size = global_batch_size
        self._step: int | None = None
        self._scale = 1.0
        self._report = reporter().report if keeps_points() else reporter().progress
        self._steps_per_epoch: int | None = None
        self._epoch_done = 0  # the steps of this epoch Keras has counted so far (its `batch` + 1)
        self._in_fit = False
        self._remote = False  # ParameterServerStrategy: batch logs are RemoteValues
        self._before: str | None = None  # busy with, before evaluate or predict began
        # Keras asks this before fit: it lets a batch-level callback run under ParameterServerStrategy
        # (which then gets the logs as they are: _remote makes it leave them alone)
        self._supports_tf_logs = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._in_fit = True
        self._step = None  # read after the first batch: BackupAndRestore may restore the count first
        self._remote = _uses_coordinator(self.model)
        self._scale = 1.0 / _summed_replicas(self.model)
        steps, epochs = self.params.get("steps"), self.params.get("epochs")
        self._steps_per_epoch = int(steps) if steps else None
        if steps and epochs:
            reporter().set_total_steps(int(steps) * int(epochs), self._global_batch_size)
        reporter().set_busy(_TRAINING)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_done = 0
        reporter().set_busy(_TRAINING)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Keras calls this once per execution, `batch` being the last step it ran: with
        # `steps_per_execution=N` (the parameter-server tutorial's 10), every Nth step only
        done = batch + 1
        if self._step is None:
            self._step = _iterations(self.model, default=done)
            if self._remote:
                self._step = max(self._step, done)  # scheduled, not yet run
        else:
            self._step += max(1, done - self._epoch_done)
        self._epoch_done = done
        if self._remote:
            reporter().progress(self._step)  # its logs are RemoteValues: reading one waits for it
        else:
            self._report(self._step, **_values(logs, self._scale))
        if self._steps_per_epoch is not None and batch + 1 >= self._steps_per_epoch:
            reporter().set_busy("ending the epoch")  # the other callbacks save, validate, log

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._before = reporter().busy
        reporter().set_busy("validating" if self._in_fit else "evaluating")

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        reporter().set_busy("ending the epoch" if self._in_fit else self._before)

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._before = reporter().busy
        reporter().set_busy("predicting")

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        reporter().set_busy(self._before)  # what it was doing before (after fit: done training)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._step is not None:
            # the optimizer's count, exact at an epoch's end: under ParameterServerStrategy every
            # scheduled step has run by now (Keras joins the coordinator first); elsewhere it
            # corrects any miscount of Keras' `batch` (its meaning varies across Keras releases)
            self._step = _iterations(self.model, default=self._step)
        values = _values(logs)  # epoch logs are reduced right: no scaling
        if values:  # the epoch's metrics: val_* included, and under ParameterServerStrategy the only ones
            self._report(self._step, **values)
        elif self._step is not None:
            reporter().progress(self._step)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._in_fit = False
        if self._step is not None:  # a finished fit's last word is its last step
            reporter().progress(_iterations(self.model, default=self._step))
        reporter().set_busy("done training")  # saving the model, evaluating: whatever follows fit


def _values(logs: dict[str, Any] | None, scale: float = 1.0) -> dict[str, float]:
    """A Keras log's numbers (tensors, numpy values, RemoteValues fetched), each times `scale`."""
    out = {}
    for name, value in (logs or {}).items():
        number = _number(value)
        if number is not None:
            out[name] = number * scale
    return out


def _iterations(model: Any, default: int) -> int:
    """The training steps Keras has counted (the optimizer's iterations: a restored run's count
    goes on from its checkpoint), or `default` when the model has no such count."""
    try:
        return int(model.optimizer.iterations.numpy())
    except (AttributeError, ValueError, TypeError):
        return default


def _uses_coordinator(model: Any) -> bool:
    """Does fit dispatch steps through a ClusterCoordinator (ParameterServerStrategy)?"""
    strategy = getattr(model, "distribute_strategy", None)
    return bool(getattr(strategy, "_should_use_with_coordinator", False))


def _number(value: Any) -> float | None:
    """A log value as a float: a tensor, a numpy value, a RemoteValue (fetched), or None."""
    try:
        if hasattr(value, "fetch"):
            value = value.fetch()
        if hasattr(value, "numpy"):
            value = value.numpy()
        return float(value)
    except (TypeError, ValueError):
        return None


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
