"""Hostile input and hostile neighbours against a live run (issue 13): a flood of connections, a
task forging another's heartbeats, a run directory whose disk fills up, secrets in the spec. Real
coordinators, real sockets, a real tmpfs; each job needs no TensorFlow."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_processes, tmpfs_disk, wait_until
from worker.wire.dial import dial

pytestmark = pytest.mark.e2e

STEPS = """
    import os, time
    import worker
    for i in range(1, {steps} + 1):
        worker.report(step=i, loss=1.0 / i)
        time.sleep({sleep})
"""


def coordinator_url(job) -> str:
    assert wait_until(lambda: (job.run_dir / "coordinator.json").exists(), 30)
    return json.loads((job.run_dir / "coordinator.json").read_text())["heartbeat_url"]


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path.name} ends in a torn line"
    return [json.loads(line) for line in text.splitlines()]


def test_a_flood_of_idle_connections_cannot_stop_a_run(job_factory):
    job = job_factory(
        STEPS.format(steps=60, sleep=0.1), "health: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 3}\n"
    )
    # the coordinator's open files: 1,024 (it keeps a reserve for its record; the rest for connections)
    proc = subprocess.Popen(
        ["prlimit", "--nofile=1024:1024", "--", *job.command()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=job.root,
    )
    held: list[socket.socket] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # room for the flood
    try:
        url = coordinator_url(job)  # the run's Unix socket (its tasks in a network namespace of their own)
        assert url.startswith("unix:"), url
        assert wait_until(lambda: job.status().get("state") == "RUNNING", 60), job.status()
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:  # 3,000 open at all times
            held = [s for s in held if not _closed(s)]
            for _ in range(3000 - len(held)):
                with contextlib.suppress(OSError):
                    held.append(dial(url, 2.0))
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if proc.poll() is None:
            proc.kill()
    print("held up to 3,000 idle connections; the coordinator's open-files limit 1,024")
    assert proc.returncode == 0, out
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 0, status
    assert [t["last_step"] for t in status["tasks"]] == [60, 60]
    assert "Traceback" not in out and "Too many open files" not in out
    assert run_processes(job.run_id) == []


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


FORGER = """
    import http.client, json, os, time
    import worker
    from worker.wire.dial import dial  # the coordinator's Unix socket (or an http:// URL)
    task = os.environ["ORCHESTRATE_TASK"]
    for i in range(1, 21):
        worker.report(step=i)
        time.sleep(0.1)
        if task == "worker-1" and i == 5:
            # its own credential, another task's name (a pid and seq meant to drown the real one's);
            # then its own name, with a point that names another task
            for name, point in (("worker-0", {"step": 999}), ("worker-1", {"step": 999, "task": "worker-0"})):
                forged = json.dumps({"task": name, "attempt": 0, "seq": 10**9, "sent_at": time.time(),
                                     "pid": 1, "points": [point]}).encode()
                sock = dial(os.environ["ORCHESTRATE_COORDINATOR"], 5)
                head = (f"POST /v1/heartbeat HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: {len(forged)}\\r\\n"
                        f"X-Orchestrate-Token: {os.environ['ORCHESTRATE_TOKEN']}\\r\\n\\r\\n")
                sock.sendall(head.encode() + forged)
                answer = http.client.HTTPResponse(sock)
                answer.begin()
                print("FORGED: accepted" if answer.status == 200 else f"FORGED: {answer.status}", flush=True)
                sock.close()
"""


def test_a_task_cannot_speak_for_another(job_factory):
    job = job_factory(FORGER, "health: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 3}\n")
    res = job.up(timeout_s=120)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (job.run_dir / "logs" / "worker-1.log").read_text()
    assert "FORGED: 403\nFORGED: 400\n" in log and "accepted" not in log
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 0  # worker-0 was never taken for lost
    points = whole_lines(job.run_dir / "metrics.jsonl")
    assert [p["step"] for p in points if p["task"] == "worker-0"] == list(range(1, 21))  # each once
    assert not any(p["step"] == 999 for p in points)  # none forged


@pytest.fixture
def small_disk(tmp_path: Path):
    with tmpfs_disk(tmp_path / "disk", "4m") as disk:
        yield disk


def test_a_run_directory_that_fills_up_stops_the_job_cleanly(job_factory, small_disk):
    job = job_factory(STEPS.format(steps=600, sleep=0.05))
    job.run_dir = small_disk / "run"
    proc = job.start()
    try:
        assert wait_until(lambda: (job.task("worker-1").get("last_step") or 0) >= 5, 60), job.status()
        fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 65536)
        os.close(fd)
        filled = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - filled
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"stopped {took:.1f} s after its disk filled up")
    assert proc.returncode == 1, out
    assert "Traceback" not in out
    status = job.status()  # written in the room the record kept for it
    assert status["state"] == "FAILED", status
    assert "No space left on device" in status["reason"] and "the job is stopped" in status["reason"]
    assert [t["state"] for t in status["tasks"]] == ["STOPPED", "STOPPED"]
    whole_lines(job.run_dir / "events.jsonl")
    points = whole_lines(job.run_dir / "metrics.jsonl")
    steps = [p["step"] for p in points if p["task"] == "worker-0"]
    assert steps == list(range(1, len(steps) + 1))  # what was written is whole and in order
    assert run_processes(job.run_id) == []


SECRETS = """
    import hashlib, os
    import worker
    for name in ("WANDB_API_KEY", "LAB_PROXY"):
        print(name, hashlib.sha256(os.environ[name].encode()).hexdigest()[:12], flush=True)
    worker.report(step=1)
"""


def test_secret_values_stay_out_of_the_record_and_the_console(job_factory):
    job = job_factory(SECRETS)
    spec = job.spec.read_text().replace(
        'env: {TF_CPP_MIN_LOG_LEVEL: "2"}',
        'env: {TF_CPP_MIN_LOG_LEVEL: "2", WANDB_API_KEY: "wandb-s3cret-4242", LAB_PROXY: "proxy-s3cret-77"}\n'
        "  secret_env: [LAB_PROXY]",
    )
    job.spec.write_text(spec)
    res = job.up(timeout_s=120)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (job.run_dir / "logs" / "worker-0.log").read_text()
    for name, value in (("WANDB_API_KEY", "wandb-s3cret-4242"), ("LAB_PROXY", "proxy-s3cret-77")):
        assert f"{name} {hashlib.sha256(value.encode()).hexdigest()[:12]}" in log  # the task had it
        assert value not in res.stdout + res.stderr
        for path in job.run_dir.rglob("*"):
            if path.is_file():
                assert value.encode() not in path.read_bytes(), path
    plan = json.loads((job.run_dir / "plan.json").read_text())
    assert plan["tasks"][0]["env"]["WANDB_API_KEY"] == "<redacted>"
    assert "WANDB_API_KEY" in (job.run_dir / "spec.yaml").read_text()  # the copy keeps its shape
