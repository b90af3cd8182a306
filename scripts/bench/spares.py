"""Issue 27: lab machines lost — a host cut off (`ip link set eth0 down` in its namespace).

On the network-namespace lab (each host its own disk, tests/lab.py), a MultiWorkerMirroredStrategy
job with the built-in loop:
- `--part cut`: a worker's host cut while it trains: the time from the cut to the first step of
  the next attempt, and its phases (the restart's timeline), with a spare host and, without one,
  shrunk to the hosts left (restart.shrink); the baseline in the same run: a kill -9 of the same
  worker (the host stays), restarted in place.
- `--part owner`: the owner's host (worker-0: its checkpoints are on its own disk) cut, no spare,
  shrunk: the steps lost (its last step against the step the next attempt restored, which came
  home while it trained), against checkpoint_every.
- `--part copy`: what copying each new checkpoint home while training costs: steps/s with the
  checkpoints on each host's own disk (copied home) and, the baseline, on the lab's shared folder
  (declared shared: nothing copied), 1 MB and 100 MB checkpoints (SGD: the checkpoint is the
  weights), checkpoint_every 10, interleaved.

Needs root and openssh-server: `sudo .venv/bin/python scripts/bench/spares.py [--part P]`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.common import iso_to_s  # noqa: E402
from scripts.bench.ship_state import LOOP, WIDTHS, read  # noqa: E402
from tests.lab import NetnsLab, can_netns, why_no_lab  # noqa: E402


def spec_for(
    lab: NetnsLab, root: Path, hosts: list[dict], *, width: int = 64, every: int = 10, **more: Any
) -> Path:
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "train.py").write_text(LOOP)
    train: dict[str, Any] = {"steps": 100000, "global_batch_size": 12, "checkpoint_every": every}
    train.update(more.pop("train", {}))
    data = {
        "name": "bench-spares",
        "backend": "ssh",
        "hosts": hosts,
        "job": {"loop": "job/train.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "WIDTH": str(width)}},
        "train": train,
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4, "stop_grace_s": 5},
        "restart": {"max_restarts": 2, "backoff_s": 0, "standby": "off", **more.pop("restart", {})},
        "ssh": lab.ssh_spec(),
    }
    spec = root / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def spare(lab: NetnsLab, i: int) -> dict:
    entry = lab.host_spec(i, spare=True)
    del entry["tasks"]
    return entry


def start(spec: Path, root: Path) -> tuple[subprocess.Popen[bytes], Path]:
    run_dir = root / f"run-{secrets.token_hex(3)}"
    argv = [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run_dir), "--plain"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), run_dir


def task(run_dir: Path, name: str) -> dict:
    return next((t for t in read(run_dir, "status.json").get("tasks") or [] if t["task"] == name), {})


def wait_for(what: str, test: Any, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = test()
        if got:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def lose(lab: NetnsLab, spec: Path, root: Path, victim: str, how: str) -> dict[str, Any]:
    """One run: `victim`'s host cut (or the task killed) after step 25; measured to the first step
    of attempt 1."""
    proc, run_dir = start(spec, root)
    host = None
    try:
        wait_for("step 25", lambda: (task(run_dir, victim).get("last_step") or 0) >= 25)
        t = task(run_dir, victim)
        host = next(i for i, h in enumerate(lab.hosts) if h.address == t["host"])
        lost_at = time.time()
        if how == "cut":
            lab.cut(host)
        else:
            os.kill(t["pid"], signal.SIGKILL)
        rate = t.get("steps_per_s") or 0.0
        points = lambda: [p for p in read(run_dir, "metrics.jsonl") if p.get("attempt") == 1]  # noqa: E731
        first = wait_for("attempt 1's first step", points)[0]
        last = max(p["step"] for p in read(run_dir, "metrics.jsonl") if p.get("attempt") == 0)
        saved = last_saved(lab.hosts[host], read(run_dir, "status.json")["run_id"], victim)
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        if host is not None:
            lab.restore(host)
    status = read(run_dir, "status.json")
    recovery = next((r for r in status.get("recoveries") or [] if r["attempt"] == 1), {})
    restored = (status.get("tasks") or [{}])[0].get("restored") or {}
    return {
        "training_again_s": round(iso_to_s(first["time"]) - lost_at, 2),
        "phases_s": recovery.get("phases_s"),
        "steps_per_s": rate,
        "steps_lost": last - int(restored.get("step", 0)),  # the last step heard of (heartbeats)
        # the owner's last checkpoint on its own disk against the one the next attempt restored
        "saved_on_host": saved,
        "restored": int(restored.get("step", 0)),
        "workers": [a["workers"] for a in status.get("attempts") or []],
        "changes": [c for a in status.get("attempts") or [] for c in a["changes"]],
    }


def last_saved(host: Any, run_id: str, task: str) -> int | None:
    """The step of the last checkpoint `task` saved on its host, from its log there."""
    log = host.path(host.workdir / "runs" / run_id / "logs" / f"{task}.log")
    steps = [
        int(line.split()[2].split("/")[0])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("[orchestrate] step ") and line.endswith("checkpoint saved")
    ]
    return max(steps) if steps else None


def part_cut(lab: NetnsLab, root: Path, repeats: int) -> dict[str, Any]:
    two, shrink = [lab.host_spec(0), lab.host_spec(1)], {"shrink": True, "min_workers": 2}
    cases = {
        "kill -9, restarted in place (baseline)": (two, {}, "kill"),
        "host cut, moved to the spare": ([*two, spare(lab, 2)], {}, "cut"),
        "host cut, shrunk to the hosts left": ([*two, lab.host_spec(2)], {"restart": shrink}, "cut"),
    }
    out: dict[str, Any] = {}
    for i in range(repeats):
        for name, (hosts, more, how) in cases.items():
            where = root / f"cut-{len(out)}-{i}-{secrets.token_hex(2)}"
            got = lose(lab, spec_for(lab, where, hosts, **more), where, "worker-1", how)
            out.setdefault(name, []).append(got)
    return {
        name: {
            "training_again_s_median": statistics.median(r["training_again_s"] for r in runs),
            "runs": runs,
        }
        for name, runs in out.items()
    }


def part_owner(lab: NetnsLab, root: Path, repeats: int) -> dict[str, Any]:
    hosts = [lab.host_spec(0), lab.host_spec(1), lab.host_spec(2)]
    runs = []
    for i in range(repeats):
        where = root / f"owner-{i}"
        spec = spec_for(lab, where, hosts, every=10, restart={"shrink": True, "min_workers": 2})
        runs.append(lose(lab, spec, where, "worker-0", "cut"))
    lost = [r["steps_lost"] for r in runs]
    behind = [r["saved_on_host"] - r["restored"] for r in runs if r["saved_on_host"] is not None]
    return {
        "checkpoint_every": 10,
        "steps_lost": lost,
        "max": max(lost),
        "saved_on_host_minus_restored": behind,
        "runs": runs,
    }


def steps_per_s(lab: NetnsLab, spec: Path, root: Path, seconds: float) -> float:
    """The chief's steps/s over `seconds` of training, once 20 steps are done (warmed up)."""
    proc, run_dir = start(spec, root)
    try:
        wait_for("step 20", lambda: (task(run_dir, "worker-0").get("last_step") or 0) >= 20)
        a = (time.monotonic(), task(run_dir, "worker-0")["last_step"])
        time.sleep(seconds)
        b = (time.monotonic(), task(run_dir, "worker-0")["last_step"])
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    return (b[1] - a[1]) / (b[0] - a[0])


def part_copy(
    lab: NetnsLab, root: Path, repeats: int, seconds: float, sizes: list[str]
) -> list[dict[str, Any]]:
    rows = []
    hosts = [lab.host_spec(0), lab.host_spec(1)]
    for size, width in ((s, WIDTHS[s]) for s in sizes):
        got: dict[bool, list[float]] = {True: [], False: []}
        for i in range(repeats):
            for shared in (True, False):
                where = root / f"copy-{width}-{shared}-{i}"
                train = {"checkpoint_dir": str(lab.shared / f"ckpt-{secrets.token_hex(3)}")} if shared else {}
                spec = spec_for(lab, where, hosts, width=width, every=10, train=train)
                got[shared].append(steps_per_s(lab, spec, where, seconds))
        base, copied = statistics.median(got[True]), statistics.median(got[False])
        rows.append(
            {
                "checkpoint": size,
                "steps_per_s_not_copied": round(base, 2),
                "steps_per_s_copied_home": round(copied, 2),
                "ratio": round(copied / base, 3),
                "runs": {"not copied": got[True], "copied": got[False]},
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("cut", "owner", "copy", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="--part copy: how long each run is timed")
    parser.add_argument(
        "--sizes", nargs="*", default=list(WIDTHS), help="--part copy: of " + ", ".join(WIDTHS)
    )
    args = parser.parse_args()
    if why_no_lab() or not can_netns():
        print(json.dumps({"metric": "issue 27 lost hosts", "skipped": why_no_lab() or "needs root"}))
        return 0
    out: dict[str, Any] = {"metric": "issue 27 lost hosts", "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="bench-spares-") as tmp:
        root = Path(tmp)
        lab = NetnsLab(root / "lab", 3)
        try:
            if args.part in ("cut", "all"):
                out["cut"] = part_cut(lab, root, args.repeats)
            if args.part in ("owner", "all"):
                out["owner"] = part_owner(lab, root, args.repeats)
            if args.part in ("copy", "all"):
                out["copy"] = part_copy(lab, root, args.repeats, args.seconds, args.sizes)
        finally:
            lab.close()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
