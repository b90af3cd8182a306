"""Launch layer: tasks as Slurm job steps on a Slurm cluster (backend: slurm).

- **The allocation.** Inside one (`salloc … orchestrate up`, an sbatch script: SLURM_JOB_ID is
  set), the run uses it and leaves it alone. Otherwise it asks for one sized from the spec with
  `salloc --no-kill … -- sh -c 'echo …; exec cat'`: the command salloc runs on this machine only
  reads a pipe from the coordinator, so the allocation is released when the coordinator closes it —
  at the end, or when the coordinator dies, even by SIGKILL. A request still pending after
  `slurm.queue_timeout_s` is cancelled. Every Slurm command runs under a timeout: a slurmctld that
  does not answer is a launch error within `slurm.connect_timeout_s`, never a hang.
- **The tasks.** Each attempt of each task is one step on its node (`srun --overlap -N1 -n1 -w NODE`)
  running worker/shim.py, as over SSH: the job (environment and credential included) travels on
  the step's stdin, never on a command line; TERM/KILL lines follow; end of file stops the task;
  events come back on stderr. Heartbeats go straight from the nodes to the coordinator's server,
  which listens on this machine's address on the route to the nodes (`slurm.coordinator_address`).
- **Nodes and ports.** One probe step per attempt (the first in `open`) checks every node still
  answers, its TF ports are free (new ones are chosen where not), and that it sees the run's files.
  A node whose task's end could not be confirmed, or that no longer answers, is left out of the
  next attempt; a spare node (`slurm.nodes` beyond those used) takes its place.
- **Files.** A Slurm cluster's nodes share a filesystem with the login node (home, project space):
  the job's folder, the run directory and orchestrate's worker runtime are used in place. This is
  proven at launch (a nonce file written here must be read on every node), never assumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.api import (
    Backend,
    CheckReport,
    Heartbeats,
    Leftovers,
    Prepared,
    ProcessInfo,
    Sig,
    TaskHandle,
)
from orchestrator.launch.placement import Placement
from orchestrator.plan import LaunchPlan, TaskPlan
from orchestrator.record import make_private_dir
from orchestrator.spec.model import Backend as BackendName
from orchestrator.spec.model import ClusterSpec, SlurmSpec
from orchestrator.spec.roles import task_slots

log = logging.getLogger("orchestrator.slurm")

COMMANDS = ("salloc", "srun", "scancel", "squeue", "scontrol")
NOT_INSTALLED = "Slurm's commands are not installed here"
_RUNTIME_ROOT = Path(__file__).resolve().parents[2]  # the folder holding worker/
SHIM = _RUNTIME_ROOT / "worker" / "shim.py"
PROBE_SOURCE = (_RUNTIME_ROOT / "worker" / "probe.py").read_text(encoding="utf-8")
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

    def __init__(self, timeout_s: float, env: Mapping[str, str] | None = None):
        self.timeout_s = timeout_s
        self.env = dict(env if env is not None else os.environ)
        for name in _STEP_OPTION_ENV:
            self.env.pop(name, None)

    @staticmethod
    def missing() -> list[str]:
        return [c for c in COMMANDS if shutil.which(c) is None]

    def run(
        self, argv: Sequence[str], what: str, *, timeout_s: float | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        limit = timeout_s or self.timeout_s
        try:
            return subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=limit,
                env=self.env,
                check=False,
                start_new_session=True,  # a Ctrl-C in the terminal is ours to handle, not srun's
            )
        except FileNotFoundError:
            raise LaunchError(f"{NOT_INSTALLED} ({argv[0]} not found on PATH)") from None
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"{what}: `{argv[0]}` got no answer within {limit:g} s — is slurmctld up? "
                "(slurm.connect_timeout_s)"
            ) from None

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
        assert spec.slurm is not None
        most = max(sum(t.values()) for t in spec.slurm.layout())
        return cls(spec.slurm.nodes, most, spec.slurm.partition)


def check_cluster(slurm: Slurm, request: Request) -> tuple[str, list[dict[str, str]]]:
    """The partition the request goes to and its nodes; LaunchError when it cannot be satisfied."""
    missing = Slurm.missing()
    if missing:
        raise LaunchError(f"{NOT_INSTALLED} (missing: {', '.join(missing)}); install Slurm's client tools")
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


class Allocation:
    """The Slurm job the tasks run in: ours (released at the end) or the surrounding one."""

    def __init__(
        self,
        job_id: str,
        nodes: list[str],
        owned: bool,
        holder: subprocess.Popen[bytes] | None = None,
        log_path: Path | None = None,
    ):
        self.job_id = job_id
        self.nodes = nodes
        self.owned = owned
        self._holder = holder
        self._log_path = log_path
        self.released = False
        self.granted = not owned  # ours: once salloc's command runs
        self._log_size = -1
        self._revoked = False

    @classmethod
    def surrounding(cls, slurm: Slurm, env: Mapping[str, str]) -> Allocation | None:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job or not nodelist:
            return None
        return cls(job, slurm.hostnames(nodelist), owned=False)

    @classmethod
    def request(
        cls, slurm: Slurm, spec: ClusterSpec, run_id: str, folder: Path, cancel: threading.Event
    ) -> Allocation:
        """salloc, holding the allocation with a pipe from us; waits up to slurm.queue_timeout_s."""
        assert spec.slurm is not None
        argv = salloc_argv(spec, run_id)
        n = 1 + sum(1 for _ in folder.glob("salloc-*.log"))  # one pair of files per request
        out, err = folder / f"salloc-{n}.out", folder / f"salloc-{n}.log"
        with open(out, "wb") as o, open(err, "wb") as e:
            try:
                holder = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=o,
                    stderr=e,
                    env=slurm.env,
                    start_new_session=True,
                )
            except FileNotFoundError:
                raise LaunchError(f"{NOT_INSTALLED} (salloc not found on PATH)") from None
        alloc = cls("", [], owned=True, holder=holder, log_path=err)
        deadline = time.monotonic() + spec.slurm.queue_timeout_s
        try:
            while True:
                line = out.read_text(errors="replace").strip()
                if line.startswith("ALLOCATED "):
                    _, job, nodelist = line.split(maxsplit=2)
                    alloc.job_id, alloc.granted = job, True
                    alloc.nodes = slurm.hostnames(nodelist)
                    return alloc
                alloc.job_id = alloc.job_id or _pending_job(err)
                if holder.poll() is not None:
                    said = " ".join(_salloc_errors(err)) or f"salloc exited with {holder.returncode}"
                    raise LaunchError(f"Slurm refused the allocation: {said}")
                if cancel.is_set():
                    raise LaunchError("interrupted while waiting for the allocation")
                if time.monotonic() > deadline:
                    why = alloc.pending_reason(slurm)
                    raise LaunchError(
                        f"the allocation (job {alloc.job_id or '?'}) was still pending after "
                        f"{spec.slurm.queue_timeout_s:g} s (slurm.queue_timeout_s){why}; "
                        "the request is cancelled"
                    )
                time.sleep(0.05)
        except BaseException:
            alloc.release(slurm)
            raise

    def pending_reason(self, slurm: Slurm) -> str:
        if not self.job_id:
            return ""
        with contextlib.suppress(LaunchError):
            out = slurm.checked(["squeue", "-h", "-j", self.job_id, "-o", "%r"], "asking why").strip()
            if out:
                return f" (Slurm's reason: {out})"
        return ""

    def time_left_s(self, slurm: Slurm) -> float | None:
        """Seconds until the allocation's time limit; None without a limit (or when unknown)."""
        with contextlib.suppress(LaunchError):
            out = slurm.checked(
                ["squeue", "-h", "-j", self.job_id, "-o", "%L"], "asking the time left"
            ).strip()
            return _duration_s(out)
        return None

    def ended(self) -> str | None:
        """Ours, and gone without us releasing it: why (salloc's words). Cheap: salloc's log is
        read only when it grew."""
        if not self.owned or self.released or self._holder is None or self._log_path is None:
            return None
        try:
            size = self._log_path.stat().st_size
        except OSError:
            return None
        if size != self._log_size:
            self._log_size = size
            self._revoked = any(
                "revoked" in line or "time limit" in line for line in _salloc_errors(self._log_path)
            )
        if not self._revoked and self._holder.poll() is None:
            return None
        return " ".join(_salloc_errors(self._log_path)) or f"salloc exited ({self._holder.returncode})"

    def release(self, slurm: Slurm) -> None:
        """Ours: close the holder's pipe (salloc relinquishes it), or while it is still pending
        SIGTERM salloc (it withdraws the request); then scancel, to be sure. The surrounding
        allocation is left alone."""
        if not self.owned or self.released:
            return
        self.released = True
        holder = self._holder
        if holder is not None and holder.poll() is None:
            if self.granted:
                with contextlib.suppress(OSError):
                    assert holder.stdin is not None
                    holder.stdin.close()
            else:
                holder.terminate()
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(timeout=10)
        job = self.job_id or (_pending_job(self._log_path) if self._log_path else "")
        if job:
            with contextlib.suppress(LaunchError):
                slurm.run(["scancel", job], "releasing the allocation")


def salloc_argv(spec: ClusterSpec, run_id: str) -> list[str]:
    assert spec.slurm is not None
    s: SlurmSpec = spec.slurm
    request = Request.of(spec)
    argv = [
        "salloc",
        "--no-kill",  # a node lost leaves the others (and the spares) allocated
        f"--nodes={s.nodes}",
        f"--ntasks-per-node={request.tasks_per_node}",
        f"--job-name={job_name(run_id)}",
    ]
    if s.partition:
        argv.append(f"--partition={s.partition}")
    if s.account:
        argv.append(f"--account={s.account}")
    if s.time:
        argv += [f"--time={s.time}", f"--signal=TERM@{signal_lead_s(spec)}"]
    argv += s.extra_args
    # the allocation lives as long as this reads our pipe
    holder = 'echo "ALLOCATED $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null'
    return [*argv, "sh", "-c", holder]


def srun_argv(job_id: str, node: str, name: str, python: Sequence[str]) -> list[str]:
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",  # the tasks of a node share its CPUs, as on a lab machine
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={name}",
        "--quiet",
        *python,
        "-S",  # the shim needs only the standard library
        str(SHIM),
    ]


def _pending_job(log_path: Path | None) -> str:
    if log_path is None:
        return ""
    with contextlib.suppress(OSError):
        m = re.search(
            r"(?:Pending|Granted) job allocation (\d+)|[Jj]ob (\d+) queued",
            log_path.read_text(errors="replace"),
        )
        if m:
            return m.group(1) or m.group(2)
    return ""


def _salloc_errors(log_path: Path | None) -> list[str]:
    if log_path is None:
        return []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [ln.removeprefix("salloc: ").strip() for ln in lines]
    routine = (
        r"(Pending|Granted) job allocation|Relinquishing|Waiting for|Nodes .* are ready"
        r"|job \d+ (queued|has been allocated)"
    )
    keep = [ln for ln in keep if ln and not re.match(routine, ln)]
    return keep[-4:]


def _duration_s(text: str) -> float | None:
    """Slurm's `[D-]HH:MM:SS` (or MM:SS) as seconds; None for UNLIMITED or not a duration."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


class SlurmTaskHandle(TaskHandle):
    kill_wait_s = 5.0
    unconfirmed_hint = (
        "its node did not confirm (cut off?); it was left out of later attempts, its step goes with "
        "the allocation, and its task stops by itself once the coordinator is out of reach"
    )

    def __init__(
        self,
        task: TaskPlan,
        attempt: int,
        log_path: Path,
        node: str,
        popen: subprocess.Popen[bytes],
        slurm: Slurm,
    ):
        super().__init__(task, attempt, log_path)
        self.node = node
        self._popen = popen
        self._slurm = slurm
        self._started = threading.Event()
        self._ended = threading.Event()  # stderr closed: srun is done
        self._exit_code: int | None = None
        self._given_up = False  # its srun killed by us, the task's end unknown
        self._info: ProcessInfo | None = None
        self.step: str | None = None
        self.messages: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._pump_events, daemon=True, name=f"{task.name}-events").start()

    @property
    def process(self) -> ProcessInfo:
        return self._info or ProcessInfo(pid=0, pgid=0, create_time=0.0)

    @property
    def where(self) -> str:
        return self.node

    def poll(self) -> int | None:
        if self._exit_code is not None:
            return self._exit_code
        if self._given_up:
            return None  # srun was stopped by us: nothing is known of the task
        if self._ended.is_set() and self._popen.poll() is not None:
            return self._popen.returncode or 1  # the step ended with no word from the shim (node failure)
        return None

    def signal(self, sig: Sig) -> None:
        self.send(f"{sig.value}\n".encode())  # the shim signals the group (TERM with CONT)

    def send(self, data: bytes) -> None:
        """To the shim's stdin; a step already gone is fine (the shim stops the task by itself)."""
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.write(data)
            self._popen.stdin.flush()

    @property
    def exited(self) -> bool:
        return self.poll() is not None

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._started.is_set() and not self._ended.is_set() and time.monotonic() < deadline:
            self._started.wait(0.05)
        if self._started.is_set():
            return
        said = "; ".join(self.messages[-3:]) or (
            "its step ended" if self._ended.is_set() else f"no answer within {timeout_s:g} s"
        )
        self.release()
        raise LaunchError(f"cannot start {self.task.name} on {self.node}: {said}")

    def release(self) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.close()  # end of file: the shim stops the task, if it is still there
        if self._popen.poll() is None and not self.exited:
            # its node did not answer: cancel the step (Slurm cleans the node once it is back)
            self._given_up = True
            if self.step is not None:
                with contextlib.suppress(LaunchError):
                    self._slurm.run(["scancel", self.step], "cancelling a step", timeout_s=5)
            self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)

    def _pump_events(self) -> None:
        assert self._popen.stderr is not None
        for raw in self._popen.stderr:
            self._on_line(raw.decode(errors="replace").rstrip("\n"))
        self._popen.wait()
        self._ended.set()

    def _on_line(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict) or "event" not in event:
            if line.strip():
                self.messages.append(line.strip()[:500])
                del self.messages[:-20]
            return
        if event["event"] == "started":
            self._info = ProcessInfo(int(event["pid"]), int(event["pgid"]), float(event["create_time"]))
            self.step = event.get("step")
            self._started.set()
        elif event["event"] == "exit":
            self._exit_code = int(event["code"])
        elif event["event"] == "error":
            self.messages.append(str(event.get("message"))[:500])


class SlurmBackend(Backend):
    name = BackendName.SLURM.value
    listen_key = "slurm.coordinator_address"

    def __init__(
        self,
        spec: ClusterSpec,
        run_id: str,
        run_dir: Path,
        spec_dir: Path,
        env: Mapping[str, str] | None = None,
    ):
        assert spec.slurm is not None
        self._spec = spec
        self._conf: SlurmSpec = spec.slurm
        self._run_id = run_id
        self._run_dir = run_dir.resolve()
        self._spec_dir = spec_dir
        self._env = dict(env if env is not None else os.environ)
        self._slurm = Slurm(self._conf.connect_timeout_s, self._env)
        self._python = tuple(shlex.split(self._conf.python)) if self._conf.python else (sys.executable,)
        self._folder = self._run_dir / "slurm"  # salloc's output, the nodes' pid files
        self._alloc: Allocation | None = None
        self._addresses: dict[str, str] = {}  # node name -> NodeAddr
        self._cluster_nodes: list[dict[str, str]] = []
        self._surrounding: Allocation | None = None
        self._heartbeats: Heartbeats | None = None
        self._placements: dict[str, Placement] = {}
        self._node_of: dict[str, str] = {}  # task -> node name
        self._excluded: set[str] = set()  # nodes left out (lost)
        self._handles: dict[str, SlurmTaskHandle] = {}
        self._cancel = threading.Event()
        self._lock = threading.Lock()

    # --- opening ---

    def listen(self) -> tuple[str, int]:
        """slurm.coordinator_address, else this machine's address on the route to the nodes."""
        self._learn_cluster()
        direct = self._conf.coordinator_address
        if direct is not None:
            host, _, port = direct.partition(":")
            return host, int(port or 0)
        targets = [n.get("NodeAddr") or n.get("NodeName", "") for n in self._cluster_nodes]
        return route_address([t for t in targets if t]), 0

    def _learn_cluster(self) -> None:
        """The request checked against the cluster (or the surrounding allocation), and its nodes."""
        if self._cluster_nodes:
            return
        if Slurm.missing():
            raise LaunchError(
                f"{NOT_INSTALLED} (missing: {', '.join(Slurm.missing())}); install Slurm's client tools"
            )
        self._surrounding = Allocation.surrounding(self._slurm, self._env)
        if self._surrounding is not None:
            self._cluster_nodes = self._slurm.records("node", ",".join(self._surrounding.nodes))
        else:
            _, self._cluster_nodes = check_cluster(self._slurm, Request.of(self._spec))

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        self._heartbeats = heartbeats
        self._learn_cluster()
        make_private_dir(self._folder)
        alloc = self._surrounding
        if alloc is None:
            alloc = Allocation.request(self._slurm, self._spec, self._run_id, self._folder, self._cancel)
            log.info("allocation: job %s on %s", alloc.job_id, ",".join(alloc.nodes))
        else:
            log.info("inside allocation %s (%s): it is left as it is", alloc.job_id, ",".join(alloc.nodes))
        self._alloc = alloc
        used = len(self._spec.hosts)
        if len(alloc.nodes) < used:
            raise LaunchError(
                f"allocation {alloc.job_id} has {len(alloc.nodes)} node(s); the spec uses {used} "
                "(slurm.tasks_per_node)"
            )
        self._addresses = self._node_addresses(alloc.nodes)
        self._place(self._healthy(alloc.nodes, reason="at launch", required=True))
        return dict(self._placements)

    def _node_addresses(self, nodes: list[str]) -> dict[str, str]:
        known = {n.get("NodeName", ""): n.get("NodeAddr", "") for n in self._cluster_nodes}
        if not all(known.get(n) for n in nodes):
            known.update(
                {
                    r.get("NodeName", ""): r.get("NodeAddr", "")
                    for r in self._slurm.records("node", ",".join(nodes))
                }
            )
        return {n: known.get(n) or n for n in nodes}

    def _healthy(self, nodes: list[str], *, reason: str, required: bool) -> dict[str, dict[str, Any]]:
        """Probe every node (one step each, in parallel): its answer, for those that answered and
        see the run's files. Nodes that did not are named in the error (required) or left out."""
        assert self._alloc is not None
        nonce_path = self._folder / f"nonce-{secrets.token_hex(4)}"
        nonce = secrets.token_hex(16)
        nonce_path.write_text(nonce, encoding="utf-8")
        paths = {str(nonce_path): nonce, str(SHIM): SHIM.read_text(encoding="utf-8")[:4096]}
        entry = self._spec.job.script or self._spec.job.loop
        assert entry is not None
        paths[str(entry)] = entry.read_text(encoding="utf-8", errors="replace")[:4096]
        count = max(sum(h.tasks.values()) for h in self._spec.hosts)

        job_id = self._alloc.job_id

        def one(node: str) -> dict[str, Any]:
            mine = [str(p.port) for t, p in self._placements.items() if self._node_of.get(t) == node]
            argv = [
                *srun_argv(job_id, node, f"{job_name(self._run_id)}-probe", ())[:-2],
                *self._python,
                "-c",
                PROBE_SOURCE,
                "node",
                str(count),
                *mine,
            ]
            res = self._slurm.run(
                argv,
                f"probing {node}",
                timeout_s=self._conf.connect_timeout_s + 20,
                stdin=json.dumps({str(k): v for k, v in paths.items()}),
            )
            if res.returncode != 0:
                raise LaunchError(" ".join(res.stderr.split())[-400:] or f"exit {res.returncode}")
            return dict(json.loads(res.stdout.strip().splitlines()[-1]))

        answers: dict[str, dict[str, Any]] = {}
        problems: list[str] = []
        try:
            with ThreadPoolExecutor(max_workers=min(32, len(nodes)) or 1) as pool:
                results = list(zip(nodes, pool.map(_guarded(one), nodes), strict=True))
        finally:
            nonce_path.unlink(missing_ok=True)
        for node, answer in results:
            if isinstance(answer, BaseException):
                problems.append(f"{node}: {answer}")
                continue
            unseen = [p for p, ok in answer.get("seen", {}).items() if not ok]
            if unseen:
                problems.append(
                    f"{node} does not see this machine's files ({', '.join(unseen[:2])}): the slurm backend "
                    "needs the job's folder, the run directory and orchestrate on a filesystem the nodes "
                    "share (run from your home or project space, or --run-dir there)"
                )
                continue
            answers[node] = answer
        if problems and required:
            raise LaunchError(f"node check {reason} failed:\n  " + "\n  ".join(problems))
        for p in problems:
            log.warning("left out %s", p)
        return answers

    def _place(self, answers: Mapping[str, dict[str, Any]]) -> dict[str, Placement]:
        """Give every task a node and a free port: each node used keeps its tasks while it is well;
        a node lost is replaced by the first spare. Returns the tasks placed anew."""
        assert self._heartbeats is not None and self._alloc is not None
        used = len(self._spec.hosts)
        previous = [self._host_node(i) for i in range(used)]
        well = [n for n in self._alloc.nodes if n in answers and n not in self._excluded]
        spares = [n for n in well if n not in previous]
        nodes: list[str] = []
        for node in previous:
            if node is not None and node in well:
                nodes.append(node)
            elif spares:
                nodes.append(spares.pop(0))
            else:
                raise LaunchError(
                    f"{len(well)} node(s) of allocation {self._alloc.job_id} answer, the spec uses {used}"
                    + (f" (left out: {', '.join(sorted(self._excluded))})" if self._excluded else "")
                )
        moved: dict[str, Placement] = {}
        free = {n: list(a.get("free", [])) for n, a in answers.items()}
        pythonpath = () if self._conf.python is None else (str(_RUNTIME_ROOT),)
        for slot in task_slots(self._spec):
            node = nodes[slot.host_index]
            old = self._placements.get(slot.name)
            port = old.port if old is not None and self._node_of.get(slot.name) == node else 0
            if port and not answers[node].get("ports", {}).get(str(port), True):
                port = 0  # another program took it meanwhile
            if not port:
                if not free.get(node):
                    raise LaunchError(f"{node}: no free TCP port found for {slot.name}")
                port = int(free[node].pop(0))
            place = Placement(
                host=self._addresses.get(node, node),
                port=port,
                run_folder=str(self._run_dir),
                python=self._python,
                cwd=str(self._spec_dir),
                coordinator_url=self._heartbeats.url,
                host_index=slot.host_index,
                pythonpath=pythonpath,
            )
            if old is not None and old != place:
                moved[slot.name] = place
            self._placements[slot.name] = place
            self._node_of[slot.name] = node
        return moved

    def _host_node(self, index: int) -> str | None:
        for slot in task_slots(self._spec):
            if slot.host_index == index and slot.name in self._node_of:
                return self._node_of[slot.name]
        return None

    def record(self) -> dict[str, Any]:
        alloc = self._alloc
        return {
            "backend": self.name,
            "run_id": self._run_id,
            "job_name": job_name(self._run_id),
            "job_id": alloc.job_id if alloc else None,
            "owned": alloc.owned if alloc else None,
            "nodes": alloc.nodes if alloc else [],
            "connect_timeout_s": self._conf.connect_timeout_s,
        }

    # --- per attempt ---

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
        """From the second attempt: leave out the nodes whose tasks' end could not be confirmed
        and those that no longer answer; a new allocation when ours ended (its time limit) or is
        about to."""
        if attempt == 0 or self._alloc is None:
            return Prepared()
        notes = []
        lost = sorted({h.node for h in self._handles.values() if not h.exited})
        for node in lost:
            if node not in self._excluded:
                self._excluded.add(node)
                notes.append(
                    f"node {node} is left out: the end of its task could not be confirmed (cut off?)"
                )
        self._handles = {}
        if self._alloc.owned and self._renew_allocation(notes):
            self._excluded.clear()
        candidates = [n for n in self._alloc.nodes if n not in self._excluded]
        answers = self._healthy(candidates, reason=f"before attempt {attempt}", required=False)
        for node in candidates:
            if node not in answers:
                self._excluded.add(node)
                notes.append(f"node {node} is left out: it did not answer a probe step")
        before = {t: self._node_of.get(t) for t in self._placements}
        moved = self._place(answers)
        for task in moved:
            if before.get(task) not in (None, self._node_of[task]):
                notes.append(f"{task} moves from {before.get(task)} to {self._node_of[task]}")
        return Prepared(notes=notes, moved=moved)

    def _renew_allocation(self, notes: list[str]) -> bool:
        assert self._alloc is not None
        ended = self._alloc.ended()
        left = None if ended else self._alloc.time_left_s(self._slurm)
        if ended is None and (left is None or left > signal_lead_s(self._spec)):
            return False
        why = f"it ended ({ended})" if ended else f"its time limit is {left:g} s away"
        self._alloc.release(self._slurm)
        old = self._alloc.job_id
        self._alloc = Allocation.request(self._slurm, self._spec, self._run_id, self._folder, self._cancel)
        self._addresses = self._node_addresses(self._alloc.nodes)
        notes.append(
            f"a new allocation (job {self._alloc.job_id} on {','.join(self._alloc.nodes)}): job {old}: {why}"
        )
        return True

    def ended_outside(self) -> str | None:
        """The allocation was cancelled from outside (scancel): the run ends INTERRUPTED. A time
        limit is not: the next attempt gets a new allocation."""
        alloc = self._alloc
        if alloc is None:
            return None
        ended = alloc.ended()
        if ended is None or "time limit" in ended.lower():
            return None
        return f"the allocation (Slurm job {alloc.job_id}) ended from outside: {ended}"

    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        handle = self._open_step(task, attempt, token, log_path)
        handle.wait_started(self._conf.connect_timeout_s + 20)
        return handle

    def start_all(
        self, tasks: list[TaskPlan], attempt: int, tokens: list[str], log_paths: list[Path]
    ) -> list[TaskHandle | LaunchError]:
        def one(i: int) -> TaskHandle:
            return self.start(tasks[i], attempt, tokens[i], log_paths[i])

        with ThreadPoolExecutor(max_workers=min(32, len(tasks)) or 1) as pool:
            results = list(pool.map(_guarded(one), range(len(tasks))))
        out: list[TaskHandle | LaunchError] = []
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, LaunchError):
                raise r
            out.append(r)
        return out

    def _open_step(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> SlurmTaskHandle:
        assert self._alloc is not None
        node = self._node_of[task.name]
        pidfile = self._folder / "nodes" / node / f"{task.name}.json"
        job = {
            "cache": "",
            "folder": str(self._run_dir),
            "files": [],
            "argv": list(task.argv),
            "env": task.launch_env(attempt=attempt, token=token),
            "cwd": task.cwd,
            "log": str(log_path.resolve()),
            "pidfile": str(pidfile),
            "run_id": self._run_id,
            "task": task.name,
            "attempt": attempt,
            "grace_s": self._spec.health.stop_grace_s,
            "follow": False,  # the log file is shared: the coordinator reads it in place
            "forward_signals": False,  # Slurm signals the task itself
        }
        argv = srun_argv(self._alloc.job_id, node, f"{job_name(self._run_id)}-{task.name}", self._python)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=self._slurm.env,
                start_new_session=True,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {task.name}: srun: {exc.strerror or exc}") from None
        handle = SlurmTaskHandle(task, attempt, log_path, node, popen, self._slurm)
        handle.send((json.dumps(job) + "\n").encode())
        with self._lock:
            self._handles[task.name] = handle
        return handle

    def close(self) -> None:
        self._cancel.set()
        alloc = self._alloc
        if alloc is None:
            return
        for h in list(self._handles.values()):
            h.release()
        if alloc.owned:
            alloc.release(self._slurm)
        else:
            cancel_steps(self._slurm, alloc.job_id, job_name(self._run_id))


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


def _guarded(fn: Any) -> Any:
    def call(arg: Any) -> Any:
        try:
            return fn(arg)
        except Exception as exc:  # noqa: BLE001 - handed back as the item's result
            return exc

    return call


class SlurmLeftovers(Leftovers):
    """`orchestrate down` with the coordinator gone: its allocation (found by name: a renewed one
    too) is cancelled; inside an allocation that is not ours, only this run's steps."""

    def __init__(self, record: Mapping[str, Any]):
        self._record = record

    def stop(self, grace_s: float) -> list[tuple[str, bool]]:
        slurm = Slurm(float(self._record.get("connect_timeout_s") or 10.0))
        name = str(self._record.get("job_name") or job_name(str(self._record.get("run_id"))))
        try:
            if self._record.get("owned") is False:
                steps = cancel_steps(slurm, str(self._record.get("job_id")), name)
                what = f"cancelled step(s) {', '.join(steps)}" if steps else "no step of this run left"
                return [(f"Slurm job {self._record.get('job_id')} (not ours, left running): {what}", True)]
            out = slurm.checked(["squeue", "-h", "--name", name, "-o", "%i"], "listing this run's allocation")
            jobs = out.split()
            if jobs:
                slurm.checked(["scancel", "--signal=TERM", *jobs], "asking the tasks to stop")
                deadline = time.monotonic() + grace_s
                while (
                    time.monotonic() < deadline
                    and slurm.checked(
                        ["squeue", "-h", "-s", "-j", ",".join(jobs), "-o", "%i"], "waiting"
                    ).strip()
                ):
                    time.sleep(0.2)
                slurm.checked(["scancel", *jobs], "releasing the allocation")
            what = f"cancelled job(s) {', '.join(jobs)}" if jobs else "no allocation of this run left"
            return [(f"Slurm: {what}", True)]
        except LaunchError as exc:
            return [(f"Slurm: {exc}", False)]


def preview_lines(
    spec: ClusterSpec, run_id: str, run_dir: Path, env: Mapping[str, str] | None = None
) -> list[str]:
    """`orchestrate plan`: the Slurm commands `up` will use."""
    env = env if env is not None else os.environ
    job = env.get("SLURM_JOB_ID")
    if job:
        alloc = f"inside Slurm job {job} (SLURM_JOB_ID): its nodes are used, the allocation is left as it is"
    else:
        alloc = f"allocation: {shlex.join(salloc_argv(spec, run_id))}"
    python = tuple(shlex.split(spec.slurm.python)) if spec.slurm and spec.slurm.python else (sys.executable,)
    step = shlex.join(srun_argv(job or "JOB", "NODE", f"{job_name(run_id)}-TASK", python))
    return [
        alloc,
        f"each task, one step: {step}",
        "  (the task's command and environment reach worker/shim.py on its stdin, never on a command line)",
        "nodes, their addresses and free TF ports are known once allocated; the nodes must see this "
        f"machine's files (the job's folder, {run_dir}, orchestrate): checked at launch",
    ]


def check(spec: ClusterSpec) -> CheckReport:
    """`orchestrate check`: the partition can run the request; one short step on the nodes
    (Python, TensorFlow, the files they see); the nodes reach each other on a TF port."""
    assert spec.slurm is not None
    conf = spec.slurm
    title = f"{spec.name}: Slurm, {conf.nodes} node(s)"
    slurm = Slurm(conf.connect_timeout_s)
    try:
        partition, nodes = check_cluster(slurm, Request.of(spec))
    except LaunchError as exc:
        return CheckReport(title, [{"node": "-", "problem": str(exc)}], [], [str(exc)])
    rows = {
        n.get("NodeName", "?"): {
            "node": n.get("NodeName", "?"),
            "address": n.get("NodeAddr", "?"),
            "state": n.get("State", "?"),
            "cpus": n.get("CPUTot", "?"),
            "python": "-",
            "tensorflow": "-",
            "files": "-",
            "peers": "-",
        }
        for n in nodes
    }
    problems: list[str] = []
    warnings: list[str] = []
    python = tuple(shlex.split(conf.python)) if conf.python else (sys.executable,)
    entry = spec.job.script or spec.job.loop
    assert entry is not None
    seen = {str(SHIM): SHIM.read_text(encoding="utf-8")[:4096]}
    with contextlib.suppress(OSError):
        seen[str(entry)] = entry.read_text(encoding="utf-8", errors="replace")[:4096]
    port = secrets.SystemRandom().randrange(15000, 32000)
    # the step runs on nodes we name, so that each knows its peers: idle ones first
    ready = sorted(nodes, key=lambda n: not n.get("State", "").startswith(("IDLE", "MIXED")))[: conf.nodes]
    addresses = [n.get("NodeAddr") or n.get("NodeName", "") for n in ready]
    argv = [
        "srun",
        f"--immediate={max(1, math.ceil(conf.connect_timeout_s))}",
        f"--nodes={len(ready)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(n.get('NodeName', '') for n in ready)}",
        f"--partition={partition}",
        *([f"--account={conf.account}"] if conf.account else []),
        f"--job-name=orchestrate-check-{secrets.token_hex(4)}",
        "--quiet",
        *python,
        "-c",
        PROBE_SOURCE,
        "mesh",
        str(port),
        "3",
        *(f"{a}:{port}" for a in addresses),
    ]
    res = slurm.run(
        argv, "a probe step on the nodes", timeout_s=conf.connect_timeout_s + 60, stdin=json.dumps(seen)
    )
    answers = []
    for line in res.stdout.splitlines():
        with contextlib.suppress(ValueError):
            answers.append(json.loads(line))
    if res.returncode != 0 or not answers:
        problems.append(
            f"a probe step on {conf.nodes} node(s) of {partition} failed: "
            + (" ".join(res.stderr.split())[-400:] or f"exit {res.returncode}")
        )
    versions = set()
    for a in answers:
        row = rows.get(a.get("hostname", ""))
        if row is None:
            continue
        row["python"] = f"{a.get('python')} ({a.get('executable')})"
        row["tensorflow"] = str(a.get("tensorflow") or "MISSING")
        versions.add((a.get("python"), a.get("tensorflow")))
        if not a.get("tensorflow"):
            problems.append(
                f"{row['node']}: TensorFlow is not installed for {shlex.join(python)} (slurm.python)"
            )
        unseen = [p for p, ok in a.get("seen", {}).items() if not ok]
        row["files"] = "shared" if not unseen else "NOT SEEN"
        if unseen:
            problems.append(
                f"{row['node']} does not see {', '.join(unseen)}: the slurm backend needs this "
                "machine's files on a filesystem the nodes share"
            )
        unreached = [peer for peer, ok in a.get("reached", {}).items() if not ok]
        row["peers"] = "all reached" if not unreached else f"cannot reach {', '.join(unreached)}"
        if unreached:
            problems.append(f"{row['node']} cannot reach {', '.join(unreached)} (TF ports between nodes)")
    if len(versions) > 1:
        warnings.append(f"the nodes differ in Python/TensorFlow: {sorted(map(str, versions))}")
    return CheckReport(title, list(rows.values()), warnings, problems)
