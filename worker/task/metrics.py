"""What a job's reported values become on their way to the coordinator: numbers (`number`: numpy
scalars, 0-d tensors, Python numbers; NaN kept), under names the coordinator takes (`MetricNames`:
the names every view shows, bounded in length and count; the rest dropped, each said once)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from worker import wire

log = logging.getLogger("worker")  # as the reporter's: python -m worker shows its warnings


class MetricNames:
    """The reported names a task's reporter admits, and those it said it refused or escaped."""

    def __init__(self) -> None:
        self.refused: set[str] = set()  # metric names dropped or escaped (said once each)

    def admit(self, values: Mapping[str, float], known: Mapping[str, float]) -> dict[str, float]:
        """The values whose names the coordinator takes, by the names every view shows them with
        (`wire.safe_text`: a control, bidi or lone surrogate character as its escape, said once):
        short, not its own (`task`, `time`...), at most wire.MAX_METRICS names in all with `known`
        (the names taken before). The others are dropped, each said once."""
        kept = {}
        for name, value in values.items():
            shown = wire.safe_text(name)
            if shown in known:
                kept[shown] = value
                continue
            why = (
                "a name the record uses itself"
                if shown in wire.RESERVED_POINT_KEYS or shown in ("time", "step")
                else f"longer than {wire.MAX_NAME_CHARS} characters"
                if len(shown) > wire.MAX_NAME_CHARS
                else f"over {wire.MAX_METRICS} metric names"
                if len(known) + len(kept) >= wire.MAX_METRICS
                else None
            )
            if why is None:
                kept[shown] = value
                if shown != name and name not in self.refused:
                    self.refused.add(name)
                    log.warning(
                        "worker.report(): metric %s is shown as %r (a control, bidi or lone surrogate "
                        "character in its name, written as its escape)",
                        ascii(name),
                        shown,
                    )
            elif name not in self.refused:
                self.refused.add(name)
                log.warning("worker.report(): metric %r dropped: %s", shown[:200], why)
        return kept


def number(value: Any) -> float | None:
    # numpy scalars, 0-d tensors, Python numbers; NaN is kept (a NaN loss is worth seeing), an
    # integer past a float's range is ±inf
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")
    except (TypeError, ValueError):
        return None
