"""P10 what a researcher sees (issue 15): time from a worker's death to its cause on the console,
and the cost of the run's page to the coordinator.

- cause on screen: `orchestrate up --plain` of 2 workers (no TensorFlow: the coordinator's side is
  measured), a worker killed with SIGKILL; time from the kill to the console line naming it
  (`worker-1 FAILED (was killed by SIGKILL …)`), and to the restart's line. The live view shows the
  same event in its events pane at its next refresh (4 Hz). Median of several kills.
- page cost: the coordinator's CPU share over a window with no page open and with one page
  polling as orchestrator/web/static/page.js does (state every second, curves when they changed,
  a log tail every 2 s), for 2 tasks (P6's load generator at 2 tasks; scripts/bench/capacity.py
  --pages gives the 1,000-task figure). Ratios in one run.

    .venv/bin/python scripts/bench/researcher_view.py [--kills 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import REPO, median, tmpdir

JOB = """\
import time, worker
for i in range(1, 10**7):
    time.sleep(0.05)
    worker.report(step=i, loss=1.0 / i)
"""

SPEC = """\
name: bench-view
hosts: [{address: 127.0.0.1, tasks: {worker: 2}}]
job: {script: job.py}
health: {heartbeat_interval_s: 0.5}
restart: {max_restarts: 100, backoff_s: 0.5}
"""


def cause_on_screen(kills: int) -> dict[str, Any]:
    folder = tmpdir()
    (folder / "job.py").write_text(JOB)
    (folder / "spec.yaml").write_text(SPEC)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", "spec.yaml", "--run-dir", "run", "--plain", "--no-web"],
        cwd=folder,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    to_cause, to_restart = [], []
    try:
        for attempt in range(kills):
            victim = _running_pid(folder / "run", "worker-1", attempt)
            seen = len(lines)
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            cause = _line_after(lines, seen, "worker-1 FAILED (was killed by SIGKILL")
            restart = _line_after(lines, seen, "RESTARTING (")
            to_cause.append(cause - killed_at)
            to_restart.append(restart - killed_at)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return {
        "kills": kills,
        "cause_on_screen_s": round(median(to_cause), 3),
        "cause_on_screen_max_s": round(max(to_cause), 3),
        "restart_line_s": round(median(to_restart), 3),
    }


def _running_pid(run_dir: Path, task: str, attempt: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = json.loads((run_dir / "status.json").read_text())
            t = next(t for t in status["tasks"] if t["task"] == task)
            if (
                status["attempt"] == attempt
                and status["state"] == "RUNNING"
                and t["pid"]
                and (t["last_step"] or 0) > 3
            ):
                return int(t["pid"])
        except (OSError, ValueError, StopIteration, KeyError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{task} never ran in attempt {attempt}")


def _line_after(lines: list[tuple[float, str]], start: int, text: str, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for at, line in lines[start:]:
            if text in line:
                return at
        time.sleep(0.005)
    raise RuntimeError(f"no line with {text!r}")


def page_cost(measure_s: float) -> dict[str, Any]:
    out = {}
    for pages in (0, 1):
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "bench" / "capacity.py"),
                "--cases",
                "whole:direct:2",
                "--pages",
                str(pages),
                "--measure-s",
                str(measure_s),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        (result,) = json.loads(proc.stdout)["results"]
        out[pages] = result
    base, page = out[0]["coordinator_cpu_share"], out[1]["coordinator_cpu_share"]
    return {
        "tasks": 2,
        "cpu_share_no_page": base,
        "cpu_share_one_page": page,
        "page_cost_share": round(page - base, 4),
        "page_p99_ms": out[1]["page_p99_ms"],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--measure-s", type=float, default=20.0)
    ns = parser.parse_args()
    result = {"metric": "P10 researcher's view", **cause_on_screen(ns.kills), "page": page_cost(ns.measure_s)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
