"""TensorBoard scalars — of the built-in loop, and of a mode-1 job's
`worker.report` points (`<run dir>/tensorboard/<task>`, the chief's, as metrics.jsonl keeps).

Written with TensorFlow's own file writer: the tensorboard package is needed to look at them
(`pip install tf-orchestrate[tensorboard]`), not to write them. A job's points are written from
the heartbeat thread, in batches, and only once the job itself has imported TensorFlow: a script
without it never loads it for us.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

#: Points held for TensorBoard at most (the oldest go first): a job reporting far faster than the
#: heartbeat thread writes never grows the task's memory.
MAX_PENDING = 10_000


def scalar(tf: Any, name: str, value: float, step: int | None = None) -> None:
    """A TensorBoard scalar, written without the tensorboard package (tf.summary.scalar needs it;
    the file format does not): a float tensor tagged for TensorBoard's "scalars" plugin."""
    from tensorflow.core.framework import summary_pb2

    plugin = summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    tf.summary.write(
        name,
        tf.constant(value, dtype=tf.float32),
        step=step,
        metadata=summary_pb2.SummaryMetadata(plugin_data=plugin),
    )


class Scalars:
    """A mode-1 job's reported points, as TensorBoard scalars in `folder`."""

    def __init__(self, folder: Path):
        self._folder = folder
        self._writer: Any = None
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, point: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(point)
            if len(self._pending) > MAX_PENDING:
                del self._pending[: len(self._pending) - MAX_PENDING]

    def flush(self) -> None:
        """Write what was reported since the last flush (the heartbeat thread calls this)."""
        tf = sys.modules.get("tensorflow")
        if tf is None or getattr(getattr(tf, "__spec__", None), "_initializing", False):
            return  # not imported by the job (yet): never by us, never half way
        with self._lock:
            points, self._pending = self._pending, []
        if not points:
            return
        try:
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(str(self._folder))
            with self._writer.as_default():
                for p in points:
                    for name, value in p.items():
                        if name not in ("time", "step"):
                            scalar(tf, name, value, step=p.get("step"))
            self._writer.flush()
        except Exception:  # noqa: BLE001 - TensorBoard is a view: it never fails the job
            self._pending = []
