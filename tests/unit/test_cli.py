"""CLI layer (orchestrator/cli/commands.py): every command that needs no running job, called in-process
through `main([...])`, its output and its exit code (the summary at the end of `orchestrate up`:
test_summary.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator import cli
from orchestrator.launch.exposure import PRIVATE_NETWORK
from orchestrator.record import read as rundir
from tests.unit.test_spec import MINIMAL, REPO, y
from worker.host import stacks

LOCAL_SPEC = y(MINIMAL)  # the spec suite's minimal spec

SSH_SPEC = """\
name: demo
backend: ssh
hosts:
  - address: 10.255.255.1
    tasks: {worker: 2}
job:
  script: train.py
"""

BAD_SPEC = """\
name: demo
hosts:
  - address: 127.0.0.1
    tasks: {worker: 2}
    bogus: 1
job:
  script: train.py
"""


def spec_file(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach a host fails the test (instead of waiting for a timeout)."""

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError(f"a connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- validate, schema ------------------------------------------------------------------------------


def test_validate_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = spec_file(tmp_path, LOCAL_SPEC)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0
    assert out == f"{path}: ok — demo: multi_worker_mirrored, 2 tasks on 1 host(s), backend local\n"
    assert err == ""


def test_validate_with_a_backend_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = spec_file(tmp_path, SSH_SPEC)
    code, out, _ = run(capsys, "validate", str(path), "--backend", "local")
    assert code == 0
    assert out.rstrip().endswith("backend local")


def test_validate_an_unknown_backend_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "validate", str(spec_file(tmp_path, LOCAL_SPEC)), "--backend", "k8s")
    assert code == 2
    assert out == ""
    assert err == "orchestrate: --backend k8s: no backend 'k8s'; registered: local, ssh, slurm\n"
    code, _, err = run(capsys, "validate", str(spec_file(tmp_path, LOCAL_SPEC)), "--backend", "sssh")
    assert code == 2
    said = "no backend 'sssh' (did you mean 'ssh'?); registered: local, ssh, slurm"
    assert err == f"orchestrate: --backend sssh: {said}\n"


def test_validate_a_malformed_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = spec_file(tmp_path, BAD_SPEC, name="bad.yaml")
    code, out, err = run(capsys, "validate", str(path))
    assert code == 2
    assert out == ""
    assert f"{path}:5: hosts[0].bogus: unknown key" in err
    assert "Traceback" not in err


def test_validate_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope.yaml" in err and "Traceback" not in err


def test_schema_prints_the_specs_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "schema")
    assert code == 0
    schema = json.loads(out)
    assert {"name", "hosts", "job", "backend"} <= set(schema["properties"])


# --- plan -----------------------------------------------------------------------------------------


def test_plan_text_of_a_local_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(spec_file(tmp_path, LOCAL_SPEC)))
    assert code == 0
    assert out.startswith("demo: multi_worker_mirrored on the local backend, 2 tasks\n")
    assert "policy (spec key policy: <role>: {decides, on_failure, at_end}):" in out
    for name in ("worker-0", "worker-1"):
        assert f"\n{name}  host 127.0.0.1  port " in out
        assert f"ORCHESTRATE_TASK={name}" in out
    assert out.count("TF_CONFIG=") == 2
    assert "ORCHESTRATE_ATTEMPT=<0, 1, … per attempt>" in out
    standbys = "warm standbys (restart.standby: auto; each imports TensorFlow for the next attempt):\n"
    assert (
        standbys + "  127.0.0.1: 2 × 750 MiB = 1,500 MiB, where 2,048 MiB stay available with them\n" in out
    )


def test_plan_json_of_a_local_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(spec_file(tmp_path, LOCAL_SPEC)), "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["name"] == "demo" and plan["backend"] == "local"
    assert plan["network"]["isolated"] is True  # where its TF ports are reachable: its own namespace
    tasks = plan["tasks"]
    assert [t["name"] for t in tasks] == ["worker-0", "worker-1"]
    addresses = plan["cluster"]["worker"]
    for i, t in enumerate(tasks):
        assert t["tf_config"] == {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}}
        assert json.loads(t["env"]["TF_CONFIG"]) == t["tf_config"]
        assert t["address"] == addresses[i]


def test_plan_of_an_ssh_spec_reaches_no_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_network: None
) -> None:
    code, out, _ = run(capsys, "plan", str(spec_file(tmp_path, SSH_SPEC)))
    assert code == 0
    assert out.startswith("demo: multi_worker_mirrored on the ssh backend, 2 tasks\n")
    assert "worker-0  host 10.255.255.1  port " in out
    assert "cwd:     ~/.orchestrate/runs/demo-<time>-<random>/code" in out
    assert "ORCHESTRATE_RUN_DIR=~/.orchestrate/runs/demo-<time>-<random>\n" in out
    assert "PYTHONPATH=~/.orchestrate/runs/demo-<time>-<random>/lib" in out


def test_plan_json_of_an_ssh_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_network: None
) -> None:
    code, out, _ = run(capsys, "plan", str(spec_file(tmp_path, SSH_SPEC)), "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["backend"] == "ssh"
    assert plan["network"] == {
        "isolated": False,
        "reachable_from": "every address of 10.255.255.1, by whoever can reach them",
        "why": PRIVATE_NETWORK,
        "outbound": "each host's own network",
        "names": None,
    }
    assert all(t["host"] == "10.255.255.1" for t in plan["tasks"])
    assert all(t["tf_config"]["cluster"] == plan["cluster"] for t in plan["tasks"])


# --- check, up ------------------------------------------------------------------------------------


def test_check_of_a_local_spec_says_whether_a_hung_tasks_native_stacks_can_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = spec_file(tmp_path, LOCAL_SPEC)
    code, out, _ = run(capsys, "check", str(path))
    assert code == 0 and out.startswith(f"{path}: backend local runs every task on this machine\n")
    assert out.endswith(f"a hung task's stacks: native frames too ({stacks.find_py_spy()})\n"), out
    # without py-spy (a bare Python): said, with what to do; not a problem
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(bare / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, _ = run(capsys, "check", str(path))
    assert code == 0 and "warning: this machine: a hung task's stacks will have its Python frames only" in out
    assert "py-spy not installed" in out


def test_up_with_resume_and_another_run_dir_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = spec_file(tmp_path, LOCAL_SPEC)
    code, out, err = run(
        capsys, "up", str(path), "--resume", str(tmp_path / "x"), "--run-dir", str(tmp_path / "y")
    )
    assert code == 2
    assert err == "orchestrate: give either --resume RUN_DIR or --run-dir DIR, not both\n"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# --- status, logs, down on a fabricated run directory ---------------------------------------------


def task_entry(i: int, state: str, step: int | None = 10) -> dict[str, Any]:
    return {
        "task": f"worker-{i}",
        "role": "worker",
        "index": i,
        "host": "127.0.0.1",
        "state": state,
        "reason": "",
        "pid": None,
        "pgid": None,
        "create_time": None,
        "exit_code": 0 if state == "SUCCEEDED" else None,
        "last_step": step,
        "total_steps": 20,
        "metrics": {"loss": 0.125},
        "steps_per_s": 12.5,
        "rss_bytes": 200 * 2**20,
        "last_heartbeat_at": "2026-01-01T00:00:59.000Z",
    }


def fabricate_run(
    run_dir: Path, state: str = "SUCCEEDED", reason: str = "every deciding task exited 0"
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    status = {
        "name": "demo",
        "run_id": "demo-20260101-000000-0badcafe",
        "state": state,
        "attempt": 1,
        "restarts": 1,
        "reason": reason,
        "started_at": "2026-01-01T00:00:00.000Z",
        "ended_at": None if state == "RUNNING" else "2026-01-01T00:01:00.000Z",
        "tasks": [task_entry(0, state if state != "RUNNING" else "RUNNING"), task_entry(1, "FAILED", None)],
    }
    (run_dir / "status.json").write_text(json.dumps(status))
    (run_dir / "plan.json").write_text(json.dumps({"tasks": [{"name": "worker-0"}, {"name": "worker-1"}]}))
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "worker-0.log").write_text("zero one\nzero two\n")
    (run_dir / "logs" / "worker-1.log").write_text("one one\n")
    return run_dir


def test_status_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    code, out, _ = run(capsys, "status", str(run_dir), "--json")
    assert code == 0
    recorded = json.loads((run_dir / "status.json").read_text())
    assert json.loads(out) == recorded | {"coordinator": {"pid": None, "alive": False}, "stale": False}


def test_status_json_flags_a_run_whose_coordinator_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    code, out, _ = run(capsys, "status", str(run_dir), "--json")
    assert code == 0
    assert json.loads(out)["stale"] is True and json.loads(out)["state"] == "RUNNING"
    alive = fabricate_coordinator(run_dir)
    code, out, _ = run(capsys, "status", str(run_dir), "--json")
    assert json.loads(out)["stale"] is False
    assert json.loads(out)["coordinator"] == {"pid": alive, "alive": True}


def test_status_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    code, out, _ = run(capsys, "status", str(run_dir))
    assert code == 0
    assert "run directory:" in out and str(run_dir) in out.replace("\n", "")
    assert "demo SUCCEEDED" in out and "attempt 1" in out and "restarts 1" in out
    assert "worker-0" in out and "worker-1" in out
    assert "0.125" in out and "200 MiB" in out
    assert "every deciding task exited 0" in out
    assert "coordinator is gone" not in out


def test_status_of_a_failed_run_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="FAILED", reason="worker-1 exited with code 1")
    code, out, _ = run(capsys, "status", str(run_dir))
    assert code == 1
    assert "demo FAILED" in out


def test_status_of_a_run_whose_coordinator_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    code, out, _ = run(capsys, "status", str(run_dir))
    assert code == 0
    assert "its coordinator is gone" in out
    assert "orchestrate down" in out


def test_status_of_the_latest_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rundir, "RUNS_DIR", tmp_path / "runs")
    run_dir = fabricate_run(tmp_path / "runs" / "demo-1")
    code, out, _ = run(capsys, "status")
    assert code == 0
    assert str(run_dir) in out.replace("\n", "")  # rich may wrap a long path


def test_status_of_a_folder_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "status", str(tmp_path))
    assert code == 1
    assert "is not a run directory" in err and "Traceback" not in err


def test_logs_of_every_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    code, out, _ = run(capsys, "logs", str(run_dir))
    assert code == 0
    assert out.splitlines() == ["[worker-0] zero one", "[worker-0] zero two", "[worker-1] one one"]


def test_logs_of_one_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    code, out, _ = run(capsys, "logs", str(run_dir), "worker-1")
    assert code == 0
    assert out == "one one\n"


def test_logs_of_an_unknown_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    code, _, err = run(capsys, "logs", str(run_dir), "worker-7")
    assert code == 1
    assert "no log for worker-7" in err


@pytest.mark.parametrize("state", ["SUCCEEDED", "INTERRUPTED"])
def test_down_of_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], state: str) -> None:
    run_dir = fabricate_run(tmp_path / "run", state=state, reason="done")
    (run_dir / "backend.json").write_text(json.dumps({"backend": "local"}))
    code, out, _ = run(capsys, "down", str(run_dir))
    assert code == 0
    assert out == f"run demo: {state} (done)\n"


@pytest.mark.parametrize("command", ["down", "logs"])
def test_down_and_logs_write_to_the_current_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="SUCCEEDED", reason="done")
    code, out, _ = run(capsys, command, str(run_dir))
    assert code == 0
    assert out != ""


def test_exit_code_constants_match_the_documented_ones() -> None:
    assert (cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_LAUNCH, cli.EXIT_INTERRUPTED) == (
        0,
        1,
        2,
        3,
        130,
    )
    assert "130 interrupted" in (cli.__doc__ or "")


# --- the command line as a user types it (the spec suite's cases) --------------------------------


def orchestrate(
    capsys: pytest.CaptureFixture[str], *args: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    """`orchestrate ARGS` in-process, from folder `cwd` (as a user in that folder types it)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        code = cli.main(list(args))
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MINIMAL + "    hots: []\n", "bad.yaml:7: hots: unknown key"),
        (MINIMAL.replace("{worker: 2}", "{worker: 0}"), "bad.yaml:4: hosts[0].tasks.worker: "),
        ("name: demo\nhosts: [\n", "bad.yaml:2: (top level): YAML syntax error"),
    ],
    ids=["unknown-key", "zero-workers", "yaml-syntax"],
)
def test_cli_validate_bad_spec(
    tmp_path: Path, text: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "bad.yaml").write_text(y(text))
    proc = orchestrate(capsys, "validate", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_validate_good_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "good.yaml").write_text(y(MINIMAL))
    proc = orchestrate(capsys, "validate", "good.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_cli_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = orchestrate(capsys, "schema", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert {"name", "strategy", "backend", "hosts", "job", "train", "health", "restart", "ssh"} <= set(
        schema["properties"]
    )


def test_cli_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "good.yaml").write_text(
        y(
            """
            name: demo
            hosts:
              - address: 127.0.0.1
                tasks: {chief: 1, worker: 2}
            job:
              script: train.py
            """
        )
    )
    proc = orchestrate(capsys, "plan", "good.yaml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert [t["name"] for t in plan["tasks"]] == ["chief-0", "worker-0", "worker-1"]
    for t in plan["tasks"]:
        assert t["tf_config"]["task"] == {"type": t["role"], "index": t["index"]}
        assert t["tf_config"]["cluster"] == plan["cluster"]
        assert json.loads(t["env"]["TF_CONFIG"]) == t["tf_config"]
        assert "ORCHESTRATE_TOKEN" not in t["env"]
    assert len(plan["cluster"]["worker"]) == 2 and len(plan["cluster"]["chief"]) == 1


def test_cli_plan_bad_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.yaml").write_text("name: demo\n")
    proc = orchestrate(capsys, "plan", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "bad.yaml:1: hosts: required key is missing" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("spec", sorted((REPO / "cluster_specs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_validate_and_plan(spec: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every example spec is valid as shipped (the strategies' e2e tests run the same shapes)."""
    res = orchestrate(capsys, "plan", str(spec), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "policy (spec key policy" in res.stdout


def test_python_dash_m_orchestrator_is_the_same_command(tmp_path: Path) -> None:
    """The one case run as its own process: the module entry point, exit code and stderr."""
    (tmp_path / "train.py").write_text("")
    (tmp_path / "bad.yaml").write_text(y(MINIMAL + "    hots: []\n"))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "validate", "bad.yaml"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "bad.yaml:7: hots: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# --- scripting: --version, ls, wait, logs of the latest run, did you mean, --resume of an ended run ---


def fabricate_coordinator(run_dir: Path, resume_argv: list[str] | None = None) -> int:
    """coordinator.json naming this test's own process: a coordinator that is alive."""
    me = psutil.Process()
    info = {"run_id": "x", "pid": me.pid, "create_time": me.create_time(), "resume_argv": resume_argv}
    (run_dir / "coordinator.json").write_text(json.dumps(info))
    return me.pid


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    from orchestrator import __version__

    assert capsys.readouterr().out == f"orchestrate (tf-orchestrate) {__version__}\n"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{__version__}"' in pyproject


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [(["stauts"], "did you mean 'status'?"), (["schema", "stats"], "did you mean 'status'?")],
)
def test_a_mistyped_command_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], argv: list[str], suggestion: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert suggestion in capsys.readouterr().err


def test_a_mistyped_spec_key_gets_a_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = LOCAL_SPEC.replace("tasks:", "taks:") + "restart:\n  max_restrats: 2\n"
    code, _, err = run(capsys, "validate", str(spec_file(tmp_path, text)))
    assert code == 2
    assert "hosts[0].taks: unknown key; did you mean `tasks`?" in err
    assert "restart.max_restrats: unknown key; did you mean `max_restarts`?" in err


def test_ls_lists_runs_with_state_age_and_restarts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = fabricate_run(tmp_path / "runs" / "demo-1", state="FAILED", reason="x")
    os.utime(old / "status.json", (0, time.time() - 7200))
    fabricate_run(tmp_path / "runs" / "demo-2", state="RUNNING", reason="training")  # its coordinator gone
    (tmp_path / "runs" / "not-a-run").mkdir()
    code, out, _ = run(capsys, "ls", "--runs", str(tmp_path / "runs"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "AGE", "ATTEMPTS", "RESTARTS"]
    assert lines[1].split() == [str(old), "FAILED", "2", "h", "2", "1"]  # oldest first
    assert lines[2].split()[1] == "RUNNING?" and "coordinator is gone" in lines[3]
    code, out, _ = run(capsys, "ls", "--runs", str(tmp_path / "runs"), "--json")
    runs = [json.loads(line) for line in out.splitlines()]
    assert [(r["name"], r["state"], r["stale"], r["restarts"]) for r in runs] == [
        ("demo", "FAILED", False, 1),
        ("demo", "RUNNING", True, 1),
    ]


def test_ls_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", "--runs", str(tmp_path / "nothing"))
    assert code == 0 and "no runs under" in out


@pytest.mark.parametrize(("state", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("INTERRUPTED", 130)])
def test_wait_for_an_ended_run_exits_with_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: str, code: int
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state=state, reason="why")
    assert run(capsys, "wait", str(run_dir))[0] == code
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps(status | {"exit_code": 3}))  # as recorded
    got, out, err = run(capsys, "wait", str(run_dir))
    assert got == 3 and f"run demo: {state} (why)" in out + err


def test_wait_for_a_run_whose_coordinator_is_gone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    code, _, err = run(capsys, "wait", str(run_dir))
    assert code == 1 and "its coordinator is gone" in err and f"orchestrate down {run_dir}" in err


def test_wait_gives_up_after_its_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    fabricate_coordinator(run_dir)
    started = time.monotonic()
    code, out, _ = run(capsys, "wait", str(run_dir), "--timeout", "0.3")
    assert code == 124 and "still RUNNING after 0.3 s" in out
    assert time.monotonic() - started < 5


def test_wait_sees_the_end_of_a_run_that_ends_meanwhile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    fabricate_coordinator(run_dir)
    ended = fabricate_run(tmp_path / "ended", state="SUCCEEDED", reason="done")

    def finish() -> None:
        time.sleep(0.5)
        os.replace(ended / "status.json", run_dir / "status.json")

    threading.Thread(target=finish).start()
    code, out, _ = run(capsys, "wait", str(run_dir), "--timeout", "20")
    assert code == 0 and "run demo: SUCCEEDED (done)" in out


def test_wait_for_a_run_that_never_started(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("999999999\n")  # its coordinator is gone
    (run_dir / "coordinator.log").write_text("orchestrate: cannot reach hosts[0]\n")
    code, _, err = run(capsys, "wait", str(run_dir))
    assert code == 3 and "ended before it started" in err and "| orchestrate: cannot reach hosts[0]" in err


def test_logs_default_to_the_latest_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rundir, "RUNS_DIR", tmp_path / "runs")
    fabricate_run(tmp_path / "runs" / "demo-1")
    code, out, _ = run(capsys, "logs")
    assert code == 0 and out.splitlines()[0] == "[worker-0] zero one"
    code, out, _ = run(capsys, "logs", "worker-1")  # a task of the latest run
    assert code == 0 and out == "one one\n"


def test_resume_of_a_run_that_succeeded_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = spec_file(tmp_path, LOCAL_SPEC)
    run_dir = fabricate_run(tmp_path / "run", state="SUCCEEDED", reason="every training task exited 0")
    before = sorted(p.name for p in run_dir.iterdir())
    code, _, err = run(capsys, "up", str(path), "--resume", str(run_dir))
    assert code == 2
    assert "that run SUCCEEDED (every training task exited 0)" in err
    assert f"nothing to resume — start a new run: orchestrate up {path}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing started, nothing written


def test_down_says_how_to_resume_an_interrupted_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = fabricate_run(tmp_path / "run", state="INTERRUPTED", reason="interrupted by SIGTERM")
    argv = ["orchestrate", "up", str(tmp_path / "my spec.yaml"), "--resume", str(run_dir)]
    info = {"run_id": "x", "pid": 999999999, "create_time": 0.0, "resume_argv": argv}
    (run_dir / "coordinator.json").write_text(json.dumps(info))
    code, out, _ = run(capsys, "down", str(run_dir))
    assert code == 0
    assert "continue it from its checkpoints: orchestrate up 'my spec.yaml' --resume run\n" in out


def test_plan_with_a_fixed_port_in_use_shows_the_plan_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        fixed = LOCAL_SPEC.replace("tasks: {worker: 2}", f"tasks: {{worker: 2}}\n    base_port: {busy}")
        on_host = spec_file(tmp_path, fixed + "local: {isolate_network: off}\n", "on-host.yaml")
        code, out, err = run(capsys, "plan", str(on_host), "--json")
        assert code == 0
        assert [t["port"] for t in json.loads(out)["tasks"]] == [busy, busy + 1]
        assert f"warning: port {busy} for worker-0 (hosts[0].base_port) is in use" in err
        # in the run's own network namespace the host's listener is no matter
        code, out, err = run(capsys, "plan", str(spec_file(tmp_path, fixed)), "--json")
    assert code == 0
    assert [t["port"] for t in json.loads(out)["tasks"]] == [busy, busy + 1]
    assert "in use" not in err


def test_status_shows_the_runs_notable_events_with_their_causes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = fabricate_run(tmp_path / "run")
    task = {"kind": "task", "task": "worker-1"}
    events = [
        {**task, "time": "2026-01-01T00:00:05.000Z", "new": "RUNNING", "reason": "up"},
        {**task, "time": "2026-01-01T00:00:09.000Z", "new": "FAILED", "reason": "was killed by SIGKILL (-9)"},
        "{torn",
    ]
    (run_dir / "events.jsonl").write_text(
        "\n".join(e if isinstance(e, str) else json.dumps(e) for e in events)
    )
    code, out, _ = run(capsys, "status", str(run_dir))
    assert code == 0
    assert "events:" in out and "00:00:09 worker-1 FAILED: was killed by SIGKILL" in out
    assert "RUNNING: up" not in out  # only what a person must not miss


def test_status_of_a_run_whose_coordinator_died_stops_its_clock_at_the_last_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = fabricate_run(tmp_path / "run", state="RUNNING", reason="training")
    status = json.loads((run_dir / "status.json").read_text())
    status["started_at"] = "2026-01-01T00:00:00.000Z"
    (run_dir / "status.json").write_text(json.dumps(status))
    record_time = dt.datetime(2026, 1, 1, 0, 5, tzinfo=dt.timezone.utc).timestamp()
    os.utime(run_dir / "status.json", (record_time, record_time))  # written 5 min in, then it died
    code, out, _ = run(capsys, "status", str(run_dir))
    assert code == 0 and "5:00" in out and "its coordinator is gone" in out


def test_a_page_address_already_taken_is_exit_3_before_any_task_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page is served once the tasks are started (its import is not in their way); an address
    it cannot have is still said before anything starts."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run_dir = tmp_path / "run"
        spec = str(spec_file(tmp_path, LOCAL_SPEC))
        code, _, err = run(capsys, "up", spec, "--run-dir", str(run_dir), "--web", f"127.0.0.1:{port}")
    assert code == 3
    assert f"cannot serve the run's page on 127.0.0.1:{port} (--web): Address already in use" in err
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())  # nothing started
