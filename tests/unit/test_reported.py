"""What a job reports or prints, whatever it is, through the whole path (issue 22): any JSON value in
any field of a heartbeat, any bytes a task prints — through the wire's check, the store, the
supervisor, status.json, events.jsonl, metrics.jsonl, the console (plain lines and the live view,
on a console that can write ASCII only), `orchestrate status`, the page's APIs and /metrics, all
real (a real record on disk, a real web server on loopback). Nothing raises; every document and
answer is strict JSON whose every string is UTF-8; /metrics is valid Prometheus text."""

from __future__ import annotations

import contextlib
import io
import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from orchestrator import cli
from orchestrator.cli.view import PlainView, render_status
from orchestrator.health.store import HealthStore
from orchestrator.record.logtail import LogTailer
from orchestrator.record.progress import recent_events
from orchestrator.record.quiet import ConsoleFilter, console_writes_anything
from orchestrator.record.schemas import Metrics, Status
from orchestrator.record.write import RunRecord
from orchestrator.supervise.config import SupervisorConfig
from orchestrator.supervise.supervisor import Supervisor
from orchestrator.web.reader import RunReader
from orchestrator.web.server import WebServer
from tests.unit.test_supervisor import SPEC, FakeBackend, FakeClock, at_once, plan_of, start_running
from worker import wire

#: Any Unicode, lone surrogates, controls and bidi characters included.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=30)
NAMES = st.one_of(
    ANY_TEXT.filter(lambda n: 0 < len(n) <= wire.MAX_NAME_CHARS),
    st.sampled_from(
        ["loss", "__proto__", "constructor", "bad\ud800name", "rev\u202eesrever", "損失", "a\x1b[2J"]
    ),
)
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = [f for f in wire.Heartbeat.__dataclass_fields__ if f not in ("task", "attempt", "pid")]


@st.composite
def heartbeats(draw: st.DrawFn) -> dict[str, Any]:
    """A heartbeat of worker-0 that is mostly right, with anything at all in some of its fields."""
    metrics = draw(st.dictionaries(NAMES, NUMBERS, max_size=6))
    raw: dict[str, Any] = {
        "task": "worker-0",
        "attempt": 0,
        "seq": draw(st.integers(min_value=10**6, max_value=10**9)),
        "sent_at": 1.0,
        "pid": 1,
        "ready": True,
        "step": draw(st.integers(min_value=0, max_value=2**40)),
        "metrics": metrics,
        "points": [{"step": s, **metrics} for s in draw(st.lists(st.integers(0, 10**6), max_size=3))],
        "busy": draw(st.none() | ANY_TEXT),
        "user_frame": draw(st.none() | ANY_TEXT),
        "error": draw(
            st.none() | st.fixed_dictionaries({"type": ANY_TEXT, "message": ANY_TEXT, "traceback": ANY_TEXT})
        ),
    }
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        raw[name] = draw(JSON)
    return raw


class WholePath:
    """One run directory, record and page for every example (a server per example would cost more
    than the test): each example adds its heartbeat and its printed bytes to them."""

    def __init__(self, root: Path):
        self.dir = root / "run"
        self.record = RunRecord(self.dir)
        self.log = self.record.log_path("worker-0.log")
        self.log.write_bytes(b"")
        self.console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")  # writes ASCII only
        console_writes_anything(self.console)
        self.view = PlainView(self.console, progress_every_s=0.001)
        shown = ConsoleFilter()
        self.tailer = LogTailer(
            {"worker-0": self.log},
            lambda task, line: [self.view.log_line(task, s) for s in shown(task, line)],
        )
        self.record.listen(self.view.event)
        self.server = WebServer(RunReader(self.dir, min_interval_s=0)).start()

    def get(self, path: str) -> bytes:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.port}{path}",
            headers={"Authorization": f"Bearer {self.server.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
            return bytes(answer.read())

    def close(self) -> None:
        self.server.close()
        self.tailer.stop()
        self.record.close()


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WholePath]:
    p = WholePath(tmp_path_factory.mktemp("reported"))
    yield p
    p.close()


def strict(text: str | bytes) -> Any:
    """Parsed as a browser would (no bare NaN or Infinity), every string in it UTF-8 text."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"a bare {constant}: not JSON")

    value = json.loads(text, parse_constant=refuse)
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate would raise here
    return value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=heartbeats(),
    printed=st.lists(
        st.binary(max_size=60) | ANY_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")), max_size=4
    ),
)
def test_anything_reported_or_printed_goes_through_the_whole_path(
    path: WholePath, tmp_path: Path, raw: dict[str, Any], printed: list[bytes]
) -> None:
    (tmp_path / "sup").mkdir(exist_ok=True)
    plan = plan_of(tmp_path / "sup", SPEC.format(workers=2), {"worker-0": 20000, "worker-1": 20001})
    clock, backend = FakeClock(), FakeBackend()
    store = HealthStore(clock, on_points=path.record.metrics)  # as the coordinator wires it
    config = SupervisorConfig(
        heartbeat_timeout_s=10, stall_timeout_s=30, startup_timeout_s=60, poll_interval_s=0
    )
    sup = Supervisor(
        plan,
        backend,
        store,
        path.record,
        lambda t, a: "tok",
        config,
        clock=clock,
        sleep=clock.advance,
        in_background=at_once,
    )
    start_running(sup, backend, store, clock)
    body = json.dumps(raw).encode()  # how it travels (Python writes a lone surrogate as \ud800)
    try:
        hb = wire.Heartbeat.from_bytes(body)
    except ValueError:
        hb = None  # refused: answered 400, the task's liveness unchanged
    if hb is not None and hb.task == "worker-0" and hb.attempt == 0:
        store.ingest(hb)
    clock.advance(0.5)
    sup.step()
    if hb is not None and hb.error is not None:
        path.record.event(kind="warning", task="worker-0", reason=hb.error.message)
    status = sup.status()
    path.record.write_status(status)
    path.record.flush()
    with open(path.log, "ab") as f:
        f.write(b"\n".join(printed) + b"\n")
    path.tailer.poll()

    # the record: strict JSON, every document as its schema says
    doc = strict((path.dir / "status.json").read_text())
    Status.model_validate(doc)
    for line in (path.dir / "metrics.jsonl").read_text().splitlines():
        Metrics.model_validate(strict(line))
    events = [strict(line) for line in (path.dir / "events.jsonl").read_text().splitlines()]
    for task in doc["tasks"]:
        for name, value in task["metrics"].items():
            assert wire.safe_text(name) == name and wire.number(value) is not None
            if isinstance(value, float):
                assert math.isfinite(value)

    # the console: plain lines (a progress line included) and the live view, ASCII only
    path.view.update(status)
    path.view.update({**status, "state": "RUNNING"})
    live = Console(file=path.console, width=60, force_terminal=False)
    live.print(render_status(doc, recent_events(events), width=60))
    path.console.flush()
    for args, code in ((["status", str(path.dir)], (0, 1)), (["status", str(path.dir), "--json"], (0,))):
        out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
        with contextlib.redirect_stdout(out):
            assert cli.main(args) in code
        out.flush()
        if "--json" in args:
            assert strict(out.buffer.getvalue())["tasks"] == doc["tasks"]

    # the page's APIs and /metrics
    state = strict(path.get("/api/state?events=0&page=prop"))
    assert state["status"]["state"] == doc["state"]
    strict(path.get("/api/curves?points=50"))
    strict(path.get("/api/logs/worker-0?lines=200"))
    families = list(text_string_to_metric_families(path.get("/metrics").decode("utf-8")))
    assert any(f.name == "orchestrate_task_metric" for f in families) or not doc["tasks"][0]["metrics"]
