"""Issue 28: what a local run's private network namespace costs, against the same run on the
host's network (`local: {isolate_network: off}`), alternated in one run, medians:

- P1 launch: launch.py's 2-worker MWMS job, `orchestrate up` spawn -> first step and total, and
  the floor (a bare Popen launcher) for context;
- P5 recovery: recovery.py's `exit` case (a worker killed with SIGKILL mid-training -> the first
  step after the resume), warm standbys on (they start inside the namespace too);
- making a namespace alone (`netns.make`: unshare, the holder's loopback up, its descriptors).
Goal: P1 and P5 in the namespace <= 1.05x off. The heartbeats' own path (Unix socket vs loopback
TCP) is capacity.py's `path:unix:N` against `path:direct:N`.

    .venv/bin/python scripts/bench/netns.py [--runs 5] [--recovery-runs 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import launch  # noqa: E402 - scripts/bench, this file's folder
import recovery  # noqa: E402
from common import median  # noqa: E402

from orchestrator.launch.local import netns  # noqa: E402

OFF = "local: {isolate_network: off}\n"


def make_s(n: int = 20) -> float:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        made = netns.make()
        took.append(time.perf_counter() - t0)
        if isinstance(made, str):
            raise SystemExit(f"no namespace here: {made}")
        made.close()
    return median(took)


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """The ratio of the medians, and the median of the pairs' ratios (each run against its
    neighbour of the other way: resists drift)."""
    return {
        "of_medians": round(median(a) / median(b), 3),
        "of_pairs": round(median([x / y for x, y in zip(a, b, strict=True)]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--recovery-runs", type=int, default=3)
    ns = parser.parse_args()
    out: dict = {"metric": "issue 28: a local run in its own network namespace", "make_s": round(make_s(), 4)}
    p1: dict[str, list[tuple[float, float]]] = {"floor": [], "namespace": [], "off": []}
    for i in range(ns.runs):  # alternated, each way first in turn, so drift hits every way alike
        p1["floor"].append(launch.bare())
        for way in ("namespace", "off") if i % 2 == 0 else ("off", "namespace"):
            p1[way].append(launch.orchestrate(OFF if way == "off" else ""))
    out["P1"] = {
        way: {
            "first_step_s": round(median([f for f, _ in runs]), 3),
            "total_s": round(median([t for _, t in runs]), 3),
        }
        for way, runs in p1.items()
    }
    out["P1"]["namespace_vs_off"] = {
        "first_step": ratio([f for f, _ in p1["namespace"]], [f for f, _ in p1["off"]]),
        "total": ratio([t for _, t in p1["namespace"]], [t for _, t in p1["off"]]),
    }
    p5: dict[str, list[dict]] = {"namespace": [], "off": []}
    for i in range(ns.recovery_runs):
        for way in ("namespace", "off") if i % 2 == 0 else ("off", "namespace"):
            where = recovery.Where(recovery.LOCAL_HOSTS + (OFF if way == "off" else ""))
            p5[way].append(recovery.one_run("exit", "on", where))
    keys = ("detected_s", "recovery_s", "from_noticed_s")
    out["P5"] = {way: {k: round(median([r[k] for r in runs]), 3) for k in keys} for way, runs in p5.items()}
    out["P5"]["namespace_vs_off"] = {
        k: ratio([r[k] for r in p5["namespace"]], [r[k] for r in p5["off"]])
        for k in ("recovery_s", "from_noticed_s")
    }
    out["P5"]["lines"] = {way: runs[-1]["line"] for way, runs in p5.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
