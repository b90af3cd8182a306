"""CLI layer, the end of `orchestrate up` (orchestrator/cli/summary.py): its text and exit code."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.summary import summarize
from orchestrator.control import RunResult
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.record.quiet import job_traceback
from orchestrator.spec.model import Strategy
from orchestrator.states import ClusterState, FailureKind
from orchestrator.supervise.policy import Failure
from orchestrator.supervise.records import SupervisorResult
from worker.wire import TaskError


def outcome(
    run_dir: Path,
    state: ClusterState,
    cause: Failure | None = None,
    **kw: Any,
) -> RunResult:
    result = SupervisorResult(
        state=state,
        reason=kw.pop("reason", "the reason"),
        attempt=kw.pop("attempt", 1),
        restarts=kw.pop("restarts", 1),
        root_cause=cause,
        started_at="2026-01-01T00:00:00.000Z",
        ended_at="2026-01-01T00:01:00.000Z",
        **kw,
    )
    plan = LaunchPlan("demo", "demo-x", Strategy.MULTI_WORKER_MIRRORED, "local", {})
    return RunResult(run_dir=run_dir, result=result, plan=plan)


def write_log(run_dir: Path, task: str, *lines: str) -> Path:
    path = run_dir / "logs" / f"{task}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_of_a_failure_names_its_exit_code_and_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(
        tmp_path,
        "worker-1",
        "===== orchestrate: worker-1 attempt 0 started =====",
        "an earlier attempt",
        "===== orchestrate: worker-1 attempt 1 started =====",
        "loading data",
        "Segmentation fault",
    )
    cause = Failure(("worker-1",), FailureKind.EXIT, 1, "exited with code 139", exit_code=139)
    code = summarize(outcome(tmp_path, ClusterState.FAILED, cause, reason="budget exhausted"))
    out = capsys.readouterr().out
    assert code == 1
    assert "orchestrate: demo FAILED — budget exhausted" in out
    assert "  took 1:00 · attempts 2 · restarts 1\n" in out
    assert "  first failure: worker-1 exited with code 139\n" in out
    assert "  exit code: 139\n" in out
    assert f"  last lines of {log}:\n    | loading data\n    | Segmentation fault\n" in out
    assert "an earlier attempt" not in out  # only the last attempt's lines


def test_summary_shows_the_log_of_every_failed_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_log(tmp_path, "worker-0", "w0 waiting for its peer")
    write_log(tmp_path, "worker-1", "w1 never came up")
    cause = Failure(("worker-0", "worker-1"), FailureKind.STARTUP_TIMEOUT, 0, "not up within 120 s")
    code = summarize(outcome(tmp_path, ClusterState.FAILED, cause))
    out = capsys.readouterr().out
    assert code == 1
    assert "first failure: worker-0, worker-1 not up within 120 s" in out
    assert "exit code:" not in out
    assert "    | w0 waiting for its peer" in out
    assert "    | w1 never came up" in out
    assert out.index("worker-0.log") < out.index("worker-1.log")


def test_summary_shows_the_traceback_of_an_exception(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "train.py", line {i}\n' for i in range(30))
    tb += "ValueError: bad batch\n"
    err = TaskError("ValueError", "bad batch", tb)
    cause = Failure(
        ("worker-0",), FailureKind.EXCEPTION, 0, "raised ValueError: bad batch", error=err, step=3
    )
    summarize(outcome(tmp_path, ClusterState.FAILED, cause))
    out = capsys.readouterr().out
    assert "  traceback:\n" in out
    assert "    ValueError: bad batch\n" in out
    assert "line 29" in out and "line 15\n" not in out  # the last 15 lines only
    assert "last lines of" not in out  # that task wrote no log


JOB_TRACEBACK = """Traceback (most recent call last):
  File "/home/u/.orchestrate/runs/r1/lib/worker/__main__.py", line 78, in <module>
    runtime.flush_and_exit(main(sys.argv[1:]))
  File "/home/u/.orchestrate/runs/r1/lib/worker/task/runtime.py", line 78, in run_reported
    main()
  File "<frozen runpy>", line 291, in run_path
  File "<frozen runpy>", line 98, in _run_module_code
  File "/home/u/job/train.py", line 12, in <module>
    data = load("digits.npz")
  File "/home/u/job/train.py", line 5, in load
    return np.load(path)
           ^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/numpy/lib/npyio.py", line 427, in load
    fid = stack.enter_context(open(os_fspath(file), "rb"))
FileNotFoundError: [Errno 2] No such file or directory: 'digits.npz'
"""


def test_a_new_users_failure_shows_the_jobs_own_frames_and_its_own_last_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job that cannot find its data file, as a new user meets it (issue 26.5): the traceback
    starts at the job's code, and TensorFlow's start-up chatter is not taken for its last lines."""
    log = write_log(
        tmp_path,
        "worker-0",
        "===== orchestrate: worker-0 attempt 0 started =====",
        "I0000 00:00:1796150547.581546   29018 cudart_stub.cc:31] Could not find cuda drivers",
        "I0000 00:00:1796150547.581546   29018 port.cc:153] oneDNN custom operations are on.",
        "reading the data",
        "I0000 00:00:1796150547.6   29018 cpu_feature_guard.cc:227] This TensorFlow binary is optimized",
        *JOB_TRACEBACK.splitlines(),
    )
    err = TaskError("FileNotFoundError", "No such file", JOB_TRACEBACK)
    cause = Failure(("worker-0",), FailureKind.EXCEPTION, 0, "raised FileNotFoundError", error=err)
    summarize(outcome(tmp_path, ClusterState.FAILED, cause))
    out = capsys.readouterr().out
    after = out.split("  traceback:\n", 1)[1].splitlines()
    shown = list(itertools.takewhile(lambda line: line.startswith("    "), after))
    assert shown == [
        "    Traceback (most recent call last):",
        '      File "/home/u/job/train.py", line 12, in <module>',
        '        data = load("digits.npz")',
        '      File "/home/u/job/train.py", line 5, in load',
        "        return np.load(path)",
        "               ^^^^^^^^^^^^^",
        '      File "/venv/lib/python3.11/site-packages/numpy/lib/npyio.py", line 427, in load',
        '        fid = stack.enter_context(open(os_fspath(file), "rb"))',
        "    FileNotFoundError: [Errno 2] No such file or directory: 'digits.npz'",
    ]
    assert f"  last lines of {log} before the traceback:\n    | reading the data\n" in out
    assert "cudart_stub" not in out and "oneDNN" not in out and "cpu_feature_guard" not in out


def test_a_traceback_with_no_frame_of_the_job_is_shown_whole() -> None:
    """An error inside our runtime itself: nothing is left off (no frame is the job's)."""
    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/worker/task/runtime.py", line 78, in run_reported\n'
        "    main()\n"
        '  File "/x/worker/task/loop.py", line 89, in run\n'
        "    trainer = _Trainer(config)\n"
        "KeyError: 'steps'\n"
    )
    assert job_traceback(text) == text.rstrip().splitlines()
    # a chain: each of its tracebacks starts at the job's own code
    chained = (
        JOB_TRACEBACK + "\nThe above exception was the direct cause of the following exception:\n\n" + text
    )
    lines = job_traceback(chained, limit=100)
    assert sum("runtime.py" in line for line in lines) == 1  # the second traceback's, kept whole
    assert lines[1] == '  File "/home/u/job/train.py", line 12, in <module>'


def test_summary_lists_tasks_restarted_alone_and_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone = Failure(("evaluator-0",), FailureKind.EXIT, 0, "exited with code 2", exit_code=2)
    ignored = Failure(("evaluator-1",), FailureKind.LOST, 0, "no heartbeat for 10 s")
    code = summarize(
        outcome(tmp_path, ClusterState.SUCCEEDED, None, task_restarts=(alone,), ignored=(ignored,))
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "  restarted alone: evaluator-0 exited with code 2\n" in out
    assert "  reported, did not stop the job: evaluator-1 no heartbeat for 10 s\n" in out
    assert "first failure" not in out


def test_summary_of_a_success_shows_no_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cause = Failure(
        ("worker-1",), FailureKind.EXIT, 0, "exited with code 1", exit_code=1
    )  # a restart's cause
    write_log(tmp_path, "worker-1", "recovered")
    code = summarize(outcome(tmp_path, ClusterState.SUCCEEDED, cause, reason="done"))
    out = capsys.readouterr().out
    assert code == 0
    assert "demo SUCCEEDED — done" in out
    assert "first failure" not in out and "recovered" not in out


def test_summary_lists_what_was_brought_home(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = outcome(tmp_path, ClusterState.SUCCEEDED)
    result = RunResult(result.run_dir, result.result, result.plan, brought_home=("model/ (3 files)",))
    summarize(result)
    out = capsys.readouterr().out
    assert f"  brought home from the hosts into {tmp_path}:\n    model/ (3 files)\n" in out


@pytest.mark.parametrize(
    ("state", "kind", "expected"),
    [
        (ClusterState.SUCCEEDED, None, 0),
        (ClusterState.FAILED, FailureKind.EXIT, 1),
        (ClusterState.FAILED, FailureKind.EXCEPTION, 1),
        (ClusterState.FAILED, None, 1),
        (ClusterState.INTERRUPTED, None, 130),
        (ClusterState.INTERRUPTED, FailureKind.LAUNCH, 130),
        (ClusterState.FAILED, FailureKind.LAUNCH, 3),
    ],
)
def test_summary_exit_codes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    state: ClusterState,
    kind: FailureKind | None,
    expected: int,
) -> None:
    cause = Failure(("worker-0",), kind, 0, "went wrong", exit_code=1) if kind is not None else None
    assert summarize(outcome(tmp_path, state, cause)) == expected


def test_summary_follows_each_restarts_cause_with_its_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cause = Failure(("worker-1",), FailureKind.EXIT, 0, "was killed by SIGKILL (exit code -9)", exit_code=-9)
    line = "attempt 1 training again 2.9 s after worker-1 died: stop 0.3, start 0.1, connect 1.2"
    done = outcome(tmp_path, ClusterState.SUCCEEDED, cause, failures=(cause,))
    summarize(dataclasses.replace(done, status={"recoveries": [{"attempt": 1, "line": line}]}))
    out = capsys.readouterr().out
    assert f"  attempt 0 ended: worker-1 was killed by SIGKILL (exit code -9)\n  {line}\n" in out
