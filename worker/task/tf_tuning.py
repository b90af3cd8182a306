"""Tune TensorFlow's own coordination service before a MultiWorkerMirroredStrategy
connects, so peers fail fast too (docs/architecture.md §7: TF waits an hour for a missing peer and notices a
frozen one only after its 10 s heartbeat).

This configures exactly what MWMS would configure itself (TF 2.21, collective_all_reduce_strategy
`_initialize_multi_worker`), plus two timeouts: the heartbeat timeout (health.heartbeat_timeout_s)
and the cluster registration timeout (health.startup_timeout_s). Called from the strategy hook,
when TensorFlow is already imported; it never raises (tuning is optional).

Also: a task that is not the coordination service's leader waits until the leader's TF port
accepts connections before it connects (and a ParameterServerStrategy's chief, until every ps
and worker task's does). TensorFlow's first attempt to register with a leader not
yet listening fails, and its retry comes ~1 s later (gRPC's reconnect backoff): measured, the
strategy came up 0.4–0.9 s after the last task's import without this, 0.1 s with it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from worker import wire

log = logging.getLogger("worker")

_COORDINATED_JOBS = ("chief", "worker")


def configure_coordination(extended: Any) -> bool:
    """Configure TF's coordination service for an MWMS about to connect; True when applied."""
    if type(extended).__name__ != "CollectiveAllReduceExtended":
        return False
    heartbeat_s = os.environ.get(wire.ENV_TF_HEARTBEAT_TIMEOUT_S)
    register_s = os.environ.get(wire.ENV_TF_REGISTER_TIMEOUT_S)
    if not heartbeat_s and not register_s:
        return False
    try:
        from tensorflow.python.distribute import collective_all_reduce_strategy as mwms
        from tensorflow.python.distribute import multi_worker_util
        from tensorflow.python.eager import context
        from tensorflow.python.training import server_lib

        ctx = context.context()
        if ctx.coordination_service is not None:
            return False  # the user's program configured it: theirs wins
        tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        cluster = tf_config.get("cluster") or {}
        task_type = (tf_config.get("task") or {}).get("type")
        if task_type not in _COORDINATED_JOBS or not cluster:
            return False
        cluster_spec = server_lib.ClusterSpec(cluster)
        proto = mwms.coordination_config_pb2  # the proto module MWMS itself uses
        jobs = [
            proto.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in _COORDINATED_JOBS
            if job in cluster_spec.jobs
        ]
        ctx.configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(cluster_spec),
            coordinated_jobs=jobs,
            heartbeat_timeout_in_ms=int(float(heartbeat_s) * 1000) if heartbeat_s else 0,
            cluster_register_timeout_in_ms=int(float(register_s) * 1000) if register_s else 0,
        )
        return True
    except Exception as exc:  # noqa: BLE001 - TF internals moved: run untuned rather than not at all
        log.warning("could not tune TF's coordination service (%s); using its defaults", exc)
        return False


#: How often a task looks whether its leader listens yet, and how long one look may take.
LEADER_POLL_S = 0.01
LEADER_CONNECT_S = 0.5


def leader_address(tf_config: dict[str, Any]) -> tuple[str, int] | None:
    """(host, port) of the coordination service's leader (as TF's `coordination_leader`: the
    chief, else worker 0), None when this task is the leader or the cluster has none."""
    cluster = tf_config.get("cluster") or {}
    task = tf_config.get("task") or {}
    job = "chief" if cluster.get("chief") else "worker"
    if not cluster.get(job) or (task.get("type") == job and int(task.get("index") or 0) == 0):
        return None
    host, _, port = str(cluster[job][0]).rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def wait_for_leader(extended: Any) -> float | None:
    """For an MWMS about to connect: wait until the leader's TF port accepts a connection (at most
    the registration timeout, as TF itself would); the seconds waited, None where nothing was to
    wait for. Never raises: the strategy then connects as it would have."""
    if type(extended).__name__ != "CollectiveAllReduceExtended":
        return None
    try:
        leader = leader_address(json.loads(os.environ.get("TF_CONFIG") or "{}"))
        return _listening([leader]) if leader is not None else None
    except Exception as exc:  # noqa: BLE001 - an optimisation: the strategy connects as it would have
        log.debug("waiting for the leader: %s", exc)
        return None


def server_addresses(tf_config: dict[str, Any]) -> list[tuple[str, int]]:
    """(host, port) of every ps and worker task a ParameterServerStrategy's chief connects to;
    [] for any other task."""
    cluster = tf_config.get("cluster") or {}
    if (tf_config.get("task") or {}).get("type") != "chief" or not cluster.get("ps"):
        return []
    out = []
    for address in [*cluster["ps"], *(cluster.get("worker") or [])]:
        host, _, port = str(address).rpartition(":")
        if host and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    return out


def wait_for_servers(strategy: Any) -> float | None:
    """For a ParameterServerStrategy's chief about to connect: wait until every ps and worker
    task's TF port accepts a connection, as wait_for_leader (its first connection to a server
    still starting would wait out gRPC's ~1 s reconnect backoff). Never raises."""
    if type(strategy).__name__ != "ParameterServerStrategyV2":
        return None
    try:
        servers = server_addresses(json.loads(os.environ.get("TF_CONFIG") or "{}"))
        return _listening(servers) if servers else None
    except Exception as exc:  # noqa: BLE001 - an optimisation: the strategy connects as it would have
        log.debug("waiting for the servers: %s", exc)
        return None


def _listening(addresses: list[tuple[str, int]]) -> float:
    """Seconds until each address accepts a connection (at most the registration timeout)."""
    limit_s = float(os.environ.get(wire.ENV_TF_REGISTER_TIMEOUT_S) or 120.0)
    start = time.monotonic()
    waiting = list(addresses)
    while waiting and time.monotonic() - start < limit_s:
        try:
            socket.create_connection(waiting[0], timeout=LEADER_CONNECT_S).close()
            waiting.pop(0)
        except OSError:
            time.sleep(LEADER_POLL_S)
    return time.monotonic() - start
