"""P5 per kind of job (issue 39): a warm restart (every task handed to its standby) against a cold
one (no standbys), the kill at the same step, with the restart's phases; and the warm run's second
kill, 3 s after its attempt 1's first step (before keepers, its standbys were still importing then:
a cold restart; now the same keepers fork it).

Jobs, each with Python in its input pipeline where named `-py` (a `tf.numpy_function` or
`tf.py_function` map, as augmentation or decoding has):
- `loop`, `loop-py`: the built-in loop (MultiWorkerMirroredStrategy, 2 workers), `.repeat()`;
- `fit-py`: Keras `model.fit` in the job's own script (mode 1) with `BackupAndRestore`;
- `ps-py`: ParameterServerStrategy's chief (the built-in loop; chief, 2 workers, 1 ps): the
  chief is the one killed (a whole-job restart).
Run by `recovery.py --jobs loop,loop-py,fit-py,ps-py [--backend ssh|slurm]`; with `--first-steps
K`, only the first step after each restart, K kills per run (`first_steps`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from common import (
    REPO,
    events,
    first_step_of_attempt,
    median,
    start_up,
    status,
    tmpdir,
    wait_for,
    write_spec,
)

SPEC = """\
name: bench-first-step
{strategy}job:
  {job}
  env: {{TF_CPP_MIN_LOG_LEVEL: "2"{legacy}}}
{train}health: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: 5}}
restart: {{max_restarts: 2, backoff_s: 0, standby: {standby}}}
"""
TRAIN = "train: {steps: 100000, global_batch_size: 64, checkpoint_every: 50}\n"
LOOP = """
import numpy as np
import tensorflow as tf
from pathlib import Path
__file__ = str(Path(__file__).with_name("digits_loop.py"))  # it finds its data beside itself
exec(open(__file__).read())
_make = make_dataset
def make_dataset(ctx, gbs):
    ds = _make(ctx, gbs).repeat()
    if {py}:
        def augment(x):
            return (x + np.float32(0.0)).astype(np.float32)
        ds = ds.map(lambda x, y: (tf.ensure_shape(tf.numpy_function(augment, [x], tf.float32), x.shape), y))
    return ds
"""
FIT_MAP = """
def _augment(x, y):
    x = tf.py_function(lambda v: v + 0.0, [x], tf.float32)
    return tf.ensure_shape(x, [None, 64]), y
train_ds = train_ds.map(_augment)
"""


def job_folder(folder: Path, job: str, standby: str, hosts: str) -> Path:
    """The job's folder (its files beside the spec); the spec's path."""
    (folder / "job" / "data").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "data" / "digits.npz", folder / "job" / "data" / "digits.npz")
    legacy, strategy, train = "", "", TRAIN
    if job == "fit-py":
        text = (REPO / "examples" / "digits_fit.py").read_text()
        text = text.replace("\nwith strategy.scope():", FIT_MAP + "\nwith strategy.scope():", 1)
        (folder / "job" / "fit.py").write_text(text)
        line, train = 'script: job/fit.py\n  args: ["--epochs", "1000"]', ""
        legacy = ", TF_USE_LEGACY_KERAS: '1'"
    else:
        shutil.copy(REPO / "examples" / "digits_loop.py", folder / "job" / "digits_loop.py")
        (folder / "job" / "train.py").write_text(LOOP.format(py=job != "loop"))
        line = "loop: job/train.py"
        if job == "ps-py":
            strategy = "strategy: parameter_server\n"
    text = SPEC.format(strategy=strategy, job=line, legacy=legacy, train=train, standby=standby)
    return write_spec(folder, text + hosts)


def hosts_for(job: str, where_spec: str) -> str:
    """The hosts' lines: the ps job has a chief and a ps on its first host, beside the workers."""
    if job != "ps-py":
        return where_spec
    spec = yaml.safe_load(where_spec)
    if "hosts" not in spec:
        sys.exit("ps-py runs on hosts (local or ssh), not on Slurm nodes of one layout")
    spec["hosts"][0]["tasks"] = {**spec["hosts"][0]["tasks"], "chief": 1, "ps": 1}
    return yaml.safe_dump(spec)


def victim_of(job: str) -> str:
    return "chief-0" if job == "ps-py" else "worker-1"


@contextlib.contextmanager
def _running(job: str, standby: str, where, max_restarts: int = 2) -> Iterator[Path]:
    """`orchestrate up` of the job in a folder of its own: its run directory; interrupted (SIGINT)
    at the end, killed if that fails, the folder removed (kept with BENCH_KEEP set)."""
    folder = tmpdir()
    spec = job_folder(folder, job, standby, hosts_for(job, where.spec))
    spec.write_text(spec.read_text().replace("max_restarts: 2", f"max_restarts: {max_restarts}"))
    proc = start_up(spec, folder / "run", where.env)
    try:
        yield folder / "run"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        proc.kill()
        if os.environ.get("BENCH_KEEP") is None:
            shutil.rmtree(folder, ignore_errors=True)


def _standbys_ready(run: Path) -> None:
    wait_for(lambda: {s["state"] for s in status(run).get("standbys", [])} == {"ready"}, 240)


def _victim_pid(run: Path, job: str) -> int:
    return next(t["pid"] for t in status(run)["tasks"] if t["task"] == victim_of(job))


def one_run(job: str, standby: str, where, at_step: int) -> dict:
    """One run: killed at `at_step` at least (and, warm, once every standby is ready); warm, killed
    again 3 s after attempt 1's first step. Each restart's seconds and phases."""
    out: dict = {"job": job, "standby": standby}
    with _running(job, standby, where) as run:
        wait_for(lambda: _step(run) >= at_step, 240)
        if standby == "on":  # every task's standby ready
            _standbys_ready(run)
        out["killed_at_step"] = _step(run)
        restarts = [_kill(run, _victim_pid(run, job), 1)]
        if standby == "on":  # a failure soon after a start (the keepers fork its tasks again)
            first = first_step_of_attempt(run, 1)[0]
            time.sleep(max(0.0, first + 3.0 - time.time()))
            restarts.append(_kill(run, _victim_pid(run, job), 2))
        out["restarts"] = restarts
    return out


def _kill(run: Path, pid: int, attempt: int) -> dict:
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: first_step_of_attempt(run, attempt) is not None, 240)
    wait_for(lambda: sum(e["kind"] == "recovery" for e in events(run)) >= attempt, 60)
    recovery = [e for e in events(run) if e["kind"] == "recovery"][attempt - 1]
    first = first_step_of_attempt(run, attempt)[0]
    return {"recovery_s": round(first - t0, 3), "phases_s": recovery["phases_s"], "line": recovery["reason"]}


def table(jobs: list[str], runs_each: int, where, import_s) -> dict:
    """Per job: warm and cold P5 (median), their phases, the ratio to `import tensorflow`, and the
    warm run's second restart (3 s after a first step)."""
    out: dict = {}
    imports: list[float] = []
    for job in jobs:
        done: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(runs_each):  # interleaved; the cold run killed at the warm one's step
            imports.append(import_s())
            warm = one_run(job, "on", where, 120)
            done["on"].append(warm)
            done["off"].append(one_run(job, "off", where, warm["killed_at_step"]))
        out[job] = {mode: _summary(runs) for mode, runs in done.items()}
    out["tf_import_s"] = round(median(imports), 3)
    for job in jobs:
        for mode in ("on", "off"):
            r = out[job][mode]
            r["ratio_to_import"] = round(r["recovery_s"] / out["tf_import_s"], 2)
            if "after_3s" in r:
                r["after_3s"]["ratio_to_import"] = round(r["after_3s"]["recovery_s"] / out["tf_import_s"], 2)
    return out


def first_steps(jobs: list[str], kills: int, runs_each: int, where) -> dict:
    """Point 2's question with more samples than one restart per run gives: per job, runs warm and
    cold interleaved, each killed `kills` times. The warm run is killed 6 s after each attempt's
    first step, once every standby is ready (the keepers' spares made by then); the cold run after
    it at the same steps, so that each resumed epoch skips as many batches (their cost grows with
    the kill's step: a time after each first step put the cold kills hundreds of steps earlier,
    the warm run's first kill having waited for its standbys). Each restart's `first step` phase
    and the step killed at; medians, and how many warm ones are above the cold median."""
    out: dict = {}
    for job in jobs:
        seen: dict[str, list[float]] = {"on": [], "off": []}
        at: dict[str, list[int]] = {"on": [], "off": []}
        for _ in range(runs_each):
            warm, steps = _first_steps_of_one_run(job, "on", where, kills, None)
            cold, cold_steps = _first_steps_of_one_run(job, "off", where, kills, steps)
            seen["on"] += warm
            seen["off"] += cold
            at["on"] += steps
            at["off"] += cold_steps
        cold_median = median(seen["off"])
        out[job] = {
            m: {"median_s": round(median(v), 3), "n": len(v), "all": v, "killed_at_step": at[m]}
            for m, v in seen.items()
        }
        out[job]["warm_above_cold_median"] = (
            f"{sum(v > cold_median for v in seen['on'])} of {len(seen['on'])}"
        )
    return out


def _step(run: Path) -> int:
    return max((t.get("last_step") or 0) for t in status(run).get("tasks") or [{}])


def _first_steps_of_one_run(
    job: str, standby: str, where, kills: int, at_steps: list[int] | None
) -> tuple[list[float], list[int]]:
    """Its restarts' first steps and the steps killed at: `at_steps` if given, else 6 s after each
    attempt's first step once every standby is ready."""
    seen: list[float] = []
    killed_at: list[int] = []
    with _running(job, standby, where, max_restarts=kills) as run:
        wait_for(lambda: first_step_of_attempt(run, 0) is not None, 240)
        for attempt in range(1, kills + 1):
            if at_steps is not None:
                wait_for(lambda target=at_steps[attempt - 1]: _step(run) >= target, 240)
            else:
                if standby == "on":
                    _standbys_ready(run)
                time.sleep(max(0.0, first_step_of_attempt(run, attempt - 1)[0] + 6.0 - time.time()))
            killed_at.append(_step(run))
            seen.append(_kill(run, _victim_pid(run, job), attempt)["phases_s"]["first_step"])
    return seen, killed_at


def _summary(runs: list[dict]) -> dict:
    def of(restarts: list[dict]) -> dict:
        names = restarts[0]["phases_s"]
        phases = {p: round(median([r["phases_s"][p] or 0.0 for r in restarts]), 3) for p in names}
        return {"recovery_s": round(median([r["recovery_s"] for r in restarts]), 3), "phases_s": phases}

    out = of([r["restarts"][0] for r in runs]) | {"killed_at_step": [r["killed_at_step"] for r in runs]}
    if len(runs[0]["restarts"]) > 1:
        out["after_3s"] = of([r["restarts"][1] for r in runs])
    out["lines"] = [r["line"] for run in runs for r in run["restarts"]]
    return out
