"""Issue 26's figures: what reading a hung job's stacks costs.

- `capture`: N tasks (2, 4, 16), each a real Python process that has imported TensorFlow and hangs
  in its own code under the worker runtime (its dump registered), read all at once as the
  coordinator does before a stop (orchestrator/stacks/record.py's capture_all): Python frames only
  (py-spy --nonblocking: what a live `orchestrate stacks` reads), native frames too (py-spy
  pausing each task: before a stop), and the runtime's own dump (no py-spy). Per task and per job.
- `stop`: a hung job (2 MWMS workers, one deadlocked in its own Python): from the stall detector
  firing (its task's FAILED event) to the run's STOPPING event and to its end, with the stacks read
  (health.stacks_timeout_s 5) and without (0), interleaved.
- `p3`: P3's steps job with `orchestrate stacks` asked once a second of the live run, against
  none; pairs back to back, the order alternated.

`python scripts/bench/stacks.py [--part capture|stop|p3] [--runs N]`; one JSON object per part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import BENCH, REPO, iso_to_s, median, tmpdir, value, values, write_spec

sys.path.insert(0, str(REPO))

from orchestrator.launch.api import ProcessInfo, Sig, TaskHandle  # noqa: E402
from orchestrator.plan.launch_plan import TaskPlan  # noqa: E402
from worker.host import stacks  # noqa: E402

# Under the worker runtime, TensorFlow imported: the odd tasks hang in their own code (a lock),
# the even ones wait inside TensorFlow (an empty queue's dequeue: C++ frames of TensorFlow's, whose
# symbols are what native frames cost), as the peers of a hung task wait in a collective.
HUNG = """
import os, threading, tensorflow as tf
print("ready", flush=True)
if int(os.environ["ORCHESTRATE_TASK"].split("-")[1]) % 2:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
tf.queue.FIFOQueue(1, tf.float32).dequeue()
"""


class Hung(TaskHandle):
    """A local process read as LocalTaskHandle reads its task."""

    def __init__(self, name: str, proc: subprocess.Popen[str], dumps: str, py_spy: str | None):
        plan = TaskPlan.__new__(TaskPlan)
        object.__setattr__(plan, "name", name)
        super().__init__(plan, 0, Path(os.devnull))
        self.proc, self.dumps, self.py_spy = proc, dumps, py_spy

    @property
    def process(self) -> ProcessInfo:
        return ProcessInfo(self.proc.pid, self.proc.pid, 0.0)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: Sig) -> None:
        raise AssertionError

    @property
    def exited(self) -> bool:
        return False

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        return stacks.capture(
            self.proc.pid, deadline, stacks_file=self.dumps, py_spy=self.py_spy, native=native
        )


def start_hung(count: int, folder: Path) -> list[tuple[subprocess.Popen[str], str]]:
    (folder / "hung.py").write_text(HUNG)
    job = str(folder / "hung.py")
    code = (
        "import runpy; from worker.task import runtime; "
        f"runtime.run_reported(lambda: runpy.run_path({job!r}))"
    )
    procs = []
    for i in range(count):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "ORCHESTRATE_RUN_DIR": str(folder),
            "ORCHESTRATE_TASK": f"worker-{i}",
            "ORCHESTRATE_ATTEMPT": "0",
        }
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        procs.append((proc, stacks.path(str(folder), f"worker-{i}", 0)))
        if len(procs) % 2 == 0 or len(procs) == count:  # two imports at a time: two cores here
            for p, _ in procs[-2 if len(procs) % 2 == 0 else -1 :]:
                assert p.stdout is not None and p.stdout.readline() == "ready\n"
    time.sleep(1.0)  # into the lock
    return procs


def capture_part(runs: int) -> dict[str, Any]:
    from orchestrator.stacks.record import capture_all

    py_spy = stacks.find_py_spy()
    out: dict[str, Any] = {"metric": "capture time, per task and per job", "py_spy": py_spy}
    for count in (2, 4, 16):
        folder = tmpdir()
        procs = start_hung(count, folder)
        try:
            row: dict[str, Any] = {}
            for mode, native, spy, bound in (
                ("python_frames", False, py_spy, 5.0),
                ("native_frames", True, py_spy, 60.0),
                ("native_within_5s", True, py_spy, 5.0),
                ("runtime_dump", False, None, 5.0),
            ):
                handles = [Hung(f"worker-{i}", p, d, spy) for i, (p, d) in enumerate(procs)]
                jobs, per_task, complete = [], [], []
                for _ in range(runs):
                    cap = capture_all(handles, bound, "bench", native=native)
                    jobs.append(cap.seconds)
                    per_task += [d["seconds"] for d in cap.docs.values()]
                    read = [d for d in cap.docs.values() if d.get("threads") and d.get("native") == native]
                    complete.append(len(read))
                row[mode] = {
                    "job_s_median": round(median(jobs), 3),
                    "job_s_max": round(max(jobs), 3),
                    "task_s_median": round(median(per_task), 3),
                    "task_s_max": round(max(per_task), 3),
                    "tasks_read_as_asked_median": median(complete),
                }
            out[f"{count}_tasks"] = row
        finally:
            for p, _ in procs:
                p.kill()
                p.wait()
    return out


DEADLOCK = """
import os, threading
import tensorflow as tf
import worker
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    v = tf.Variable(0.0)
step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
lock = threading.Lock()
for i in range(1, 1000):
    if os.environ["ORCHESTRATE_TASK"] == "worker-1" and i == 10:
        lock.acquire()
        lock.acquire()
    step()
    worker.report(step=i)
"""


def one_stop(read_s: float) -> tuple[float, float]:
    """A hung job stopped: (the stall's FAILED event -> STOPPING, -> the run's end), seconds."""
    folder = tmpdir()
    (folder / "job.py").write_text(DEADLOCK)
    spec = write_spec(
        folder,
        f"""\
        name: bench-hang
        hosts: [{{address: 127.0.0.1, tasks: {{worker: 2}}}}]
        job: {{script: job.py, env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}}}
        health: {{stall_timeout_s: 4, stacks_timeout_s: {read_s}}}
        restart: {{max_restarts: 0}}
        """,
    )
    argv = [
        sys.executable,
        "-m",
        "orchestrator",
        "up",
        str(spec),
        "--run-dir",
        str(folder / "run"),
        "--plain",
    ]
    subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=folder)
    events = [json.loads(x) for x in (folder / "run" / "events.jsonl").read_text().splitlines()]
    fired = min(iso_to_s(e["time"]) for e in events if e.get("kind") == "task" and e.get("new") == "FAILED")
    stopping = next(iso_to_s(e["time"]) for e in events if e.get("new") == "STOPPING")
    end = next(iso_to_s(e["time"]) for e in events if e.get("kind") == "run" and e.get("new") == "FAILED")
    return stopping - fired, end - fired


def stop_part(runs: int) -> dict[str, Any]:
    got: dict[float, list[tuple[float, float]]] = {5.0: [], 0.0: []}
    for i in range(runs):
        for read_s in (5.0, 0.0) if i % 2 == 0 else (0.0, 5.0):
            got[read_s].append(one_stop(read_s))
    return {
        "metric": "a hung job: detector -> stop, stacks read (stacks_timeout_s 5) and not (0)",
        "to_stopping_s_with": [round(a, 3) for a, _ in got[5.0]],
        "to_stopping_s_without": [round(a, 3) for a, _ in got[0.0]],
        "to_end_s_with": [round(b, 3) for _, b in got[5.0]],
        "to_end_s_without": [round(b, 3) for _, b in got[0.0]],
        "capture_cost_s_median": round(
            median([a for a, _ in got[5.0]]) - median([a for a, _ in got[0.0]]), 3
        ),
    }


def p3_once(steps: int, ask_every_s: float | None) -> tuple[float, int, float]:
    """The steps job under `orchestrate up`, `orchestrate stacks` asked every `ask_every_s`:
    (steps/s, how many were answered, the workers' CPU ms per step)."""
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
        restart: {{max_restarts: 1, standby: off}}
        """,
    )
    run = folder / "run"
    argv = [sys.executable, "-m", "orchestrator", "up", str(spec), "--run-dir", str(run), "--plain"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=folder)
    answered = [0]

    def ask() -> None:
        while proc.poll() is None:
            try:
                state = json.loads((run / "status.json").read_text()).get("state")
            except (OSError, ValueError):
                state = None
            if state == "RUNNING":
                res = subprocess.run(
                    [sys.executable, "-m", "orchestrator", "stacks", str(run), "--json"],
                    capture_output=True,
                    timeout=60,
                )
                answered[0] += res.returncode == 0
            time.sleep(ask_every_s or 1.0)

    if ask_every_s is not None:
        threading.Thread(target=ask, daemon=True).start()
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(out[-3000:])
    return value(out, "steps_per_s"), answered[0], sum(values(out, "cpu_ms_per_step"))


def p3_part(runs: int, steps: int) -> dict[str, Any]:
    on: list[tuple[float, int, float]] = []
    off: list[tuple[float, int, float]] = []
    for i in range(runs):
        for asked in (True, False) if i % 2 == 0 else (False, True):
            (on if asked else off).append(p3_once(steps, 1.0 if asked else None))
    return {
        "metric": "P3 steps/s with `orchestrate stacks` once a second vs none",
        "steps": steps,
        "with_steps_per_s": [r[0] for r in on],
        "without_steps_per_s": [r[0] for r in off],
        "answered": [r[1] for r in on],
        "pair_ratio_median": round(median([a[0] / b[0] for a, b in zip(on, off, strict=True)]), 3),
        "cpu_ms_per_step_with": [r[2] for r in on],
        "cpu_ms_per_step_without": [r[2] for r in off],
        "cpu_ratio_median": round(median([a[2] / b[2] for a, b in zip(on, off, strict=True)]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["capture", "stop", "p3"], action="append")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    ns = parser.parse_args()
    for part in ns.part or ["capture", "stop", "p3"]:
        if part == "capture":
            print(json.dumps(capture_part(ns.runs), indent=2), flush=True)
        elif part == "stop":
            print(json.dumps(stop_part(ns.runs), indent=2), flush=True)
        else:
            print(json.dumps(p3_part(ns.runs, ns.steps), indent=2), flush=True)


if __name__ == "__main__":
    main()
