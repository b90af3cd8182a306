"""`environment:` end to end (issue 38): lab hosts whose Python has no TensorFlow and no route to
any package index train in the environment made from the coordinator's wheels; a second run uses
it as it is; a changed requirement makes a new one, sending only what changed; a requirement
nobody can satisfy stops the launch before anything starts, in pip's words.

The wheels come from the tests' wheelhouse (tests/wheelhouse.py: made once per machine from the
package index, which `.ci/run` does before the suite): every spec here resolves from it alone
(`no_index`), so no run of these tests asks an index."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.e2e.test_ssh import SshJob
from tests.lab import NetnsLab, make_lab, why_no_lab

pytestmark = [pytest.mark.e2e]
HOST_PYTHON = "/usr/bin/python3"  # the hosts' own: Debian's, without TensorFlow

JOB = """
    import importlib.util, os, sys
    import worker
    try:
        import extra_pkg
        extra = extra_pkg.VALUE
    except ImportError:
        extra = None
    tf_found = importlib.util.find_spec("tensorflow") is not None
    print("PYTHON", sys.executable, "TF", tf_found, "EXTRA", extra, flush=True)
    if os.environ.get("TRAIN") == "1":  # else the environment is what is tested: no import of TF
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)
        step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
        for i in range(1, 6):
            step()
            worker.report(step=i)
        print("FINAL", float(v.numpy()), flush=True)
"""


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    return wheelhouse.ensure()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if why_no_lab() is not None or not Path(HOST_PYTHON).exists():
        pytest.skip(why_no_lab() or f"no {HOST_PYTHON}")
    lab = make_lab(tmp_path_factory.mktemp("lab"), 2)
    if not isinstance(lab, NetnsLab):
        lab.close()
        pytest.skip("hosts with disks of their own need the namespace lab (root)")
    yield lab
    lab.close()


class EnvJob(SshJob):
    """An ssh job whose coordinator keeps its wheels and resolutions in `cache` (not the user's)."""

    cache: Path
    web = False

    def env(self) -> dict[str, str]:
        return {**super().env(), "XDG_CACHE_HOME": str(self.cache)}

    def command(self) -> list[str]:
        return [*super().command(), *(["--web", "127.0.0.1:0"] if self.web else [])]


def _page_during_the_build(job: EnvJob) -> list[str]:
    """`up` with its page; the environment's events as the page gave them while it was built
    (asked once the console said a host was being sent its wheels). The run must succeed."""
    proc = job.start()
    assert proc.stdout is not None
    lines, url, shown = [], None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "the run's page: " in line:
                url = line.split("the run's page: ", 1)[1].split()[0]
            if "sending" in line and not shown:
                assert url is not None, "".join(lines)  # served before the build
                base, token = url.split("/?token=")
                ask = urllib.request.Request(
                    f"{base}/api/state?events=0", headers={"Authorization": f"Bearer {token}"}
                )
                with urllib.request.urlopen(ask, timeout=10) as answer:
                    events = json.loads(answer.read())["events"]
                shown = [e["reason"] for e in events if e.get("kind") == "environment"]
        assert proc.wait(timeout=600) == 0, "".join(lines)
    finally:
        proc.kill()
    return shown


def _job(
    lab, root: Path, cache: Path, requirements: list[str], links: list[Path], train: bool = False
) -> EnvJob:
    """Two hosts whose Python has no TensorFlow; the job trains (MWMS) with `train`, else it says
    where it runs and ends (the environment is what is tested, without TensorFlow's start)."""
    environment = {"requirements": requirements, "find_links": [str(p) for p in links], "no_index": True}
    spec = {
        "hosts": [lab.host_spec(i, python=HOST_PYTHON) for i in (0, 1)],
        "environment": environment,
        "health": {"startup_timeout_s": 120},
        "job": {"script": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "TRAIN": "1" if train else "0"}},
        "restart": {"max_restarts": 0, "standby": "off"},
    }
    job = EnvJob(lab, root, JOB, spec=spec, name="env")
    job.cache = cache
    return job


def _environment_events(job: SshJob) -> list[str]:
    return [e["reason"] for e in job.events() if e.get("kind") == "environment"]


@pytest.mark.wheelhouse
def test_hosts_without_tensorflow_train_in_the_environment_made_for_them(lab, wheels, tmp_path):
    for i in (0, 1):  # as the hosts: no TensorFlow, no route to any index
        host = lab.hosts[i]
        probe = "import socket; socket.create_connection(('192.0.2.2', 443), timeout=2)"
        for code in ("import tensorflow", probe):
            done = subprocess.run(
                [*host.exec_prefix(), HOST_PYTHON, "-c", code], capture_output=True, timeout=30
            )
            assert done.returncode != 0, code
    extra = tmp_path / "extra"
    extra.mkdir()
    wheelhouse.tiny_wheel(extra, "extra_pkg", "1.0")
    cache = tmp_path / "cache"
    tf = wheelhouse.requirements()[0]

    first = _job(lab, tmp_path / "first", cache, [tf], [wheels], train=True)
    check = subprocess.run(
        [sys.executable, "-m", "orchestrator", "check", str(first.spec)],
        capture_output=True, text=True, timeout=300, env=first.env(), cwd=first.root,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("to build (") == 2 and "MB to send)" in check.stdout, check.stdout
    first.web = True
    shown = _page_during_the_build(first)
    assert any("sending" in s for s in shown), shown  # the page showed the build as it went
    said = _environment_events(first)
    assert any("sending" in s for s in said) and any("environment built" in s for s in said), said
    built = _pythons(first)
    assert len(built) == 1, built  # the same environment's name on both hosts
    for i in (0, 1):
        log = (first.run_dir / "logs" / f"worker-{i}.log").read_text()
        assert "FINAL 10.0" in log and "TF True EXTRA None" in log, log[-2000:]
    record = json.loads((first.run_dir / "backend.json").read_text())
    assert [h["state"] for h in record["environment"]] == ["ready", "ready"], record

    second = _job(lab, tmp_path / "second", cache, [tf], [wheels])
    res = second.up(timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _environment_events(second) == []  # nothing resolved, sent or built
    assert _pythons(second) == built

    changed = _job(lab, tmp_path / "changed", cache, [tf, "extra_pkg==1.0"], [wheels, extra])
    res = changed.up(timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    said = _environment_events(changed)
    assert sum("sending 1 wheels" in s for s in said) == 2, said  # the new wheel alone, to each host
    assert _pythons(changed) != built
    for i in (0, 1):
        assert "TF True EXTRA 1.0" in (changed.run_dir / "logs" / f"worker-{i}.log").read_text()
        envs = lab.hosts[i].path(lab.hosts[i].home / ".orchestrate" / "envs")
        assert len([p for p in envs.iterdir() if not p.name.startswith(".")]) == 2  # keep: 3
    assert first.hosts_empty(), first.host_pids()


def _pythons(job: SshJob) -> set[str]:
    """The environments the tasks ran in, by name (each host's is under its own home)."""
    found = set()
    for i in (0, 1):
        host = job.lab.hosts[i]
        for line in (job.run_dir / "logs" / f"worker-{i}.log").read_text().splitlines():
            if line.startswith("PYTHON "):
                python = Path(line.split()[1])
                assert python.parents[1].parent == host.home / ".orchestrate" / "envs", line
                found.add(python.parents[1].name)
    return found


@pytest.mark.wheelhouse
def test_a_requirement_nobody_can_satisfy_stops_the_launch_in_pips_words(wheels, tmp_path):
    spec = tmp_path / "spec.yaml"
    (tmp_path / "job.py").write_text("print('never')\n")
    spec.write_text(
        "name: nope\njob: {script: job.py}\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\n"
        f"environment:\n  requirements: [no-such-package-anywhere==1.0]\n  find_links: [{wheels}]\n"
        "  no_index: true\n"
    )
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "up",
            str(spec),
            "--run-dir",
            str(tmp_path / "run"),
            "--plain",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 3, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "no-such-package-anywhere" in out and "No matching distribution" in out, out
    assert "this machine" in out and "nothing was started" in out, out
    assert not (tmp_path / "run" / "logs" / "worker-0.log").exists()
