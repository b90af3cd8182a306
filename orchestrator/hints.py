"""CLI output layer: a one-line hint for a failure whose fix is known, with the spec line to edit.

Only failures recognised for certain get one; a hint never replaces the cause, it follows it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from orchestrator.plan import LaunchPlan
from orchestrator.spec.load import key_lines
from orchestrator.supervise import restores
from orchestrator.supervise.policy import Failure, FailureKind

#: What Keras 3 raises under tf.distribute where tf-keras trains (docs/architecture.md §7: five of the six
#: official tutorials, keras-team/keras#20585), matched in the error's message or traceback.
KERAS3_SIGNS = (
    re.compile(r"PerReplica.*to a Tensor", re.S),
    re.compile(r"has no attribute 'reset_states'"),
    re.compile(r"optimizers\.legacy|legacy optimizer", re.I),
    re.compile(r"has no attribute 'Reduction'"),
    re.compile(r"KerasTensor cannot be used as input to a TensorFlow function"),
)
_KERAS3_FRAME = re.compile(r"[/\\]keras[/\\]src[/\\]")  # Keras 3's files; tf-keras lives in tf_keras/


def hints(
    failures: Sequence[Failure], plan: LaunchPlan, run_dir: Path, spec_name: str = "spec.yaml"
) -> list[str]:
    """The hints for a run's failures (each said once)."""
    out: list[str] = []
    for failure in failures:
        for hint in (keras3_hint(failure, plan, run_dir, spec_name), diverged_hint(failure)):
            if hint is not None and hint not in out:
                out.append(hint)
    return out


def diverged_hint(failure: Failure) -> str | None:
    """Tasks that started from different states: where checkpoints are kept the same on every host."""
    return f"hint: {restores.FIX}" if failure.kind is FailureKind.DIVERGED else None


def keras3_hint(
    failure: Failure, plan: LaunchPlan, run_dir: Path, spec_name: str = "spec.yaml"
) -> str | None:
    """Keras 3 under a distribution strategy: set TF_USE_LEGACY_KERAS (tf-keras is installed)."""
    error = failure.error
    if error is None:
        return None
    text = f"{error.message}\n{error.traceback}"
    keras3 = _KERAS3_FRAME.search(error.traceback) or "KerasTensor" in error.message
    if not keras3 or not any(sign.search(text) for sign in KERAS3_SIGNS):
        return None
    if any(t.env.get("TF_USE_LEGACY_KERAS") == "1" for t in plan.tasks):
        return None  # tf-keras was asked for: something else is wrong
    where = _where(run_dir / "spec.yaml", spec_name)
    return (
        "hint: this is Keras 3 under tf.distribute, where TF 2.21's tf.keras fails; tf-keras (installed) "
        f'trains: add `TF_USE_LEGACY_KERAS: "1"` to job.env {where}'
    )


def _where(recorded: Path, spec_name: str) -> str:
    """`(spec.yaml:9, under env:)` — where the line goes in the spec as it was given."""
    try:
        lines = key_lines(recorded.read_text(encoding="utf-8"))
    except OSError:
        lines = {}
    if ("job", "env") in lines:
        return f"({spec_name}:{lines[('job', 'env')]}, under `env:`)"
    if ("job",) in lines:
        return f'({spec_name}:{lines[("job",)]}, under `job:` as `env: {{TF_USE_LEGACY_KERAS: "1"}}`)'
    return f"({spec_name})"
