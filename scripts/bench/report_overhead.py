"""P3: training steps/s with heartbeats and per-step reporting on (orchestrate up, worker.report
every step) vs off (a bare Popen launcher, the same job without the reporting API), alternated
A/B, median of the runs. Goal: ratio >= 0.98.

Wall-clock steps/s on this shared 2-core machine swings by ±40% between identical runs, which
hides a 2% effect; so each run also reports the CPU time its worker processes spent per step
(both workers, all their threads; goal ≤ ×1.02, the same 2%) and the coordinator's CPU over the
run (start-up included). Both still drift with the machine; what does not is the cost measured
in-process: one worker.report() call and one heartbeat, which at the job's step rate bound what
reporting takes from a task (`api_cost.share_of_task_time`).

`--standbys`: P3 with warm standbys (issue 25): `orchestrate up` with `restart.standby: on` vs
`off`, back to back, reporting on in both. The standbys start once the job steps and import
TensorFlow at the lowest CPU priority while it trains, then wait; the run is long enough for
both (`--steps 2000` by default here). Goal: steps/s and CPU per step unchanged (the same 2%).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import (
    BENCH,
    REPO,
    bare_launch,
    children_cpu_s,
    median,
    orchestrate_up,
    tmpdir,
    value,
    values,
    write_spec,
)


def api_cost(calls: int = 20000, heartbeats: int = 300) -> dict[str, float]:
    """What reporting costs a task, measured in-process (no noise from other processes): one
    worker.report() call, and one heartbeat (build it, post it, the coordinator's answer)."""
    sys.path.insert(0, str(REPO))
    from orchestrator.health.credentials import Credentials
    from orchestrator.health.server import HeartbeatServer
    from orchestrator.health.store import HealthStore
    from worker.task.reporter import Reporter, ReporterConfig

    store = HealthStore(time.monotonic)
    store.reset(0, ["worker-0"])
    credentials = Credentials()
    credentials.place({"worker-0": 0})  # one host, as the local backend
    server = HeartbeatServer(store, credentials).start()
    try:
        token = credentials.task_token("worker-0", 0)  # the task's own, as its backend gives it
        rep = Reporter(
            ReporterConfig("worker-0", 0, server.url, token, interval_s=3600, coordinator_timeout_s=60)
        )
        t0 = time.perf_counter()
        for i in range(calls):
            rep.report(i, loss=0.5)
        report_us = 1e6 * (time.perf_counter() - t0) / calls
        rep._points.clear()
        t0 = time.perf_counter()
        for i in range(heartbeats):
            for j in range(10):  # ten steps reported since the last heartbeat
                rep.report(i * 10 + j, loss=0.5)
            body, _, _ = rep._snapshot()
            assert rep._post(body, urgent=False)[0] == 200
        heartbeat_ms = 1e3 * (time.perf_counter() - t0) / heartbeats - 10 * report_us / 1e3
    finally:
        server.close()
    return {"report_call_us": round(report_us, 2), "heartbeat_ms": round(heartbeat_ms, 3)}


def up_steps(steps: int, standby: str) -> tuple[float, float, float]:
    """One `orchestrate up` of the steps job, reporting on: (steps/s, workers' CPU ms per step,
    the coordinator's share of a core)."""
    folder = tmpdir()
    spec = write_spec(
        folder,
        f"""\
        name: bench-steps
        hosts: [{{address: 127.0.0.1, tasks: {{worker: 2}}}}]
        job:
          script: {BENCH / "steps_job.py"}
          args: ["--report", "--steps", "{steps}"]
          env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}
        restart: {{max_restarts: 1, standby: {standby}}}
        """,
    )
    before, t0 = children_cpu_s(), time.monotonic()
    out = orchestrate_up(spec, folder / "run")
    wall, whole_cpu = time.monotonic() - t0, children_cpu_s() - before  # coordinator + its tasks
    if out.returncode != 0:
        raise SystemExit(out.stdout[-3000:])
    if standby == "on" and "warm standbys started" not in (folder / "run" / "events.jsonl").read_text():
        raise SystemExit("standby: on, but no standby was started:\n" + out.stdout[-3000:])
    tasks_cpu = sum(values(out.stdout, "cpu_total_s"))
    return (
        value(out.stdout, "steps_per_s"),
        sum(values(out.stdout, "cpu_ms_per_step")),
        (whole_cpu - tasks_cpu) / wall,
    )


def with_standbys(runs: int, steps: int) -> dict:
    """P3's pair ratios, standbys on / off (each pair back to back, the order alternated)."""
    got: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}
    for i in range(runs):
        for standby in ("on", "off") if i % 2 == 0 else ("off", "on"):
            got[standby].append(up_steps(steps, standby))
    on, off = got["on"], got["off"]
    return {
        "metric": "P3 steps/s, warm standbys on vs off (reporting on in both)",
        "steps": steps,
        "on_steps_per_s": [r[0] for r in on],
        "off_steps_per_s": [r[0] for r in off],
        "pair_ratio_median": round(median([a[0] / b[0] for a, b in zip(on, off, strict=True)]), 3),
        "cpu_ms_per_step_on": [r[1] for r in on],
        "cpu_ms_per_step_off": [r[1] for r in off],
        "cpu_ratio_median": round(median([a[1] / b[1] for a, b in zip(on, off, strict=True)]), 3),
        # the coordinator's CPU, with its children that are not tasks: the standbys' imports
        "coordinator_and_standbys_cpu_share_on_off": [
            round(median([r[2] for r in on]), 4),
            round(median([r[2] for r in off]), 4),
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--standbys", action="store_true")
    ns = parser.parse_args()
    if ns.standbys:
        print(json.dumps(with_standbys(ns.runs, ns.steps or 2000), indent=2))
        return
    ns.steps = ns.steps or 600
    job = BENCH / "steps_job.py"
    on, off, cpu_on, cpu_off, coordinator_share = [], [], [], [], []
    for _ in range(ns.runs):
        # standbys off: their imports would count as the coordinator's CPU (`--standbys` measures them)
        steps_per_s, cpu_ms, share = up_steps(ns.steps, "off")
        on.append(steps_per_s)
        cpu_on.append(cpu_ms)
        coordinator_share.append(share)
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
    # the bound that noise cannot blur: reporting's cost per second of training, at the measured
    # rate, one heartbeat a second (the heartbeat thread's work, the coordinator's answer included)
    cost = api_cost()
    rate = median(on + off)
    cost["share_of_task_time"] = round((cost["report_call_us"] * rate / 1e6) + cost["heartbeat_ms"] / 1e3, 5)
    result["api_cost"] = cost
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
