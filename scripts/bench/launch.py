"""P1 launch: the same 2-worker MWMS job (launch_job.py) started three ways, alternated, median:

- floor: a bare launcher — Popen of 2 workers with hand-made TF_CONFIG (what a person scripts);
- orchestrate: `orchestrate up` of a spec running that job (CLI start, validation, ports, heartbeat
  server, supervision included);
- multi_process_runner: TensorFlow's own test launcher (needs portpicker and dill; skipped if absent).

Per launcher: spawn -> first finished step (from the moment the launcher command is started) and
the total wall time until it returns. Goal: orchestrate <= 1.10x the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import BENCH, median, orchestrate_up, tmpdir, write_spec

JOB = BENCH / "launch_job.py"


def bare() -> tuple[float, float]:
    from common import bare_launch

    t0 = time.time()
    outs = bare_launch(JOB, [])
    total = time.time() - t0
    return _first_step(outs[0]) - t0, total


def orchestrate(extra: str = "") -> tuple[float, float]:
    """`extra`: spec lines added (scripts/bench/netns.py: `local: {isolate_network: off}`)."""
    folder = tmpdir()
    spec = write_spec(
        folder,
        f"""\
        name: bench-launch
        hosts: [{{address: 127.0.0.1, tasks: {{worker: 2}}}}]
        job:
          script: {JOB}
          env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}
        {extra}""",
    )
    t0 = time.time()
    out = orchestrate_up(spec, folder / "run")
    total = time.time() - t0
    if out.returncode != 0:
        raise SystemExit(out.stdout[-3000:])
    return _first_step((folder / "run" / "logs" / "worker-0.log").read_text()) - t0, total


def multi_process_runner() -> tuple[float, float]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    t0 = time.time()
    out = subprocess.run([str(BENCH / "mpr_launch")], capture_output=True, text=True, env=env, timeout=300)
    total = time.time() - t0
    if "[       OK ]" not in out.stdout + out.stderr:
        raise RuntimeError((out.stdout + out.stderr)[-2000:])
    return _first_step(out.stdout) - t0, total


def _first_step(text: str) -> float:
    for line in text.splitlines():
        if "first_step_wall=" in line:
            return float(line.rsplit("first_step_wall=", 1)[1].split()[0])
    raise ValueError(f"no first_step_wall in:\n{text[-2000:]}")


def mpr_available() -> str | None:
    try:
        import dill  # noqa: F401
        import portpicker  # noqa: F401
    except ImportError as exc:
        return f"multi_process_runner needs {exc.name} (pip install portpicker dill)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    launchers = {"floor (bare Popen)": bare, "orchestrate up": orchestrate}
    skipped = mpr_available()
    if skipped is None:
        launchers["multi_process_runner"] = multi_process_runner
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in launchers}
    for _ in range(ns.runs):
        for name, fn in launchers.items():  # alternated, so drift hits every launcher alike
            runs[name].append(fn())
    floor_first = median([f for f, _ in runs["floor (bare Popen)"]])
    floor_total = median([t for _, t in runs["floor (bare Popen)"]])
    rows = []
    for name, values in runs.items():
        first, total = median([f for f, _ in values]), median([t for _, t in values])
        rows.append(
            {
                "launcher": name,
                "first_step_s": round(first, 2),
                "first_step_ratio": round(first / floor_first, 3),
                # each launcher's run against the floor's run just before it: resists the drift
                "first_step_pair_ratio": round(
                    median(
                        [a / b for (a, _), (b, _) in zip(values, runs["floor (bare Popen)"], strict=True)]
                    ),
                    3,
                ),
                "total_s": round(total, 2),
                "total_ratio": round(total / floor_total, 3),
            }
        )
    print(json.dumps({"metric": "P1 launch", "runs": ns.runs, "rows": rows, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
