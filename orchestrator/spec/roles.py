"""Spec layer: what the supervisor does with each role's tasks — the strategy's defaults, with the
spec's `policy:` entries over them (docs/architecture.md §7 says why each default is what it is).

- `decides`: the job succeeds when every task of the deciding roles has exited 0.
- `on_failure`: restart_job (stop all, restart all from the last checkpoint), restart_task (this
  task alone, same address, while the others go on), or ignore (report it and go on).
- `at_end`: once the deciders are done, wait for the task to finish by itself (bounded by
  health.final_wait_s) or stop it (servers that never exit).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.spec.model import AtEnd, ClusterSpec, OnFailure, Role, Strategy


@dataclass(frozen=True)
class RolePolicy:
    decides: bool
    on_failure: OnFailure
    at_end: AtEnd

    def describe(self) -> str:
        decides = "decides success" if self.decides else "does not decide success"
        failure = {
            OnFailure.RESTART_JOB: "a failure restarts the whole job",
            OnFailure.RESTART_TASK: "a failure restarts this task alone",
            OnFailure.IGNORE: "a failure is reported, the job goes on",
        }[self.on_failure]
        end = (
            "waited for at the end"
            if self.at_end is AtEnd.WAIT
            else "stopped at the end, with a short grace (it saves nothing)"
        )
        return f"{decides}; {failure}; {end}"


_TRAINING = RolePolicy(True, OnFailure.RESTART_JOB, AtEnd.WAIT)
_EVALUATOR = RolePolicy(False, OnFailure.IGNORE, AtEnd.WAIT)

DEFAULTS: dict[Strategy, dict[Role, RolePolicy]] = {
    # No elasticity: every task is needed, and a task is never restarted alone (TF rejects it).
    Strategy.MULTI_WORKER_MIRRORED: {
        Role.CHIEF: _TRAINING,
        Role.WORKER: _TRAINING,
        Role.EVALUATOR: _EVALUATOR,
    },
    Strategy.MIRRORED: {Role.CHIEF: _TRAINING, Role.WORKER: _TRAINING, Role.EVALUATOR: _EVALUATOR},
    # The chief trains; workers come and go (the coordinator reschedules their steps); a lost ps
    # loses variables, so the job restarts from the chief's checkpoint. Servers never exit.
    Strategy.PARAMETER_SERVER: {
        Role.CHIEF: _TRAINING,
        Role.WORKER: RolePolicy(False, OnFailure.RESTART_TASK, AtEnd.STOP),
        Role.PS: RolePolicy(False, OnFailure.RESTART_JOB, AtEnd.STOP),
        Role.EVALUATOR: _EVALUATOR,
    },
}


def role_policies(spec: ClusterSpec) -> dict[Role, RolePolicy]:
    """The policy of every role present in the spec."""
    out = {}
    for role, default in DEFAULTS[spec.strategy].items():
        if spec.role_count(role) == 0:
            continue
        given = spec.policy.get(role)
        if given is None:
            out[role] = default
            continue
        out[role] = RolePolicy(
            decides=default.decides if given.decides is None else given.decides,
            on_failure=given.on_failure or default.on_failure,
            at_end=given.at_end or default.at_end,
        )
    return out


@dataclass(frozen=True)
class TaskSlot:
    """A task's place in the cluster, before ports are known."""

    role: Role
    index: int
    host_index: int

    @property
    def name(self) -> str:
        return f"{self.role.value}-{self.index}"


def task_slots(spec: ClusterSpec) -> list[TaskSlot]:
    """Every task of the spec, numbered per role in the order of the hosts that give them, listed
    chief, worker, ps, evaluator. Under a layout (`spec.laid_out`) a host's tasks run on the host
    that took them, keeping their numbers; a host's left out, and those after it renumbered."""
    counters = {role: 0 for role in Role}
    slots = []
    for role in Role:
        for p, host in enumerate(spec.hosts):
            runs_on = spec.runs_on(p)
            if runs_on is None:
                continue
            for _ in range(host.tasks.get(role, 0)):
                slots.append(TaskSlot(role, counters[role], runs_on))
                counters[role] += 1
    return slots
