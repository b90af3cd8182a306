"""worker/host/environment.py on this machine, as a host runs it: real uv, real processes, real files,
small wheels made by the test (tests/wheelhouse.py) and uv's own from the tests' wheelhouse.

A build "halfway" is made deterministic with a FIFO in place of a wheel: uv blocks reading it, so
the build is caught inside `uv pip install`, with its staging folder there."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.environment.local import LocalSite
from tests import wheelhouse
from tests.conftest import wait_until
from worker.host import ENVIRONMENT_SOURCE, RUNTIME_ROOT

pytestmark = pytest.mark.wheelhouse  # uv's own wheel comes from it


@pytest.fixture(scope="module")
def uv_wheel() -> Path:
    found = sorted(wheelhouse.ensure().glob("uv-*.whl"))
    assert found, "the tests' wheelhouse has no uv wheel"
    return found[-1]


class Host:
    """A work folder, with wheels in its file cache, as the coordinator leaves it."""

    def __init__(self, workdir: Path, uv_wheel: Path):
        self.workdir = workdir
        (workdir / "cache").mkdir(parents=True, exist_ok=True)
        self.uv = self.put(uv_wheel)

    def put(self, wheel: Path) -> dict:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel.is_file() else "f" * 64
        target = self.workdir / "cache" / digest
        if wheel.is_file():
            shutil.copyfile(wheel, target)
        else:  # a FIFO: uv blocks reading it
            os.mkfifo(target)
        return {"file": wheel.name, "sha256": digest, "size": 1}

    def manifest(self, wheels: list[dict], keep: int = 3) -> str:
        return json.dumps({"wheels": wheels, "uv": self.uv, "keep": keep}) + "\n"

    def start(self, mode: str, key: str, manifest: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-S", "-c", ENVIRONMENT_SOURCE, mode, str(self.workdir), key]
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert child.stdin is not None
        child.stdin.write(manifest)
        child.stdin.flush()
        return child

    def run(self, mode: str, key: str, manifest: str) -> dict:
        """As the coordinator asks (the local backend's own client: stdin open until the answer)."""
        return LocalSite(sys.executable, self.workdir).ask(mode, key, manifest, lambda _: None)

    def age(self, name: str) -> None:
        """Environment `name` last asked for an hour ago."""
        then = time.time() - 3600
        os.utime(self.workdir / "envs" / name / ".orchestrate-env", (then, then))

    def envs(self) -> list[str]:
        return sorted(p.name for p in (self.workdir / "envs").iterdir())


@pytest.fixture
def host(tmp_path, uv_wheel) -> Host:
    return Host(tmp_path / "work", uv_wheel)


def test_a_built_environment_is_ready_and_runs_its_packages(host, tmp_path):
    wheel = host.put(wheelhouse.tiny_wheel(tmp_path, "tiny_pkg", "1.0"))
    manifest = host.manifest([wheel])
    assert host.run("ready", "k1", manifest) == {**host.run("ready", "k1", manifest), "ready": False}
    assert host.run("ready", "k1", manifest)["missing"] == []
    built = host.run("build", "k1", manifest)
    assert built["ready"] and built["built"] and built["packages"] == 1
    python = host.workdir / "envs" / "k1" / "bin" / "python"
    assert built["python"] == str(python)
    # compiled at build, as pip does (before any import): a task run with PYTHONDONTWRITEBYTECODE=1
    # compiles nothing, nor does any first start write into the environment
    assert list((host.workdir / "envs" / "k1").glob("lib/python3*/site-packages/__pycache__/tiny_pkg.*.pyc"))
    said = subprocess.run(
        [python, "-c", "import tiny_pkg; print(tiny_pkg.VALUE)"], capture_output=True, text=True
    )
    assert said.stdout.strip() == "1.0", said.stderr
    assert host.run("ready", "k1", manifest)["ready"] is True
    again = host.run("build", "k1", manifest)  # another run that raced to build it: nothing done
    assert again["ready"] and again["built"] is False


def test_a_build_killed_halfway_leaves_nothing_a_later_run_uses(host, tmp_path):
    blocking = host.put(tmp_path / "slow_pkg-1.0-py3-none-any.whl")  # a FIFO: uv waits in it
    child = host.start("build", "k2", host.manifest([blocking]))
    envs = host.workdir / "envs"
    assert wait_until(
        lambda: envs.is_dir() and any(p.name.startswith(".part-k2-") for p in envs.iterdir()), 60
    )
    assert wait_until(lambda: _uv_running(child.pid), 30)  # inside `uv pip install`
    os.killpg(child.pid, signal.SIGKILL)  # the host rebooted, the coordinator's kill -9 reached it...
    child.wait(timeout=10)
    assert host.run("ready", "k2", host.manifest([blocking]))["ready"] is False
    assert not (envs / "k2").exists()
    # a later build of another environment sweeps the part away, and works
    wheel = host.put(wheelhouse.tiny_wheel(tmp_path, "tiny_pkg", "1.0"))
    assert host.run("build", "k3", host.manifest([wheel]))["ready"]
    assert host.envs() == [".id", ".k2.lock", ".k3.lock", ".prune.lock", ".uv-cache.lock", "k3"]


def test_the_coordinator_gone_stops_the_build_and_removes_the_part(host, tmp_path):
    blocking = host.put(tmp_path / "slow_pkg-1.0-py3-none-any.whl")
    child = host.start("build", "k4", host.manifest([blocking]))
    assert wait_until(lambda: _uv_running(child.pid), 60)
    assert child.stdin is not None
    child.stdin.close()  # the channel closed: the coordinator died or lost the host
    child.wait(timeout=30)
    assert child.stderr is not None
    err = child.stderr.read()
    assert child.returncode != 0 and "went away" in err, err
    assert [p.name for p in (host.workdir / "envs").iterdir() if p.name.startswith(".part")] == []
    assert not (host.workdir / "envs" / "k4").exists()


def test_old_environments_go_beyond_keep_but_never_one_a_task_holds(host, tmp_path):
    """keep: 1. Removed: what no task holds and no run asked for within the grace (a run asked
    for an environment just now may be about to start in it: `host.age` is time passing)."""
    wheels = [host.put(wheelhouse.tiny_wheel(tmp_path, "tiny_pkg", v)) for v in ("1.0", "2.0", "3.0")]
    assert host.run("build", "a", host.manifest([wheels[0]], keep=1))["ready"]
    holder = subprocess.Popen(  # a task in environment a: the worker holds it while it lives
        [str(host.workdir / "envs" / "a" / "bin" / "python"), "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); from worker.task import held; "
         "held.hold(); print('held', flush=True); sys.stdin.read()", str(RUNTIME_ROOT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        host.age("a")
        assert host.run("build", "b", host.manifest([wheels[1]], keep=1))["removed"] == []  # a in use
    finally:
        holder.communicate(timeout=30)
    assert host.run("build", "c", host.manifest([wheels[2]], keep=1))["removed"] == ["a"]  # b: just asked
    host.age("b")
    host.age("c")
    assert sorted(host.run("build", "d", host.manifest([wheels[2]], keep=1))["removed"]) == ["b", "c"]
    assert [n for n in host.envs() if not n.startswith(".")] == ["d"]
    cache = {p.name for p in (host.workdir / "cache").iterdir()}
    assert wheels[2]["sha256"] in cache  # d's own (c had it too)
    assert not {wheels[0]["sha256"], wheels[1]["sha256"]} & cache
    assert host.uv["sha256"] in cache  # every build needs it


def test_a_work_folder_that_is_not_ours_is_refused(host, tmp_path):
    (host.workdir / "envs").symlink_to(tmp_path)  # planted: builds must not follow it
    child = host.start("build", "k5", host.manifest([]))
    _, err = child.communicate(timeout=30)
    assert child.returncode != 0 and "not a folder of this user's" in err, err


def _uv_running(pid: int) -> bool:
    import psutil

    try:
        return any(Path(c.exe()).name.startswith("uv") for c in psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return False


def test_a_task_whose_environment_is_gone_stops_saying_so(tmp_path):
    code = "import sys; sys.path.insert(0, sys.argv[1]); from worker.task import held; held.hold()"
    env = {**os.environ, "ORCHESTRATE_ENVIRONMENT": str(tmp_path / "envs" / "gone")}
    done = subprocess.run(
        [sys.executable, "-c", code, str(RUNTIME_ROOT)], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "is gone" in done.stderr, done.stderr


def test_a_changed_environment_links_the_wheels_it_shares_from_uvs_cache(host, tmp_path):
    """uv keeps what it unpacked by the wheel's path: the wheels lie at paths that never change,
    so the second environment's copy of a shared wheel is the first's file, not unpacked again."""
    shared = host.put(wheelhouse.tiny_wheel(tmp_path, "tiny_pkg", "1.0"))
    extra = host.put(wheelhouse.tiny_wheel(tmp_path, "extra_pkg", "1.0"))
    host.run("build", "one", host.manifest([shared]))
    host.run("build", "two", host.manifest([shared, extra]))
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    files = [
        host.workdir / "envs" / k / "lib" / version / "site-packages" / "tiny_pkg.py" for k in ("one", "two")
    ]
    assert files[0].read_text() == files[1].read_text() == "VALUE = '1.0'\n"
    assert files[0].stat().st_ino == files[1].stat().st_ino  # one file, linked from uv's cache
