"""P3: training steps/s with heartbeats and per-step reporting on (orchestrate up, worker.report
every step) vs off (a bare Popen launcher, the same job without the reporting API), alternated
A/B, median of the runs. Goal: ratio >= 0.98.

Wall-clock steps/s on this shared 2-core machine swings by ±40% between identical runs, which
hides a 2% effect; so each run also reports the CPU time its worker processes spent per step
(both workers, all their threads) and the coordinator's own CPU time: reporting costs what it
adds to the workers' CPU per step (goal: ≤ ×1.02, the same 2%), plus the coordinator's share.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from common import BENCH, bare_launch, median, orchestrate_up, tmpdir, value, values, write_spec


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    ns = parser.parse_args()
    job = BENCH / "steps_job.py"
    on, off, cpu_on, cpu_off, coordinator_share = [], [], [], [], []
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
        before, t0 = children_cpu_s(), time.monotonic()
        out = orchestrate_up(spec, folder / "run")
        wall, whole_cpu = time.monotonic() - t0, children_cpu_s() - before  # coordinator + its tasks
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:])
        on.append(value(out.stdout, "steps_per_s"))
        cpu_on.append(sum(values(out.stdout, "cpu_ms_per_step")))
        tasks_cpu = sum(values(out.stdout, "cpu_total_s"))
        coordinator_share.append((whole_cpu - tasks_cpu) / wall)
        bare = bare_launch(job, ["--steps", str(ns.steps)])
        off.append(value(bare[0], "steps_per_s"))
        cpu_off.append(sum(value(text, "cpu_ms_per_step") for text in bare))
    result = {
        "metric": "P3 steps/s, reporting on vs off",
        "on_steps_per_s": on,
        "off_steps_per_s": off,
        "ratio_median": round(median(on) / median(off), 3),
        # each on/off pair ran back to back: the median of their ratios resists the machine's drift
        "pair_ratio_median": round(median([a / b for a, b in zip(on, off, strict=True)]), 3),
        "cpu_ms_per_step_on": cpu_on,
        "cpu_ms_per_step_off": cpu_off,
        # workers' CPU per step, on / off, each pair back to back: > 1 is what reporting adds
        "cpu_ratio_median": round(median([a / b for a, b in zip(cpu_on, cpu_off, strict=True)]), 3),
        "coordinator_cpu_share_median": round(median(coordinator_share), 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
