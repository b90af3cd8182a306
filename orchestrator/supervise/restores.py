"""Supervision layer: every task of a synchronous job must start an attempt from one state.

- `JobFolders`: the folders the job writes its own checkpoints to, as its owner told them
  (worker/task/checkpoints.py), learned across attempts: the backend keeps them the same on every host
  before the next attempt (plan.state.job_folders; launch/exchange.py).
- `diverged_start`: the tasks' restore reports compared as they arrive — tasks that restored
  different states (or one restored and another nothing) fail the attempt before they train.
- `collective_mismatch`: TensorFlow's own words when the tasks of one collective do not run the
  same program — what a diverged start looks like when the job restores where no one can see.
Both are DIVERGED failures: never retried while nothing changes, never offered `--resume`.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence

from orchestrator.health.store import TaskHealth
from orchestrator.plan.launch_plan import LaunchPlan, StatePlan
from orchestrator.spec.model import Strategy
from orchestrator.states import FailureKind
from orchestrator.supervise.policy import Failure
from worker.wire import MAX_FOLDERS, RESTORED_NOTHING, TaskError
from worker.wire import Restored as Restored

NOTHING = RESTORED_NOTHING  # the fingerprint of "restored nothing" (worker/task/checkpoints.py)
#: TensorFlow's collective mismatch errors (collective_param_resolver_local.cc and its kin).
COLLECTIVE_MISMATCH = re.compile(
    r"Collective instance \d+ expected|mismatch in the collective instance|"
    r"but another member in the group|but that group has size"
)
#: What to do about it (the summary's hint: hints.py).
FIX = (
    "orchestrate keeps $ORCHESTRATE_CHECKPOINT_DIR and the folders it sees the job checkpoint to "
    "(Keras BackupAndRestore and ModelCheckpoint, tf.train.CheckpointManager and Checkpoint) the same "
    "on every host before each attempt; checkpoint there, or onto a disk every host shares "
    "(README: checkpoints on hosts that share no disk)"
)


class JobFolders:
    """The owner's checkpoint folders, learned from its heartbeats, across attempts."""

    def __init__(self, known: Iterable[str] = ()):
        self.folders: dict[str, str] = dict.fromkeys(known, "")
        self.at_attempt_start: frozenset[str] = frozenset(self.folders)

    def attempt_starts(self) -> None:
        self.at_attempt_start = frozenset(self.folders)

    def learn(self, owner: str | None, health: TaskHealth | None) -> list[str]:
        """What the owner told that is new: one line each, for the run's events."""
        if owner is None or health is None:
            return []
        lines = []
        for path, by in health.folders.items():
            if path in self.folders or len(self.folders) >= MAX_FOLDERS:
                continue
            self.folders[path] = by
            lines.append(
                f"{owner} checkpoints to {path} ({by}): kept the same on every host that has a disk of "
                "its own before each attempt"
            )
        return lines

    @property
    def learned_this_attempt(self) -> bool:
        """A restart would meet different folders: the ones learned since the attempt began."""
        return bool(set(self.folders) - self.at_attempt_start)

    def plan(self, plan: LaunchPlan) -> LaunchPlan:
        """The plan with the folders (the outermost of nested ones) in its state."""
        if plan.state is None:
            return plan
        folders = self.folders
        outer = tuple(sorted(p for p in folders if not any(_under(p, q) for q in folders if q != p)))
        if outer == plan.state.job_folders:
            return plan
        return dataclasses.replace(plan, state=dataclasses.replace(plan.state, job_folders=outer))


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def check_start(
    plan: LaunchPlan,
    tasks: Mapping[str, tuple[bool, TaskHealth | None]],
    attempt: int,
    failures: Sequence[Failure] = (),
) -> tuple[bool, Failure | None]:
    """`diverged_start` over the training tasks of a synchronous job (`tasks`: in the cluster,
    health) by their final reports; parameter_server's state is the chief's alone: always settled.
    Where a task's collectives failed to match (in `failures`) before the reports were final, the
    restores said as they happened explain it, a task that said none counted as restoring nothing."""
    state = plan.state
    if state is None or plan.strategy is Strategy.PARAMETER_SERVER:
        return True, None
    readers = [n for n in state.readers if tasks[n][0]]
    said = {n: h.restored for n in readers if (h := tasks[n][1]) is not None and h.restored is not None}
    settled, failure = diverged_start(state, readers, {n: r for n, r in said.items() if r.final}, attempt)
    mismatch = next((f for f in failures if collective_mismatch(f.error)), None)
    if failure is None and mismatch is not None and said:
        nothing = Restored(step=0, fingerprint=NOTHING, source=None, final=False)
        _, failure = diverged_start(state, readers, {n: said.get(n, nothing) for n in readers}, attempt)
        if failure is not None:
            tf_said = f"{mismatch.tasks[0]} {mismatch.detail.split(' — ')[0]}"
            failure = dataclasses.replace(failure, detail=f"{failure.detail} (then {tf_said})")
    return settled, failure


def diverged_start(
    state: StatePlan, readers: Sequence[str], restored: Mapping[str, Restored], attempt: int
) -> tuple[bool, Failure | None]:
    """The training tasks of a synchronous job must start an attempt from one state, the owner's
    (its checkpoint is the truth). Compared as their restore reports arrive (`restored`, of the
    `readers` that reported): (settled — every one reported the same —, the failure if they differ)."""
    if len({(r.step, r.fingerprint) for r in restored.values()}) < 2:
        return len(restored) == len(readers), None
    truth = restored.get(state.owner)
    odd = tuple(
        n
        for n, r in restored.items()
        if truth is None or (r.step, r.fingerprint) != (truth.step, truth.fingerprint)
    )
    said = "; ".join(f"{n} restored {where(r)}" for n, r in restored.items())
    sources = [r.source for r in restored.values() if r.source]
    folder = posixpath.dirname(sources[0]) if sources else None
    differs = f"{folder} differs between the hosts" if folder else "their hosts' checkpoint folders differ"
    detail = (
        f"started from different states: {said} — {differs}, so trained together they would "
        "average the gradients of different models"
    )
    return False, Failure(odd, FailureKind.DIVERGED, attempt, detail)


def where(r: Restored) -> str:
    """What one task restored, in words."""
    if r.source is None and r.step == 0 and r.fingerprint == NOTHING:
        return "nothing"
    if r.source is None:
        return f"no checkpoint (fresh weights, state {r.fingerprint})"
    at = []
    if r.epoch or r.step_in_epoch:
        at.append(f"epoch {r.epoch} batch {r.step_in_epoch}")
    if r.step and r.fingerprint != NOTHING:
        at.append(f"step {r.step}")
    return f"{r.source} at {', '.join(at)}" if at else r.source


def collective_mismatch(error: TaskError | None) -> bool:
    """In the message or, where Keras's `in user code:` pushed it past the message's first 2,000
    characters, in the traceback's last lines (which end with the whole message)."""
    if error is None:
        return False
    return any(COLLECTIVE_MISMATCH.search(text) for text in (error.message, error.traceback[-8000:]))


def mismatch_detail(first_line: str) -> str:
    """A collective mismatch, explained."""
    return (
        f"{first_line} — the tasks' collectives do not match: after a restart, the sign that they "
        "restored different checkpoints (a folder on each host's own disk); on a first attempt, that "
        "they build different models or batches"
    )
