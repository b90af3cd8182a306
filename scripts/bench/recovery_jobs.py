"""P5 per kind of job (issue 39): a warm restart (every task handed to its standby) against a cold
one (no standbys), with the restart's phases; and the warm run's second kill, 3 s after its
attempt 1's first step (before keepers, its standbys were still importing then: a cold restart;
now the same keepers fork it).

Like with like (issue 53): both runs resume at the same batch. Checkpoints are CHECKPOINT_EVERY
steps apart (a wide interval: a kill lands 0-150 steps after its target, the step read from
status.json lagging), each kill aims at a target CHECKPOINT_EVERY-aligned + MARGIN (its checkpoint
written), the cold run at the warm run's targets; each restart records the step it resumed at (the
one before the attempt's first reported step), and a warm/cold pair is compared only where both
resumed at the same step (a pair that did not is kept, apart, never dropped). Every run is in the
output (medians, ranges, all values); `restore` and `first step` are also given together (work may
move between them: the first step of a job that restores nothing begins at "up").
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
    spread,
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
CHECKPOINT_EVERY, MARGIN = 250, 20
TRAIN = f"train: {{steps: 100000, global_batch_size: 64, checkpoint_every: {CHECKPOINT_EVERY}}}\n"
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
        text = text.replace("save_freq=10)", f"save_freq={CHECKPOINT_EVERY})")  # as the loop's, below
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


def _target(step: int) -> int:
    """The first step past `step` at which a checkpoint is written and MARGIN steps are done."""
    return (step // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY + MARGIN


def one_run(job: str, standby: str, where, targets: list[int] | None) -> dict:
    """One run: killed at `targets` (warm: the first once every standby is ready, past step 120;
    the second 3 s after attempt 1's first step — the targets the cold run is then given). Each
    restart's seconds, phases, target, step killed at and step resumed at."""
    out: dict = {"job": job, "standby": standby}
    with _running(job, standby, where) as run:
        if targets is None:
            wait_for(lambda: _step(run) >= 120, 240)
            _standbys_ready(run)
        restarts = []
        for attempt in (1, 2) if standby == "on" or (targets and len(targets) > 1) else (1,):
            if targets is None and attempt == 2:  # a failure soon after a start (the keepers fork again)
                first = first_step_of_attempt(run, 1)[0]
                time.sleep(max(0.0, first + 3.0 - time.time()))
            target = targets[attempt - 1] if targets is not None else _target(_step(run))
            wait_for(lambda target=target: _step(run) >= target, 240)
            restarts.append(_kill(run, _victim_pid(run, job), attempt) | {"target": target})
        out["restarts"] = restarts
    return out


def _kill(run: Path, pid: int, attempt: int) -> dict:
    killed_at = _step(run)
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: first_step_of_attempt(run, attempt) is not None, 240)
    wait_for(lambda: sum(e["kind"] == "recovery" for e in events(run)) >= attempt, 60)
    recovery = [e for e in events(run) if e["kind"] == "recovery"][attempt - 1]
    first = first_step_of_attempt(run, attempt)[0]
    phases = recovery["phases_s"]
    return {
        "recovery_s": round(first - t0, 3),
        "phases_s": phases,
        "restore_and_first_step_s": round(
            (phases.get("restore") or 0.0) + (phases.get("first_step") or 0.0), 3
        ),
        "killed_at_step": killed_at,
        "resumed_at_step": _resumed(run, attempt),
        "line": recovery["reason"],
    }


def _resumed(run: Path, attempt: int) -> int | None:
    """The step the attempt resumed at: the one before its first reported step (metrics.jsonl),
    for every kind of job alike (Keras fit's tasks report no step in their `restored`)."""
    first = first_step_of_attempt(run, attempt)
    return first[1] - 1 if first is not None else None


def table(jobs: list[str], runs_each: int, where, import_s) -> dict:
    """Per job: warm and cold P5 over all runs (medians, ranges, every value), their phases, the
    ratio to `import tensorflow`, the warm/cold ratio of each pair that resumed at the same step,
    and the warm run's second restart (3 s after a first step) against the cold run's second kill
    at the same target."""
    out: dict = {}
    imports: list[float] = []
    for job in jobs:
        done: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(runs_each):  # interleaved; the cold run killed at the warm one's targets
            imports.append(import_s())
            warm = one_run(job, "on", where, None)
            done["on"].append(warm)
            done["off"].append(one_run(job, "off", where, [r["target"] for r in warm["restarts"]]))
        out[job] = {mode: _summary(runs) for mode, runs in done.items()} | {"pairs": _pairs(done)}
    out["tf_import_s"] = spread(imports)
    tf = out["tf_import_s"]["median"]
    for job in jobs:
        for mode in ("on", "off"):
            for restart in out[job][mode].values():
                restart["ratio_to_import"] = round(restart["recovery_s"]["median"] / tf, 2)
    return out


def _pairs(done: dict[str, list[dict]]) -> dict:
    """Warm / cold per restart of each pair of runs: where both resumed at the same step (like with
    like), and apart those that did not (kept, not compared)."""
    out: dict = {}
    for n, name in enumerate(("first", "second (3 s after a first step)")):
        same, other = [], []
        for warm, cold in zip(done["on"], done["off"], strict=True):
            if len(warm["restarts"]) <= n or len(cold["restarts"]) <= n:
                continue
            w, c = warm["restarts"][n], cold["restarts"][n]
            row = {
                "resumed_at_step": [w["resumed_at_step"], c["resumed_at_step"]],
                "recovery": round(w["recovery_s"] / c["recovery_s"], 2),
                "first_step": round(
                    (w["phases_s"]["first_step"] or 0) / (c["phases_s"]["first_step"] or 1e-9), 2
                ),
                "restore_and_first_step": round(
                    w["restore_and_first_step_s"] / c["restore_and_first_step_s"], 2
                ),
            }
            (same if w["resumed_at_step"] == c["resumed_at_step"] is not None else other).append(row)
        ratios = {
            k: spread([r[k] for r in same], 2) for k in ("recovery", "first_step", "restore_and_first_step")
        }
        out[name] = {
            "same resumed step": same,
            "ratios warm/cold": ratios if same else None,
            "not like with like": other,
        }
    return out


def first_steps(jobs: list[str], kills: int, runs_each: int, where) -> dict:
    """Point 2's question with more samples than one restart per run gives: per job, runs warm and
    cold interleaved, each killed `kills` times. The warm run aims each kill at the target after
    6 s past each attempt's first step, once every standby is ready (the keepers' spares made by
    then); the cold run at the same targets, so that each resumes at the same batch. Each
    restart's phases, target, steps killed and resumed at; every value, medians and ranges of
    `first step` and of `restore` + `first step`, and the pairs resumed at the same step."""
    out: dict = {}
    for job in jobs:
        seen: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(runs_each):
            warm = _first_steps_of_one_run(job, "on", where, kills, None)
            seen["on"] += warm
            seen["off"] += _first_steps_of_one_run(job, "off", where, kills, [r["target"] for r in warm])
        out[job] = {
            m: {
                "first_step_s": spread([r["phases_s"]["first_step"] or 0.0 for r in v]),
                "restore_and_first_step_s": spread([r["restore_and_first_step_s"] for r in v]),
                "restarts": [
                    {k: r[k] for k in ("target", "killed_at_step", "resumed_at_step", "phases_s")} for r in v
                ],
            }
            for m, v in seen.items()
        }
        same = [
            (w, c)
            for w, c in zip(seen["on"], seen["off"], strict=True)
            if w["resumed_at_step"] == c["resumed_at_step"] is not None
        ]
        out[job]["pairs resumed at the same step"] = f"{len(same)} of {len(seen['on'])}"
        if same:
            out[job]["warm/cold, same resumed step"] = {
                "first_step": spread(
                    [
                        (w["phases_s"]["first_step"] or 0) / (c["phases_s"]["first_step"] or 1e-9)
                        for w, c in same
                    ],
                    2,
                ),
                "restore_and_first_step": spread(
                    [w["restore_and_first_step_s"] / c["restore_and_first_step_s"] for w, c in same], 2
                ),
            }
    return out


def _step(run: Path) -> int:
    return max((t.get("last_step") or 0) for t in status(run).get("tasks") or [{}])


def _first_steps_of_one_run(
    job: str, standby: str, where, kills: int, targets: list[int] | None
) -> list[dict]:
    """Its restarts (`_kill`'s, with their targets): at `targets` if given, else each at the
    target after 6 s past the attempt's first step, once every standby is ready."""
    seen: list[dict] = []
    with _running(job, standby, where, max_restarts=kills) as run:
        wait_for(lambda: first_step_of_attempt(run, 0) is not None, 240)
        for attempt in range(1, kills + 1):
            if targets is None:
                if standby == "on":
                    _standbys_ready(run)
                time.sleep(max(0.0, first_step_of_attempt(run, attempt - 1)[0] + 6.0 - time.time()))
            target = targets[attempt - 1] if targets is not None else _target(_step(run))
            wait_for(lambda target=target: _step(run) >= target, 240)
            seen.append(_kill(run, _victim_pid(run, job), attempt) | {"target": target})
    return seen


def _summary(runs: list[dict]) -> dict:
    """Per restart (the first; the second where there is one): every run's figures, with medians
    and ranges; the steps aimed at, killed at and resumed at; the timeline lines."""

    def of(restarts: list[dict]) -> dict:
        names = restarts[0]["phases_s"]
        return {
            "recovery_s": spread([r["recovery_s"] for r in restarts]),
            "phases_s": {p: spread([r["phases_s"][p] or 0.0 for r in restarts]) for p in names},
            "restore_and_first_step_s": spread([r["restore_and_first_step_s"] for r in restarts]),
            "steps (target, killed, resumed)": [
                (r["target"], r["killed_at_step"], r["resumed_at_step"]) for r in restarts
            ],
            "lines": [r["line"] for r in restarts],
        }

    out = {"first": of([r["restarts"][0] for r in runs])}
    if all(len(r["restarts"]) > 1 for r in runs):
        out["second (3 s after a first step)"] = of([r["restarts"][1] for r in runs])
    return out
