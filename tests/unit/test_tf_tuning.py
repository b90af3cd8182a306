"""worker/task/tf_tuning.py's wait for the coordination service's leader: a task that is not the leader
connects only once the leader's TF port listens (TensorFlow's own first attempt against a port not
yet listening costs ~1 s of gRPC backoff). Real sockets; no TensorFlow."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from worker import wire
from worker.task import tf_tuning


class CollectiveAllReduceExtended:
    """Named as MultiWorkerMirroredStrategy's extended part (the wait looks at the type's name)."""


def tf_config(monkeypatch: pytest.MonkeyPatch, cluster: dict, task: tuple[str, int]) -> None:
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task[0], "index": task[1]}})
    )


def free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


def listen_later(schedule: list[tuple[float, int]]) -> list[socket.socket]:
    """Sockets that start listening on 127.0.0.1, each port after its delay (one after another)."""
    servers = [socket.socket() for _ in schedule]

    def listen() -> None:
        for (delay, port), server in zip(schedule, servers, strict=True):
            time.sleep(delay)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()

    threading.Thread(target=listen, daemon=True).start()
    return servers


def test_the_leader_is_the_chief_else_worker_0_and_waits_for_no_one() -> None:
    two = {"worker": ["10.0.0.1:2000", "10.0.0.2:2000"]}
    assert tf_tuning.leader_address({"cluster": two, "task": {"type": "worker", "index": 1}}) == (
        "10.0.0.1",
        2000,
    )
    assert tf_tuning.leader_address({"cluster": two, "task": {"type": "worker", "index": 0}}) is None
    chief = {"chief": ["[::1]:3000"], "worker": ["10.0.0.2:2000"]}
    assert tf_tuning.leader_address({"cluster": chief, "task": {"type": "worker", "index": 0}}) == (
        "::1",
        3000,
    )
    assert tf_tuning.leader_address({"cluster": chief, "task": {"type": "chief", "index": 0}}) is None
    assert tf_tuning.leader_address({}) is None


def test_a_worker_connects_as_soon_as_its_leader_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # a port nothing listens on, yet
    tf_config(monkeypatch, {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}, ("worker", 1))
    leader = listen_later([(0.5, port)])
    try:
        waited = tf_tuning.wait_for_leader(CollectiveAllReduceExtended())
    finally:
        for server in leader:
            server.close()
    assert waited is not None and 0.4 < waited < 5.0
    # other strategies, and the leader itself, wait for nothing
    assert tf_tuning.wait_for_leader(object()) is None
    tf_config(monkeypatch, {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}, ("worker", 0))
    assert tf_tuning.wait_for_leader(CollectiveAllReduceExtended()) is None


def test_a_leader_that_never_listens_is_waited_for_no_longer_than_the_registration_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tf_config(monkeypatch, {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, ("worker", 1))
    monkeypatch.setenv(wire.ENV_TF_REGISTER_TIMEOUT_S, "0.3")
    began = time.monotonic()
    waited = tf_tuning.wait_for_leader(CollectiveAllReduceExtended())
    assert waited is not None and waited >= 0.3 and time.monotonic() - began < 3.0


class ParameterServerStrategyV2:
    """Named as ParameterServerStrategy (the wait looks at the type's name)."""


def test_a_ps_chief_connects_once_every_ps_and_worker_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first connection to a server still starting would wait out gRPC's backoff."""
    ps, worker = free_port(), free_port()
    cluster = {"chief": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{ps}"], "worker": [f"[127.0.0.1]:{worker}"]}
    assert tf_tuning.server_addresses({"cluster": cluster, "task": {"type": "chief", "index": 0}}) == [
        ("127.0.0.1", ps),
        ("127.0.0.1", worker),
    ]
    assert tf_tuning.server_addresses({"cluster": cluster, "task": {"type": "worker", "index": 0}}) == []
    assert (
        tf_tuning.server_addresses(
            {"cluster": {"chief": ["a:1"], "worker": ["b:2"]}, "task": {"type": "chief"}}
        )
        == []
    )
    tf_config(monkeypatch, cluster, ("chief", 0))
    servers = listen_later([(0.3, worker), (0.3, ps)])
    try:
        waited = tf_tuning.wait_for_servers(ParameterServerStrategyV2())
    finally:
        for server in servers:
            server.close()
    assert waited is not None and 0.5 < waited < 5.0  # until the last one listened
    assert tf_tuning.wait_for_servers(CollectiveAllReduceExtended()) is None
