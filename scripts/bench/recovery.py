"""P4/P5: detection latency per detector against its configured value, recovery time (kill ->
first step after resume) as a ratio to the bare TensorFlow import time measured in the same run,
and steps lost per failure against checkpoint_every. Each figure is the median of several runs,
with warm standbys (restart.standby: on, the default's choice here) and without (off), the two
interleaved; with them, the standbys have imported TensorFlow before the failure.

Detectors: process exit (kill -9 of a worker), heartbeat timeout (SIGSTOP of a worker), stall (a
worker alive but stuck in Python). Latency = signal sent -> the run's STOPPING event. Recovery
after a SIGSTOP or a stall is also given from the failure noticed (detection excluded), with the
restart's timeline (the `recovery` event's phases). Also: attempt 0's steps/s with its standbys
importing and then waiting, against none (P3's question), and a standby's RSS.

`--backend ssh`: the same on two hosts of a network-namespace lab (tests/lab.py: each host its
own network, hostname and disk; needs root and openssh-server), a worker on each; the digits
model is widened so that its checkpoint (weights and Adam's slots) is ~1 MB, copied from the
chief's host to the other's on the way to the next attempt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import recovery_jobs
import yaml
from common import (
    REPO,
    events,
    first_step_of_attempt,
    iso_to_s,
    median,
    start_up,
    status,
    tmpdir,
    wait_for,
    write_spec,
)

sys.path.insert(0, str(REPO))
from tests.lab import NetnsLab, can_netns, why_no_lab  # noqa: E402
from tests.slurm_lab import SlurmLab, why_no_slurm  # noqa: E402

LOOP_SPEC = """\
name: bench-recovery
job:
  loop: job/train.py
  env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}
train: {{steps: 100000, global_batch_size: 64, checkpoint_every: {every}}}
health: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: {hb}, stall_timeout_s: {stall}}}
restart: {{max_restarts: 1, backoff_s: 0, standby: {standby}}}
"""
LOCAL_HOSTS = "hosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\n"

# The loop module: examples/digits_loop.py (copied beside it, with its data), widened on ssh (a ~1
# MB checkpoint), and for a stall one whose worker-1 sticks in Python once the flag file exists.
MODULE = """
import os, time
from pathlib import Path
import tensorflow as tf
import worker
__file__ = str(Path(__file__).with_name("digits_loop.py"))  # it finds its data beside itself
exec(open(__file__).read())
if {hidden}:
    def build_model():
        return tf.keras.Sequential([
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense({hidden}, activation="relu"),
            tf.keras.layers.Dense(10),
        ])
_make = make_dataset
def make_dataset(ctx, gbs):
    ds = _make(ctx, gbs).repeat()
    if {stuck} and os.environ["ORCHESTRATE_TASK"] == "worker-1" and os.environ["ORCHESTRATE_ATTEMPT"] == "0":
        def stick(x, y):
            def wait(v):
                if os.path.exists({flag!r}):
                    while True:
                        time.sleep(0.1)     # alive, heartbeats flowing, stuck in Python
                return v
            return tf.py_function(wait, [x], tf.float32), y
        ds = ds.map(stick)
    return ds
"""
HIDDEN_SSH = 1200  # (64·1200 + 1200 + 1200·10 + 10) parameters × 3 (Adam) × 4 bytes ≈ 1.1 MB


def _job_folder(folder: Path, kind: str, flag: Path, hidden: int) -> None:
    job = folder / "job"
    (job / "data").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "digits_loop.py", job / "digits_loop.py")
    shutil.copy(REPO / "examples" / "data" / "digits.npz", job / "data" / "digits.npz")
    (job / "train.py").write_text(MODULE.format(hidden=hidden, stuck=kind == "stall", flag=str(flag)))


@dataclass(frozen=True)
class Where:
    """Where the job runs: the spec's lines for it, the environment `orchestrate up` needs, a
    folder every task sees at the same path (for the stall's flag), and the model's width."""

    spec: str = LOCAL_HOSTS
    env: dict[str, str] | None = None
    seen: Path | None = None  # None: this machine's own folders
    hidden: int = 0


def ssh_lab(lab: NetnsLab) -> Where:
    hosts = {"backend": "ssh", "hosts": [lab.host_spec(0), lab.host_spec(1)], "ssh": lab.ssh_spec()}
    return Where(yaml.safe_dump(hosts), None, lab.shared, HIDDEN_SSH)


def slurm_lab(lab: SlurmLab) -> Where:
    """Two nodes of the Slurm lab, a worker on each; the run's folder on the nodes' shared file
    system (as this machine's), their /tmp each their own: the checkpoints are not copied."""
    slurm = {"nodes": 2, "tasks_per_node": {"worker": 1}, "queue_timeout_s": 60, "connect_timeout_s": 10}
    return Where(yaml.safe_dump({"backend": "slurm", "slurm": slurm}), lab.env(), None, HIDDEN_SSH)


def one_run(
    kind: str, standby: str, where: Where, every: int = 50, hb: float = 3.0, stall: float = 5.0
) -> dict:
    folder = tmpdir()
    # the flag file: where worker-1 looks, on its own host
    flag = (where.seen or folder) / f"stick-now-{secrets.token_hex(4)}"
    _job_folder(folder, kind, flag, where.hidden)
    text = LOOP_SPEC.format(every=every, hb=hb, stall=stall, standby=standby) + where.spec
    spec = write_spec(folder, text)
    run = folder / "run"
    proc = start_up(spec, run, where.env)
    rss = 0
    try:
        wait_for(lambda: ((status(run).get("tasks") or [{}])[-1].get("last_step") or 0) >= 120, 120)
        if standby == "on":  # a failure mid-training meets standbys that have imported TensorFlow
            wait_for(lambda: [s["state"] for s in status(run).get("standbys", [])] == ["ready", "ready"], 120)
            rss = max(s["rss_bytes"] or 0 for s in status(run)["standbys"])
        victim = status(run)["tasks"][1]["pid"]
        t0 = time.time()
        if kind == "exit":
            os.kill(victim, signal.SIGKILL)
        elif kind == "heartbeat":
            os.kill(victim, signal.SIGSTOP)
        else:
            flag.write_text("now")
        wait_for(lambda: any(e.get("new") == "STOPPING" for e in events(run)), 120)
        noticed = next(iso_to_s(e["time"]) for e in events(run) if e.get("new") == "STOPPING")
        wait_for(lambda: first_step_of_attempt(run, 1) is not None, 180)
        first, resumed = first_step_of_attempt(run, 1)
        wait_for(lambda: any(e["kind"] == "recovery" for e in events(run)), 30)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    points = _points(run)
    # trained before the failure (the last step attempt 0 reported) and not in the checkpoint resumed
    trained = max(p["step"] for p in points if p["attempt"] == 0)
    recovery = next(e for e in events(run) if e["kind"] == "recovery")
    return {
        "detected_s": noticed - t0,
        "recovery_s": first - t0,
        "from_noticed_s": first - noticed,
        "steps_lost": max(0, trained - (resumed - 1)),
        "steps_per_s": _rate(points, 20, 120),
        "standby_rss_mib": rss / 2**20,
        "phases_s": recovery["phases_s"],
        "line": recovery["reason"],
    }


def _rate(points: list[dict], lo: int, hi: int) -> float:
    """Attempt 0's steps per second between steps lo and hi (the chief's points)."""
    times = {p["step"]: iso_to_s(p["time"]) for p in points if p["attempt"] == 0 and p["task"] == "worker-0"}
    return (hi - lo) / (times[hi] - times[lo])


def _points(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def tf_import_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tensorflow"], check=True, capture_output=True)
    return time.perf_counter() - t0


def _kind(kind: str, runs_each: int, where: Where, imports: list[float]) -> dict:
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(runs_each):  # interleaved: the machine's drift falls on both alike
        imports.append(tf_import_s())
        for standby in ("on", "off"):
            runs[standby].append(one_run(kind, standby, where))
    out = {}
    for standby, done in runs.items():
        numbers = [k for k, v in done[0].items() if isinstance(v, (int, float))]
        summary = {k: round(median([r[k] for r in done]), 3) for k in numbers}
        phases = {p: round(median([r["phases_s"][p] or 0.0 for r in done]), 3) for p in done[0]["phases_s"]}
        out[standby] = summary | {"phases_s": phases, "runs": done}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", default="exit,heartbeat,stall")
    parser.add_argument("--backend", choices=("local", "ssh", "slurm"), default="local")
    parser.add_argument("--jobs", help="P5 per kind of job instead: loop,loop-py,fit-py,ps-py")
    parser.add_argument("--first-steps", type=int, metavar="K", help="--jobs: first steps, K kills a run")
    ns = parser.parse_args()
    out: dict = {
        "backend": ns.backend,
        "configured": {
            "heartbeat_timeout_s": 3.0,
            "stall_timeout_s": 5.0,
            "checkpoint_every": recovery_jobs.CHECKPOINT_EVERY if ns.jobs else 50,
        },
    }
    imports: list[float] = []
    with contextlib.ExitStack() as labs:
        where = Where()
        if ns.backend == "ssh":
            if why_no_lab() or not can_netns():
                sys.exit(f"--backend ssh needs root and sshd: {why_no_lab() or 'not root'}")
            lab = NetnsLab(tmpdir() / "lab", 2)
            labs.callback(lab.close)
            where = ssh_lab(lab)
        elif ns.backend == "slurm":
            if why_no_slurm():
                sys.exit(f"--backend slurm: {why_no_slurm()}")
            base = tmpdir()  # every run's folder in it: on the nodes' shared file system
            labs.callback(shutil.rmtree, base, ignore_errors=True)
            cluster = labs.enter_context(SlurmLab(nodes=2, shared=[base]))  # its folder not in base (0700)
            tempfile.tempdir = str(base)
            cluster.wait_ready(timeout_s=30)
            where = slurm_lab(cluster)
        if ns.jobs and ns.first_steps:
            steps = recovery_jobs.first_steps(ns.jobs.split(","), ns.first_steps, ns.runs, where)
            print(json.dumps(out | steps, indent=2))
            return
        if ns.jobs:
            table = recovery_jobs.table(ns.jobs.split(","), ns.runs, where, tf_import_s)
            print(json.dumps(out | table, indent=2))
            return
        for kind in ns.kinds.split(","):
            out[kind] = _kind(kind, ns.runs, where, imports)
    out["tf_import_s"] = round(median(imports), 3)
    for kind in ns.kinds.split(","):
        for standby in ("on", "off"):
            r = out[kind][standby]
            r["ratio_to_import"] = round(r["recovery_s"] / out["tf_import_s"], 2)
            r["noticed_ratio_to_import"] = round(r["from_noticed_s"] / out["tf_import_s"], 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
