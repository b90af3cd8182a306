"""Web layer (orchestrator/web/): a real server on loopback over a fabricated run directory — the
token on every request, the page's API read incrementally from the run's files, Prometheus' text,
the bounds a client cannot push past (connections, idle sockets, log lines, task names)."""

from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.web.curves import MAX_MARKED_ATTEMPTS, Curves
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


def test_every_request_for_the_runs_data_needs_its_token(server: WebServer) -> None:
    for path in ("/api/state", "/api/curves", "/metrics", "/api/logs/worker-0"):
        status, _, body = request(server, path)
        assert status == 401 and b"needs its token" in body, path
        assert request(server, path, "not-the-token")[0] == 401
        assert request(server, path, cookie=f"orchestrate_token={server.token}")[0] == 401  # no cookie counts
        assert request(server, path, server.token)[0] == 200
    assert request(server, "/?token=wrong")[0] == 401  # a wrong address is said at once
    # the page's own files (no run data in them, the same for every run) load without it: the
    # page then sends the token it finds in its address; a reload finds it in the tab's storage
    for path in ("/", f"/?token={urllib.parse.quote(server.token)}", "/static/page.js", "/static/page.css"):
        status, headers, body = request(server, path)
        assert status == 200, path
        assert "set-cookie" not in headers  # a cookie would reach every other port of this host
        assert "default-src 'self'" in headers["content-security-policy"]
    assert b"/static/page.js" in request(server, "/")[2]
    assert request(server, "/static/../web/server.py")[0] == 404
    assert request(server, "/static/server.py")[0] == 404


def raw(server: WebServer, data: bytes) -> bytes:
    """What the server answers to these bytes, whatever they are (its first line)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(data)
        answer = b""
        while b"\r\n" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n")[0]


def test_malformed_requests_get_a_4xx_and_one_log_line_each_second(
    server: WebServer, caplog: pytest.LogCaptureFixture
) -> None:
    bad = [
        b"GET /api/state HTTP/1.1\r\nHost: x\r\nCookie: a=\xff\xfe\x80\r\n\r\n",
        b"GET /api/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n",
        b"GET /?token=\xff HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/logs/\xff\xfe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n",
        b"GET /api/curves?points=%%ff HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX: \x00\x01\r\n\r\n",
        b"\xff\xfe / HTTP/1.1\r\n\r\n",
        b"GET /api/state HTTP/9.9\r\n\r\n",
    ]
    token = server.token.encode()
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        for data in bad:
            line = raw(server, data.replace(b"%s", token).replace(b"%%", b"%"))
            assert line.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) or line == b"", (data, line)
        for query in ("points=0", "points=-1", "points=1", "points=2001", "points=x", "points=1e3"):
            status, _, body = request(server, f"/api/curves?{query}", server.token)
            assert status == 400 and b"points: an integer from 2 to 2000" in body, query
        for query in ("lines=0", "lines=-5", "lines=201", "lines="):
            status, _, body = request(server, f"/api/logs/worker-0?{query}", server.token)
            assert status == 400 and b"lines: an integer from 1 to 200" in body, query
        for query in ("events=-1", "page=../x", "page=" + "a" * 33):
            assert request(server, f"/api/state?{query}", server.token)[0] == 400, query
        assert len(get_json(server, "/api/curves?points=2")["worker-0"]["loss"]) <= 3
        assert len(get_json(server, "/api/logs/worker-0?lines=200")["lines"]) <= 200
    said = [r for r in caplog.records if r.name.startswith(("orchestrator.web", "aiohttp"))]
    assert not any(r.exc_info for r in said), "a traceback"
    took_s = time.monotonic() - started
    assert 1 <= len(said) <= took_s + 1, [r.getMessage() for r in said]  # one a second: the rest counted
    assert all("\x1b" not in r.getMessage() and "\ufffd" not in r.getMessage() for r in said)


def test_the_page_keeps_the_token_per_origin_not_in_a_cookie() -> None:
    page = (Path(__file__).parents[2] / "orchestrator/web/static/page.js").read_text()
    assert "document.cookie" not in page and 'credentials: "omit"' in page
    assert "sessionStorage" in page and "history.replaceState" in page and "Authorization" in page


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
    assert request(server, "/api/logs/worker-0?lines=999999", server.token)[0] == 400


def test_log_tails_read_as_the_console_shows_them(server: WebServer, run_dir: Path) -> None:
    bar = "".join(f"{i}/20 [{'=' * i}>]\b\b\b\b\r" for i in range(1, 21))  # Keras redraws in place
    with open(run_dir / "logs" / "worker-0.log", "w", encoding="utf-8") as f:
        f.write(f"===== orchestrate: attempt 1 =====\nEpoch 1/2\n{bar}20/20 [done]\nloss\u202e is\tnan\n")
    lines = get_json(server, "/api/logs/worker-0?lines=200")["lines"]
    assert lines == [
        "Epoch 1/2",
        "20/20 [done]",
        "loss\\u202e is    nan",
    ]  # one line per epoch, not per batch


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


def test_strangers_cannot_keep_the_owner_out(run_dir: Path) -> None:
    server = WebServer(
        RunReader(run_dir, min_interval_s=0), max_connections=8, idle_s=1.0, hello_s=1.0
    ).start()
    held: list[socket.socket] = []
    try:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(8)]
        deadline = time.monotonic() + 5
        while len(server.connections) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.connections) == 8  # every slot a stranger's
        started = time.monotonic()
        assert get_json(server, "/api/state")["status"]["name"] == "demo"  # a stranger made room
        assert time.monotonic() - started < 1.0
        assert server.connections.evicted >= 1
        time.sleep(2.5)  # hello_s = 1: strangers that never showed the token are closed
        assert all(s.recv(1) == b"" for s in held)
        assert len(server.connections) == 0
    finally:
        for s in held:
            s.close()
        server.close()


def test_when_every_slot_is_the_owners_own_a_newcomer_is_refused(run_dir: Path) -> None:
    server = WebServer(RunReader(run_dir, min_interval_s=0), max_connections=8, idle_s=30, hello_s=30).start()
    owners = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=5) for _ in range(8)]
    try:
        for conn in owners:  # kept while used: the owner's own, never evicted for a stranger
            conn.request("GET", "/api/state", headers={"Authorization": f"Bearer {server.token}"})
            assert conn.getresponse().read()
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        started = time.monotonic()
        assert extra.recv(1) == b"" and time.monotonic() - started < 1  # closed at once (hello_s is 30)
        extra.close()
        assert server.connections.refused == 1 and server.connections.evicted == 0
    finally:
        for conn in owners:
            conn.close()
        server.close()


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


def test_a_curves_first_nan_of_each_attempt_survives_every_thinning() -> None:
    """The page says where a curve first went bad: at its true step, whichever points the store
    and the page's own thinning happen to keep (found flaky in the browser test: step 22 said)."""
    curves = Curves(budget=1_000, per_curve=100, min_per_curve=10)
    for attempt, bad in ((0, range(21, 40)), (1, range(333, 334)), (2, ())):
        for step in range(1, 5_001):
            value = math.nan if step in bad else -math.inf if attempt == 2 and step == 4_999 else 1.0
            curves.add("worker-0", attempt, [{"step": step, "loss": value}])
    for max_points in (7, 50, 300):
        loss = curves.snapshot(max_points=max_points)["worker-0"]["loss"]
        odd = [(a, s) for s, v, a in loss if not math.isfinite(v)]
        assert odd[:1] == [(0, 21)] and (1, 333) in odd and (2, 4_999) in odd, (max_points, odd)
        assert len(loss) <= max_points + 4
        assert loss == sorted(loss, key=lambda p: (p[2], p[0]))  # each mark in its place
    many = Curves()
    for attempt in range(100):  # a curve marks its latest attempts only
        many.add("worker-0", attempt, [{"step": 1, "loss": math.nan}])
    assert len(many.snapshot(max_points=10)["worker-0"]["loss"]) <= 10 + 1 + MAX_MARKED_ATTEMPTS


def test_nan_and_infinity_reach_the_page_as_strict_json(server: WebServer, run_dir: Path) -> None:
    status = json.loads((run_dir / "status.json").read_text())
    status["tasks"][0]["metrics"] = {"loss": "NaN", "grad": "Infinity", "low": "-Infinity", "acc": 0.5}
    (run_dir / "status.json").write_text(json.dumps(status))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps(
                {"schema_version": 1, "time": "t", "task": "worker-0", "attempt": 0, "step": 4, "loss": "NaN"}
            )
        )
        f.write("\n")
    for path in ("/api/state", "/api/curves"):
        status_code, _, body = request(server, path, server.token)
        assert status_code == 200
        json.loads(body, parse_constant=_bare)  # what a browser parses: no bare NaN or Infinity
    state = get_json(server, "/api/state")
    assert state["status"]["tasks"][0]["metrics"] == {
        "loss": "NaN",
        "grad": "Infinity",
        "low": "-Infinity",
        "acc": 0.5,
    }
    assert get_json(server, "/api/curves")["worker-0"]["loss"][-1] == [4, "NaN", 0]
    _, _, body = request(server, "/metrics", server.token)
    families = text_string_to_metric_families(body.decode())
    values = {
        s.labels["name"]: s.value
        for f in families
        if f.name == "orchestrate_task_metric"
        for s in f.samples
        if s.labels["task"] == "worker-0"
    }
    assert (
        values["grad"] == float("inf") and values["low"] == float("-inf") and values["loss"] != values["loss"]
    )


def test_a_run_whose_coordinator_is_gone_is_said_stale(server: WebServer) -> None:
    state = get_json(server, "/api/state")
    assert state["status"]["state"] == "RUNNING" and state["stale"] is True  # fabricated: no coordinator
    assert isinstance(state["recorded_at"], float)


def test_an_open_page_is_shown_the_end_before_the_server_goes(server: WebServer, run_dir: Path) -> None:
    get_json(server, "/api/state?page=abc123")  # an open page, RUNNING
    started = time.monotonic()
    server.linger(timeout_s=0.5)  # it has not seen the end: waited for
    assert time.monotonic() - started >= 0.45
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(
        json.dumps({**status, "state": "SUCCEEDED", "ended_at": "2026-01-01T00:02:00Z"})
    )
    assert get_json(server, "/api/state?page=abc123")["status"]["state"] == "SUCCEEDED"
    started = time.monotonic()
    server.linger(timeout_s=5)  # it has: nothing to wait for
    assert time.monotonic() - started < 0.2


def _bare(constant: str) -> None:
    raise AssertionError(f"a bare {constant} in strict JSON")


def test_where_each_task_was_is_on_the_page_with_its_full_stacks_a_click_away(
    server: WebServer, run_dir: Path
) -> None:
    assert get_json(server, "/api/state")["stacks"] == {}
    assert request(server, "/api/stacks/worker-1", server.token)[0] == 404
    frames = [
        {"function": "wait_for_lock", "file": "/j/train.py", "line": 17, "native": False},
        {"function": "\u202e<script>", "file": "/j/train.py", "line": 30, "native": False},  # any text
    ]
    doc = {
        "task": "worker-1",
        "attempt": 0,
        "captured_at": "2026-01-01T00:00:02.000Z",
        "why": "before the stop: worker-1 stalled",
        "state": "running",
        "method": "py-spy",
        "threads": [{"name": "MainThread", "main": True, "active": False, "frames": frames}],
    }
    (run_dir / "stacks" / "attempt-0").mkdir(parents=True)
    (run_dir / "stacks" / "attempt-0" / "worker-1.json").write_text(json.dumps(doc))
    said = get_json(server, "/api/state")["stacks"]
    assert said["worker-1"]["culprit"] is True and said["worker-1"]["why"] == doc["why"]
    assert said["worker-1"]["line"].startswith("worker-1: in wait_for_lock (train.py:17), not in TensorFlow")
    full = get_json(server, "/api/stacks/worker-1")["lines"]
    assert any("wait_for_lock (/j/train.py:17)" in line for line in full)
    assert not any("\u202e" in line for line in full)  # shown as its escape, never as a direction
    assert request(server, "/api/stacks/..%2Fstatus.json", server.token)[0] == 404
