from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def run_processes(run_id: str) -> list[psutil.Process]:
    """Every live process of a run, found by the ORCHESTRATE_RUN_ID its tasks carry."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("ORCHESTRATE_RUN_ID") == run_id:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@contextlib.contextmanager
def tmpfs_disk(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax) of its own at `folder`: a disk that can really fill up
    (root only; the test is skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


class CliRun:
    """One `orchestrate up` of a spec into a run directory, through the real CLI, and its record."""

    root: Path
    spec: Path
    run_dir: Path

    @property
    def run_id(self) -> str:
        """The run's id as its record says (never the folder's name); until the coordinator has
        written one, a value that matches no process."""
        for name in ("plan.json", "coordinator.json", "status.json"):
            try:
                run_id = json.loads((self.run_dir / name).read_text()).get("run_id")
            except (OSError, ValueError):
                continue
            if run_id:
                return str(run_id)
        return "<no run id recorded yet>"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "orchestrator",
            "up",
            str(self.spec),
            "--run-dir",
            str(self.run_dir),
            "--plain",
        ]

    def env(self) -> dict[str, str]:
        return _env()

    def up(self, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(), capture_output=True, text=True, timeout=timeout_s, cwd=self.root, env=self.env()
        )

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.root,
            env=self.env(),
        )

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def task(self, name: str) -> dict:
        return next((t for t in self.status().get("tasks", []) if t["task"] == name), {})

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class Job(CliRun):
    """A spec and its script in a temporary folder (local backend)."""

    def __init__(self, root: Path, script: str, spec_extra: str = "", workers: int = 2, name: str = "t"):
        self.root = root
        self.run_dir = root / "run"
        (root / "job.py").write_text(textwrap.dedent(script))
        self.spec = root / "spec.yaml"
        self.spec.write_text(
            textwrap.dedent(
                f"""\
                name: {name}
                hosts:
                  - address: 127.0.0.1
                    tasks: {{worker: {workers}}}
                job:
                  script: job.py
                  env: {{TF_CPP_MIN_LOG_LEVEL: "2"}}
                """
            )
            + textwrap.dedent(spec_extra)
        )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ORCHESTRATE_RUN_ID", None)
    return env


@pytest.fixture
def job_factory(tmp_path):
    made: list[Job] = []

    def make(script: str, spec_extra: str = "", **kw) -> Job:
        job = Job(tmp_path, script, spec_extra, **kw)
        made.append(job)
        return job

    yield make
    for job in made:  # whatever a test did, leave nothing behind
        for proc in run_processes(job.run_id):
            proc.kill()


@pytest.fixture(scope="session")
def uninterrupted_loop_weights(tmp_path_factory):
    """The final weights of tests/e2e/test_separate_disks.py's deterministic loop (TRAIN), trained
    on this machine by two local workers without a failure: what a run that lost a task or a host
    must end with. Trained once a session (the tests that compare with it share it)."""
    from tests.e2e.test_separate_disks import LOOP, TRAIN, final_weights

    root = tmp_path_factory.mktemp("uninterrupted")
    baseline = Job(root, "", workers=2)
    (root / "train.py").write_text(textwrap.dedent(LOOP))
    text = baseline.spec.read_text().replace("script: job.py", "loop: train.py")
    baseline.spec.write_text(text + f"train: {json.dumps(TRAIN)}\n")
    try:
        res = baseline.up(timeout_s=180)
        assert res.returncode == 0, res.stdout
        return final_weights(baseline.run_dir)
    finally:
        for proc in run_processes(baseline.run_id):
            proc.kill()
