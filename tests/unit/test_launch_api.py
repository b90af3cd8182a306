"""orchestrator/launch/api.py: `on_all`'s group result (what succeeded, what failed, per item)."""

from __future__ import annotations

import threading

import pytest

from orchestrator.errors import LaunchError
from orchestrator.group import on_all


def test_every_item_at_once_each_with_its_value_or_its_exception_in_order() -> None:
    barrier = threading.Barrier(3, timeout=10)  # only passes if the three run at the same time

    def one(n: int) -> int:
        barrier.wait()
        if n == 2:
            raise LaunchError(f"host {n}: refused")
        return n * 10

    group = on_all([1, 2, 3], one)
    assert len(group) == 3 and [item for item, _ in group] == [1, 2, 3]
    assert group.succeeded == [(1, 10), (3, 30)]
    assert [(item, str(exc)) for item, exc in group.failed] == [(2, "host 2: refused")]
    with pytest.raises(LaunchError, match=r"copying failed on 1 of 3 hosts:\n  host 2: refused"):
        group.raise_if_failed("copying")
    assert on_all([1, 3], lambda n: n).raise_if_failed("copying") == [1, 3]
    assert len(on_all([], lambda n: n)) == 0
