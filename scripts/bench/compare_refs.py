"""Compare two checkouts of the project on the same benchmarks, in one run: each round runs every
benchmark once from each checkout, alternately (drift hits both alike), then prints each figure's
median per checkout and after/before (a refactoring must not make anything slower).

    git worktree add /tmp/before <commit>
    scripts/bench/compare_refs.py --before /tmp/before --rounds 3 --only P1 P2 P7 P8

A checkout runs its own benchmark scripts with its own packages first on PYTHONPATH (this venv's
dependencies; the editable install of this checkout comes after them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parents[2]

#: benchmark -> (script, arguments for one round, the figures it gives: name -> how to read it)
Figures = dict[str, Callable[[dict[str, Any]], float]]


def _row(key: str, value: str, field: str) -> Callable[[dict[str, Any]], float]:
    return lambda doc: float(next(r for r in doc["rows"] if str(r[key]) == value)[field])


PLAN: dict[str, tuple[str, list[str], Figures]] = {
    "P2": (
        "cli_start.py",
        ["--runs", "5"],
        {
            "validate start (s)": _row("command", "orchestrate validate", "median_s"),
            "plan start (s)": _row("command", "orchestrate plan", "median_s"),
        },
    ),
    "P1": (
        "launch.py",
        ["--runs", "1"],
        {
            "launch first step / bare Popen": _row("launcher", "orchestrate up", "first_step_ratio"),
            "launch total / bare Popen": _row("launcher", "orchestrate up", "total_ratio"),
        },
    ),
    "P7": (
        "ssh_fanout.py",
        ["--repeats", "1"],
        {
            "ssh launch, 1 host (s)": _row("hosts", "1", "launch_s"),
            "ssh launch, 8 hosts (s)": _row("hosts", "8", "launch_s"),
        },
    ),
    "P8": (
        "slurm_launch.py",
        ["--rounds", "1"],
        {
            "slurm up -> first step (s)": lambda d: float(d["orchestrate_first_step_s"]),
            "slurm / bare srun": lambda d: float(d["ratio"]),
        },
    ),
}


def run(tree: Path, script: str, args: list[str]) -> dict[str, Any] | str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    bench = tree / "scripts" / "bench"
    res = subprocess.run(
        [sys.executable, str(bench / script), *args], capture_output=True, text=True, cwd=bench, env=env
    )
    start = res.stdout.find("{")
    if res.returncode != 0 or start < 0:
        return f"exit {res.returncode}: {(res.stdout + res.stderr)[-800:]}"
    doc: dict[str, Any] = json.loads(res.stdout[start:])
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(PLAN), help="e.g. P1 P2")
    ns = parser.parse_args()
    trees = {"before": ns.before.resolve(), "after": HERE}
    seen: dict[tuple[str, str], list[float]] = {}
    errors: list[str] = []
    for n in range(ns.rounds):
        for name in ns.only:
            script, args, figures = PLAN[name]
            for label, tree in trees.items() if n % 2 == 0 else reversed(trees.items()):
                t0 = time.monotonic()
                doc = run(tree, script, args)
                if isinstance(doc, str) or doc.get("skipped"):
                    errors.append(f"{name} {label}: {doc if isinstance(doc, str) else doc['skipped']}")
                    continue
                for figure, read in figures.items():
                    seen.setdefault((figure, label), []).append(read(doc))
                print(f"round {n + 1} {name} {label}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    print("| figure | before | after | after / before |\n|---|---|---|---|")
    for name in ns.only:
        for figure in PLAN[name][2]:
            before, after = seen.get((figure, "before")), seen.get((figure, "after"))
            if before and after:
                b, a = median(before), median(after)
                print(f"| {name} {figure} | {b:.3f} | {a:.3f} | ×{a / b:.3f} |")
                print(f"  {name} {figure}: before {before}, after {after}", file=sys.stderr)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
