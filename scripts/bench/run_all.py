"""Run every benchmark (docs/architecture.md §9, P1-P8; P9 state across hosts; P10 what a researcher sees; P11
the run's page against a stranger holding its connections),
print one table, keep the figures.

Each benchmark is its own script (runnable alone) that prints one JSON document; this runs them
one after another (never side by side: they would measure each other), writes everything to
bench-results/<time>.json and the table to bench-results/<time>.md (docs/benchmarks.md holds the
latest one).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]

# name, script, arguments (full, --quick)
PLAN = [
    ("P2", "cli_start.py", (["--runs", "7"], ["--runs", "3"])),
    ("P1", "launch.py", (["--runs", "3"], ["--runs", "1"])),
    ("P3", "report_overhead.py", (["--runs", "5", "--steps", "1000"], ["--runs", "1", "--steps", "300"])),
    ("P4/P5", "recovery.py", (["--runs", "3"], ["--runs", "1"])),
    ("P6", "capacity.py", ([], ["--cases", "whole:relayed:1000", "relay:direct:8", "--measure-s", "8"])),
    ("P7", "ssh_fanout.py", (["--repeats", "3"], ["--repeats", "1"])),
    ("P9", "ship_state.py", (["--repeats", "2"], ["--repeats", "1", "--quick"])),
    ("P12", "own_checkpoints.py", (["--repeats", "2"], ["--repeats", "1", "--quick"])),
    ("P8", "slurm_launch.py", (["--rounds", "5"], ["--rounds", "1"])),
    ("P10", "researcher_view.py", (["--kills", "5"], ["--kills", "2", "--measure-s", "8"])),
    ("P11", "web_strangers.py", (["--measure-s", "10"], ["--measure-s", "3"])),
]


def run_one(script: str, args: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, cwd=BENCH
    )
    took = round(time.monotonic() - t0, 1)
    text = res.stdout
    start = text.find("{")
    if res.returncode != 0 or start < 0:
        return {"error": f"exit {res.returncode}", "tail": (res.stdout + res.stderr)[-1500:], "took_s": took}
    data = json.loads(text[start:])
    data["took_s"] = took
    return data


def table(results: dict[str, dict[str, Any]]) -> str:
    out = ["| metric | measured | baseline / goal |", "|---|---|---|"]
    p2 = results.get("P2", {})
    if "rows" in p2:
        rows = {r["command"]: r for r in p2["rows"]}
        py = rows["python -c pass"]["median_s"]
        for cmd in ("orchestrate validate", "orchestrate plan"):
            out.append(
                f"| P2 `{cmd}` start | {rows[cmd]['median_s']:.3f} s | `python -c pass` {py:.3f} s; "
                f"goal ≤ 0.3 s; imports TensorFlow: {'yes' if p2.get('imports_tensorflow') else 'no'} |"
            )
    p1 = results.get("P1", {})
    for r in p1.get("rows", []):
        out.append(
            f"| P1 launch, {r['launcher']} | first step {r['first_step_s']:.2f} s "
            f"(×{r['first_step_ratio']:.2f}), total {r['total_s']:.2f} s (×{r['total_ratio']:.2f}) "
            "| floor = bare Popen; goal ≤ ×1.10 |"
        )
    if p1.get("skipped"):
        out.append(f"| P1 multi_process_runner | skipped | {p1['skipped']} |")
    p3 = results.get("P3", {})
    if "ratio_median" in p3:
        on, off = median(p3["on_steps_per_s"]), median(p3["off_steps_per_s"])
        out.append(
            f"| P3 steps/s, heartbeats + per-step report on / off | ×{p3['ratio_median']:.3f} "
            f"({on:.0f} vs {off:.0f} steps/s; median of pair ratios "
            f"×{p3.get('pair_ratio_median', float('nan')):.3f}) | goal ≥ ×0.98 |"
        )
    if "cpu_ratio_median" in p3:
        on, off = median(p3["cpu_ms_per_step_on"]), median(p3["cpu_ms_per_step_off"])
        out.append(
            f"| P3 workers' CPU per step, on / off | ×{p3['cpu_ratio_median']:.3f} (median of pair "
            f"ratios; {on:.2f} vs {off:.2f} ms); coordinator "
            f"{100 * p3['coordinator_cpu_share_median']:.1f}% of a core over the run, start-up included "
            "| goal ≤ ×1.02 (= steps/s ≥ ×0.98) |"
        )
    if "api_cost" in p3:
        c = p3["api_cost"]
        out.append(
            f"| P3 reporting's cost, in-process | `worker.report()` {c['report_call_us']:.1f} µs a call, "
            f"a heartbeat {c['heartbeat_ms']:.2f} ms: {100 * c['share_of_task_time']:.2f}% of a task's "
            "time at the job's step rate | goal ≤ 2% |"
        )
    p45 = results.get("P4/P5", {})
    if "exit" in p45:
        cfg = p45["configured"]
        names = {
            "exit": "kill -9 (exit)",
            "heartbeat": "SIGSTOP (heartbeat)",
            "stall": "stuck in Python (stall)",
        }
        limits = {
            "exit": "0.1 s poll",
            "heartbeat": f"timeout {cfg['heartbeat_timeout_s']:g} s",
            "stall": f"stall {cfg['stall_timeout_s']:g} s",
        }
        for kind, label in names.items():
            r = p45[kind]["on"]
            out.append(f"| P4 detection, {label} | {r['detected_s']:.2f} s | configured {limits[kind]} |")
        for kind, label in names.items():
            for standby in ("on", "off"):
                r = p45[kind][standby]
                said = "warm standbys" if standby == "on" else "no standbys"
                out.append(
                    f"| P5 recovery after {label}, {said} | first step after resume {r['recovery_s']:.2f} s "
                    f"(×{r['ratio_to_import']:.2f} of an import; from the failure noticed "
                    f"{r['from_noticed_s']:.2f} s, ×{r['noticed_ratio_to_import']:.2f}), "
                    f"{r['steps_lost']:.0f} steps lost | `import tensorflow` {p45['tf_import_s']:.2f} s; "
                    f"goal ≤ ×1.0 on local |"
                )
    p6 = results.get("P6", {})
    for r in p6.get("results", []):
        if r["coordinator"] == "one host's relay":
            what = f"P6 relay on a host, {r['tasks']} tasks × 1 Hz"
            goal = "its host's cost (per-host relay, ssh backend)"
        else:
            arrival = (
                "one request per task"
                if r["arrival"] == "direct"
                else "batched by host relays (8 tasks each)"
            )
            what = f"P6 {r['coordinator']}, {r['tasks']:,} tasks × 1 Hz, {arrival}"
            goal = "goal at 1,000: ≤ 10%, p99 ≤ 5 ms"
        share, kernel = 100 * r["coordinator_cpu_share"], 100 * r["of_which_kernel"]
        out.append(
            f"| {what} | {share:.1f}% of a core ({kernel:.1f}% kernel), p50 {r['p50_ms']} ms, "
            f"p99 {r['p99_ms']} ms, {r['heartbeats_per_s']:.0f} heartbeats/s taken in "
            f"{r['requests_per_s']:.0f} requests/s, {r['errors']} errors | {goal} |"
        )
    p7 = results.get("P7", {})
    for r in p7.get("rows", []):
        floor = (
            f"; machine CPU {r['machine_cpu_s']:.2f} s = {r['cpu_bound_floor_s']:.2f} s on all cores; "
            f"coordinator CPU {r['coordinator_cpu_s']:.2f} s"
            if "coordinator_cpu_s" in r
            else ""
        )
        out.append(
            f"| P7 ssh launch, {r['hosts']} host(s) | {r['launch_s']:.2f} s (×{r['ratio']:.2f}{floor}) "
            "| K = 1 baseline; goal K=8 ≤ ×1.5 |"
        )
    if "cut_off_detected_s" in p7:
        out.append(
            f"| P4 detection, host cut off (ssh) | {p7['cut_off_detected_s']:.2f} s "
            f"| heartbeat_timeout_s {p7['heartbeat_timeout_s']} |"
        )
    if p7.get("skipped"):
        out.append(f"| P7 ssh fan-out | skipped | {p7['skipped']} |")
    p9 = results.get("P9", {})
    for r in p9.get("rows", []):
        out.append(
            f"| P9 restart, chief's checkpoint copied, {r['model']} model, {r['hosts']} hosts | "
            f"{r['restart_copied_s']:.2f} s (×{r['ratio']:.2f}; the copy {r['copy_s']:.2f} s); results "
            f"home {r['home_s']:.2f} s | same restart with a shared folder {r['restart_shared_s']:.2f} s |"
        )
    for every, r in (p9.get("steps_lost") or {}).items():
        out.append(
            f"| P9 steps lost per kill -9, separate disks | median {r['median']:g}, max {r['max']} "
            f"| checkpoint_every {every} |"
        )
    if p9.get("skipped"):
        out.append(f"| P9 state across hosts | skipped | {p9['skipped']} |")
    p12 = results.get("P12", {})
    for r in p12.get("rows", []):
        out.append(
            f"| P12 restart, a job's own folder copied, {r['model']} model, {r['hosts']} hosts | "
            f"{r['restart_copied_s']:.2f} s (×{r['ratio']:.2f}; the copy {r['copy_s']:.2f} s) | same "
            f"restart with the folder shared {r['restart_shared_s']:.2f} s "
            f"(the nonce check {r['copy_shared_s']:.2f} s) |"
        )
    if p12.get("skipped"):
        out.append(f"| P12 a job's own folder | skipped | {p12['skipped']} |")
    p8 = results.get("P8", {})
    if "ratio" in p8:
        out.append(
            f"| P8 Slurm launch, 2 nodes, up → first step | {p8['orchestrate_first_step_s']:.2f} s "
            f"(×{p8['ratio']:.2f}) | bare srun, TF_CONFIG by hand {p8['floor_first_step_s']:.2f} s; "
            "goal ≤ ×1.15 |"
        )
        out.append(
            f"| P4 detection, Slurm node cut off | {p8['lost_detected_s']:.2f} s "
            f"| Slurm's own NODE_FAIL {p8['slurm_node_down_s']:.1f} s (SlurmdTimeout 20 s) |"
        )
    if p8.get("skipped"):
        out.append(f"| P8 Slurm launch | skipped | {p8['skipped']} |")
    p10 = results.get("P10", {})
    if "cause_on_screen_s" in p10:
        page = p10["page"]
        out.append(
            f"| P10 kill -9 → its cause on the console | {p10['cause_on_screen_s']:.2f} s "
            f"(max {p10['cause_on_screen_max_s']:.2f} s); the restart's line {p10['restart_line_s']:.2f} s "
            "| the live view's events pane: the same event, next refresh (≤ 0.25 s) |"
        )
        out.append(
            f"| P10 one open page (1 Hz), {page['tasks']} tasks "
            f"| coordinator {page['cpu_share_one_page']:.1%} of a core vs {page['cpu_share_no_page']:.1%} "
            f"with none; page p99 {page['page_p99_ms']} ms "
            "| 1,000 tasks: `capacity.py --pages 1` |"
        )
    for case, r in results.get("P11", {}).get("results", {}).items():
        if "ratio_to_alone" in r:
            out.append(
                f"| P11 the page's owner, {case} | {r['answered_per_s']:.0f} requests/s answered "
                f"(×{r['ratio_to_alone']:.2f} of alone), {r['failed']} failed, p99 {r['p99_ms']} ms "
                "| before issue 22: 0 answered |"
            )
    for name, r in results.items():
        if "error" in r:
            out.append(f"| {name} | FAILED ({r['error']}) | see the JSON |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one run each (a smoke test, not figures)")
    parser.add_argument("--only", nargs="*", help="e.g. P1 P6")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    ns = parser.parse_args()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for name, script, (full, quick) in PLAN:
        if ns.only and name not in ns.only and not any(o in name.split("/") for o in ns.only):
            continue
        print(f"bench: {name} ({script}) …", file=sys.stderr, flush=True)
        results[name] = run_one(script, quick if ns.quick else full)
        print(f"bench: {name} done in {results[name]['took_s']} s", file=sys.stderr, flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    header = (
        f"Measured {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} on {machine} "
        f"(`scripts/bench/run{' --quick' if ns.quick else ''}`, {time.monotonic() - started:.0f} s in all)"
    )
    text = header + "\n\n" + table(results) + "\n"
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / f"{stamp}.json").write_text(json.dumps({"header": header, "results": results}, indent=2))
    (ns.out / f"{stamp}.md").write_text(text)
    print(text)
    print(f"(figures: {ns.out / (stamp + '.json')})")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
