"""P8 Slurm launch, on a real Slurm cluster built on this machine (tests/slurm_lab.py: slurmctld and
three slurmd nodes in namespaces of their own). Needs root and slurm-wlm + munge (.ci/run installs them):
`sudo .venv/bin/python scripts/bench/slurm_launch.py`.

- Launch: the same 2-node MWMS job (launch_job.py, one task per node), alternated, median of
  start → first finished step on worker 0:
  - floor: one bare `srun -N2 --ntasks-per-node=1` (it allocates, as `up` does) whose tasks build
    TF_CONFIG by hand from SLURM_PROCID and ports fixed beforehand — what a person scripts;
  - orchestrate: `orchestrate up` of a slurm spec (CLI start, cluster check, salloc, a probe step
    per node, one step per task under the shim, heartbeats, supervision). Goal: <= 1.15x the floor.
- Detection of a lost node: a 2-node job (no TensorFlow, heartbeat_timeout_s = 3), one node's link
  cut; the time until orchestrate marks its task LOST, and until Slurm itself marks the node down
  (its NODE_FAIL; SlurmdTimeout = 20 s in the lab, 300 s by default), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import iso_to_s  # noqa: E402
from tests.slurm_lab import SlurmLab, why_no_slurm  # noqa: E402

BENCH = Path(__file__).resolve().parent
JOB = BENCH / "launch_job.py"
PLAIN = "import time, worker\nfor i in range(1, 100000):\n    worker.report(step=i)\n    time.sleep(0.05)\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def first_step(text: str) -> float:
    for line in text.splitlines():
        if "first_step_wall=" in line:
            return float(line.split("first_step_wall=")[1])
    raise SystemExit(f"no first step in:\n{text[-3000:]}")


def floor(lab: SlurmLab) -> float:
    ports = [free_port(), free_port()]
    workers = [f"{lab.node(n).address}:{p}" for n, p in zip(("n1", "n2"), ports, strict=True)]
    cluster = json.dumps({"worker": workers})
    # each task makes its own TF_CONFIG from its rank, as a hand-written sbatch script does
    config = f'{{"cluster": {cluster}, "task": {{"type": "worker", "index": ' + "'$SLURM_PROCID'}}"
    script = f"export TF_CONFIG='{config}'; exec {sys.executable} {JOB}"
    env = {**lab.env(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    t0 = time.time()
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "-w", "n1,n2", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    return first_step(out.stdout) - t0


def write_spec(folder: Path, slurm: dict, job: dict, **extra: object) -> Path:
    spec = {"name": "bench-slurm", "backend": "slurm", "slurm": slurm, "job": job, **extra}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def orchestrate(lab: SlurmLab) -> float:
    folder = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    spec = write_spec(
        folder,
        {"nodes": 2, "tasks_per_node": {"worker": 1}},
        {"script": str(JOB), "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
    )
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(folder / "run"), "--plain"],
        capture_output=True,
        text=True,
        timeout=300,
        env=lab.env(),
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    return first_step((folder / "run" / "logs" / "worker-0.log").read_text()) - t0


def detection(lab: SlurmLab) -> tuple[float, float]:
    """(orchestrate's LOST, Slurm's node down), seconds after the cut."""
    folder = Path(tempfile.mkdtemp(prefix="bench-slurm-cut-"))
    (folder / "job.py").write_text(PLAIN)
    spec = write_spec(
        folder,
        {"nodes": 2, "tasks_per_node": {"worker": 1}},
        {"script": "job.py"},
        health={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, "stop_grace_s": 2},
        restart={"max_restarts": 0},
    )
    run = folder / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run), "--plain"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=lab.env(),
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                tasks = json.loads((run / "status.json").read_text())["tasks"]
                if all((t.get("last_step") or 0) > 3 for t in tasks):
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        cut_at = time.time()
        lab.cut("n2")
        slurm_down = None
        while time.time() < cut_at + 120 and slurm_down is None:
            if lab.node_states().get("n2", "").startswith("down"):
                slurm_down = time.time() - cut_at
            time.sleep(0.2)
        proc.wait(timeout=120)
        events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
        lost = next(e for e in events if e.get("new") == "LOST")
        return iso_to_s(lost["time"]) - cut_at, slurm_down or float("nan")
    finally:
        proc.kill()
        lab.restore("n2")
        lab.rejoin("n2", timeout_s=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    why = why_no_slurm()
    if why is not None:
        print(json.dumps({"metric": "P8 Slurm launch", "skipped": why}))
        return 0
    base = Path(tempfile.mkdtemp(prefix="bench-slurm-"))  # the runs' folders: the nodes' shared file system
    try:
        with SlurmLab(nodes=3, shared=[base]) as lab:  # its own folder beside (munged cannot pass a 0700 one)
            tempfile.tempdir = str(base)
            lab.wait_ready()
            floor(lab), orchestrate(lab)  # warm: the page cache, Slurm's first job
            bare, ours = [], []
            for _ in range(args.rounds):
                bare.append(floor(lab))
                ours.append(orchestrate(lab))
            lost_s, slurm_s = detection(lab)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = {
        "floor_first_step_s": statistics.median(bare),
        "orchestrate_first_step_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(bare),
        "floor_all": bare,
        "orchestrate_all": ours,
        "lost_detected_s": lost_s,
        "slurm_node_down_s": slurm_s,
    }
    print(
        f"P8 Slurm launch, 2 nodes, median of {args.rounds}: bare srun {result['floor_first_step_s']:.2f} s, "
        f"orchestrate up {result['orchestrate_first_step_s']:.2f} s → {result['ratio']:.2f}x (goal <= 1.15x)"
    )
    print(
        f"   lost node: orchestrate LOST after {lost_s:.1f} s (heartbeat_timeout_s 3); "
        f"Slurm down after {slurm_s:.1f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))  # for run_all.py
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
