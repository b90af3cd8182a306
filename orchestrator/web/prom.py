"""Web layer: a run's state in Prometheus' text format (`GET /metrics`), built from its status
document at each scrape by a prometheus-client collector (no second bookkeeping to drift).

Names: `orchestrate_*`; a task's reported values are one family, `orchestrate_task_metric`, with
the value's name as a label (a user's metric name need not be a valid Prometheus name).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from orchestrator.record.progress import parse_time
from orchestrator.states import ClusterState, TaskState
from worker import wire


class RunCollector(Collector):
    def __init__(self, status: Callable[[], Mapping[str, Any]]):
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        if not status:
            return
        run = {"run_id": str(status.get("run_id", "")), "name": str(status.get("name", ""))}
        info = GaugeMetricFamily("orchestrate_run_info", "The run (always 1)", labels=list(run))
        info.add_metric(list(run.values()), 1)
        yield info
        state = GaugeMetricFamily("orchestrate_run_state", "1 for the run's current state", labels=["state"])
        for s in ClusterState:
            state.add_metric([s.value], 1.0 if status.get("state") == s.value else 0.0)
        yield state
        yield _gauge("orchestrate_run_attempt", "The current attempt (0, 1, …)", status.get("attempt"))
        restarts = CounterMetricFamily("orchestrate_run_restarts", "Whole-job restarts")
        restarts.add_metric([], float(status.get("restarts") or 0))
        yield restarts
        firings = CounterMetricFamily(
            "orchestrate_detector_firings",
            "Failures detected, by kind (exit, exception, lost, stalled, startup_timeout, …)",
            labels=["kind"],
        )
        kinds = Counter(
            str(f.get("kind")) for f in [*status.get("failures", []), *status.get("task_restarts", [])]
        )
        for kind, n in sorted(kinds.items()):
            firings.add_metric([kind], float(n))
        yield firings
        yield from _tasks(status.get("tasks", []))


def _tasks(tasks: list[Mapping[str, Any]]) -> Iterator[Metric]:
    now = time.time()
    labels = ["task", "role"]
    state = GaugeMetricFamily(
        "orchestrate_task_state", "1 for each task's current state", labels=[*labels, "state"]
    )
    step = GaugeMetricFamily("orchestrate_task_step", "The task's last reported step", labels=labels)
    total = GaugeMetricFamily("orchestrate_task_total_steps", "The steps the task will run", labels=labels)
    rate = GaugeMetricFamily("orchestrate_task_steps_per_second", "Training steps per second", labels=labels)
    age = GaugeMetricFamily(
        "orchestrate_task_heartbeat_age_seconds", "Seconds since the task's last heartbeat", labels=labels
    )
    rss = GaugeMetricFamily(
        "orchestrate_task_rss_bytes", "Resident memory of the task's process", labels=labels
    )
    restarts = CounterMetricFamily("orchestrate_task_restarts", "Restarts of this task alone", labels=labels)
    metric = GaugeMetricFamily(
        "orchestrate_task_metric",
        "The task's latest reported values (loss, accuracy, …)",
        labels=[*labels, "name"],
    )
    for t in tasks:
        key = [wire.safe_text(str(t.get("task"))), str(t.get("role"))]
        for s in TaskState:
            state.add_metric([*key, s.value], 1.0 if t.get("state") == s.value else 0.0)
        for family, value in (
            (step, t.get("last_step")),
            (total, t.get("total_steps")),
            (rate, t.get("steps_per_s")),
        ):
            if value is not None:
                family.add_metric(key, float(value))
        beat = parse_time(t.get("last_heartbeat_at"))
        if beat is not None and t.get("state") in ("STARTING", "RUNNING"):
            age.add_metric(key, max(0.0, now - beat))
        if t.get("rss_bytes"):
            rss.add_metric(key, float(t["rss_bytes"]))
        restarts.add_metric(key, float(t.get("restarts") or 0))
        for name, value in (t.get("metrics") or {}).items():
            number = wire.number(value)  # NaN and ±inf are Prometheus' own NaN, +Inf, -Inf
            if number is not None:
                metric.add_metric([*key, wire.safe_text(str(name))], number)
    yield from (state, step, total, rate, age, rss, restarts, metric)


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], float(value or 0))
    return g


def registry(status: Callable[[], Mapping[str, Any]]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RunCollector(status))
    return reg
