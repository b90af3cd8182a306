"""What a job's reported values become on their way to the coordinator: numbers (`number`: numpy
scalars, 0-d tensors, Python numbers; NaN kept), under names the coordinator takes (`MetricNames`:
the names every view shows, bounded in length and count; the rest dropped and counted)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from worker import wire

log = logging.getLogger("worker")  # as the reporter's: python -m worker shows its warnings


#: Distinct dropped names remembered (each counted once); past it, every new one is counted.
MAX_REMEMBERED = 100_000


class MetricNames:
    """The reported names a task's reporter admits; those it dropped, counted (`dropped`: sent with
    every heartbeat, the coordinator shows one line with the count), the first of each reason said
    once in the task's log — a job that reports a new name every step fills no log."""

    def __init__(self) -> None:
        self.refused: set[str] = set()  # metric names dropped or escaped (each counted once)
        self.dropped: wire.Dropped | None = None
        self._said: set[str] = set()  # the reasons said in the log

    def admit(self, values: Mapping[str, float], known: Mapping[str, float]) -> dict[str, float]:
        """The values whose names the coordinator takes, by the names every view shows them with
        (`wire.safe_text`: a control, bidi or lone surrogate character as its escape, said once):
        short, not its own (`task`, `time`...), at most wire.MAX_METRICS names in all with `known`
        (the names taken before). The others are dropped and counted."""
        kept, new = {}, 0
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
                if len(known) + new >= wire.MAX_METRICS
                else None
            )
            if why is None:
                new += shown not in kept  # two names shown alike are one
                kept[shown] = value
                if shown != name and name not in self.refused:
                    self.refused.add(name)  # at most MAX_METRICS such names: each said
                    log.warning(
                        "worker.report(): metric %s is shown as %r (a control, bidi or lone surrogate "
                        "character in its name, written as its escape)",
                        ascii(name),
                        shown,
                    )
            elif name not in self.refused:
                self._drop(name, shown, why)
        return kept

    def _drop(self, name: str, shown: str, why: str) -> None:
        if len(self.refused) < MAX_REMEMBERED:
            self.refused.add(name)
        if self.dropped is None:
            self.dropped = wire.Dropped(1, shown[: wire.MAX_NAME_CHARS], why)
        else:
            self.dropped = wire.Dropped(self.dropped.count + 1, self.dropped.first, self.dropped.why)
        if why not in self._said:
            self._said.add(why)
            log.warning(
                "worker.report(): metric %r dropped: %s (names dropped for this reason from now on are "
                "counted, not said: the coordinator shows how many)",
                shown[:200],
                why,
            )


def number(value: Any) -> float | None:
    # numpy scalars, 0-d tensors, Python numbers; NaN is kept (a NaN loss is worth seeing), an
    # integer past a float's range is ±inf
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")
    except (TypeError, ValueError):
        return None
