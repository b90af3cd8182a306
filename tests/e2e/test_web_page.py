"""End to end: a live run's page in a real headless browser (Debian's chromium, driven by
playwright, which downloads nothing here), and a real Prometheus server scraping its /metrics.
One run serves both: two workers without TensorFlow reporting for ~40 s, as a job may: a NaN loss,
an infinite value, names no view can show as they are (a lone surrogate, a bidi override), names
that are JavaScript's own (`__proto__`, `constructor`), any script, more values than the page
draws, a progress bar redrawn in place; its coordinator's console can only write ASCII."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import seccomp
from tests.conftest import run_processes, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROMETHEUS = shutil.which("prometheus")
#: Where the screenshot goes (kept after the run: CI keeps it with the test output).
OUTPUT = Path(os.environ.get("ORCHESTRATE_TEST_OUTPUT", REPO / "test-output"))

JOB = """
    import time, worker
    steps = 4000  # ~200 s: longer than the tests, which end it
    worker.set_total_steps(steps)
    odd = {"bad\\ud800name": 1.0, "rev\\u202eesrever": 2.0, "__proto__": 3.0, "constructor": 4.0, "損失": 5.0}
    many = {f"metric_{k:02d}_with_a_long_name": float(k) for k in range(18)}
    for i in range(1, steps + 1):
        time.sleep(0.05)
        loss = float("nan") if 20 <= i < 40 else 1.0 / i
        grad = float("inf") if i % 25 == 0 else 1.0
        worker.report(step=i, loss=loss, accuracy=i / steps, grad_norm=grad, **odd, **many)
        if i % 20 == 0:
            print(f"trained {i} steps", flush=True)
            bar = "".join(f"{j}/20 [{'=' * j}]\\r" for j in range(1, 21))  # redrawn in place
            print(bar + f"20/20 [epoch {i // 20}]", flush=True)
"""
#: The names as every view shows them (worker.wire.safe_text)
SHOWN_SURROGATE, SHOWN_BIDI = "bad\\ud800name", "rev\\u202eesrever"


class LiveRun:
    def __init__(self, root: Path):
        (root / "job.py").write_text(textwrap.dedent(JOB))
        (root / "spec.yaml").write_text(
            "name: page\nhosts:\n  - address: 127.0.0.1\n    tasks: {worker: 2}\njob:\n  script: job.py\n"
        )
        self.run_dir = root / "run"
        self.console = root / "console.txt"
        # a console that can write ASCII only: whatever the job reports, the coordinator writes it
        env = {**os.environ, "PYTHONIOENCODING": "ascii"}
        # on a kernel that refuses the standbys' page copy (as before Linux 5.14, for real:
        # tests/seccomp.py), which the page lists among what runs degraded
        refuses = [sys.executable, seccomp.__file__, "no-populate-write", "--"] if seccomp.SUPPORTED else []
        self.proc = subprocess.Popen(
            [*refuses, sys.executable, "-m", "orchestrator", "up", "spec.yaml", "--run-dir", "run", "--plain"]
            + ["--progress-every", "1"],
            cwd=root,
            stdout=open(self.console, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            env=env,
        )
        assert wait_until(lambda: "urls" in self.status() and self.step() >= 5, 60), self.status()
        self.page_url: str = self.status()["urls"]["page"]
        self.metrics_url: str = self.status()["urls"]["metrics"]
        self.token = urllib.parse.parse_qs(urllib.parse.urlsplit(self.page_url).query)["token"][0]
        self.base = self.page_url.split("/?", 1)[0]

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def step(self) -> int:
        return min((t.get("last_step") or 0 for t in self.status().get("tasks", [])), default=0)

    def close(self) -> None:
        run_id = self.status().get("run_id", "")
        self.proc.terminate()
        self.proc.wait(timeout=30)
        assert run_processes(run_id) == []


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    run = LiveRun(tmp_path_factory.mktemp("web"))
    yield run
    run.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed (.ci/run installs it)")
def test_a_real_prometheus_scrapes_the_live_run(live: LiveRun, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    token = tmp_path / "token"
    token.write_text(live.token)
    token.chmod(0o600)
    target = urllib.parse.urlsplit(live.metrics_url).netloc
    (tmp_path / "prometheus.yml").write_text(
        textwrap.dedent(
            f"""\
            global: {{scrape_interval: 1s, evaluation_interval: 1s}}
            scrape_configs:
              - job_name: orchestrate
                static_configs: [{{targets: ["{target}"]}}]
                authorization: {{credentials_file: {token}}}
            """
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115 - closed with the process
    )

    def query(q: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return list(json.load(r)["data"]["result"])
        except OSError:
            return []

    try:
        assert wait_until(lambda: query('up{job="orchestrate"} == 1'), 40), (
            tmp_path / "prometheus.log"
        ).read_text()[-2000:]
        assert wait_until(lambda: len(query("orchestrate_task_step > 0")) == 2, 20)
        first = {r["metric"]["task"]: float(r["value"][1]) for r in query("orchestrate_task_step")}
        assert wait_until(
            lambda: all(
                float(r["value"][1]) > first[r["metric"]["task"]] for r in query("orchestrate_task_step")
            ),
            20,
        )
        loss = query('orchestrate_task_metric{name="accuracy"}')
        assert {r["metric"]["task"] for r in loss} == {"worker-0", "worker-1"}
        # a value named with a lone surrogate or a bidi override, as its escape; any script as it is
        names = {r["metric"]["name"] for r in query('orchestrate_task_metric{task="worker-0"}')}
        assert {SHOWN_SURROGATE, SHOWN_BIDI, "損失", "__proto__", "loss", "grad_norm"} <= names
        assert query('orchestrate_run_state{state="RUNNING"} == 1')
        assert query("orchestrate_task_heartbeat_age_seconds < 5")
        assert query('orchestrate_task_state{state="RUNNING"} == 1')
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_live_page_in_a_real_browser(live: LiveRun) -> None:
    """Runs after the Prometheus test: it ends the run while the page is open."""
    playwright = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    outside: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=30_000)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})  # one browser's
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: None if r.url.startswith(live.base) else outside.append(r.url))
            cookies: list[str] = []
            page.on("request", lambda r: cookies.append(r.url) if "cookie" in r.headers else None)
            started = time.monotonic()
            page.goto(live.page_url)
            page.wait_for_selector('#tasks tr[data-task="worker-1"]', timeout=15_000)
            page.wait_for_selector('svg[data-metric="loss"] path[data-task="worker-0"]', timeout=15_000)
            load_s = time.monotonic() - started
            assert page.url == f"{live.base}/"  # the token left the address bar (kept in the tab)
            assert page.locator("#state").inner_text() == "RUNNING"
            assert page.locator('#tasks tr[data-task="worker-0"] td').nth(1).inner_text() == "RUNNING"

            def points() -> int:
                path = page.locator('svg[data-metric="loss"] path[data-task="worker-0"]')
                return int(path.get_attribute("data-points") or 0)

            first = points()
            assert wait_until(lambda: points() > first, 15, 0.5), "the loss curve did not grow"
            # the NaN loss (steps 20-39) and the infinite grad_norm: marked on their curves, said
            assert page.locator('svg[data-metric="loss"] text.nonfinite[data-task="worker-0"]').count() >= 1
            assert "NaN at step 20" in page.locator('svg[data-metric="loss"] ~ .legend').inner_text()
            assert wait_until(lambda: "12 of 26 values drawn" in page.locator("#plots-more").inner_text(), 10)
            # every name is a column (its whole name the header's title), the hostile ones as text
            header = page.locator("#tasks thead th")
            titles = [header.nth(i).get_attribute("title") for i in range(header.count())]
            for name in ("__proto__", "constructor", SHOWN_SURROGATE, SHOWN_BIDI, "損失"):
                assert name in titles, (name, titles)
            row = page.locator('#tasks tr[data-task="worker-0"] td')
            assert row.nth(titles.index("__proto__")).inner_text() == "3"
            assert row.nth(titles.index("constructor")).inner_text() == "4"
            # 26 columns stay within the window: the table scrolls, the page does not
            box = page.locator("#tasks").locator("xpath=..").bounding_box()
            assert box is not None and box["x"] + box["width"] <= 1280
            if seccomp.SUPPORTED:  # what runs degraded, above the tasks, with its fix
                page.wait_for_selector("#notices li", timeout=60_000)
                notice = page.locator("#notices li").first.inner_text()
                assert notice.startswith(
                    "degraded: warm standbys on this machine hand over without their page copy"
                )
                assert "(hint: a kernel of Linux 5.14 or later" in notice, notice
            page.locator('#tasks tr[data-task="worker-1"]').click()
            # (the page's CSP forbids eval: the test reads the DOM as a user would, no script injected)
            assert wait_until(lambda: "trained" in page.locator("#log").inner_text(), 10)
            log = page.locator("#log").inner_text()
            assert "20/20 [epoch" in log and "1/20 [=]" not in log  # a redrawn bar: its last state
            # `orchestrate stacks` on the live run: where each task is, its full stacks a click away
            asked = [sys.executable, "-m", "orchestrator", "stacks", str(live.run_dir)]
            res = subprocess.run(asked, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0 and "== worker-0" in res.stdout, res.stdout + res.stderr
            page.wait_for_selector('#stacks li[data-task="worker-0"]', timeout=10_000)
            assert "asked: orchestrate stacks" in page.locator("#stacks-when").inner_text()
            page.locator('#stacks li[data-task="worker-0"]').click()
            assert wait_until(lambda: "MainThread" in page.locator("#stacks-full").inner_text(), 10)
            # another run's page beside it (`orchestrate show` of this run: another port, another
            # token), then a reload: each keeps its own token (no cookie for them to evict)
            shown = live.run_dir.parent / "show.txt"
            show = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "show", str(live.run_dir), "--web", "127.0.0.1:0"],
                stdout=open(shown, "wb"),  # noqa: SIM115 - closed with the process
                stderr=subprocess.STDOUT,
            )
            try:
                assert wait_until(lambda: "token=" in shown.read_text(), 20), shown.read_text()
                other = context.new_page()
                other.goto(shown.read_text().splitlines()[0].strip().split(": ", 1)[1])
                other.wait_for_selector('#tasks tr[data-task="worker-1"]', timeout=15_000)
                page.reload()
                page.wait_for_selector('#tasks tr[data-task="worker-1"]', timeout=15_000)
                for tab in (page, other):
                    tab.wait_for_timeout(1500)  # a poll or two more: none refused
                    assert tab.locator("#note").inner_text() == "" and tab.url.endswith("/")
                    assert tab.locator("#state").inner_text() == "RUNNING"
                other.close()
            finally:
                show.terminate()
                show.wait(timeout=10)
            OUTPUT.mkdir(parents=True, exist_ok=True)
            shot = OUTPUT / "web-page.png"
            page.screenshot(path=str(shot), full_page=True)
            # the run ends while the page is open: it shows how, and says the page is no longer served
            assert errors == [], errors
            live.proc.terminate()
            assert wait_until(lambda: page.locator("#state").inner_text() == "INTERRUPTED", 15, 0.2)
            assert wait_until(lambda: "has ended" in page.locator("#note").inner_text(), 15, 0.2)
            assert "ETA" not in page.locator("#progress-text").inner_text()
        finally:
            browser.close()
    # after its end, the page's request to a server that is gone (the browser says so itself)
    assert all("ERR_CONNECTION_REFUSED" in e for e in errors), errors
    assert outside == [] and cookies == [], (outside, cookies)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert live.proc.wait(timeout=30) == 130
    console = live.console.read_bytes().decode("ascii")  # an ASCII console got ASCII, nothing raised
    assert "Traceback" not in console and "orchestrate: progress step" in console
    assert SHOWN_SURROGATE in console and "\\u640d\\u5931" in console  # 損失 as its escape
    print(f"page loaded and showed both tasks in {load_s:.2f} s; screenshot: {shot}")
