"""A group run: one function on every host (or item) at once, and each one's value or exception
kept (Fabric's `GroupResult`): a partial failure is never lost. Every layer that reaches several
hosts uses it (the backends, the environment's build, the stacks read before a stop)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from orchestrator.errors import LaunchError

T = TypeVar("T")
R = TypeVar("R")


class GroupResult(Generic[T, R]):
    """What `on_all` did on every item, in order: each item with fn's value or the exception it
    raised (Fabric's GroupResult): what succeeded, what failed, per item."""

    def __init__(self, pairs: list[tuple[T, R | Exception]]):
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[T, R | Exception]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def succeeded(self) -> list[tuple[T, R]]:
        return [(item, out) for item, out in self.pairs if not isinstance(out, Exception)]

    @property
    def failed(self) -> list[tuple[T, Exception]]:
        return [(item, out) for item, out in self.pairs if isinstance(out, Exception)]

    def values(self) -> list[R | Exception]:
        return [out for _, out in self.pairs]

    def raise_if_failed(self, what: str) -> list[R]:
        """Every value, or one LaunchError that lists every failure (not only the first)."""
        failed = self.failed
        if failed:
            lines = "\n  ".join(str(exc) for _, exc in failed)
            raise LaunchError(f"{what} failed on {len(failed)} of {len(self.pairs)} hosts:\n  {lines}")
        return [out for _, out in self.succeeded]


def on_all(items: Sequence[T], fn: Callable[[T], R]) -> GroupResult[T, R]:
    """fn on every item at once (a thread each, 64 at most); the group's result."""
    if not items:
        return GroupResult([])

    def guarded(item: T) -> R | Exception:
        try:
            return fn(item)
        except Exception as exc:  # handed back, never lost
            return exc

    with ThreadPoolExecutor(max_workers=min(64, len(items)), thread_name_prefix="launch") as pool:
        return GroupResult(list(zip(items, pool.map(guarded, items), strict=True)))
