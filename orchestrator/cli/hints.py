"""CLI room: a one-line hint for a failure whose fix is known, with the spec line to edit.

Only failures recognised for certain get one; a hint never replaces the cause, it follows it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.launch.exposure import NAMES_FIX
from orchestrator.launch.local import outbound as outbound_words
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.spec.load import key_lines
from orchestrator.states import FailureKind
from orchestrator.supervise import restores
from orchestrator.supervise.policy import Failure
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
    network = _network(run_dir)
    for failure in failures:
        for hint in (
            keras3_hint(failure, plan, run_dir, spec_name),
            diverged_hint(failure),
            network_hint(failure, plan, network),
        ):
            if hint is not None and hint not in out:
                out.append(hint)
    return out


def _network(run_dir: Path) -> Mapping[str, Any]:
    """status.json's `network` (what the run's tasks could reach), as recorded."""
    try:
        network = json.loads((run_dir / "status.json").read_text()).get("network")
    except (OSError, ValueError, AttributeError):
        return {}
    return network if isinstance(network, dict) else {}


#: What a program says when it reaches for a network it does not have (a name to resolve, an
#: address with no route): in a local run's own network namespace offline, its loopback alone.
NO_NETWORK_SIGNS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|No address associated with hostname"
    r"|Network is unreachable|No route to host|Errno -[235]\]|Errno 101\]"
)
#: What a program says when a name cannot be resolved.
NAME_SIGNS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|No address associated with hostname"
    r"|Errno -[235]\]"
)
#: A connection to the loopback refused: in the run's namespace, its own loopback, not the machine's.
LOOPBACK_REFUSED = re.compile(r"Connection refused|Errno 111\]")
LOOPBACK = re.compile(r"\b(127\.\d+\.\d+\.\d+|localhost|\[::1\])\b")


def network_hint(failure: Failure, plan: LaunchPlan, network: Mapping[str, Any]) -> str | None:
    """A task of a run in its own network namespace that reached for the network outside (the
    namespace offline: `network`, status.json's, says so), or for this machine's loopback."""
    error = failure.error
    if error is None:
        return None
    if not any(t.env.get(wire.ENV_COORDINATOR, "").startswith(wire.UNIX_SCHEME) for t in plan.tasks):
        return None  # on the machine's own network: the network itself is down
    text = f"{error.message}\n{error.traceback}"
    outbound, names = str(network.get("outbound") or ""), str(network.get("names") or "")
    if names and not outbound.startswith("offline") and NAME_SIGNS.search(text):
        where = "the tasks run in a network namespace of the run's own"
        return f"hint: {where}, where names are {names}: {NAMES_FIX}"
    if outbound.startswith("offline") and NO_NETWORK_SIGNS.search(text):
        fix = (
            "install passt (`apt install passt`: outgoing network, nothing published), "
            if outbound_words.INSTALL in outbound
            else "set `local: {outbound: auto}`, "
            if outbound_words.OFF_BY_SPEC in outbound
            else ""
        )
        return (
            f"hint: the tasks run in a network namespace of the run's own, {outbound}: {fix}fetch what "
            "the job downloads before the run, or set `local: {isolate_network: off}` (its TF ports are "
            "then open to every user of this machine)"
        )
    if LOOPBACK_REFUSED.search(text) and LOOPBACK.search(text):
        return (
            "hint: the tasks run in a network namespace of the run's own: its loopback is not this "
            "machine's, where other users' services listen too; a service of this machine's loopback "
            "the job needs is reached by its port: `local: {reach_host_loopback: [PORT]}`"
        )
    return None


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
