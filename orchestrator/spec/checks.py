"""Spec layer: checks across several keys (role counts, ports, strategy/role fit, files that must exist).

Each problem is reported at the key the user should change; `load.py` adds the line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import SpecProblem
from orchestrator.launch import registry
from orchestrator.launch.kind import Kind
from orchestrator.spec.model import MAX_TASKS, AtEnd, ClusterSpec, OnFailure, Role, Strategy
from orchestrator.spec.roles import role_policies
from orchestrator.spec.sections import missing_section
from worker.wire import RESERVED_ENV

_TRAINING_ROLES = (Role.CHIEF, Role.WORKER)


def check_spec(spec: ClusterSpec, kind: Kind | None) -> list[SpecProblem]:
    """Every problem of the spec past its models; `kind`: its backend, as the loader looked it up
    (None where none could be loaded: asked once more here, to say why as the one problem)."""
    if kind is None:
        if not registry.is_registered(spec.backend):
            return [SpecProblem(("backend",), registry.unknown_message(spec.backend))]
        try:
            kind = registry.get(spec.backend)
        except registry.UnknownBackend as exc:
            return [SpecProblem(("backend",), str(exc))]
    if kind.places_tasks and spec.section(kind.name) is None:
        return [missing_section(kind)]
    if not spec.hosts:
        return [
            SpecProblem(("hosts",), "give at least one host, e.g. - {address: 127.0.0.1, tasks: {worker: 2}}")
        ]
    own = kind.spec_problems(spec)
    general: list[SpecProblem] = []
    general += _check_counts(spec, kind)
    general += _check_strategy_roles(spec, kind)
    general += _check_ports(spec, kind)
    general += _check_job(spec)
    general += _check_policy(spec)
    general += _check_spares(spec, kind)
    general += _check_shrink(spec, kind)
    # the backend's message is the more precise where both found something; each said once
    taken = {p.path for p in own}
    return own + list(dict.fromkeys(p for p in general if p.path not in taken))


def _where(spec: ClusterSpec, kind: Kind, role: Role) -> list[tuple[str | int, ...]]:
    keys = [
        (*kind.tasks_key(spec, i), role.value) for i, h in enumerate(spec.hosts) if h.tasks.get(role, 0) > 0
    ]
    return list(dict.fromkeys(keys))


def _check_counts(spec: ClusterSpec, kind: Kind) -> list[SpecProblem]:
    problems = []
    for i, host in enumerate(spec.hosts):
        key = kind.tasks_key(spec, i)
        for role, count in host.tasks.items():
            if count < 1:
                problems.append(
                    SpecProblem((*key, role.value), "count must be at least 1 (leave the role out for none)")
                )
        if host.spare and host.tasks:
            problems.append(
                SpecProblem(
                    ("hosts", i, "spare"),
                    "a spare host runs no task until a host is lost: remove its tasks, or its spare: true",
                )
            )
        elif not host.tasks and not host.spare:
            problems.append(
                SpecProblem(
                    key, "this host runs no task; give e.g. {worker: 1} (or spare: true to keep it spare)"
                )
            )
    for role, noun in ((Role.CHIEF, "chief"), (Role.EVALUATOR, "evaluator")):
        if spec.role_count(role) > 1:
            where = _where(spec, kind, role)
            others = ", ".join(_key(p) for p in where[:3]) + (
                f" and {len(where) - 3} more" if len(where) > 3 else ""
            )
            problems.append(
                SpecProblem(
                    where[-1],
                    f"a cluster has at most one {noun}, this spec has {spec.role_count(role)} ({others})",
                )
            )
    total = sum(spec.role_count(r) for r in Role)
    if total > MAX_TASKS:
        problems.append(
            SpecProblem(
                ("hosts",),
                f"{total:,} tasks; a spec may have at most {MAX_TASKS:,} (every task's TF_CONFIG lists "
                "the whole cluster)",
            )
        )
    if sum(spec.role_count(r) for r in _TRAINING_ROLES) == 0 and not problems:
        problems.append(
            SpecProblem(("hosts",), "no chief or worker task: give at least one host tasks: {worker: 1}")
        )
    return problems


def _check_strategy_roles(spec: ClusterSpec, kind: Kind) -> list[SpecProblem]:
    problems = []
    ps = spec.role_count(Role.PS)
    if spec.strategy is Strategy.MULTI_WORKER_MIRRORED and ps:
        problems += [
            SpecProblem(p, "multi_worker_mirrored has no parameter servers; use strategy: parameter_server")
            for p in _where(spec, kind, Role.PS)
        ]
    elif spec.strategy is Strategy.MIRRORED:
        problems += [
            SpecProblem(p, "mirrored has no parameter servers; use strategy: parameter_server")
            for p in _where(spec, kind, Role.PS)
        ]
        training = sum(spec.role_count(r) for r in _TRAINING_ROLES)
        if training > 1:
            problems.append(
                SpecProblem(
                    ("strategy",),
                    f"mirrored runs one task using all devices of its host, this spec has {training} "
                    "chief/worker tasks; use multi_worker_mirrored for several",
                )
            )
    elif spec.strategy is Strategy.PARAMETER_SERVER:
        if spec.role_count(Role.CHIEF) != 1:
            problems.append(
                SpecProblem(("strategy",), "parameter_server needs exactly one chief (it runs the training)")
            )
        if ps == 0:
            problems.append(SpecProblem(("strategy",), "parameter_server needs at least one ps task"))
        if spec.role_count(Role.WORKER) == 0:
            problems.append(SpecProblem(("strategy",), "parameter_server needs at least one worker task"))
    return problems


def _check_ports(spec: ClusterSpec, kind: Kind) -> list[SpecProblem]:
    """Hosts with a base_port on one machine (the backend's `port_scope`: for local, all) must have
    disjoint port ranges. Compared as ranges, sorted (not port by port: 1,024 hosts of 4,096
    tasks each were four million ports)."""
    problems = []
    ranges: dict[str, list[tuple[int, int, int]]] = {}  # address -> (first, last, host index)
    for i, host in enumerate(spec.hosts):
        if host.base_port is None:
            continue
        where = kind.port_scope(spec, host)
        count = sum(host.tasks.values())
        if host.base_port + count - 1 > 65535:
            problems.append(
                SpecProblem(("hosts", i, "base_port"), f"{count} tasks do not fit above this port")
            )
        if count > 0:
            ranges.setdefault(where, []).append((host.base_port, host.base_port + count - 1, i))
    for where, spans in ranges.items():
        spans.sort()
        reported = set()
        reach = spans[0]  # the range reaching furthest so far
        for span in spans[1:]:
            first, _, i = span
            if first <= reach[1]:
                later, earlier = max(i, reach[2]), min(i, reach[2])
                if later not in reported:
                    reported.add(later)
                    port = max(first, reach[0])
                    problems.append(
                        SpecProblem(
                            ("hosts", later, "base_port"),
                            f"port {port} on {where} is already used by hosts[{earlier}]; "
                            "give each host a disjoint base_port range",
                        )
                    )
            if span[1] > reach[1]:
                reach = span
    return problems


def _check_job(spec: ClusterSpec) -> list[SpecProblem]:
    problems = []
    job = spec.job
    for key, path in (("script", job.script), ("loop", job.loop)):
        if path is not None and not _is(path, Path.is_file):
            problems.append(SpecProblem(("job", key), f"no such file: {path}"))
    entry = job.script or job.loop
    if job.files is not None:
        if not _is(job.files, Path.is_dir):
            problems.append(SpecProblem(("job", "files"), f"no such folder: {job.files}"))
        elif entry is not None and not entry.is_relative_to(job.files):
            key = "script" if job.script is not None else "loop"
            problems.append(
                SpecProblem(
                    ("job", "files"),
                    f"job.{key} {entry} must be inside this folder (it is copied to the hosts)",
                )
            )
    if job.loop is not None and spec.train is None:
        problems.append(
            SpecProblem(("train",), "job.loop needs a train: section (steps or epochs, batch size)")
        )
    envs = [(("job", "env"), job.env)] + [(("hosts", i, "env"), h.env) for i, h in enumerate(spec.hosts)]
    for where, env in envs:
        problems += [
            SpecProblem(where + (k,), "set by orchestrate for every task; remove it from the spec")
            for k in env
            if k in RESERVED_ENV
        ]
    if job.script is not None and spec.train is not None:
        problems.append(
            SpecProblem(("train",), "train: applies to job.loop only; a job.script trains by itself")
        )
    return problems


def _check_policy(spec: ClusterSpec) -> list[SpecProblem]:
    problems = []
    for role in spec.policy:
        if spec.role_count(role) == 0:
            problems.append(SpecProblem(("policy", role.value), f"this spec has no {role.value} task"))
    effective = role_policies(spec)
    ps_strategy = spec.strategy is Strategy.PARAMETER_SERVER
    for role, rule in effective.items():
        where = ("policy", role.value)
        if role is Role.EVALUATOR:
            continue  # a sidecar: any policy is sound
        if rule.on_failure is not OnFailure.RESTART_JOB and (not ps_strategy or role is not Role.WORKER):
            why = (
                "a MultiWorkerMirroredStrategy task cannot be restarted alone (TensorFlow rejects its new "
                "incarnation) nor left out (the others would wait forever)"
                if not ps_strategy
                else f"a lost {role.value} takes the job's state with it"
            )
            problems.append(SpecProblem(where + ("on_failure",), f"{role.value} must use restart_job: {why}"))
        if ps_strategy and role in (Role.PS, Role.WORKER):
            if rule.decides:
                problems.append(
                    SpecProblem(
                        where + ("decides",),
                        f"{role.value} tasks serve until stopped; only the chief decides",
                    )
                )
            if rule.at_end is not AtEnd.STOP:
                problems.append(
                    SpecProblem(
                        where + ("at_end",), f"{role.value} tasks serve until stopped; they must be stopped"
                    )
                )
    if effective and not any(rule.decides for rule in effective.values()):
        problems.append(SpecProblem(("policy",), "no role decides success; the job could never end"))
    if spec.job.checkpoint_dir is not None and spec.job.loop is not None:
        problems.append(
            SpecProblem(("job", "checkpoint_dir"), "the built-in loop's folder is train.checkpoint_dir")
        )
    if ps_strategy and spec.train is not None and spec.train.epochs is not None:
        problems.append(
            SpecProblem(
                ("train", "epochs"),
                "parameter_server trains asynchronously (workers pull batches): give train.steps",
            )
        )
    if (
        spec.train is not None
        and spec.train.cpu_replicas is not None
        and spec.strategy is not Strategy.MIRRORED
    ):
        problems.append(SpecProblem(("train", "cpu_replicas"), "applies to strategy: mirrored only"))
    return problems


def _check_spares(spec: ClusterSpec, kind: Kind) -> list[SpecProblem]:
    """A spare host is another machine than every other host, under a backend that keeps spares."""
    problems = []
    for i, host in enumerate(spec.hosts):
        if not host.spare:
            continue
        if not kind.spare_hosts:
            where = "slurm.spare_nodes" if kind.places_tasks else "no spare host"
            why = f"backend {kind.name} keeps {where}; spare hosts are for backend ssh"
            problems.append(SpecProblem(("hosts", i, "spare"), why))
            continue
        others = [j for j, h in enumerate(spec.hosts) if j != i and _same_machine(h.address, host.address)]
        if others:
            problems.append(
                SpecProblem(
                    ("hosts", i, "address"),
                    f"this spare is the same machine as hosts[{others[0]}] ({host.address}): losing one "
                    "would lose both; a spare must be another machine",
                )
            )
    return problems


def _same_machine(a: str, b: str) -> bool:
    return a.strip().lower().rstrip(".") == b.strip().lower().rstrip(".")


def _check_shrink(spec: ClusterSpec, kind: Kind) -> list[SpecProblem]:
    """restart.shrink: a backend whose machines can be lost, a strategy that can go on with fewer
    workers, a host that could be left out (workers alone), min_workers within the workers."""
    restart = spec.restart
    workers = spec.role_count(Role.WORKER)
    problems = []
    if (restart.shrink or "min_workers" in restart.model_fields_set) and restart.min_workers > workers:
        problems.append(
            SpecProblem(
                ("restart", "min_workers"),
                f"{restart.min_workers} is more than the spec's {workers} worker task(s)",
            )
        )
    if not restart.shrink:
        return problems
    why = None
    if not kind.loses_hosts:
        why = f"backend {kind.name} runs on one machine, which is never lost: nothing to shrink"
    elif spec.strategy is Strategy.MIRRORED:
        why = "mirrored runs one task on one host: it cannot go on with fewer; give a spare host"
    elif not any(h.tasks and set(h.tasks) == {Role.WORKER} for h in spec.hosts if not h.spare):
        held = "the chief or a ps" if spec.strategy is Strategy.PARAMETER_SERVER else "the chief"
        why = (
            f"no host could be left out: only a host of worker tasks alone can be (one holding {held} "
            "or the evaluator cannot: the job needs it); give a spare host"
        )
    if why is not None:
        problems.append(SpecProblem(("restart", "shrink"), why))
    return problems


def _key(path: tuple[str | int, ...]) -> str:
    return SpecProblem(path, "").key


def _is(path: Path, test: Callable[[Path], bool]) -> bool:
    """`path.is_file()` and the like, False where the path cannot even be looked at (a name too
    long, a folder we may not enter)."""
    try:
        return test(path)
    except OSError:
        return False
