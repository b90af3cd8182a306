"""P2 CLI start: `orchestrate validate` and `orchestrate plan` on a shipped spec, vs `python -c pass`
(the interpreter's own start), alternated, median. Goal: <= 0.3 s, and no TensorFlow import."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import REPO, median

SPEC = REPO / "cluster_specs" / "local.yaml"
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "orchestrate validate": [sys.executable, "-m", "orchestrator", "validate", str(SPEC)],
    "orchestrate plan": [sys.executable, "-m", "orchestrator", "plan", str(SPEC)],
}


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    ns = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(ns.runs):
        for name, argv in COMMANDS.items():
            times[name].append(timed(argv))
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, orchestrator.cli as c; c.main(['validate', sys.argv[1]]); "
            "print('tensorflow' in sys.modules)",
            str(SPEC),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    base = median(times["python -c pass"])
    rows = [
        {"command": name, "median_s": round(median(v), 3), "over_python_s": round(median(v) - base, 3)}
        for name, v in times.items()
    ]
    imports_tf = check.stdout.strip().splitlines()[-1] == "True"
    print(
        json.dumps(
            {"metric": "P2 CLI start", "runs": ns.runs, "rows": rows, "imports_tensorflow": imports_tf},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
