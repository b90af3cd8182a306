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
from worker import wire

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
        for hint in (
            keras3_hint(failure, plan, run_dir, spec_name),
            diverged_hint(failure),
            network_hint(failure, plan),
        ):
            if hint is not None and hint not in out:
                out.append(hint)
    return out


#: What a program says when it reaches for a network it does not have (a name to resolve, an
#: address with no route): in a local run's own network namespace there is its loopback alone.
NO_NETWORK_SIGNS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|No address associated with hostname"
    r"|Network is unreachable|No route to host|Errno -[235]\]|Errno 101\]"
)


def network_hint(failure: Failure, plan: LaunchPlan) -> str | None:
    """A task of a run in its own network namespace that reached for the network outside."""
    error = failure.error
    if error is None or not NO_NETWORK_SIGNS.search(f"{error.message}\n{error.traceback}"):
        return None
    if not any(t.env.get(wire.ENV_COORDINATOR, "").startswith(wire.UNIX_SCHEME) for t in plan.tasks):
        return None  # on the machine's own network: the network itself is down
    return (
        "hint: the tasks run in a network namespace of the run's own (local.isolate_network), which "
        "reaches nothing outside it: fetch what the job downloads before the run (a dataset into "
        "~/.keras/datasets, say), or set `local: {isolate_network: off}` (its TF ports are then "
        "open to every user of this machine)"
    )


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
