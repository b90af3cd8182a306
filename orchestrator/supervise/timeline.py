"""Supervision layer: a restart's timeline — from the failure noticed to the next attempt's first
step — measured by the supervisor's clock, as the events, status.json, the summary and the page
say it (`attempt 1 training again 2.9 s after worker-1 died: stop 0.3, start 0.1, connect 1.2,
restore 0.4, first step 0.9`).

Phases: stop (the failure noticed → every task of the old attempt stopped), wait (the backoff, when
there is one), start (the backend's preparation, the copy of the latest checkpoint included, and
every task started), connect (→ every training task's strategy up), restore (→ every deciding
task reported what it restored) and first step (→ every deciding task reported a step). A phase a
job does not report (a script that reports no step) stays unknown, never guessed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.health.store import TaskHealth
from orchestrator.states import FailureKind
from orchestrator.supervise.policy import Failure

PHASES = ("stop", "wait", "start", "connect", "restore", "first_step")


def what_happened(failure: Failure) -> str:
    """The cause in a few words: `worker-1 died`."""
    who = ", ".join(failure.tasks) or "the job"
    error = failure.error.type.rsplit(".", 1)[-1] if failure.error else "an exception"
    if failure.is_preemption:
        return f"{who} was preempted"
    return {
        FailureKind.EXIT: f"{who} died",
        FailureKind.EXCEPTION: f"{who} raised {error}",
        FailureKind.LOST: f"{who} went silent",
        FailureKind.STALLED: f"{who} stalled",
        FailureKind.STARTUP_TIMEOUT: f"{who} missed the start-up deadline",
        FailureKind.NO_STRATEGY: f"{who} created no strategy",
        FailureKind.DIVERGED: f"{who} restored different states",
        FailureKind.LAUNCH: f"{who} could not be launched",
    }[failure.kind].rstrip()


@dataclass
class Recovery:
    """One restart, as it happens: each instant by the supervisor's clock (None: not yet, or never
    reported)."""

    attempt: int  # the attempt it starts
    cause: str
    noticed: float
    noticed_wall: str  # the same instant, for people (UTC)
    stopped: float | None = None
    launching: float | None = None  # the backoff over: the backend prepares the attempt
    started: float | None = None  # every task started
    up: float | None = None  # every training task's strategy up
    restored: float | None = None
    first_step: float | None = None
    ended: bool = False  # the attempt ended (or the run) before its first step was seen

    @property
    def complete(self) -> bool:
        return self.first_step is not None or self.ended

    def observe(self, deciders: Iterable[TaskHealth | None]) -> None:
        """Take what the deciding tasks reported: the last one's restore and first step."""
        seen = list(deciders)
        if self.up is None or not seen:
            return
        restored = [h.restored_at if h else None for h in seen]
        if self.restored is None and all(t is not None for t in restored):
            self.restored = max(t for t in restored if t is not None)
        stepped = [h.first_step_at if h else None for h in seen]
        if self.first_step is None and all(t is not None for t in stepped):
            self.first_step = max(t for t in stepped if t is not None)

    def phases(self) -> dict[str, float | None]:
        """Each phase's seconds (None: unknown)."""
        marks = [self.noticed, self.stopped, self.launching, self.started, self.up, self.restored]
        out: dict[str, float | None] = {}
        for name, (begin, end) in zip(PHASES[:-1], zip(marks, marks[1:], strict=False), strict=True):
            out[name] = _span(begin, end)
        # a job that reports no restore: its first step counts from its strategy's start
        out["first_step"] = _span(self.restored if self.restored is not None else self.up, self.first_step)
        return out

    @property
    def training_again_s(self) -> float | None:
        return _span(self.noticed, self.first_step)

    def line(self) -> str:
        """`attempt 1 training again 2.9 s after worker-1 died: stop 0.3, start 0.1, …`."""
        shown = []
        for name, seconds in self.phases().items():
            if name == "wait" and (seconds or 0.0) < 0.05:
                continue  # no backoff: nothing to say
            shown.append(f"{name.replace('_', ' ')} {'—' if seconds is None else f'{seconds:.1f}'}")
        total = self.training_again_s
        if total is not None:
            head = f"attempt {self.attempt} training again {total:.1f} s after {self.cause}"
        elif self.up is not None:
            up_s = self.up - self.noticed
            head = f"attempt {self.attempt} up {up_s:.1f} s after {self.cause} (no step reported)"
        else:
            head = f"attempt {self.attempt} after {self.cause}: never up"
        return f"{head}: {', '.join(shown)}"

    def status(self) -> dict[str, Any]:
        """As status.json lists it (`recoveries`)."""
        total = self.training_again_s
        return {
            "attempt": self.attempt,
            "cause": self.cause,
            "noticed_at": self.noticed_wall,
            "phases_s": {k: None if v is None else round(v, 3) for k, v in self.phases().items()},
            "training_again_s": None if total is None else round(total, 3),
            "complete": self.complete,
            "line": self.line(),
        }


def _span(begin: float | None, end: float | None) -> float | None:
    if begin is None or end is None:
        return None
    return max(0.0, end - begin)


class Timeline:
    """The run's restarts: those complete, and the one under way (at most one)."""

    def __init__(self) -> None:
        self.done: list[Recovery] = []
        self.current: Recovery | None = None

    def failure_stops(self, next_attempt: int, failure: Failure, now: float, wall: str) -> Recovery | None:
        """A failure stops the job (to be restarted, perhaps): its clock starts. A restart under
        way that had not trained yet ends here; it is returned, to be said."""
        ended = self._end()
        self.current = Recovery(next_attempt, what_happened(failure), now, wall)
        return ended

    def stopped(self, now: float, restarting: bool) -> None:
        """The old attempt is stopped. When no restart follows (failed for good, interrupted), the
        restart this stop would have begun is dropped; one under way before it is kept (run_ends)."""
        if self.current is None or self.current.stopped is not None:
            return
        if restarting:
            self.current.stopped = now
        else:
            self.current = None

    def launching(self, now: float) -> None:
        if self.current is not None and self.current.launching is None:
            self.current.launching = now

    def started(self, now: float) -> None:
        if self.current is not None and self.current.started is None:
            self.current.started = now

    def up(self, now: float) -> None:
        if self.current is not None and self.current.up is None:
            self.current.up = now

    def observe(self, deciders: Iterable[TaskHealth | None]) -> Recovery | None:
        """What the deciding tasks reported; the restart once it is complete (to be said)."""
        if self.current is None:
            return None
        self.current.observe(deciders)
        return self._end() if self.current.first_step is not None else None

    def run_ends(self) -> Recovery | None:
        """The run ended: a restart still under way is complete with what it saw."""
        return self._end()

    def _end(self) -> Recovery | None:
        ended, self.current = self.current, None
        if ended is not None:
            ended.ended = ended.first_step is None
            self.done.append(ended)
        return ended

    def status(self) -> list[dict[str, Any]]:
        return [r.status() for r in [*self.done, *([self.current] if self.current else [])]]
