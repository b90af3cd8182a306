"""Every task of a synchronous job starts an attempt from one state (supervise/restores.py): the
job's own checkpoint folders learned from the owner, restore reports compared, TensorFlow's
collective mismatch read as what it is after a restart."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from orchestrator.cli.hints import hints
from orchestrator.health.store import TaskHealth
from orchestrator.plan.launch_plan import LaunchPlan, StatePlan
from orchestrator.spec.model import Strategy
from orchestrator.states import FailureKind, TaskState
from orchestrator.supervise import detect, restores
from orchestrator.supervise.detect import TaskView
from orchestrator.supervise.policy import Action, job_decision
from tests.unit.test_detect import CONFIG
from tests.unit.test_policy import snap
from worker.wire import MAX_FOLDERS, Restored, TaskError

STATE = StatePlan(shared=False, owner="worker-0", readers=("worker-0", "worker-1"))
#: TensorFlow's words, as the tutorial case raised them (issue 24)
MISMATCH = (
    "Collective instance 122 expected type 1 and data_type 9 but got type 1 and data_type 1 "
    "[Op:CollectiveBcastRecv]"
)


def test_a_diverged_start_is_settled_only_when_every_reader_reported_the_same() -> None:
    same = Restored(step=75, fingerprint="aa")
    assert restores.diverged_start(STATE, ["worker-0", "worker-1"], {"worker-0": same}, 0) == (False, None)
    both = {"worker-0": same, "worker-1": same}
    assert restores.diverged_start(STATE, ["worker-0", "worker-1"], both, 0) == (True, None)
    fresh = Restored(step=0, fingerprint="bb")
    settled, failure = restores.diverged_start(
        STATE, ["worker-0", "worker-1"], {"worker-0": same, "worker-1": fresh}, 1
    )
    assert not settled and failure is not None
    assert failure.tasks == ("worker-1",) and failure.kind is FailureKind.DIVERGED and failure.attempt == 1


def test_a_job_that_restored_on_one_host_only_is_told_what_each_restored_and_the_fix() -> None:
    chief = Restored(step=0, fingerprint="0f3c", source="/tmp/backup/chief/ckpt-3", epoch=1, step_in_epoch=30)
    nothing = Restored(step=0, fingerprint=restores.NOTHING, source=None)
    _, failure = restores.diverged_start(
        STATE, list(STATE.readers), {"worker-0": chief, "worker-1": nothing}, 1
    )
    assert failure is not None and failure.tasks == ("worker-1",)
    assert failure.detail.startswith(
        "started from different states: worker-0 restored /tmp/backup/chief/ckpt-3 at epoch 1 batch 30; "
        "worker-1 restored nothing — /tmp/backup/chief differs between the hosts"
    )
    assert failure.detail.endswith("would average the gradients of different models")
    # the fix follows it in the summary, once
    (hint,) = hints([failure, failure], _plan(), Path("/nonexistent"))
    assert hint.startswith("hint: orchestrate keeps $ORCHESTRATE_CHECKPOINT_DIR and the folders")
    # the built-in loop's reports read as before: a step, a state
    loop = Restored(step=40, fingerprint="ab12", source="/r/checkpoints/ckpt-4")
    fresh = Restored(step=0, fingerprint="cd34")
    assert restores.where(loop) == "/r/checkpoints/ckpt-4 at step 40"
    assert restores.where(fresh) == "no checkpoint (fresh weights, state cd34)"


def _plan(strategy: Strategy = Strategy.MULTI_WORKER_MIRRORED) -> LaunchPlan:
    return LaunchPlan(name="t", run_id="t-1", strategy=strategy, backend="ssh", cluster={}, state=STATE)


def test_reports_are_compared_over_the_training_tasks_only() -> None:
    one = TaskHealth("worker-0", 1, restored=Restored(step=0, fingerprint="aa", source="/c/ckpt-1"))
    other = TaskHealth("worker-1", 1, restored=Restored(step=0, fingerprint=restores.NOTHING))
    tasks = {"worker-0": (True, one), "worker-1": (True, other)}
    settled, failure = restores.check_start(_plan(), tasks, 1)
    assert not settled and failure is not None
    # parameter_server's state is the chief's alone: nothing to compare
    assert restores.check_start(_plan(Strategy.PARAMETER_SERVER), tasks, 1) == (True, None)
    # a task outside the cluster (an evaluator) restores what it likes
    alone = {"worker-0": (True, one), "worker-1": (False, other)}
    assert restores.check_start(_plan(), alone, 1) == (True, None)


def test_restores_said_before_the_first_step_are_compared_only_to_explain_tensorflows_mismatch() -> None:
    """Issue 40: Keras's fit failed on a collective mismatch before its first step, where the final
    reports are made: the restores said as they happened name what differs, the coordinator's
    words first; without a mismatch they are not compared (a job may restore twice)."""
    chief = Restored(
        step=0, fingerprint="0f3c", source="/tmp/backup/chief/ckpt-1", step_in_epoch=30, final=False
    )
    nothing = Restored(step=0, fingerprint=restores.NOTHING, source=None, final=False)
    tasks = {
        "worker-0": (True, TaskHealth("worker-0", 1, restored=chief)),
        "worker-1": (True, TaskHealth("worker-1", 1, restored=nothing)),
    }
    assert restores.check_start(_plan(), tasks, 1) == (False, None)  # not final: not compared
    (verdict,) = detect.check_task(_raised(MISMATCH), 1.0, CONFIG, 1)
    assert verdict.failure is not None
    settled, failure = restores.check_start(_plan(), tasks, 1, [verdict.failure])
    assert not settled and failure is not None and failure.kind is FailureKind.DIVERGED
    assert failure.tasks == ("worker-1",)
    assert failure.detail.startswith(
        "started from different states: worker-0 restored /tmp/backup/chief/ckpt-1 at epoch 0 batch 30; "
        "worker-1 restored nothing — /tmp/backup/chief differs between the hosts"
    ), failure.detail
    assert "models (then worker-1 raised " in failure.detail, failure.detail
    assert failure.detail.endswith(f"InternalError: {MISMATCH})"), failure.detail
    # a task that said nothing before the mismatch counts as having restored nothing
    quiet = {**tasks, "worker-1": (True, TaskHealth("worker-1", 1))}
    assert restores.check_start(_plan(), quiet, 1, [verdict.failure])[1] is not None
    # the same restore said by both: TensorFlow's words stand (a mismatch of another cause)
    same = {n: (True, TaskHealth(n, 1, restored=chief)) for n in tasks}
    assert restores.check_start(_plan(), same, 1, [verdict.failure]) == (False, None)


def test_the_owners_folders_are_learned_once_each_the_outermost_kept_and_bounded() -> None:
    folders = restores.JobFolders()
    told = {
        "/tmp/backup": "tf_keras.callbacks.BackupAndRestore",
        "/tmp/backup/chief": "tf.train.CheckpointManager",
    }
    health = TaskHealth("worker-0", 0, folders=told)
    lines = folders.learn("worker-0", health)
    assert len(lines) == 2 and lines[0].startswith("worker-0 checkpoints to /tmp/backup (tf_keras")
    assert folders.learn("worker-0", health) == []  # told again: nothing new
    assert folders.learned_this_attempt
    plan = folders.plan(_plan())
    assert plan.state is not None and plan.state.job_folders == ("/tmp/backup",)
    assert folders.plan(plan) is plan
    folders.attempt_starts()
    assert not folders.learned_this_attempt
    many = {f"/data/c{i}": "tf.train.Checkpoint" for i in range(3 * MAX_FOLDERS)}
    folders.learn("worker-0", TaskHealth("worker-0", 1, folders=many))
    assert len(folders.folders) == MAX_FOLDERS
    # a resumed run starts with what its earlier attempts learned
    again = restores.JobFolders(["/tmp/backup"])
    assert not again.learned_this_attempt and again.plan(_plan()).state.job_folders == ("/tmp/backup",)  # type: ignore[union-attr]


def _raised(message: str, traceback: str = "Traceback…") -> TaskView:
    error = TaskError("tensorflow.python.framework.errors_impl.InternalError", message, traceback)
    return TaskView("worker-1", TaskState.RUNNING, True, 0.0, 1, TaskHealth("worker-1", 1, error=error))


@pytest.mark.parametrize(
    "message",
    [
        MISMATCH,
        "Shape mismatch in the collective instance 100. Op at device /job:worker/replica:0/task:1 expected "
        "shape [10] but another member in the group expected shape [12].",
    ],
)
def test_tensorflows_collective_mismatch_is_a_diverged_start_not_retried_while_nothing_changes(
    message: str,
) -> None:
    (verdict,) = detect.check_task(_raised(message), 1.0, CONFIG, 1)
    failure = verdict.failure
    assert failure is not None and failure.kind is FailureKind.DIVERGED
    assert (
        "the tasks' collectives do not match" in failure.detail
        and "restored different checkpoints" in failure.detail
    )
    decision = job_decision(failure, snap(first_attempt=False, restarts_used=1, max_restarts=3))
    assert decision.action is Action.FAIL and decision.reason.endswith("not restarted")
    # ... unless the attempt learned folders of the job's own: the next one has them on every host
    learned = dataclasses.replace(
        snap(first_attempt=False, restarts_used=1, max_restarts=3), learned_folders=True
    )
    assert job_decision(failure, learned).action is Action.RESTART_JOB
    spent = dataclasses.replace(learned, restarts_used=3)
    assert job_decision(failure, spent).action is Action.FAIL


def test_a_mismatch_past_the_messages_first_characters_is_read_in_the_traceback() -> None:
    """Keras's `in user code:` puts ~3,300 characters of its frames first (the tutorial case);
    the message a task reports keeps 2,000, its traceback ends with the whole message."""
    message = "in user code:\n\n" + '    File "training.py", line 1398, in train_function  *\n' * 60
    traceback = f"Traceback (most recent call last):\n  ...\nInternalError: {message[:200]}\n    {MISMATCH}\n"
    (verdict,) = detect.check_task(_raised(message[:2000], traceback), 1.0, CONFIG, 1)
    assert verdict.failure is not None and verdict.failure.kind is FailureKind.DIVERGED


def test_other_internal_errors_are_not_read_as_a_mismatch() -> None:
    (verdict,) = detect.check_task(_raised("Failed to connect to all addresses"), 1.0, CONFIG, 1)
    assert verdict.failure is not None and verdict.failure.kind is FailureKind.EXCEPTION


def test_a_resumed_run_keeps_the_folders_its_record_names_and_nothing_else(tmp_path: Path) -> None:
    from orchestrator.record.read import known_folders

    (tmp_path / "status.json").write_text(
        json.dumps({"name": "t", "checkpoint_folders": ["/tmp/backup", "relative", 3, "/" + "x" * 10]})
    )
    assert known_folders(tmp_path) == ["/tmp/backup", "/" + "x" * 10]
    (tmp_path / "status.json").write_text(json.dumps({"name": "t", "checkpoint_folders": "/tmp/backup"}))
    assert known_folders(tmp_path) == []
    assert known_folders(tmp_path / "nowhere") == [] and known_folders(None) == []
