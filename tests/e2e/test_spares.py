"""Lab machines come and go (issue 27): a host cut off (`ip link set eth0 down` in its namespace)
and its tasks go to a spare host, or the job shrinks to the hosts left; the owner's checkpoints
come home while it trains, so losing its host loses a checkpoint interval at most. Real SSH, real
TensorFlow, hosts that share no disk (tests/lab.py)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.conftest import run_processes, wait_until
from tests.e2e.test_separate_disks import KERAS_FIT, LOOP, TRAIN, final_weights
from tests.e2e.test_ssh import SshJob, cmdline
from tests.e2e.test_web_page import CHROMIUM
from tests.lab import make_lab, why_no_lab

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or "")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = make_lab(tmp_path_factory.mktemp("lab3"), 3)
    if not getattr(lab, "separate_disks", False):
        lab.close()
        pytest.skip("hosts that can be cut off, with disks of their own, need namespaces (root)")
    yield lab
    lab.close()


@pytest.fixture
def jobs(lab, tmp_path):
    made: list = []
    yield made
    for i in range(len(lab.hosts)):
        lab.restore(i)
    for job in made:
        for proc in run_processes(job.run_id):
            proc.kill()


def spare(lab, i: int) -> dict:
    entry = lab.host_spec(i, spare=True)
    del entry["tasks"]
    return entry


def loop_job(lab, root, jobs, hosts: list, **spec: object) -> SshJob:
    job = SshJob(lab, root, LOOP, hosts=len(lab.hosts))
    data = yaml.safe_load(job.spec.read_text())
    data["hosts"] = hosts
    data["job"] = {"loop": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "STEP_PAUSE_S": "0.1"}}
    data["train"] = dict(TRAIN)
    data["health"].update(heartbeat_timeout_s=4, stacks_timeout_s=1)  # a cut task's never answer
    data["restart"] = {"max_restarts": 3, "backoff_s": 1, "standby": "off"}
    data.update(spec)
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    return job


def tasks_on(lab, i: int) -> list[str]:
    """The run's processes on host i (its shims and tasks; not sshd's sessions)."""
    lines = [cmdline(pid) for pid in lab.pids(i)]
    return [line for line in lines if line and "sshd" not in line]


def backed_up_home(job) -> int:
    """The newest save of BackupAndRestore (its CheckpointManager's `ckpt-N`, one per epoch) in
    the home copy of the owner's checkpoints; 0 where none."""
    newest = 0
    for index in (job.run_dir / "checkpoints").rglob("checkpoint"):
        with contextlib.suppress(OSError):
            for number in re.findall(r'"ckpt-(\d+)"', index.read_text()):
                newest = max(newest, int(number))
    return newest


def hosts_said(job) -> list[str]:
    return [e["reason"] for e in job.events() if e.get("kind") == "hosts"]


def test_a_cut_hosts_worker_moves_to_the_spare_the_host_comes_back_as_one_and_takes_the_owners_tasks(
    lab, tmp_path, jobs, uninterrupted_loop_weights
):
    h = lab.hosts
    job = loop_job(lab, tmp_path / "spare", jobs, [lab.host_spec(0), lab.host_spec(1), spare(lab, 2)])
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 25, 120), job.status()
        lab.cut(1)
        assert wait_until(lambda: job.status()["attempt"] == 1 and job.steps() > 0, 90), job.status()
        # on the spare: worker-1 keeps its name and index, its TF_CONFIG names the spare
        assert job.task("worker-1")["host"] == h[2].address
        lab.restore(1)  # its orphan stopped by itself; the host is a spare again once it answers
        assert wait_until(lambda: not tasks_on(lab, 1), 30), tasks_on(lab, 1)
        assert wait_until(lambda: job.steps() >= 55, 90), job.status()
        lab.cut(0)  # the owner's host: its checkpoints are on its own disk, and at home
        cut_at = job.task("worker-0")["last_step"]
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 2, status
    said = hosts_said(job)
    assert said[0].startswith(f"attempt 1: worker-1 moved from {h[1].address} (unreachable since "), said
    assert said[0].endswith(f") to the spare {h[2].address}"), said
    since = said[-1].split(" since ")[1][:8]
    assert said[1:] == [
        f"{h[1].address} answers again: a spare from now on",
        f"attempt 2: worker-0 moved from {h[0].address} (unreachable since {since}) to the spare "
        f"{h[1].address}",
    ], said
    assert said[0] in out and said[2] in out  # the console said it too
    assert {t["task"]: t["host"] for t in status["tasks"]} == {
        "worker-0": h[1].address,
        "worker-1": h[2].address,
    }
    plan = json.loads((job.run_dir / "plan.json").read_text())
    assert plan["tasks"][0]["tf_config"]["cluster"]["worker"][0].startswith(f"{h[1].address}:")
    # resumed on the spare from the owner's checkpoint that came home while it trained
    restored = status["tasks"][0]["restored"]
    assert 0 <= cut_at - restored["step"] <= TRAIN["checkpoint_every"] + 15, (cut_at, restored)
    lab.restore(0)
    assert job.hosts_empty(30), job.host_pids()
    # the job moved twice and ends with the model of an uninterrupted run
    for a, b in zip(final_weights(job.run_dir), uninterrupted_loop_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def shown_restarts(run_dir) -> str:
    """The page's "Restarts and their causes" of an ended run (`orchestrate show`, a real browser)."""
    playwright = pytest.importorskip("playwright.sync_api")
    shown = run_dir.parent / "show.txt"
    argv = [sys.executable, "-m", "orchestrator", "show", str(run_dir), "--web", "127.0.0.1:0"]
    with open(shown, "wb") as out:
        show = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "token=" in shown.read_text(), 20), shown.read_text()
        url = shown.read_text().splitlines()[0].strip().split(": ", 1)[1]
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=30_000)
            try:
                page = browser.new_page()
                page.goto(url)
                page.wait_for_selector("#failures li", timeout=15_000)
                return str(page.locator("#failures").inner_text())
            finally:
                browser.close()
    finally:
        show.terminate()
        show.wait(timeout=10)


def test_a_keras_fit_job_that_loses_its_owners_host_shrinks_from_three_workers_to_two(lab, tmp_path, jobs):
    """No spare, the owner's host (worker-0, the chief of MWMS: BackupAndRestore's writer) cut: the
    job goes on with the two left, renumbered; the new worker-0 resumes from the backup that came
    home while it trained."""
    h = lab.hosts
    fit = KERAS_FIT.replace(".batch(32)", ".batch(24)")  # 24 splits over 3 replicas and over 2
    job = SshJob(lab, tmp_path / "fit", fit, hosts=3)
    data = yaml.safe_load(job.spec.read_text())
    data["job"]["env"] = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
    data["health"].update(heartbeat_timeout_s=4, stacks_timeout_s=1)
    data["restart"] = {"max_restarts": 2, "backoff_s": 1, "standby": "off", "shrink": True, "min_workers": 2}
    job.spec.write_text(yaml.safe_dump(data))
    jobs.append(job)
    proc = job.start()
    try:
        assert wait_until(lambda: (job.task("worker-0").get("last_step") or 0) >= 2, 120), job.status()
        # cut once epoch 1's backup has come home (the follower copies each new one): else the
        # cut races the copy, and the job rightly resumes from epoch 0's
        assert wait_until(lambda: backed_up_home(job) >= 2, 60), backed_up_home(job)
        lab.cut(0)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    status = job.status()
    assert status["restarts"] == 1 and [a["workers"] for a in status["attempts"]] == [3, 2], status
    assert {t["task"]: t["host"] for t in status["tasks"]} == {
        "worker-0": h[1].address,
        "worker-1": h[2].address,
    }
    said = hosts_said(job)
    since = said[0].split(" since ")[1][:8]
    assert said == [
        f"attempt 1: worker-0 left out with {h[0].address} (unreachable since {since}): no spare host is "
        "left; the job runs on 2 workers (the last attempt's worker-1 is worker-0, worker-2 is worker-1 now)"
    ], said
    assert "attempt 0 on 3 workers · attempt 1 on 2 workers" in out and said[0] in out, out
    for name in ("worker-0", "worker-1"):
        log = (job.run_dir / "logs" / f"{name}.log").read_text()
        second = log.split("attempt 1 started", 1)[1]
        begun = [int(line.split()[1]) for line in second.splitlines() if line.startswith("EPOCH ")]
        # BackupAndRestore resumed after the last epoch backed up, on two workers
        assert begun and begun[0] >= 2 and begun[-1] == 5, (name, begun)
        assert "DONE" in second
    lab.restore(0)
    assert job.hosts_empty(30), job.host_pids()
    if CHROMIUM is not None:  # the run's page says it too, under the restart's cause
        assert said[0] in shown_restarts(job.run_dir)
