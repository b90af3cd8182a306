"""The heartbeat endpoint (orchestrator/health/server.py) over real HTTP on loopback: the secret,
the wire format, statuses, and clients that misbehave."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from worker import wire


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
    assert post(srv.url, hb(step=3), "right-token") == 200
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
    ],
)
def test_malformed_heartbeat_is_400_and_server_survives(server, body):
    srv, store, _ = server
    assert post(srv.url, body, "right-token") == 400
    assert post(srv.url, hb(), "right-token") == 200


def test_a_restore_report_reaches_the_store_and_stays_for_the_attempt(server):
    srv, store, _ = server
    start = wire.Restored(
        step=75, fingerprint="a1b2c3d4e5f60718", source="/h/ckpt-75", epoch=2, step_in_epoch=5
    )
    assert post(srv.url, hb(seq=1, restored=start), "right-token") == 200
    assert post(srv.url, hb(seq=2, step=76), "right-token") == 200  # later heartbeats need not repeat it
    assert store.snapshot()["worker-0"].restored == start


def test_unknown_task_and_stale_attempt(server):
    srv, store, _ = server
    assert post(srv.url, hb(task="worker-9"), "right-token") == 404
    store.reset(1, ["worker-0"])
    assert post(srv.url, hb(attempt=0), "right-token") == wire.STALE_ATTEMPT_STATUS


def test_garbage_content_length_and_reset_connections_do_not_break_the_server(server, capfd):
    import socket

    srv, store, _ = server
    host, port = srv.url.removeprefix("http://").split(":")
    for request in (
        b"POST /v1/heartbeat HTTP/1.1\r\nX-Orchestrate-Token: right-token\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/heartbeat HTTP/1.1\r\nContent-Length: 5\r\n",  # cut off mid-headers
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(request)
            s.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )  # RST on close
    time.sleep(0.2)
    assert post(srv.url, hb(step=4), "right-token") == 200
    assert "Traceback" not in capfd.readouterr().err
