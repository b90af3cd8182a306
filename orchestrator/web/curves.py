"""Web layer: every task's reported values by step, for the page's plots — bounded whatever the run
reports (a curve keeps at most `per_curve` points, thinned by half when full: the early part of a
long run at a coarser step, the shape kept), and the whole store at most `budget` points. The first
NaN or infinite value of each attempt is kept whatever the thinning (the page says where a curve
first went bad: at its true step, not at the next point the thinning happened to keep)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from worker.wire import number as _number

#: The attempts whose first non-finite point a curve keeps (the latest ones).
MAX_MARKED_ATTEMPTS = 16
#: Keys of a metrics.jsonl line that are not a reported value.
_NOT_VALUES = frozenset({"schema_version", "time", "task", "attempt", "step"})


class _Curve:
    __slots__ = ("points", "stride", "skipped", "first_odd")

    def __init__(self) -> None:
        self.points: list[tuple[int, float, int]] = []  # (step, value, attempt)
        self.stride = 1  # keep one point in `stride` (doubled at each thinning)
        self.skipped = 0
        self.first_odd: dict[int, tuple[int, float, int]] = {}  # attempt: its first NaN/±inf point

    def mark(self, point: tuple[int, float, int]) -> None:
        attempt = point[2]
        if attempt in self.first_odd or math.isfinite(point[1]):
            return
        self.first_odd[attempt] = point
        if len(self.first_odd) > MAX_MARKED_ATTEMPTS:
            del self.first_odd[min(self.first_odd)]

    def drawn(self) -> list[tuple[int, float, int]]:
        """The kept points with each attempt's first non-finite one in its place."""
        points = list(self.points)
        kept = {(a, s) for s, _, a in points}
        for mark in sorted(self.first_odd.values(), key=lambda p: (p[2], p[0])):
            if (mark[2], mark[0]) in kept:
                continue
            at = next((i for i, p in enumerate(points) if (p[2], p[0]) > (mark[2], mark[0])), len(points))
            points.insert(at, mark)
        return points


class Curves:
    def __init__(self, budget: int = 200_000, per_curve: int = 2_000, min_per_curve: int = 100):
        self._budget, self._max, self._min = budget, per_curve, min_per_curve
        self._curves: dict[tuple[str, str], _Curve] = {}
        self._lock = threading.Lock()
        self._total = 0
        self.version = 0  # changes whenever a point is kept: the page refetches only then

    def add(self, task: str, attempt: int, points: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            for p in points:
                step = p.get("step")
                if type(step) is not int:
                    continue
                for name, value in p.items():
                    number = _number(value)  # NaN and ±inf too (metrics.jsonl writes them as strings)
                    if name in _NOT_VALUES or number is None:
                        continue
                    self._add(task, name, step, number, attempt)

    def _add(self, task: str, name: str, step: int, value: float, attempt: int) -> None:
        curve = self._curves.get((task, name))
        if curve is None:
            curve = self._curves[(task, name)] = _Curve()
            self._share_budget()
        curve.mark((step, value, attempt))
        curve.skipped += 1
        if curve.skipped < curve.stride:
            return
        curve.skipped = 0
        curve.points.append((step, value, attempt))
        self._total += 1
        self.version += 1
        if len(curve.points) >= self._limit():
            self._thin(curve)

    def _share_budget(self) -> None:
        """One more curve shares the budget: the longest give way (once per new curve, not per
        point — each curve keeps to its share as it grows)."""
        while self._total > self._budget:
            longest = max(self._curves.values(), key=lambda c: len(c.points))
            if len(longest.points) <= self._min:
                break
            self._thin(longest)

    def _thin(self, curve: _Curve) -> None:
        """Every other point dropped: the same span at half the resolution."""
        before = len(curve.points)
        del curve.points[1::2]
        curve.stride *= 2
        self._total -= before - len(curve.points)

    def _limit(self) -> int:
        return max(self._min, min(self._max, self._budget // max(1, len(self._curves))))

    def snapshot(self, max_points: int = 300) -> dict[str, dict[str, list[list[float]]]]:
        """{task: {name: [[step, value, attempt], …]}}, each curve at most `max_points` long
        (evenly thinned for the page; the last point and each attempt's first non-finite one
        always kept: at most `max_points` + MAX_MARKED_ATTEMPTS)."""
        with self._lock:
            items = [(k, list(c.points), list(c.first_odd.values())) for k, c in self._curves.items()]
        out: dict[str, dict[str, list[list[float]]]] = {}
        for (task, name), points, marks in items:
            if len(points) > max_points:
                every = -(-len(points) // max_points)
                points = points[::every] + ([points[-1]] if (len(points) - 1) % every else [])
            shown = _Curve()
            shown.points, shown.first_odd = points, {m[2]: m for m in marks}
            out.setdefault(task, {})[name] = [[s, v, a] for s, v, a in shown.drawn()]
        return out

    @property
    def size(self) -> int:
        with self._lock:
            return self._total
