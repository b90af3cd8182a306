"""P9 state on hosts that share no disk (issue 11): what shipping the chief's checkpoint costs.

On the network-namespace lab (each host its own disk, tests/lab.py), a MultiWorkerMirroredStrategy
job on K hosts (one worker each) with the built-in loop; worker-1 is killed with SIGKILL after a
checkpoint. Restart time = the kill → the first step of attempt 1 (metrics.jsonl), which includes
the copy of the chief's checkpoint to the other hosts. The baseline, measured in the same run, is
the same job with the checkpoint folder declared shared (the lab's shared folder, as an NFS
mount: nothing is copied). Models of ~1 MB and ~100 MB (checkpoint size; SGD, so the checkpoint is
the weights), K = 2 and 4. Also: the copy itself (LAUNCHING → first task started, attempt 1),
the time to bring results home at the end, and steps lost per kill -9 against checkpoint_every.

Needs root and openssh-server: `sudo .venv/bin/python scripts/bench/ship_state.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import iso_to_s  # noqa: E402
from tests.lab import NetnsLab, can_netns, why_no_lab  # noqa: E402

LOOP = """
import os
import numpy as np
import tensorflow as tf

WIDTH = int(os.environ["WIDTH"])

def build_model():
    init = tf.keras.initializers.RandomNormal(stddev=0.01, seed=1)
    return tf.keras.Sequential([
        tf.keras.layers.Input(shape=(WIDTH,)),
        tf.keras.layers.Dense(WIDTH, kernel_initializer=init),
        tf.keras.layers.Dense(1, kernel_initializer=init),
    ])

def make_optimizer():
    return tf.keras.optimizers.SGD(0.001)

def make_loss():
    return lambda labels, predictions: tf.reduce_mean(tf.square(labels - predictions), axis=-1)

def make_dataset(ctx, global_batch_size):
    x = np.random.default_rng(0).normal(size=(512, WIDTH)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat()
    ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.batch(ctx.get_per_replica_batch_size(global_batch_size), drop_remainder=True)
"""
WIDTHS = {"1 MB": 512, "100 MB": 5120}  # WIDTH² float32 weights


def spec_for(lab: NetnsLab, root: Path, k: int, width: int, every: int, shared: bool) -> Path:
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "train.py").write_text(LOOP)
    train: dict[str, Any] = {"steps": 100000, "global_batch_size": 16, "checkpoint_every": every}
    if shared:
        train["checkpoint_dir"] = str(lab.shared / f"ckpt-{secrets.token_hex(3)}")
    data = {
        "name": "bench-ship",
        "backend": "ssh",
        "hosts": [lab.host_spec(i) for i in range(k)],
        "job": {"loop": "job/train.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "WIDTH": str(width)}},
        "train": train,
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10, "stop_grace_s": 10},
        "restart": {"max_restarts": 1, "backoff_s": 0},
        "ssh": lab.ssh_spec(),
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def read(run_dir: Path, name: str) -> Any:
    try:
        text = (run_dir / name).read_text()
    except OSError:
        return [] if name.endswith(".jsonl") else {}
    if name.endswith(".jsonl"):
        return [json.loads(x) for x in text.splitlines() if x.strip()]
    try:
        return json.loads(text)
    except ValueError:
        return {}


def kill_and_resume(spec: Path, root: Path, every: int) -> dict:
    """One run of `spec`: worker-1 killed after step `every` * 2 + a random few; measured until
    the first step of attempt 1, then the run is stopped (Ctrl-C) and its results brought home."""
    run_dir = root / f"run-{secrets.token_hex(3)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        target = 2 * every + random.randrange(every)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            tasks = read(run_dir, "status.json").get("tasks") or []
            w1 = next((t for t in tasks if t["task"] == "worker-1"), {})
            if (w1.get("last_step") or 0) >= target:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"no progress: {read(run_dir, 'status.json')}")
        os.kill(w1["pid"], signal.SIGKILL)
        killed_at = time.time()
        first = None
        while time.monotonic() < deadline and first is None:
            first = next((p for p in read(run_dir, "metrics.jsonl") if p.get("attempt") == 1), None)
            time.sleep(0.05)
        if first is None:
            raise RuntimeError(f"attempt 1 never stepped: {read(run_dir, 'status.json')}")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = read(run_dir, "events.jsonl")
    launching = next(e for e in events if e.get("new") == "LAUNCHING" and e.get("attempt") == 1)
    started = min(iso_to_s(e["time"]) for e in events if e.get("new") == "STARTING" and e.get("attempt") == 1)
    restored = read(run_dir, "status.json")["tasks"][0].get("restored") or {}
    # status.json lags (refreshed once a second); the chief's per-step points do not
    last_trained = max(p["step"] for p in read(run_dir, "metrics.jsonl") if p.get("attempt") == 0)
    home = [e for e in events if e.get("kind") == "results"]
    return {
        "restart_s": iso_to_s(first["time"]) - killed_at,
        "copy_s": started - iso_to_s(launching["time"]),
        "steps_lost": last_trained - int(restored.get("step", 0)),
        "home_s": home[0]["seconds"] if home else 0.0,
    }


def compare_restarts(
    lab: NetnsLab, root: Path, cases: list[tuple[str, int]], repeats: int, spec_for: Callable[..., Path]
) -> list[dict[str, Any]]:
    """Each (model size, hosts) case run `repeats` times with its state on the lab's shared folder
    and on the hosts' own disks, interleaved (drift hits both alike): the medians, one row each.
    `spec_for(lab, root, k, width, every, shared)` writes the job's spec."""
    rows = []
    for size, k in cases:
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(repeats):
            for shared in (True, False):
                where = root / f"{size.replace(' ', '')}-k{k}-{'shared' if shared else 'own'}-{i}"
                runs[shared].append(
                    kill_and_resume(spec_for(lab, where, k, WIDTHS[size], 5, shared), where, 5)
                )
        base = statistics.median(r["restart_s"] for r in runs[True])
        own = statistics.median(r["restart_s"] for r in runs[False])
        rows.append(
            {
                "model": size,
                "hosts": k,
                "restart_shared_s": round(base, 2),
                "restart_copied_s": round(own, 2),
                "ratio": round(own / base, 3),
                "added_s": round(own - base, 2),
                "copy_s": round(statistics.median(r["copy_s"] for r in runs[False]), 2),
                "copy_shared_s": round(statistics.median(r["copy_s"] for r in runs[True]), 2),
                "home_s": round(statistics.median(r["home_s"] for r in runs[False]), 2),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 MB on 2 hosts only")
    args = parser.parse_args()
    if why_no_lab() or not can_netns():
        print(json.dumps({"metric": "P9 state across hosts", "skipped": why_no_lab() or "needs root"}))
        return 0
    cases = [(size, k) for size in WIDTHS for k in (2, 4)]
    if args.quick:
        cases = [("1 MB", 2)]
    with tempfile.TemporaryDirectory(prefix="bench-ship-") as tmp:
        root = Path(tmp)
        lab = NetnsLab(root / "lab", 4)
        try:
            rows = compare_restarts(lab, root, cases, args.repeats, spec_for)
            lost = {}
            for every in (10, 50) if not args.quick else (10,):
                folders = [root / f"lost-{every}-{i}" for i in range(max(2, args.repeats))]
                seen = [
                    kill_and_resume(spec_for(lab, f, 2, 64, every, False), f, every)["steps_lost"]
                    for f in folders
                ]
                lost[every] = {"median": statistics.median(seen), "max": max(seen), "runs": seen}
            print(
                json.dumps(
                    {
                        "metric": "P9 state across hosts",
                        "runs": args.repeats,
                        "rows": rows,
                        "steps_lost": lost,
                    },
                    indent=2,
                )
            )
        finally:
            lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
