"""Fixtures of the unit tests."""

from __future__ import annotations

import time

import pytest

from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore


@pytest.fixture
def server():
    points: list = []
    store = HealthStore(time.monotonic, on_points=lambda task, attempt, p: points.extend(p))
    store.reset(0, ["worker-0"])
    srv = HeartbeatServer(store, "right-token").start()
    yield srv, store, points
    srv.close()
