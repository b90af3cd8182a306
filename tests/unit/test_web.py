"""Web layer (orchestrator/web/): a real server on loopback over a fabricated run directory — the
token on every request, the page's API read incrementally from the run's files, Prometheus' text,
the bounds a client cannot push past (connections, idle sockets, log lines, task names)."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.web.curves import Curves
from orchestrator.web.reader import RunReader
from orchestrator.web.server import WebServer
from tests.unit.test_cli import fabricate_run


def request(
    server: WebServer, path: str, token: str | None = None, cookie: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if cookie is not None:
        headers["Cookie"] = cookie
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def get_json(server: WebServer, path: str) -> Any:
    status, _, body = request(server, path, server.token)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    head = {"schema_version": 1, "time": "2026-01-01T00:00:01.000Z"}
    events = [
        {**head, "kind": "run", "new": "RUNNING", "reason": "up"},
        {**head, "kind": "task", "task": "worker-1", "new": "FAILED", "reason": "was killed by SIGKILL"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    points = [
        {"schema_version": 1, "time": "t", "task": "worker-0", "attempt": 0, "step": s, "loss": 1 / s}
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    return run


@pytest.fixture
def server(run_dir: Path) -> Iterator[WebServer]:
    srv = WebServer(RunReader(run_dir, min_interval_s=0), max_connections=8, idle_s=1.0).start()
    yield srv
    srv.close()


def test_every_request_needs_the_runs_token(server: WebServer) -> None:
    for path in ("/", "/api/state", "/api/curves", "/metrics", "/static/page.js"):
        status, _, body = request(server, path)
        assert status == 401 and b"needs its token" in body, path
        assert request(server, path, "not-the-token")[0] == 401
    status, _, _ = request(server, "/?token=wrong")
    assert status == 401
    status, headers, _ = request(server, f"/?token={urllib.parse.quote(server.token)}")
    assert status == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"].split(";")[0]
    assert "httponly" in headers["set-cookie"].lower() and "samesite=strict" in headers["set-cookie"].lower()
    status, headers, body = request(server, "/", cookie=cookie)
    assert status == 200 and b"/static/page.js" in body
    assert "default-src 'self'" in headers["content-security-policy"]
    assert request(server, "/static/page.js", cookie=cookie)[0] == 200
    assert request(server, "/static/../web/server.py", cookie=cookie)[0] == 404


def test_the_state_api_reads_the_run_as_it_grows(server: WebServer, run_dir: Path) -> None:
    state = get_json(server, "/api/state?events=0")
    assert state["status"]["state"] == "RUNNING" and state["event_count"] == 2
    assert [e["kind"] for e in state["events"]] == ["run", "task"]
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"schema_version": 1, "time": "x", "kind": "warning", "reason": "late"}) + "\n")
        f.write('{"torn": ')  # a line being written: not read until whole
    state = get_json(server, "/api/state?events=2")
    assert [e["reason"] for e in state["events"]] == ["late"] and state["event_count"] == 3
    curves = get_json(server, "/api/curves")
    assert curves == {"worker-0": {"loss": [[1, 1.0, 0], [2, 0.5, 0], [3, pytest.approx(1 / 3), 0]]}}


def test_log_tails_only_of_the_runs_tasks(server: WebServer) -> None:
    assert get_json(server, "/api/logs/worker-0?lines=1") == {"lines": ["zero two"]}
    for bad in ("worker-7", "..%2F..%2Fstatus.json", "%2Fetc%2Fpasswd"):
        assert request(server, f"/api/logs/{bad}", server.token)[0] == 404
    assert len(get_json(server, "/api/logs/worker-0?lines=999999")["lines"]) <= 200


def test_prometheus_metrics_of_the_run(server: WebServer) -> None:
    status, headers, body = request(server, "/metrics", server.token)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    key = (("role", "worker"), ("task", "worker-0"))
    assert value[("orchestrate_task_step", key)] == 10
    assert value[("orchestrate_task_metric", (("name", "loss"), *key))] == 0.125
    assert value[("orchestrate_run_state", (("state", "RUNNING"),))] == 1
    assert value[("orchestrate_run_restarts_total", ())] == 1
    assert value[("orchestrate_task_state", (*key[:1], ("state", "RUNNING"), key[1]))] == 1
    assert ("orchestrate_task_heartbeat_age_seconds", key) in value


def test_connections_past_the_cap_are_refused_and_idle_ones_closed(server: WebServer) -> None:
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(8)]
    try:
        deadline = time.monotonic() + 5
        while len(server.connections) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        assert extra.recv(1) == b""  # closed at once: the cap holds
        extra.close()
        time.sleep(2.5)  # idle_s = 1: the silent ones are closed by the sweep
        assert all(s.recv(1) == b"" for s in held)
        assert len(server.connections) == 0
    finally:
        for s in held:
            s.close()
    assert get_json(server, "/api/state")["status"]["name"] == "demo"  # and it still serves


def test_curves_stay_bounded_and_keep_their_shape() -> None:
    curves = Curves(budget=1_000, per_curve=100, min_per_curve=10)
    for step in range(1, 10_001):
        curves.add("worker-0", 0, [{"step": step, "loss": 1.0 / step, "accuracy": step / 10_000}])
    assert curves.size <= 200
    snap = curves.snapshot(max_points=50)["worker-0"]
    assert len(snap["loss"]) <= 51 and snap["loss"][0][0] == 1 and snap["loss"][-1][0] > 9_000
    many = Curves(budget=1_000, per_curve=100, min_per_curve=10)
    for task in range(200):
        many.add(f"worker-{task}", 0, [{"step": s, "loss": 0.5} for s in range(1, 50)])
    assert many.size <= 200 * 10  # past the budget, no curve keeps more than its minimum
