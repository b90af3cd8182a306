"""P7 SSH fan-out: `orchestrate up` on K lab hosts (K = 1, 2, 4, 8), one task per host.

Launch time = from starting `orchestrate up` to the last task process running on its host (its
"pid … on …" event): CLI start, parallel connect + preflight, file sync, heartbeat tunnels, and one
shim per task. The task itself is trivial (no TensorFlow), so what is measured is the fan-out,
not TensorFlow's import. K = 1, measured in the same run, is the baseline; the file cache is warm
(one unmeasured run per host first), as for a researcher's second run. The machine's busy CPU time
until the last task started is recorded too: all "hosts" share this machine's cores, so the launch
cannot be faster than that CPU spread over them (on real hosts each has its own). Also: detection time of a
cut-off host (heartbeat_timeout_s = 3) on a 2-host MultiWorkerMirroredStrategy job.

Needs root (network namespaces) and openssh-server: `sudo .venv/bin/python scripts/bench/ssh_fanout.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import children_cpu_s, iso_to_s  # noqa: E402
from tests.lab import NetnsLab, can_netns, why_no_lab  # noqa: E402

TRIVIAL = "import worker\nworker.report(step=1)\n"
MWMS = """
import time
import tensorflow as tf
import worker
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
for i in range(1, 100000):
    step()
    worker.report(step=i)
    time.sleep(0.02)
"""


def spec_for(lab: NetnsLab, root: Path, hosts: list[int], script: str, **extra: object) -> Path:
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "job.py").write_text(script)
    data = {
        "name": "bench",
        "backend": "ssh",
        "hosts": [lab.host_spec(i) for i in hosts],
        "job": {"script": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, "stop_grace_s": 5},
        "restart": {"max_restarts": 1, "backoff_s": 0.5},
        "ssh": lab.ssh_spec(),
        **extra,
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def busy_cpu_s() -> float:
    """CPU time the whole machine has spent busy (all processes, every namespace's sshd and
    Python included): /proc/stat, less idle and iowait."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def launch_time(lab: NetnsLab, root: Path, k: int) -> tuple[float, float, float, float]:
    """(launch time, total wall, machine CPU seconds until the last task started, the
    coordinator's own CPU seconds for the whole run) of one `orchestrate up` on hosts 0..k-1."""
    run_dir = root / f"run-{secrets.token_hex(3)}"
    spec = spec_for(lab, root, list(range(k)), TRIVIAL)
    cpu_at_start = busy_cpu_s()
    cpu_samples: list[tuple[float, float]] = []
    sampling = threading.Event()

    def sample() -> None:  # the machine's CPU over time, to read it off at the launch's end
        while not sampling.is_set():
            cpu_samples.append((time.time(), busy_cpu_s() - cpu_at_start))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    coordinator_before = children_cpu_s()  # the ssh backend's coordinator has no local children
    t0 = time.time()
    sampler.start()
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    total = time.time() - t0
    coordinator = children_cpu_s() - coordinator_before
    sampling.set()
    sampler.join()
    if res.returncode != 0:
        raise RuntimeError(f"K={k}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    started = [iso_to_s(e["time"]) for e in events if e.get("new") == "STARTING" and e.get("attempt") == 0]
    assert len(started) == k, events
    launched = max(started)
    cpu = next((c for t, c in cpu_samples if t >= launched), cpu_samples[-1][1])
    return launched - t0, total, cpu, coordinator


def cut_detection(lab: NetnsLab, root: Path) -> float:
    run_dir = root / f"run-{secrets.token_hex(3)}"
    spec = spec_for(lab, root, [0, 1], MWMS)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def state() -> dict:
        try:
            return json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = state()
            if s.get("state") == "RUNNING" and min((t.get("last_step") or 0) for t in s["tasks"]) >= 20:
                break
            time.sleep(0.1)
        lab.cut(1)
        cut_at = time.monotonic()
        while time.monotonic() < cut_at + 30 and state().get("state") == "RUNNING":
            time.sleep(0.02)
        return time.monotonic() - cut_at
    finally:
        lab.restore(1)
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if why_no_lab() or not can_netns():
        reason = why_no_lab() or "network namespaces need root"
        print(json.dumps({"metric": "P7 ssh fan-out", "skipped": reason}))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-ssh-") as tmp:
        root = Path(tmp)
        lab = NetnsLab(root / "lab", 8)
        try:
            launch_time(lab, root / "warm", 8)  # fills every host's file cache; not measured
            ks = (1, 2, 4, 8)
            runs: dict[int, list[tuple[float, float, float, float]]] = {k: [] for k in ks}
            for _ in range(args.repeats):
                for k in ks:  # interleaved, so drift on a noisy machine hits every K alike
                    runs[k].append(launch_time(lab, root / f"k{k}", k))
            base = statistics.median(r[0] for r in runs[1])
            cores = os.cpu_count() or 1
            rows = []
            for k in ks:
                launch = statistics.median(r[0] for r in runs[k])
                total = statistics.median(r[1] for r in runs[k])
                cpu = statistics.median(r[2] for r in runs[k])
                coordinator = statistics.median(r[3] for r in runs[k])
                rows.append(
                    {
                        "hosts": k,
                        "launch_s": round(launch, 2),
                        "ratio": round(launch / base, 3),
                        "total_s": round(total, 2),
                        # every host's work runs on this machine's cores: the launch cannot take
                        # less than the CPU it needs spread over all of them
                        "machine_cpu_s": round(cpu, 2),
                        "cpu_bound_floor_s": round(cpu / cores, 2),
                        # what stays on the coordinator's machine when hosts are real machines
                        "coordinator_cpu_s": round(coordinator, 2),
                    }
                )
            detect = [cut_detection(lab, root / f"cut{i}") for i in range(args.repeats)]
            result = {
                "metric": "P7 ssh fan-out",
                "runs": args.repeats,
                "rows": rows,
                "cut_off_detected_s": round(statistics.median(detect), 2),
                "cut_off_runs_s": [round(d, 2) for d in detect],
                "heartbeat_timeout_s": 3,
            }
            print(json.dumps(result, indent=2))
        finally:
            lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
