"""Issue 37: what a local run's outgoing network (pasta, local.outbound) costs, in one run:

- making the run's network: the namespace with pasta connected vs the namespace offline
  (`local: {outbound: off}`), medians of 10;
- P1 launch: launch.py's 2-worker MWMS job, `orchestrate up` spawn -> first step and total, with
  outbound on vs off, alternated (goal: on <= 1.05x off);
- download throughput: a file from `python3 -m http.server` on this machine's own (non-loopback)
  address, read by a Python client (urllib, 1 MiB reads) in the run's namespace through pasta vs
  the same client on this machine directly (goal: >= 0.5x direct);
- the failing case of the issue: a one-worker job that downloads from that server, with pasta vs
  without it (the namespace offline), its exit code and first words.
P6 is not on this path: heartbeats come over the run's Unix socket, never through pasta
(capacity.py `path:unix:N` measures them).

    .venv/bin/python scripts/bench/outbound.py [--runs 5] [--mb 200]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import launch  # noqa: E402 - scripts/bench, this file's folder
from common import median  # noqa: E402
from netns import ratio  # noqa: E402

from orchestrator.launch.local import netns  # noqa: E402
from orchestrator.spec.load import parse_spec  # noqa: E402

OFF = "local: {outbound: off}\n"

READ = """
import sys, time, urllib.request
t0 = time.perf_counter()
with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
    n = 0
    while chunk := r.read(1 << 20):
        n += len(chunk)
print(n, time.perf_counter() - t0)
"""


def machine_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet sent: the route's source address
        return str(s.getsockname()[0])


def network(folder: Path, extra: str = "") -> netns.Network:
    (folder / "job.py").write_text("")
    spec = parse_spec(
        "name: b\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\njob: {script: job.py}\n" + extra,
        file="b.yaml",
        base_dir=folder,
    )
    made = netns.Network(spec)  # type: ignore[arg-type]
    if made.make(folder) is None:
        raise SystemExit(f"no namespace here: {made.exposure}")
    return made


def make_s(folder: Path, extra: str, n: int = 10) -> float:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        made = network(folder, extra)
        took.append(time.perf_counter() - t0)
        made.close()
    return median(took)


def download(url: str, made: netns.Network | None) -> float:
    """MB/s read by a Python client, in the namespace (`made`) or on this machine."""
    argv = [sys.executable, "-c", READ, url]
    out = subprocess.run(
        made.enter(argv, "/") if made else argv,
        pass_fds=made.fds if made else (),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    n, seconds = out.stdout.split()
    return int(n) / float(seconds) / 1e6


JOB = """
import os, urllib.request
import worker
data = urllib.request.urlopen(os.environ["DATA_URL"], timeout=10).read()
print("downloaded", len(data), "bytes", flush=True)
worker.report(step=1)
"""


def failing_case(url: str, root: Path, extra: str) -> dict:
    (root / "job.py").write_text(textwrap.dedent(JOB))
    spec = root / "spec.yaml"
    spec.write_text(
        "name: fetch\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\njob: {script: job.py}\n" + extra
    )
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(root / "run"), "--plain"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DATA_URL": url},
        cwd=root,
    )
    said = [x for x in res.stdout.splitlines() if "downloaded" in x or "URLError" in x or "offline" in x]
    return {"exit": res.returncode, "seconds": round(time.perf_counter() - t0, 2), "said": said[:3]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mb", type=int, default=200)
    ns = parser.parse_args()
    out: dict = {"metric": "issue 37: a local run's outgoing network (pasta)"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out["make_s"] = {"online": round(make_s(root, ""), 4), "offline": round(make_s(root, OFF), 4)}
        served = root / "served"
        served.mkdir()
        with open(served / "data.bin", "wb") as f:
            f.write(os.urandom(ns.mb << 20))
        address = machine_address()
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", address, "--directory", str(served)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://{address}:{port}/data.bin"
            time.sleep(1.0)
            direct, through = [], []
            made = network(root)
            try:
                for _ in range(ns.runs):
                    direct.append(download(url, None))
                    through.append(download(url, made))
            finally:
                made.close()
            out["download_MBps"] = {
                "file_MB": ns.mb,
                "direct": round(median(direct), 1),
                "through_pasta": round(median(through), 1),
                "through_vs_direct": ratio(through, direct),
            }
            small = f"http://{address}:{port}/small.txt"
            (served / "small.txt").write_text("x" * 1000)
            cases = root / "cases"
            for name, extra in (("with_pasta", ""), ("offline", OFF)):
                (cases / name).mkdir(parents=True)
                out.setdefault("failing_case", {})[name] = failing_case(small, cases / name, extra)
        finally:
            server.terminate()
            server.wait()
    p1: dict[str, list[tuple[float, float]]] = {"online": [], "offline": []}
    for i in range(ns.runs):  # alternated, each way first in turn
        for way in ("online", "offline") if i % 2 == 0 else ("offline", "online"):
            p1[way].append(launch.orchestrate(OFF if way == "offline" else ""))
    out["P1"] = {
        way: {
            "first_step_s": round(median([f for f, _ in runs]), 3),
            "total_s": round(median([t for _, t in runs]), 3),
        }
        for way, runs in p1.items()
    }
    out["P1"]["online_vs_offline"] = {
        "first_step": ratio([f for f, _ in p1["online"]], [f for f, _ in p1["offline"]]),
        "total": ratio([t for _, t in p1["online"]], [t for _, t in p1["offline"]]),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
