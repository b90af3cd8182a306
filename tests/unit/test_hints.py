"""CLI output layer (orchestrator/cli/hints.py): the Keras-3-under-distribution hint, with the spec
line to edit, given only where it is sure."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.hints import hints, keras3_hint
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.states import FailureKind
from orchestrator.supervise.policy import Failure
from tests.unit.test_supervisor import plan_of
from worker.wire import TaskError

KERAS3_TB = """Traceback (most recent call last):
  File "/work/job.py", line 40, in <module>
    model.fit(ds, epochs=3)
  File "/venv/lib/python3.11/site-packages/keras/src/utils/traceback_utils.py", line 122, in error_handler
    raise e.with_traceback(filtered_tb) from None
ValueError: Attempt to convert a value (PerReplica:{
  0: <tf.Tensor: shape=(), dtype=float32, numpy=0.5>
}) with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor.
"""
MESSAGE = TB_MESSAGE = KERAS3_TB.split("ValueError: ", 1)[1]

SPEC = """\
name: demo
hosts:
  - address: 127.0.0.1
    tasks: {worker: 2}
job:
  script: job.py
  env:
    TF_CPP_MIN_LOG_LEVEL: "2"
"""


def plan(tmp_path: Path, legacy_keras: bool = False) -> LaunchPlan:
    text = SPEC + ('    TF_USE_LEGACY_KERAS: "1"\n' if legacy_keras else "")
    return plan_of(tmp_path, text, {"worker-0": 20000, "worker-1": 20001})


def failure(message: str = MESSAGE, traceback: str = KERAS3_TB) -> Failure:
    return Failure(
        ("worker-0",),
        FailureKind.EXCEPTION,
        0,
        "raised ValueError",
        error=TaskError("ValueError", message, traceback),
    )


def test_keras3_under_distribution_gets_the_hint_with_the_line_to_edit(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC)
    hint = keras3_hint(failure(), plan(tmp_path), tmp_path, "cluster_specs/my.yaml")
    assert hint is not None and 'add `TF_USE_LEGACY_KERAS: "1"` to job.env' in hint
    assert hint.endswith("(cluster_specs/my.yaml:7, under `env:`)")
    (tmp_path / "spec.yaml").write_text(SPEC.replace('  env:\n    TF_CPP_MIN_LOG_LEVEL: "2"\n', ""))
    assert keras3_hint(failure(), plan(tmp_path), tmp_path).endswith(  # type: ignore[union-attr]
        '(spec.yaml:5, under `job:` as `env: {TF_USE_LEGACY_KERAS: "1"}`)'
    )


@pytest.mark.parametrize(
    ("message", "traceback"),
    [
        ("'Mean' object has no attribute 'reset_states'", KERAS3_TB),
        ("module 'keras._tf_keras.keras.losses' has no attribute 'Reduction'", KERAS3_TB),
        ("A KerasTensor cannot be used as input to a TensorFlow function.", "Traceback…"),
    ],
    ids=["reset_states", "Reduction", "KerasTensor"],
)
def test_the_other_keras3_failures_of_the_tutorials(tmp_path: Path, message: str, traceback: str) -> None:
    assert keras3_hint(failure(message, traceback), plan(tmp_path), tmp_path) is not None


def test_no_hint_where_it_is_not_sure(tmp_path: Path) -> None:
    assert keras3_hint(failure(), plan(tmp_path, legacy_keras=True), tmp_path) is None  # tf-keras already
    tf_keras_tb = KERAS3_TB.replace("/keras/src/", "/tf_keras/src/")
    assert keras3_hint(failure(traceback=tf_keras_tb), plan(tmp_path), tmp_path) is None
    other = KERAS3_TB.split("ValueError: ")[0] + "ZeroDivisionError: division by zero\n"
    assert keras3_hint(failure("division by zero", other), plan(tmp_path), tmp_path) is None
    assert (
        keras3_hint(
            Failure(("worker-0",), FailureKind.EXIT, 0, "exited 1", exit_code=1), plan(tmp_path), tmp_path
        )
        is None
    )


def test_a_hint_is_said_once_for_several_failures(tmp_path: Path) -> None:
    assert len(hints([failure(), failure()], plan(tmp_path), tmp_path)) == 1
