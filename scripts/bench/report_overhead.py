"""P3: training steps/s with heartbeats and per-step reporting on (orchestrate up, worker.report
every step) vs off (a bare Popen launcher, the same job without the reporting API), alternated
A/B, median of the runs. Goal: ratio >= 0.98.
"""

from __future__ import annotations

import argparse
import json

from common import BENCH, bare_launch, median, orchestrate_up, tmpdir, value, write_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    ns = parser.parse_args()
    job = BENCH / "steps_job.py"
    on, off = [], []
    for _ in range(ns.runs):
        folder = tmpdir()
        spec = write_spec(
            folder,
            f"""\
            name: bench-steps
            hosts: [{{address: 127.0.0.1, tasks: {{worker: 2}}}}]
            job:
              script: {job}
              args: ["--report", "--steps", "{ns.steps}"]
              env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}
            """,
        )
        out = orchestrate_up(spec, folder / "run")
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:])
        on.append(value(out.stdout, "steps_per_s"))
        off.append(value(bare_launch(job, ["--steps", str(ns.steps)])[0], "steps_per_s"))
    result = {
        "metric": "P3 steps/s, reporting on vs off",
        "on_steps_per_s": on,
        "off_steps_per_s": off,
        "ratio_median": round(median(on) / median(off), 3),
        # each on/off pair ran back to back: the median of their ratios resists the machine's drift
        "pair_ratio_median": round(median([a / b for a, b in zip(on, off, strict=True)]), 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
