"""tf-orchestrate worker runtime: what runs inside every task.

User-facing API:
    worker.report(step=..., loss=..., **metrics)   # cheap; batched into the next heartbeat
    worker.ReportCallback()                        # a Keras callback that reports every batch
    worker.set_total_steps(n)                      # the progress bar's total
    with worker.busy("saving"): ...                # not training meanwhile: never a stall

Importing this package does not import TensorFlow (ReportCallback is built on first use), and it
never imports the coordinator package.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["ReportCallback", "busy", "report", "set_total_steps"]


def report(step: int | None = None, **metrics: Any) -> None:
    """Record a progress point (step counts from 1; omitted, it is the previous one plus one)."""
    from worker.task.runtime import reporter

    reporter().report(step, **metrics)


def set_total_steps(total: int | None, global_batch_size: int | None = None) -> None:
    """Tell the coordinator how many steps the job will run (its progress bar and ETA) and, if
    given, how many examples one step takes across the cluster (its examples/s)."""
    from worker.task.runtime import reporter

    reporter().set_total_steps(total, global_batch_size)


@contextlib.contextmanager
def busy(what: str = "busy") -> Iterator[None]:
    """The task works outside its training steps meanwhile (evaluating, saving, preprocessing): the
    coordinator shows it and does not take the step standing still for a stall."""
    from worker.task.runtime import reporter

    rep = reporter()
    before = rep.busy
    rep.set_busy(what)
    try:
        yield
    finally:
        rep.set_busy(before)


def __getattr__(name: str) -> Any:
    if name == "ReportCallback":
        from worker.task.keras_callback import ReportCallback

        return ReportCallback
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
