"""Supervision layer: the task group, polled once per iteration — every live task's exit code and
latest heartbeat news, frozen (Ray Train v2's `WorkerGroupPollStatus`): the detectors and the
policy read this snapshot, never the live tasks."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.health.store import HealthStore, TaskHealth
from orchestrator.supervise.detect import TaskView
from orchestrator.supervise.records import TaskRecord

log = logging.getLogger("orchestrator.supervise")


@dataclass(frozen=True)
class Poll:
    """The task group as seen once per iteration: the detectors read this, not the tasks."""

    now: float
    tasks: Mapping[str, TaskView]  # the live ones


def poll_tasks(tasks: Mapping[str, TaskRecord], store: HealthStore, now: float) -> Poll:
    """The task group, once: every live task's exit code and latest heartbeat news (each record's
    health brought up to date)."""
    health, views = store.snapshot(), {}
    for name, rec in tasks.items():
        rec.health = health.get(name, rec.health)
        if rec.handle is not None and not rec.state.is_terminal and rec.restart_at is None:
            code = rec.handle.poll()
            if code not in (None, 0) and (rec.health is None or rec.health.error is None):
                rec.health = _written_error(rec, store) or rec.health
            views[name] = task_view(rec, code)
    return Poll(now, views)


def task_view(rec: TaskRecord, exit_code: int | None = None) -> TaskView:
    assert rec.launched_at is not None
    return TaskView(rec.plan.name, rec.state, rec.plan.in_cluster, rec.launched_at, exit_code, rec.health)


def _written_error(rec: TaskRecord, store: HealthStore) -> TaskHealth | None:
    """A failed task's error from its error file, where its last heartbeat did not bring it."""
    assert rec.handle is not None
    written = rec.handle.written_error()
    if written is None:
        return None
    log.info("%s: its error came from its error file (no heartbeat brought it)", rec.plan.name)
    return store.add_written_error(rec.plan.name, rec.handle.attempt, written)
