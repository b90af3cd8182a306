"""The heartbeat endpoint (orchestrator/health/server.py) over real HTTP on loopback: the secret,
the wire format, statuses, and clients that misbehave."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from worker import wire

CREDENTIALS = Credentials(b"unit-tests-secret")  # conftest.SECRET: the server fixture's
CREDENTIALS.place({f"worker-{i}": 0 for i in range(4)})
TOKEN = CREDENTIALS.task_token("worker-0", 0)


def post(url: str, body: bytes, token: str | None) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[wire.TOKEN_HEADER] = token
    conn.request("POST", wire.HEARTBEAT_PATH, body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def hb(**kw) -> bytes:
    return wire.Heartbeat(
        **{"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 1.0, "pid": 7, **kw}
    ).to_bytes()


def test_request_without_or_with_wrong_token_is_rejected(server):
    srv, store, _ = server
    assert post(srv.url, hb(step=3), None) == 401
    assert post(srv.url, hb(step=3), "wrong") == 401
    assert store.snapshot()["worker-0"].last_heartbeat_at is None
    assert post(srv.url, hb(step=3), TOKEN) == 200
    assert store.snapshot()["worker-0"].step == 3


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"task": "worker-0"}).encode(),
        json.dumps({"task": 1, "attempt": 0, "seq": 1, "sent_at": 0, "pid": 1}).encode(),
        *(
            json.dumps(
                {"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 0, "pid": 1, "restored": r}
            ).encode()
            for r in (
                {"step": "75", "fingerprint": "ab"},
                {"step": 75},
                {"step": 75, "fingerprint": "x" * 1000},
                {"step": 75, "fingerprint": "ab", "source": 3},
                [75],
            )
        ),
        json.dumps({"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 0, "pid": 1, "busy": 7}).encode(),
    ],
)
def test_malformed_heartbeat_is_400_and_server_survives(server, body):
    srv, store, _ = server
    assert post(srv.url, body, TOKEN) == 400
    assert post(srv.url, hb(), TOKEN) == 200


def test_what_a_task_is_busy_with_reaches_the_store_cut_to_size(server):
    srv, store, _ = server
    assert post(srv.url, hb(seq=1, busy="validating"), TOKEN) == 200
    assert store.snapshot()["worker-0"].busy == "validating"
    assert post(srv.url, hb(seq=2, busy="x" * 10_000), TOKEN) == 200
    assert store.snapshot()["worker-0"].busy == "x" * wire.MAX_NAME_CHARS


def test_a_restore_report_reaches_the_store_and_stays_for_the_attempt(server):
    srv, store, _ = server
    start = wire.Restored(
        step=75, fingerprint="a1b2c3d4e5f60718", source="/h/ckpt-75", epoch=2, step_in_epoch=5
    )
    assert post(srv.url, hb(seq=1, restored=start), TOKEN) == 200
    assert post(srv.url, hb(seq=2, step=76), TOKEN) == 200  # later heartbeats need not repeat it
    assert store.snapshot()["worker-0"].restored == start


def test_unknown_task_and_stale_attempt(server):
    srv, store, _ = server
    # a task of the run's plan that this attempt does not hold
    assert post(srv.url, hb(task="worker-1"), CREDENTIALS.task_token("worker-1", 0)) == 404
    store.reset(1, ["worker-0"])
    assert post(srv.url, hb(attempt=0), TOKEN) == wire.STALE_ATTEMPT_STATUS


def test_garbage_content_length_and_reset_connections_do_not_break_the_server(server, capfd):
    import socket

    srv, store, _ = server
    host, port = srv.url.removeprefix("http://").split(":")
    for request in (
        b"POST /v1/heartbeat HTTP/1.1\r\nX-Orchestrate-Token: "
        + TOKEN.encode()
        + b"\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 5\r\n",  # cut off mid-headers
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request)
            s.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )  # RST on close
    time.sleep(0.2)
    assert post(srv.url, hb(step=4), TOKEN) == 200
    assert "Traceback" not in capfd.readouterr().err


# --- a task speaks for itself only (issue 13) ---


def test_a_credential_speaks_for_its_own_task_and_attempt_only(server):
    srv, store, points = server
    store.reset(0, ["worker-0", "worker-1"])
    worker_1 = CREDENTIALS.task_token("worker-1", 0)
    assert post(srv.url, hb(task="worker-0", step=9), worker_1) == wire.FORBIDDEN_STATUS
    assert post(srv.url, hb(task="worker-1", attempt=1), worker_1) == wire.FORBIDDEN_STATUS
    assert store.snapshot()["worker-0"].last_heartbeat_at is None
    # a token of this run's form, signed with another secret (or forged): no credential
    other = Credentials(b"another-run")
    other.place({"worker-0": 0})
    assert post(srv.url, hb(), other.task_token("worker-0", 0)) == wire.BAD_TOKEN_STATUS
    assert post(srv.url, hb(), TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1")) == wire.BAD_TOKEN_STATUS
    # nor may a task post a relay's batch, nor a relay a task's heartbeat
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("POST", wire.BATCH_PATH, body=b"[" + hb() + b"]", headers={wire.TOKEN_HEADER: TOKEN})
    assert conn.getresponse().status == wire.FORBIDDEN_STATUS
    assert post(srv.url, hb(), CREDENTIALS.relay_token(0)) == wire.FORBIDDEN_STATUS


def test_a_relay_speaks_for_its_own_hosts_tasks_only(server):
    srv, store, _ = server
    store.reset(0, ["worker-0", "worker-1"])
    CREDENTIALS.place({"worker-0": 0, "worker-1": 1})
    srv._credentials.place({"worker-0": 0, "worker-1": 1})  # worker-1 on host 1
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        batch = b"[" + hb(task="worker-0", step=1) + b"," + hb(task="worker-1", step=1) + b"]"
        conn.request(
            "POST", wire.BATCH_PATH, body=batch, headers={wire.TOKEN_HEADER: CREDENTIALS.relay_token(0)}
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read()) == [200, wire.FORBIDDEN_STATUS]
        assert store.snapshot()["worker-1"].step is None
    finally:
        CREDENTIALS.place({f"worker-{i}": 0 for i in range(4)})


def test_the_first_process_to_speak_for_a_task_is_the_only_one(server):
    srv, store, _ = server
    assert post(srv.url, hb(pid=100, seq=1, step=1), TOKEN) == 200
    # the same credential (its environment, read by another process): refused, whatever its seq
    assert post(srv.url, hb(pid=666, seq=10**9, step=99), TOKEN) == wire.CONFLICT_STATUS
    assert post(srv.url, hb(pid=100, seq=2, step=2), TOKEN) == 200
    assert store.snapshot()["worker-0"].step == 2
    store.reset_task("worker-0")  # restarted alone: its new process speaks from now on
    assert post(srv.url, hb(pid=101, seq=1, step=3), TOKEN) == 200


def test_a_heartbeat_sent_again_writes_its_points_once(server):
    srv, store, points = server

    def beat(seq: int, points_from: int, steps: range) -> bytes:
        return hb(seq=seq, points_from=points_from, points=[{"time": 1.0, "step": i} for i in steps])

    assert post(srv.url, beat(1, 0, range(0, 3)), TOKEN) == 200
    # its answer was lost: the task sends those points again, with the next ones, in its next heartbeat
    assert post(srv.url, beat(2, 0, range(0, 5)), TOKEN) == 200
    assert post(srv.url, beat(2, 0, range(0, 5)), TOKEN) == 200  # a relay's resend of the same
    assert post(srv.url, beat(3, 5, range(5, 6)), TOKEN) == 200
    assert [p["step"] for p in points] == [0, 1, 2, 3, 4, 5]


# --- what a client can make the server hold (issue 13) ---


@pytest.mark.parametrize(
    "point",
    [{"task": 1.0}, {"attempt": 3}, {"loss": "high"}, {"x" * 101: 1.0}, {"nested": {"a": 1}}],
)
def test_a_point_is_numbers_under_names_of_its_own(server, point):
    srv, _, points = server
    assert post(srv.url, hb(points=[{"step": 1, **point}]), TOKEN) == 400
    assert points == []


def test_what_one_heartbeat_carries_is_bounded(server):
    srv, store, _ = server
    too_many = {f"m{i}": 1.0 for i in range(wire.MAX_METRICS + 1)}
    assert post(srv.url, hb(metrics=too_many), TOKEN) == 400
    assert post(srv.url, hb(points=[{"step": i} for i in range(wire.MAX_POINTS + 1)]), TOKEN) == 400
    deep = (
        b'{"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 1, "pid": 7, "metrics": ' + b"[" * 100_000
    )
    assert post(srv.url, deep, TOKEN) == 400
    # refused from its head, before any of the body is read
    [sock] = raw_connections(srv.url, 1)
    with sock:
        length = wire.MAX_HEARTBEAT_BYTES + 1
        sock.sendall(f"POST {wire.HEARTBEAT_PATH} HTTP/1.1\r\n{wire.TOKEN_HEADER}: {TOKEN}\r\n".encode())
        sock.sendall(f"Content-Length: {length}\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 413 ")
    assert post(srv.url, hb(step=5), TOKEN) == 200


def test_a_task_keeps_its_first_metric_names(server):
    srv, store, _ = server
    first = {f"a{i}": 1.0 for i in range(wire.MAX_METRICS - 2)}
    assert post(srv.url, hb(seq=1, metrics=first), TOKEN) == 200
    assert (
        post(srv.url, hb(seq=2, metrics={"a0": 2.0, "b0": 1.0, "b1": 1.0, "b2": 1.0, "b3": 1.0}), TOKEN)
        == 200
    )
    kept = store.snapshot()["worker-0"].metrics
    assert len(kept) == wire.MAX_METRICS and kept["a0"] == 2.0
    assert "b0" in kept and "b1" in kept and "b2" not in kept and "b3" not in kept


def raw_connections(url: str, n: int) -> list:
    import socket

    host, port = url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(n)]


def closed_by_server(sock) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


@pytest.fixture
def small_server():
    store = HealthStore(time.monotonic)
    store.reset(0, ["worker-0"])
    srv = HeartbeatServer(
        store, CREDENTIALS, max_connections=20, hello_s=0.5, request_s=0.5, idle_s=3.0
    ).start()
    yield srv, store
    srv.close()


def test_strangers_holding_every_connection_make_room_for_a_task(small_server):
    srv, store = small_server
    strangers = raw_connections(srv.url, 200)  # ten times the cap, idle
    try:
        deadline = time.monotonic() + 5  # all of them accepted (the machine may be busy)
        gone = lambda: srv.connections.evicted + srv.connections.expired  # noqa: E731
        while gone() < 180 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone() >= 180 and len(srv.connections) <= 20
        assert post(srv.url, hb(step=1), TOKEN) == 200  # its own connection is the newest
        assert store.snapshot()["worker-0"].step == 1
    finally:
        for s in strangers:
            s.close()


def test_idle_strangers_and_slow_requests_are_closed_in_time(small_server):
    srv, _ = small_server
    [idle, slow] = raw_connections(srv.url, 2)
    slow.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nX-Orchestrate-To")  # and no more
    time.sleep(2.0)  # hello_s 0.5 s, swept once a second
    assert closed_by_server(idle) and closed_by_server(slow)
    assert srv.connections.expired >= 2 and len(srv.connections) == 0


def test_a_known_client_may_idle_but_holds_few_connections(small_server):
    srv, store = small_server
    host, port = srv.url.removeprefix("http://").split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=5) for _ in range(6)]
    for seq, conn in enumerate(conns, 1):
        conn.request("POST", wire.HEARTBEAT_PATH, body=hb(seq=seq), headers={wire.TOKEN_HEADER: TOKEN})
        assert conn.getresponse().read() == b""
    time.sleep(0.1)
    assert len(srv.connections) == 4  # per client: its two oldest were closed
    time.sleep(1.0)  # idle, under idle_s (3 s): kept
    assert len(srv.connections) == 4
    time.sleep(3.5)  # past it, and a sweep later
    assert len(srv.connections) == 0


# --- whatever a credentialed client posts, the handler answers (hypothesis) ---

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
_FIELDS = (
    "task",
    "attempt",
    "seq",
    "sent_at",
    "pid",
    "rss_bytes",
    "cpu_percent",
    "step",
    "total_steps",
    "metrics",
    "points",
    "error",
    "user_frame",
    "restored",
    "points_from",
    "done",
    "ready",
)


@st.composite
def heartbeats(draw):
    """Mostly well-formed heartbeats of worker-0, any field replaced by any JSON value."""
    body = json.loads(hb(step=1, metrics={"loss": 0.5}, points=[{"step": 1, "loss": 0.5}]))
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=4)):
        body[name] = draw(_JSON | st.integers(min_value=-(10**400), max_value=10**400))
    return body


class _Conn:
    client = CREDENTIALS.check(TOKEN.encode())


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,  # the same examples every run (tests/unit/test_load.py says why)
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=heartbeats(), batch=st.booleans())
def test_any_heartbeat_gets_an_answer_never_an_exception(server, body, batch):
    srv, store, _ = server
    handler = srv._handler
    data = json.dumps(body).encode()
    if batch:
        status, answer = handler(wire.BATCH_PATH.encode(), b"[" + data + b"]", {}, _Conn())[:2]
        assert status == wire.FORBIDDEN_STATUS  # a task's credential: no batch
    status = handler(wire.HEARTBEAT_PATH.encode(), data, {}, _Conn())[0]
    assert status in (200, 400, 403, 404, 409, 410)


def test_a_stranger_cannot_make_the_server_derive_keys():
    before = len(CREDENTIALS._keys)
    for scope in range(1000, 1500):  # hosts the run does not have
        assert CREDENTIALS.check(f"relay/{scope}:{'0' * 40}".encode()) is None
    assert len(CREDENTIALS._keys) == before
