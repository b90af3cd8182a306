"""The backend contract (orchestrator/launch/api.py): the same cases against every backend — local
subprocesses, real sshd hosts (tests/lab.py) and a real Slurm cluster (tests/slurm_lab.py) — with
real processes and real signals, no
TensorFlow. What the supervisor and `orchestrate down` rely on: placements for every task, a
backend record, exit codes, TERM → grace → KILL through `stop_all` with what could not be
confirmed returned as data, and `reattach` finding a run's processes from its records alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator import launch
from orchestrator.errors import LaunchError
from orchestrator.health.credentials import Credentials
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from orchestrator.launch.api import Backend, Heartbeats, TaskHandle, stop_all
from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.record.write import new_run_id
from orchestrator.spec.load import load_spec
from tests.conftest import run_processes, wait_until
from tests.lab import LoopbackLab, make_lab, why_no_lab
from tests.slurm_lab import SlurmLab, why_no_slurm

pytestmark = pytest.mark.e2e

# worker-0 fails at once; worker-1 ends cleanly on SIGTERM; worker-2 ignores SIGTERM.
SCRIPT = """
    import os, signal, sys, time
    import worker
    task = os.environ["ORCHESTRATE_TASK"]
    if task == "worker-0":
        sys.exit(3)
    if task == "worker-1":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("up", flush=True)
    for i in range(1, 100000):
        worker.report(step=i)
        time.sleep(0.1)
"""

TASKS = ("worker-0", "worker-1", "worker-2")


@dataclasses.dataclass
class Opened:
    backend: Backend
    plan: LaunchPlan
    record: dict[str, Any]
    logs: Path
    run_id: str
    credentials: Credentials

    def start(self, name: str, attempt: int = 0, *, wait_up: bool = True) -> TaskHandle:
        """Start a task; unless told not to, wait until its signal handling is in place."""
        log = self.logs / f"{name}-{attempt}.log"
        token = self.credentials.task_token(name, attempt)  # its own: a task with another stops itself
        handle = self.backend.start(self.plan.task(name), attempt, token, log)
        assert not wait_up or wait_until(lambda: b"\nup\n" in log.read_bytes(), 30), log.read_text()
        return handle


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if why_no_lab() is not None:
        yield None
        return
    lab = make_lab(tmp_path_factory.mktemp("lab"), 1)
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def loopback_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An sshd on a loopback port, run as the current user: the ssh backend tested in-process with
    no root (the namespaced lab above needs it)."""
    if why_no_lab() is not None:
        yield None
        return
    lab = LoopbackLab(tmp_path_factory.mktemp("loopback"), 1)
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def slurm_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab | None]:
    if why_no_slurm() is not None:
        yield None
        return
    with SlurmLab(nodes=3, shared=[tmp_path_factory.getbasetemp()]) as lab:  # the run directories
        lab.wait_ready(timeout_s=30)
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(lab.conf)  # the backend and `reattach` find the cluster here
        try:
            yield lab
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old


#: A backend from outside the project: a package registering it through the entry-point group
#: (tests/plugins: its module and its .dist-info, as pip installs them), found by name.
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


@pytest.fixture(scope="module")
def plugin_installed() -> Iterator[None]:
    sys.path.insert(0, str(PLUGINS))  # where an installed package's files are found
    try:
        yield
    finally:
        sys.path.remove(str(PLUGINS))


@pytest.fixture(scope="module", params=["local", "ssh", "ssh-loopback", "slurm", "pigeon"])
def opened(
    request: pytest.FixtureRequest, lab: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Opened]:
    if request.param == "pigeon":
        request.getfixturevalue("plugin_installed")
    root = tmp_path_factory.mktemp(request.param)
    (root / "job").mkdir()
    (root / "job" / "job.py").write_text(textwrap.dedent(SCRIPT))
    data: dict[str, Any] = {
        "name": "contract",
        "backend": request.param.partition("-")[0],
        "job": {"script": "job/job.py"},
        # the tasks' own guard (no coordinator for this long) stays out of the way
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 60},
    }
    if request.param.startswith("ssh"):
        hosts = lab if request.param == "ssh" else request.getfixturevalue("loopback_lab")
        if hosts is None:
            pytest.skip(why_no_lab() or "")
        data["hosts"] = [hosts.host_spec(0, tasks={"worker": 3})]
        data["ssh"] = hosts.ssh_spec()
    elif request.param == "slurm":
        if request.getfixturevalue("slurm_lab") is None:
            pytest.skip(why_no_slurm() or "")
        data["slurm"] = {"nodes": 3, "tasks_per_node": {"worker": 1}, "queue_timeout_s": 60}
    else:
        data["hosts"] = [{"address": "127.0.0.1", "tasks": {"worker": 3}}]
    (root / "spec.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(root / "spec.yaml")
    run_id, run_dir = new_run_id(spec.name), root / "run"
    (run_dir / "logs").mkdir(parents=True)
    store = HealthStore(time.monotonic)
    store.reset(0, TASKS)
    credentials = Credentials()
    server = HeartbeatServer(store, credentials).start()
    backend = launch.kind_of(spec).open(spec, run_id, run_dir, root)
    try:
        placements = backend.open(Heartbeats("127.0.0.1", server.port, server.url, credentials))
        plan = make_plan(spec, run_id, placements)
        credentials.place({t.name: t.host_index for t in plan.tasks})
        yield Opened(backend, plan, backend.record(), run_dir / "logs", run_id, credentials)
    finally:
        for proc in run_processes(run_id):
            proc.kill()
        backend.close()
        server.close()


def test_open_places_every_task_and_the_record_names_the_backend(opened: Opened) -> None:
    assert [t.name for t in opened.plan.tasks] == list(TASKS)
    assert len({t.address for t in opened.plan.tasks}) == 3  # one TF address each
    assert opened.record["backend"] == opened.backend.name
    assert json.loads(json.dumps(opened.record)) == opened.record  # written as backend.json


def test_an_exit_code_is_reported_and_the_exit_confirmed(opened: Opened) -> None:
    handle = opened.start("worker-0", wait_up=False)
    assert handle.process.pid > 0
    assert wait_until(lambda: handle.poll() is not None, 30)
    assert handle.poll() == 3
    assert wait_until(lambda: handle.exited, 10)
    assert stop_all([handle], grace_s=1.0) == []  # nothing left to stop


def test_stop_all_terms_a_task_and_confirms_its_exit(opened: Opened) -> None:
    handle = opened.start("worker-1")
    assert handle.poll() is None and not handle.exited
    started = time.monotonic()
    assert stop_all([handle], grace_s=20.0) == []
    assert time.monotonic() - started < 15  # it ended on TERM, not after the grace period
    assert handle.exited and handle.poll() == 0
    assert wait_until(lambda: run_processes(opened.run_id) == [], 5)


def test_a_task_ignoring_term_is_killed_after_the_grace_period(opened: Opened) -> None:
    handle = opened.start("worker-2")
    started = time.monotonic()
    assert stop_all([handle], grace_s=1.0) == []
    assert time.monotonic() - started >= 1.0
    assert handle.exited and handle.poll() == -9
    assert wait_until(lambda: run_processes(opened.run_id) == [], 5)


def test_a_program_that_cannot_start_is_a_launch_error(opened: Opened) -> None:
    task = dataclasses.replace(opened.plan.task("worker-1"), argv=("/nonexistent/python", "-c", "pass"))
    with pytest.raises(LaunchError, match="worker-1"):
        opened.backend.start(task, 0, "secret", opened.logs / "missing.log")


def test_reattach_stops_what_a_vanished_coordinator_left_from_the_records_alone(opened: Opened) -> None:
    handles = [opened.start(name, attempt=1) for name in ("worker-1", "worker-2")]
    assert wait_until(lambda: len(run_processes(opened.run_id)) == 2, 30)
    status = {  # as status.json records the run's tasks
        "run_id": opened.run_id,
        "state": "RUNNING",
        "tasks": [
            {
                "task": h.task.name,
                "pid": h.process.pid,
                "pgid": h.process.pgid,
                "create_time": h.process.create_time,
            }
            for h in handles
        ],
    }
    plan = json.loads(json.dumps(opened.plan.to_json()))
    lines = launch.reattach(opened.record, status, plan).stop(grace_s=1.0)
    assert lines and all(reached for _, reached in lines), lines
    assert wait_until(lambda: run_processes(opened.run_id) == [], 15), run_processes(opened.run_id)
    assert stop_all(handles, grace_s=1.0) == []  # their handles learn it too


def test_a_job_runs_on_a_backend_a_package_registers(tmp_path: Path) -> None:
    """`backend: pigeon`, a name no product file knows: `orchestrate up` finds it through the
    package's entry point and runs a 2-worker job on it to its end, its section of the spec
    (`pigeon:`) read by it; a typo of it is said."""
    (tmp_path / "job.py").write_text(
        "import os, sys, worker\n"
        "assert os.environ['PIGEON_MESSAGE'] == 'hello', os.environ.get('PIGEON_MESSAGE')\n"
        "for i in range(1, 21):\n    worker.report(step=i, loss=1.0 / i)\n"
    )
    spec = (
        "name: pigeon\nbackend: pigeon\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\n"
        "job: {script: job.py}\npigeon: {message: hello}\n"
    )
    (tmp_path / "spec.yaml").write_text(spec)
    paths = [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    up = [sys.executable, "-m", "orchestrator", "up", "spec.yaml", "--run-dir", "run", "--plain"]
    res = subprocess.run(up, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "SUCCEEDED" and [t["last_step"] for t in status["tasks"]] == [20, 20]
    assert json.loads((tmp_path / "run" / "backend.json").read_text())["backend"] == "pigeon"
    assert run_processes(status["run_id"]) == []
    (tmp_path / "typo.yaml").write_text(spec.replace("backend: pigeon", "backend: pidgeon"))
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "validate", "typo.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert (
        "typo.yaml:2: backend: no backend 'pidgeon' (did you mean 'pigeon'?); "
        "registered: local, ssh, slurm, pigeon" in res.stderr
    )
