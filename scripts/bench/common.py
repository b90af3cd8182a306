"""Shared helpers of the benchmarks: run `orchestrate up` or a bare launcher, read run records."""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent


def iso_to_s(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def write_spec(folder: Path, body: str) -> Path:
    spec = folder / "spec.yaml"
    spec.write_text(textwrap.dedent(body))
    return spec


def orchestrate_up(spec: Path, run_dir: Path, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=spec.parent,
    )


def start_up(spec: Path, run_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`orchestrate up` in the background (its output dropped: the run's records say it all)."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=spec.parent,
        env=env,
    )


def status(run: Path) -> dict:
    """The run's status.json ({} before it is written)."""
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def wait_for(pred, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError("benchmark run did not reach the expected state")


def first_step_of_attempt(run: Path, attempt: int) -> tuple[float, int] | None:
    """When the attempt's first step was reported, and which step it was (None: not yet)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            p = json.loads(line)
        except ValueError:
            continue
        if p["attempt"] == attempt:
            return iso_to_s(p["time"]), p["step"]
    return None


def bare_launch(script: Path, args: list[str], workers: int = 2, timeout_s: float = 600) -> list[str]:
    """The floor: Popen with a hand-made TF_CONFIG, as a person would by hand. Returns each stdout."""
    ports = [_free_port() for _ in range(workers)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(workers):
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATE_")}
        env.update(
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"bare worker exited {p.returncode}")
        outs.append(out)
    return outs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(text: str, key: str) -> float:
    for line in text.splitlines():
        if f"{key}=" in line:
            return float(line.rsplit(f"{key}=", 1)[1].split()[0])
    raise ValueError(f"no {key}= in output:\n{text[-2000:]}")


def children_cpu_s() -> float:
    """CPU seconds (user + kernel) of the child processes this one has waited for: an
    `orchestrate up` and, on the local backend, the tasks it reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def values(text: str, key: str) -> list[float]:
    """Every `key=<number>` in the text (one per task)."""
    return [float(line.rsplit(f"{key}=", 1)[1].split()[0]) for line in text.splitlines() if f"{key}=" in line]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="orchestrate-bench-"))


def now() -> float:
    return time.time()


def spread(xs: list[float], digits: int = 3) -> dict[str, object]:
    """Every run of a figure, with its median and range: none left out as noise."""
    return {
        "median": round(statistics.median(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
        "n": len(xs),
        "all": [round(x, digits) for x in xs],
    }
