"""The slurm backend end to end, on a real Slurm cluster built on this machine (tests/slurm_lab.py:
slurmctld and three slurmd nodes, each in namespaces of its own with its own address and name).
Real salloc/srun/scancel, real TensorFlow where the case needs it, real signals, a real link cut.
After every case: nothing of ours queued (`squeue`) and no process of the run on any node."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from orchestrator.launch.slurm.step import port_lock
from tests import wheelhouse
from tests.conftest import CliRun, run_processes, wait_until
from tests.slurm_lab import SlurmLab, why_no_slurm
from worker.host.probe import port_locked

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_no_slurm() is not None, reason=why_no_slurm() or "")]

# Two tasks on two nodes sum into one variable: 2 replicas x 20 steps = 40 on both.
MWMS = """
    import socket
    import tensorflow as tf
    import worker
    print("HOST " + socket.gethostname(), flush=True)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
    step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
    worker.set_total_steps(20)
    for i in range(1, 21):
        step()
        worker.report(step=i)
    print("FINAL", float(v.numpy()), flush=True)
"""

# No TensorFlow (teardown and placement cases): STEPS steps, forever when 0; attempt 0 may run
# forever while the next ones end (FIRST_STEPS).
PLAIN = """
    import os, socket, time
    import worker
    print("HOST " + socket.gethostname(), flush=True)
    attempt = int(os.environ["ORCHESTRATE_ATTEMPT"])
    steps = int(os.environ.get("FIRST_STEPS" if attempt == 0 else "STEPS", "0"))
    i = 0
    while steps == 0 or i < steps:
        i += 1
        worker.report(step=i)
        time.sleep(0.05)
"""


class SlurmRun(CliRun):
    """`orchestrate up` of a slurm spec on the lab, from the login node (this machine)."""

    def __init__(
        self,
        lab: SlurmLab,
        root: Path,
        spec: dict[str, Any],
        script: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.lab = lab
        self.root = root
        self.run_dir = root / "run"
        if script is not None:
            (root / "job.py").write_text(textwrap.dedent(script))
        self.spec = root / "spec.yaml"
        self.spec.write_text(yaml.safe_dump(spec))
        self.extra_env = env or {}
        self.returncode: int | None = None  # of the last `through`

    def env(self) -> dict[str, str]:
        return {**super().env(), "SLURM_CONF": str(self.lab.conf), **self.extra_env}

    def backend(self) -> dict[str, Any]:
        return dict(json.loads((self.run_dir / "backend.json").read_text()))

    def log(self, task: str) -> str:
        return (self.run_dir / "logs" / f"{task}.log").read_text(errors="replace")

    def through(self, task: str, steps: int, action: Callable[[], object], timeout_s: float = 240) -> str:
        """`up`; once `task` has reported `steps` steps, `action`; its output once it has ended
        (its exit code in self.returncode)."""
        proc = self.start()
        try:
            self.wait_steps(task, steps)
            action()
            out, _ = proc.communicate(timeout=timeout_s)
        finally:
            proc.kill()
        self.returncode = proc.returncode
        return out

    def wait_steps(self, task: str, at_least: int, timeout_s: float = 90) -> None:
        assert wait_until(lambda: (self.task(task).get("last_step") or 0) >= at_least, timeout_s), (
            self.status()
        )


def kill_task(run: SlurmRun, task: str) -> None:
    os.kill(run.task(task)["pid"], signal.SIGKILL)  # the lab's nodes share this machine's pid space


def warn_of_time_limit(lab: SlurmLab, job_id: str) -> None:
    """What Slurm does near a time limit (`--signal=TERM@lead`), without waiting for the clock:
    the limit brought within the lead, the warning sent."""
    lab.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=1"], check=True)
    lab.run(["scancel", "--signal=TERM", job_id], check=True)


def spec(name: str, slurm: dict[str, Any], job: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "backend": "slurm",
        "slurm": {"queue_timeout_s": 60, "connect_timeout_s": 10, **slurm},
        "job": job or {"script": "job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
        "health": {"stop_grace_s": 3, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5},
    }
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def loop_job() -> dict[str, Any]:
    return {"loop": str(REPO / "examples" / "digits_loop.py"), "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    """Each node's /tmp its own; the tests' folders (the run directories) on the shared file system."""
    with SlurmLab(nodes=3, shared=[tmp_path_factory.getbasetemp()]) as lab:
        lab.wait_ready(timeout_s=30)
        yield lab


@pytest.fixture
def runs(lab: SlurmLab, tmp_path: Path) -> Iterator[list[SlurmRun]]:
    """Runs made by a test; afterwards nothing of theirs may be queued or running anywhere."""
    made: list[SlurmRun] = []
    yield made
    left = [p for r in made for p in run_processes(r.run_id)]

    def queued() -> list[str]:
        return [j for j in lab.jobs() if " orchestrate-" in j]

    # a job that ended while a node was cut off is COMPLETING until that node (rejoined) says so
    wait_until(lambda: all(not j.endswith(" COMPLETING") for j in queued()), 20, interval_s=0.2)
    ours = queued()
    for proc in left:
        with contextlib.suppress(psutil.Error, ProcessLookupError):  # it ended meanwhile
            proc.kill()
    for job in ours:
        lab.run(["scancel", job.split()[0]])
    assert not left and not ours, (left, ours)


def make(runs: list[SlurmRun], lab: SlurmLab, root: Path, *args: Any, **kw: Any) -> SlurmRun:
    run = SlurmRun(lab, root, *args, **kw)
    runs.append(run)
    return run


def nothing_left(lab: SlurmLab, run: SlurmRun) -> bool:
    return not [j for j in lab.jobs() if " orchestrate-" in j] and not run_processes(run.run_id)


def node_address(lab: SlurmLab, name: str) -> str:
    return lab.node(name).address


@pytest.mark.wheelhouse
def test_mwms_script_runs_a_task_per_node_and_releases_its_allocation(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    """In the environment `environment:` makes from the nodes' own Python (Debian's, without
    TensorFlow): the nodes share the work folder (on their shared file system, where the tests'
    folders are), so it is built there once."""
    wheels = wheelhouse.ensure()
    environment = {
        "requirements": wheelhouse.requirements()[:1],
        "find_links": [str(wheels)],
        "no_index": True,
    }
    if Path("/usr/bin/python3").exists():
        environment["python"] = "/usr/bin/python3"
    work = tmp_path / "work"
    mwms = spec(
        "mwms", {"nodes": 2, "tasks_per_node": {"worker": 1}, "workdir": str(work)}, environment=environment
    )
    run = make(runs, lab, tmp_path, mwms, MWMS, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    res = run.up(timeout_s=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    made = run.backend()["environment"]
    assert [h["state"] for h in made] == ["ready", "ready"] and made[0]["python"] == made[1]["python"]
    assert made[0]["python"].startswith(f"{work}/envs/"), made
    sent = [
        e["reason"] for e in run.events() if "wheels (" in e.get("reason", "") and "sending" in e["reason"]
    ]
    built = [e["reason"] for e in run.events() if "environment built" in e.get("reason", "")]
    assert len(sent) == 1 and len(built) == 1, (sent, built)  # by one node, for both
    plan = json.loads((run.run_dir / "plan.json").read_text())
    assert plan["cluster"]["worker"][0].split(":")[0] == node_address(lab, "n1")  # the real node addresses
    assert plan["cluster"]["worker"][1].split(":")[0] == node_address(lab, "n2")
    assert "HOST n1" in run.log("worker-0") and "HOST n2" in run.log("worker-1")
    assert "FINAL 40.0" in run.log("worker-0") and "FINAL 40.0" in run.log("worker-1")
    assert run.backend()["owned"] is True
    assert nothing_left(lab, run)


def test_loop_task_killed_restarts_the_job_from_its_checkpoint(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    """Its checkpoint folder on the nodes' shared file system, declared so (train.checkpoint_dir):
    proven at launch, never copied; both nodes resume from it."""
    shared = tmp_path / "ckpt"
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "loop",
            {"nodes": 2, "tasks_per_node": {"worker": 1}},
            loop_job(),
            train={
                "steps": 240,
                "checkpoint_every": 20,
                "global_batch_size": 32,
                "checkpoint_dir": str(shared),
            },
        ),
    )
    out = run.through("worker-1", 30, lambda: kill_task(run, "worker-1"))
    assert run.returncode == 0, out[-3000:]
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1 and status["attempt"] == 1
    events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "recovery" and e["reason"] in out for e in events)  # the timeline, said
    for task in ("worker-0", "worker-1"):
        assert re.search(rf"resumed from {shared}/ckpt-\d+ at step [1-9]", run.log(task)), run.log(task)[
            -2000:
        ]
    assert not [e for e in events if e["kind"] == "state"], [e for e in events if e["kind"] == "state"]
    assert not list(shared.glob(".orchestrate-shared-*"))  # the proof taken away
    assert (run.run_dir / "model").is_dir()
    assert nothing_left(lab, run)


def test_a_killed_task_restarts_from_the_standby_steps_waiting_on_the_nodes(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "standby",
            {"nodes": 2, "tasks_per_node": {"worker": 1}},
            loop_job(),
            train={"steps": 100000, "checkpoint_every": 20, "global_batch_size": 32},
        ),
    )

    def events() -> list[dict[str, Any]]:
        return [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]

    proc = run.start()
    try:

        def ready() -> bool:
            return [s["state"] for s in run.status().get("standbys") or []] == ["ready", "ready"]

        assert wait_until(ready, 120), run.status()
        standbys = {s["task"]: (s["host"], s["pid"]) for s in run.status()["standbys"]}
        kill_task(run, "worker-1")
        assert wait_until(lambda: any(e["kind"] == "recovery" for e in events()), 90), events()[-5:]
        kept = {s["task"]: (s["host"], s["pid"]) for s in run.status()["standbys"]}
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # attempt 1's tasks were forked by the standbys (in steps that waited on the nodes), which
    # stayed for the next attempt; the timeline said
    attempt_1 = {e["task"]: e["reason"] for e in events() if e.get("new") == "STARTING" and e["attempt"] == 1}
    assert kept == standbys and set(attempt_1) == set(standbys), (kept, attempt_1)
    for task, (node, pid) in standbys.items():
        assert attempt_1[task].endswith(f" on {node}") and attempt_1[task] != f"pid {pid} on {node}"
    assert "started cold" not in (run.run_dir / "logs" / "worker-1.log").read_text()
    [recovery] = [e for e in events() if e["kind"] == "recovery"]
    assert recovery["reason"].startswith("attempt 1 training again") and recovery["reason"] in out
    assert nothing_left(lab, run)


def test_ps_job_places_chief_and_ps_on_one_node_and_workers_on_another(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "ps",
            {"nodes": 2, "tasks_per_node": [{"chief": 1, "ps": 1}, {"worker": 2}]},
            loop_job(),
            strategy="parameter_server",
            train={"steps": 60, "checkpoint_every": 30, "global_batch_size": 32},
        ),
    )
    res = run.up(timeout_s=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    hosts = {t["task"]: t["host"] for t in run.status()["tasks"]}
    n1, n2 = node_address(lab, "n1"), node_address(lab, "n2")
    assert hosts == {"chief-0": n1, "ps-0": n1, "worker-0": n2, "worker-1": n2}
    assert nothing_left(lab, run)


@pytest.mark.parametrize("how", ["ctrl-c", "down", "sigkill"])
def test_a_stop_leaves_nothing_on_any_node_and_nothing_queued(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path, how: str
) -> None:
    run = make(runs, lab, tmp_path, spec("stop", {"nodes": 2, "tasks_per_node": {"worker": 1}}), PLAIN)
    proc = run.start()
    try:
        run.wait_steps("worker-1", 5)
        assert len(run_processes(run.run_id)) >= 2
        plan = json.loads((run.run_dir / "plan.json").read_text())
        port = int(plan["cluster"]["worker"][1].split(":")[1])
        # another run on n2 will not choose it (the lock is in n2's own /tmp)
        assert port_locked(lab.on_node("n2", port_lock("n2", "{port}")), port)
        started = time.monotonic()
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        elif how == "sigkill":
            proc.kill()
        else:
            down = subprocess.run(
                [*run.command()[:3], "down", str(run.run_dir)],
                capture_output=True,
                text=True,
                timeout=60,
                env=run.env(),
            )
            assert down.returncode == 0, down.stdout + down.stderr
        grace_s = 3
        assert wait_until(lambda: nothing_left(lab, run), grace_s + 5, interval_s=0.2), (
            lab.jobs(),
            run_processes(run.run_id),
        )
        took_s = time.monotonic() - started
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert took_s < 8
    if how != "sigkill":
        assert proc.returncode == 130
        assert run.status()["state"] == "INTERRUPTED"


def test_an_allocation_cancelled_from_outside_ends_the_run_interrupted(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(runs, lab, tmp_path, spec("cancel", {"nodes": 2, "tasks_per_node": {"worker": 1}}), PLAIN)
    out = run.through("worker-0", 5, lambda: lab.run(["scancel", run.backend()["job_id"]], check=True), 60)
    assert run.returncode == 130, out[-2000:]
    status = run.status()
    assert status["state"] == "INTERRUPTED" and "ended from outside" in status["reason"], status["reason"]
    assert status["restarts"] == 0
    assert wait_until(lambda: nothing_left(lab, run), 10)


def test_inside_an_existing_allocation_it_is_used_and_left_alone(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    got = lab.run(["salloc", "--no-shell", "-N2", "-J", "outer"], check=True)
    job = re.search(r"Granted job allocation (\d+)", got.stderr)
    assert job, got.stderr
    job_id = job.group(1)
    try:
        nodelist = lab.run(["squeue", "-h", "-j", job_id, "-o", "%N"], check=True).stdout.strip()
        env = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": nodelist, "STEPS": "20", "FIRST_STEPS": "20"}
        run = make(
            runs, lab, tmp_path, spec("inside", {"nodes": 2, "tasks_per_node": {"worker": 1}}), PLAIN, env=env
        )
        res = run.up(timeout_s=120)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert run.backend()["owned"] is False and run.backend()["job_id"] == job_id
        assert f"{job_id} outer RUNNING" in lab.jobs()  # left as it was
        assert not [s for s in lab.steps() if "orchestrate-" in s]  # our steps are gone
    finally:
        lab.run(["scancel", job_id])


def test_a_cut_node_is_detected_in_time_and_the_job_restarts_on_the_spare(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    timeout_s = 4.0
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "cut",
            {"nodes": 3, "spare_nodes": 1, "tasks_per_node": {"worker": 1}},
            health={"heartbeat_timeout_s": timeout_s},
        ),
        PLAIN,
        env={"STEPS": "40"},
    )
    cut_at = 0.0

    def cut() -> None:
        nonlocal cut_at
        assert run.task("worker-1")["host"] == node_address(lab, "n2")
        cut_at = time.time()
        lab.cut("n2")

    try:
        out = run.through("worker-1", 5, cut, 120)
    finally:
        lab.restore("n2")
    assert run.returncode == 0, out[-3000:]
    lost = next(e for e in run.events() if e.get("task") == "worker-1" and e.get("new") == "LOST")
    detected_s = dt.datetime.fromisoformat(lost["time"].replace("Z", "+00:00")).timestamp() - cut_at
    assert detected_s <= timeout_s + 2, detected_s  # ours, not Slurm's SlurmdTimeout (20 s here)
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1
    assert run.task("worker-1")["host"] == node_address(lab, "n3")  # the spare
    assert "HOST n3" in run.log("worker-1")
    said = [e["reason"] for e in run.events() if e.get("kind") == "hosts"]
    assert len(said) == 1 and said[0].startswith("attempt 1: worker-1 moved from n2 (unreachable since "), (
        said
    )
    assert said[0].endswith(") to the spare n3"), said
    assert [(m["host"], m["state"]) for m in status["machines"]] == [
        ("n1", "in use"),
        ("n2", "lost"),
        ("n3", "in use"),
    ]
    # the task on the cut node stopped by itself (its coordinator out of reach)
    assert wait_until(lambda: not run_processes(run.run_id), 20), run_processes(run.run_id)
    lab.rejoin("n2", timeout_s=60)


def test_a_cut_node_without_a_spare_shrinks_the_job_to_the_nodes_left(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    slurm = {"nodes": 3, "tasks_per_node": {"worker": 1}}
    shrink = {"shrink": True, "min_workers": 2, "max_restarts": 2, "backoff_s": 0.5, "standby": "off"}
    run = make(
        runs,
        lab,
        tmp_path,
        spec("shrink", slurm, health={"heartbeat_timeout_s": 4.0}, restart=shrink),
        PLAIN,
        env={"STEPS": "40"},
    )
    try:
        out = run.through("worker-2", 5, lambda: lab.cut("n3"), 120)
    finally:
        lab.restore("n3")
    assert run.returncode == 0, out[-3000:]
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status
    assert [a["workers"] for a in status["attempts"]] == [3, 2]
    assert [(t["task"], t["host"], t["last_step"]) for t in status["tasks"]] == [
        ("worker-0", node_address(lab, "n1"), 40),
        ("worker-1", node_address(lab, "n2"), 40),
    ]
    said = [e["reason"] for e in run.events() if e.get("kind") == "hosts"]
    assert len(said) == 1 and said[0].startswith(
        "attempt 1: worker-2 left out with n3 (unreachable since "
    ), said
    assert said[0].endswith("no spare host is left; the job runs on 2 workers"), said
    assert "attempt 0 on 3 workers · attempt 1 on 2 workers" in out
    assert wait_until(lambda: not run_processes(run.run_id), 20), run_processes(run.run_id)
    lab.rejoin("n3", timeout_s=60)


@pytest.mark.parametrize(
    ("slurm", "said"),
    [
        ({"nodes": 5}, "slurm.nodes asks for 5 nodes; partition lab has 3"),
        ({"partition": "gpu"}, "slurm.partition 'gpu' does not exist on this cluster (partitions: lab)"),
        ({"python": "/nonexistent/python"}, "set slurm.python to the interpreter on the nodes"),
    ],
)
def test_a_request_the_cluster_cannot_run_is_exit_3_and_nothing_is_queued(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path, slurm: dict[str, Any], said: str
) -> None:
    run = make(
        runs, lab, tmp_path, spec("bad", {"nodes": 2, "tasks_per_node": {"worker": 1}, **slurm}), PLAIN
    )
    res = run.up(timeout_s=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert said in res.stderr
    assert lab.jobs() == []


def test_without_slurms_commands_up_is_exit_3_and_says_so(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    run = make(
        runs,
        lab,
        tmp_path,
        spec("nocmd", {"nodes": 2, "tasks_per_node": {"worker": 1}}),
        PLAIN,
        env={"PATH": str(empty)},
    )
    res = run.up(timeout_s=60)
    assert res.returncode == 3 and "Slurm's commands are not installed here" in res.stderr, res.stderr


def test_a_controller_that_does_not_answer_is_exit_3_within_the_connect_timeout(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(
        runs,
        lab,
        tmp_path,
        spec("ctld", {"nodes": 2, "tasks_per_node": {"worker": 1}, "connect_timeout_s": 2}),
        PLAIN,
    )
    lab.pause_controller()
    try:
        started = time.monotonic()
        res = run.up(timeout_s=60)
        took_s = time.monotonic() - started
    finally:
        lab.resume_controller()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "got no answer within 2 s" in res.stderr and "slurmctld" in res.stderr
    assert took_s < 2 + 6  # the CLI's own start included
    assert wait_until(lambda: lab.jobs() == [], 10)


def test_a_request_pending_past_the_queue_timeout_is_cancelled(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    got = lab.run(["salloc", "--no-shell", "--exclusive", "-N3", "-J", "other"], check=True)
    other = re.search(r"Granted job allocation (\d+)", got.stderr)
    assert other, got.stderr
    try:
        run = make(
            runs,
            lab,
            tmp_path,
            spec("queue", {"nodes": 2, "tasks_per_node": {"worker": 1}, "queue_timeout_s": 2}),
            PLAIN,
        )
        started = time.monotonic()
        res = run.up(timeout_s=60)
        took_s = time.monotonic() - started
        assert res.returncode == 3, res.stdout + res.stderr
        assert "still pending after 2 s (slurm.queue_timeout_s)" in res.stderr
        assert "the request is cancelled" in res.stderr
        assert took_s < 2 + 10
        assert [j for j in lab.jobs() if "orchestrate-" in j] == []
    finally:
        lab.run(["scancel", other.group(1)])


def test_plan_shows_the_slurm_lines_and_check_probes_the_nodes(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(runs, lab, tmp_path, spec("look", {"nodes": 2, "tasks_per_node": {"worker": 1}}), PLAIN)
    base = run.command()[:3]
    plan = subprocess.run(
        [*base, "plan", str(run.spec)], capture_output=True, text=True, timeout=60, env=run.env()
    )
    assert plan.returncode == 0, plan.stderr
    assert "salloc --no-kill --nodes=2 --ntasks-per-node=1" in plan.stdout and "srun" in plan.stdout
    check = subprocess.run(
        [*base, "check", str(run.spec)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**run.env(), "COLUMNS": "250"},
    )
    assert check.returncode == 0, check.stdout + check.stderr
    for name in ("n1", "n2", "n3"):
        assert name in check.stdout
    assert check.stdout.count("all reached") == 2, check.stdout  # the two nodes probed reach each other
    assert lab.jobs() == []


def test_a_time_limit_warning_checkpoints_and_goes_on_in_a_new_allocation_outside_the_budget(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    """A time limit's warning as Slurm sends it (warn_of_time_limit), with less time left than the
    lead: the tasks checkpoint, exit 42, and the job goes on in a new allocation."""
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "limit",
            {"nodes": 2, "tasks_per_node": {"worker": 1}, "time": "10:00"},
            loop_job(),
            train={"steps": 240, "checkpoint_every": 20, "global_batch_size": 32},
        ),
    )
    first = ""  # the allocation warned

    def warn() -> None:
        nonlocal first
        first = run.backend()["job_id"]
        warn_of_time_limit(lab, first)

    out = run.through("worker-0", 30, warn)
    assert run.returncode == 0, out[-3000:]
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 1 and status["restarts"] == 0
    reasons = " | ".join(e.get("reason", "") for e in run.events())
    assert "exited with code 42; preempted" in reasons
    assert f"job {first}: its time limit is" in reasons and "a new allocation" in reasons
    assert re.search(r"resumed from .*ckpt-\d+ at step [1-9]", run.log("worker-0"))
    assert not [j for j in lab.jobs() if j.startswith(f"{first} ")]
    assert run.backend()["job_id"] != first  # backend.json names the allocation the run ended in


def test_a_detached_run_goes_on_after_the_terminal_is_gone(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    run = make(
        runs,
        lab,
        tmp_path,
        spec("detached", {"nodes": 2, "tasks_per_node": {"worker": 1}}),
        PLAIN,
        env={"FIRST_STEPS": "40"},
    )
    res = subprocess.run(
        [*run.command(), "--detach"],
        capture_output=True,
        text=True,
        timeout=60,
        env=run.env(),
        start_new_session=True,  # as a terminal that closes: the run must not depend on this session
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert wait_until(lambda: run.status().get("state") == "SUCCEEDED", 120), run.status()
    assert wait_until(lambda: nothing_left(lab, run), 15)


@pytest.mark.parametrize("how", ["kill -9", "time limit"])
def test_nodes_that_share_no_disk_get_the_job_and_the_checkpoints_copied(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path, how: str
) -> None:
    """The run's folder and the job are where the nodes cannot see them (lab.login_only); each
    node's own disk is lab.scratch. A task killed, or a time limit's warning (a new allocation):
    the job resumes on every node from the owner's checkpoint, copied to them; the model comes
    home."""
    root = lab.login_only / tmp_path.name
    (root / "job" / "data").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "digits_loop.py", root / "job")
    shutil.copy(REPO / "examples" / "data" / "digits.npz", root / "job" / "data")
    run = make(
        runs,
        lab,
        root,
        spec(
            "ship",
            {"nodes": 2, "tasks_per_node": {"worker": 1}, "workdir": str(lab.scratch), "time": "10:00"},
            {"loop": "job/digits_loop.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
            train={"steps": 240, "checkpoint_every": 20, "global_batch_size": 32},
        ),
    )

    def act() -> None:
        if how == "kill -9":
            kill_task(run, "worker-1")
        else:
            warn_of_time_limit(lab, run.backend()["job_id"])

    out = run.through("worker-1", 30, act)
    assert run.returncode == 0, out[-3000:]
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 1
    assert status["restarts"] == (1 if how == "kill -9" else 0)
    reasons = " | ".join(e.get("reason", "") for e in run.events())
    assert "checkpoints of worker-0 copied from n1" in reasons
    resumed = [
        re.search(r"resumed from \S+ckpt-(\d+) at step (\d+)", run.log(t)) for t in ("worker-0", "worker-1")
    ]
    assert all(resumed), (run.log("worker-0")[-1500:], run.log("worker-1")[-1500:])
    assert resumed[0].group(2) == resumed[1].group(2) != "0"  # both nodes from the same checkpoint
    assert (run.run_dir / "model").is_dir()  # brought home from n1
    assert json.loads((run.run_dir / "plan.json").read_text())["tasks"][0]["cwd"].startswith(str(lab.scratch))


@pytest.mark.parametrize("where", ["login node only", "each node's own /tmp"])
def test_a_checkpoint_folder_said_to_be_shared_that_a_node_does_not_see_is_exit_3(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path, where: str
) -> None:
    """Declared shared (job.checkpoint_dir), it is proven so; on node-local disk it is not."""
    base = lab.login_only if where == "login node only" else Path("/tmp")
    folder = base / f"orchestrate-{lab.tag}-{tmp_path.name}-ckpt"
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "declared",
            {"nodes": 2, "tasks_per_node": {"worker": 1}},
            {"script": "job.py", "checkpoint_dir": str(folder)},
        ),
        PLAIN,
    )
    res = run.up(timeout_s=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"does not see {folder}, which the spec says every node shares" in res.stderr
    assert not list(folder.glob(".orchestrate-shared-*"))  # its proof taken away again
    assert lab.jobs() == []
    shutil.rmtree(folder, ignore_errors=True)


def test_the_keras_tutorials_own_tmp_backup_resumes_on_every_node_after_a_kill(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    """Issue 40: the Keras tutorial as written (`BackupAndRestore(backup_dir='/tmp/backup')`) on
    nodes whose run directory is shared and whose /tmp is each their own: worker-1 killed -9
    mid-epoch; the chief's backup (not proven shared: copied) reaches the other node before the
    restart, both resume from it and end with the same model; the run's checkpoints are not copied."""
    from tests.e2e.test_job_checkpoints import KERAS_TUTORIAL

    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
    run = make(
        runs,
        lab,
        tmp_path,
        spec(
            "own",
            {"nodes": 2, "tasks_per_node": {"worker": 1}},
            {"script": "job.py", "env": env},
            restart={"max_restarts": 3, "backoff_s": 0.5},
        ),
        KERAS_TUTORIAL,
    )
    proc = run.start()
    try:
        log = run.run_dir / "logs" / "worker-1.log"
        assert wait_until(lambda: log.exists() and "AT epoch 0 batch 50" in run.log("worker-1"), 150, 0.2)
        kill_task(run, "worker-1")
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    status = run.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status["failures"]
    assert status["checkpoint_folders"] == ["/tmp/backup", "/tmp/backup/chief"]
    starts = [t["restored"] for t in status["tasks"]]
    assert starts[0] == starts[1] and starts[0]["source"].startswith("/tmp/backup/chief/ckpt-"), starts
    reasons = [e.get("reason", "") for e in run.events() if e.get("kind") == "state"]
    assert any(r.startswith("/tmp/backup of worker-0 → n2 /tmp/backup: 3 file(s)") for r in reasons), reasons
    assert not any("checkpoints of" in r for r in reasons), reasons  # the run directory is shared
    # fit deleted the chief's backup at its end: the copy on n2 goes too (a next run starts fresh)
    ends = [e["reason"] for e in run.events() if e.get("kind") == "results"]
    assert any(r.startswith("/tmp/backup of worker-0 → n2 /tmp/backup at the end: ") for r in ends), ends
    assert any("removed" in r for r in ends), ends
    weights = [
        re.findall(r"WEIGHTS (\w+)", run.log(t).split("attempt 1 started")[1])
        for t in ("worker-0", "worker-1")
    ]
    assert weights[0] and weights[0] == weights[1], weights
    assert wait_until(lambda: nothing_left(lab, run), 15)


def test_a_hung_tasks_stacks_are_read_inside_its_step(
    lab: SlurmLab, runs: list[SlurmRun], tmp_path: Path
) -> None:
    hang = """
        import os, threading, time
        import worker
        lock = threading.Lock()
        def wait_for_lock():
            lock.acquire()
            lock.acquire()  # the planted deadlock
        for i in range(1, 100000):
            if os.environ["ORCHESTRATE_TASK"] == "worker-1" and i == 10:
                wait_for_lock()
            worker.report(step=i)
            time.sleep(0.05)
    """
    conf = spec("hang", {"nodes": 2, "tasks_per_node": {"worker": 1}}, health={"stall_timeout_s": 3})
    run = make(runs, lab, tmp_path, {**conf, "restart": {"max_restarts": 0}}, hang)
    res = run.up(timeout_s=240)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(x.strip() for x in res.stdout.splitlines() if x.strip().startswith("worker-1: in"))
    assert "in wait_for_lock (job.py:7), not in TensorFlow — the one the others wait for" in line, res.stdout
    doc = json.loads((run.run_dir / "stacks" / "attempt-0" / "worker-1.json").read_text())
    assert doc["method"] == "py-spy" and doc["host"] == "n2", doc  # read on its node, by its shim
    assert nothing_left(lab, run)
