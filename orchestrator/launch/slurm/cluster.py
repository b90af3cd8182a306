"""Launch layer, slurm backend: talking to Slurm — its client commands under timeouts, the
cluster checked against a request, the allocation (requested and held, or the surrounding one),
and the command lines the backend runs (salloc, srun, scancel).

An allocation of ours is held by the command salloc runs on this machine, which only reads a pipe
from the coordinator: it is released when the coordinator closes the pipe — at the end, or when
the coordinator dies, even by SIGKILL. A request still pending after `slurm.queue_timeout_s` is
withdrawn. Every command runs under a timeout: with slurmctld down, Slurm's commands retry for
minutes, and a launch must fail within `slurm.connect_timeout_s` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.spec import SlurmSpec, section
from orchestrator.spec.model import ClusterSpec
from worker.host import SHIM

log = logging.getLogger("orchestrator.slurm")

COMMANDS = ("salloc", "srun", "scancel", "squeue", "scontrol")
NOT_INSTALLED = "Slurm's commands are not installed here"
# srun reads these as its own options; inside an allocation they describe the allocation, not a step
_STEP_OPTION_ENV = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_DISTRIBUTION",
    "SLURM_EXACT",
    "SLURM_EXCLUSIVE",
    "SLURM_MEM_PER_CPU",
    "SLURM_MEM_PER_NODE",
)


def job_name(run_id: str) -> str:
    """The allocation's name (and its steps' prefix): found again by `orchestrate down`."""
    return f"orchestrate-{run_id}"


def signal_lead_s(spec: ClusterSpec) -> int:
    """How long before a time limit Slurm warns the tasks (SIGTERM: a final checkpoint, exit 42)."""
    return SlurmSpec.warning_lead_s(spec.health.stop_grace_s)


class Slurm:
    """Slurm's client commands, each bounded: with slurmctld down they retry for minutes."""

    def __init__(
        self,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        runner: Callable[..., subprocess.CompletedProcess[Any]] = subprocess.run,
    ):
        self.timeout_s = timeout_s
        self.env = dict(env if env is not None else os.environ)
        #: how a command is run (subprocess.run's signature): the seam where tests give Slurm's
        #: recorded answers, or run a step's command on this machine
        self.runner = runner
        for name in _STEP_OPTION_ENV:
            self.env.pop(name, None)

    @staticmethod
    def missing() -> list[str]:
        return [c for c in COMMANDS if shutil.which(c) is None]

    @classmethod
    def require_commands(cls) -> None:
        missing = cls.missing()
        if missing:
            raise LaunchError(
                f"{NOT_INSTALLED} (missing: {', '.join(missing)}); install Slurm's client tools"
            )

    def run(
        self, argv: Sequence[str], what: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        limit = timeout_s or self.timeout_s
        hang = f"got no answer within {limit:g} s — is slurmctld up? (slurm.connect_timeout_s)"
        return self._call(argv, what, stdin, limit, hang, text=True)

    def run_bytes(
        self, argv: Sequence[str], what: str, data: bytes, *, timeout_s: float
    ) -> subprocess.CompletedProcess[bytes]:
        """As `run`, with bytes in and out (files travelling through a step's stdin and stdout)."""
        hang = f"did not finish within {timeout_s:g} s"
        return self._call(argv, what, data, timeout_s, hang, text=False)

    def _call(
        self,
        argv: Sequence[str],
        what: str,
        data: str | bytes | None,
        timeout_s: float,
        hang: str,
        *,
        text: bool,
    ) -> subprocess.CompletedProcess[Any]:
        try:
            return self.runner(
                list(argv),
                input=data,
                capture_output=True,
                text=text,
                timeout=timeout_s,
                env=self.env,
                check=False,
                start_new_session=True,  # a Ctrl-C in the terminal is ours to handle, not srun's
            )
        except FileNotFoundError:
            raise LaunchError(f"{NOT_INSTALLED} ({argv[0]} not found on PATH)") from None
        except subprocess.TimeoutExpired:
            raise LaunchError(f"{what}: `{argv[0]}` {hang}") from None

    def checked(self, argv: Sequence[str], what: str, **kw: Any) -> str:
        res = self.run(argv, what, **kw)
        if res.returncode != 0:
            said = " ".join(res.stderr.split()) or f"exit {res.returncode}"
            raise LaunchError(f"{what}: {said}")
        return res.stdout

    def hostnames(self, nodelist: str) -> list[str]:
        """`n[1-3],m5` → [n1, n2, n3, m5] (Slurm's own expansion)."""
        out = self.checked(["scontrol", "show", "hostnames", nodelist], "expanding the node list")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def records(self, kind: str, *names: str) -> list[dict[str, str]]:
        """`scontrol show KIND -o`: one dict per partition or node (values without spaces)."""
        out = self.checked(["scontrol", "show", kind, "-o", *names], f"asking slurmctld for its {kind}s")
        return [_fields(line) for line in out.splitlines() if line.strip()]


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(?:^|\s)([A-Za-z]+)=(\S*)", line))


@dataclasses.dataclass(frozen=True)
class Request:
    """What the spec asks of Slurm."""

    nodes: int
    tasks_per_node: int  # the most tasks any node runs
    partition: str | None

    @classmethod
    def of(cls, spec: ClusterSpec) -> Request:
        conf = section(spec)
        most = max(sum(t.values()) for t in conf.layout())
        return cls(conf.nodes, most, conf.partition)


def check_cluster(slurm: Slurm, request: Request) -> tuple[str, list[dict[str, str]]]:
    """The partition the request goes to and its nodes; LaunchError when it cannot be satisfied."""
    Slurm.require_commands()
    parts = slurm.records("partition")
    names = [p.get("PartitionName", "?") for p in parts]
    if request.partition is not None:
        chosen = next((p for p in parts if p.get("PartitionName") == request.partition), None)
        if chosen is None:
            raise LaunchError(
                f"slurm.partition {request.partition!r} does not exist on this cluster "
                f"(partitions: {', '.join(names) or 'none'})"
            )
    else:
        chosen = next((p for p in parts if p.get("Default") == "YES"), None)
        if chosen is None:
            raise LaunchError(
                f"this cluster has no default partition; set slurm.partition (one of {', '.join(names)})"
            )
    name = chosen.get("PartitionName", "?")
    if chosen.get("State", "UP") != "UP":
        raise LaunchError(f"partition {name} is {chosen.get('State')}: it runs no job now")
    total = int(chosen.get("TotalNodes", "0") or 0)
    if request.nodes > total:
        raise LaunchError(
            f"slurm.nodes asks for {request.nodes} nodes; partition {name} has {total}: "
            "ask for fewer, or another partition"
        )
    nodelist = chosen.get("Nodes", "")
    nodes = slurm.records("node", *([nodelist] if nodelist and nodelist != "(null)" else []))
    return name, nodes


def route_address(targets: Sequence[str]) -> str:
    """This machine's address on the route to the first target (no packet is sent)."""
    for target in targets:
        try:
            infos = socket.getaddrinfo(target, 9, socket.AF_INET, socket.SOCK_DGRAM)
        except OSError:
            continue
        for *_, addr in infos:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    s.connect(addr)
                    return str(s.getsockname()[0])
                except OSError:
                    continue
    raise LaunchError(
        f"no route from this machine to the nodes ({', '.join(targets[:3])}); set slurm.coordinator_address"
    )


def step_argv(job_id: str, node: str, name: str) -> list[str]:
    """srun of one step, one task, on one node of the allocation; the command follows."""
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",  # the tasks of a node share its CPUs, as on a lab machine
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={name}",
        "--quiet",
    ]


def srun_argv(job_id: str, node: str, name: str, python: Sequence[str]) -> list[str]:
    """A task's step: the shim, which needs only the standard library (-S)."""
    return [*step_argv(job_id, node, name), *python, "-S", str(SHIM)]


def cancel_steps(slurm: Slurm, job_id: str, prefix: str) -> list[str]:
    """Cancel this run's steps left in an allocation that is not ours; their ids."""
    out = slurm.checked(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], "listing the steps")
    ours = [
        line.split()[0]
        for line in out.splitlines()
        if len(line.split()) == 2 and line.split()[1].startswith(prefix)
    ]
    if ours:
        slurm.run(["scancel", *ours], "cancelling this run's steps")
    return ours
