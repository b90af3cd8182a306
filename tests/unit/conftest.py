"""Fixtures of the unit tests."""

from __future__ import annotations

import time

import pytest

from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore

#: The run secret of the unit tests' heartbeat servers: a test derives the same credentials with it.
SECRET = b"unit-tests-secret"
TASKS = ("worker-0", "worker-1", "worker-2", "worker-3")


def unit_credentials() -> Credentials:
    """worker-0..3, all on host 0, signed with SECRET."""
    credentials = Credentials(SECRET)
    credentials.place({task: 0 for task in TASKS})
    return credentials


@pytest.fixture
def server():
    points: list = []
    store = HealthStore(time.monotonic, on_points=lambda task, attempt, p: points.extend(p))
    store.reset(0, ["worker-0"])
    srv = HeartbeatServer(store, unit_credentials()).start()
    yield srv, store, points
    srv.close()
