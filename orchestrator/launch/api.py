"""Launch layer: the backend boundary — what the coordinator, the planner and the supervisor may
ask of any backend (local subprocesses, SSH hosts, the ones to come), and the one stop routine.

A backend's life: `open` (reach and check where the tasks run, take what they need: ports,
tunnels, files) → per-task placements, from which the plan is made; per attempt
`before_attempt` then `start` for each task; `bring_home` at the end; `close`. Its `record()` is
written into the run directory so that `orchestrate down` can `reattach` once the coordinator is
gone, with one code path for every backend.

A backend overrides only its transport: its handles know how to signal and watch one task's
process group; `stop_all` is the TERM → grace → KILL routine for any set of handles (as torch
elastic's one close routine over per-process handles), and it returns what it could not confirm
as data, never by raising.
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.health.credentials import Credentials
from orchestrator.launch.exposure import Exposure
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan
from orchestrator.plan.placement import Machine, Placement, Relaid
from orchestrator.states import Degraded
from worker.wire.failure import Written


@dataclass(frozen=True)
class ProcessInfo:
    """What a status reader needs to find (and safely stop) a task's process later."""

    pid: int
    pgid: int
    create_time: float  # guards against a recycled pid


class Sig(enum.Enum):
    TERM = "TERM"  # stop: the task may save and exit (a stopped task is continued first)
    KILL = "KILL"


@dataclass(frozen=True)
class Heartbeats:
    """The coordinator's heartbeat server, as a backend sees it when opening."""

    host: str  # where it listens on this machine
    port: int
    url: str
    credentials: Credentials  # a relay's (ssh backend) come from here
    notify: Callable[[str], None] = print  # lines for people while opening (an environment's progress)


@dataclass(frozen=True)
class Prepared:
    """What a backend did before an attempt: lines for the record, and the tasks it placed anew
    (a port taken meanwhile by another program); the plan is made again from those."""

    notes: list[str] = field(default_factory=list)
    moved: dict[str, Placement] = field(default_factory=dict)
    record_changed: bool = False  # record() says something new (a new allocation): written again


class TaskHandle(abc.ABC):
    """One running attempt of one task: its process group, wherever it runs."""

    kill_wait_s: ClassVar[float] = 10.0  # after SIGKILL, how long its exit may take to be confirmed
    unconfirmed_hint: ClassVar[str] = "it survived SIGKILL (uninterruptible I/O?)"

    def __init__(self, task: TaskPlan, attempt: int, log_path: Path):
        self.task = task
        self.attempt = attempt
        self.log_path = log_path

    @property
    @abc.abstractmethod
    def process(self) -> ProcessInfo: ...

    @property
    def where(self) -> str:
        """Where it runs, for people ("" on this machine)."""
        return ""

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code once the task's main process has exited (negative: killed by that signal)."""

    @abc.abstractmethod
    def signal(self, sig: Sig) -> None:
        """Send `sig` to the task's whole process group; a group already gone is fine."""

    @property
    @abc.abstractmethod
    def exited(self) -> bool:
        """Confirmed: its exit code is known and nothing of its group runs any more."""

    @property
    def reachable(self) -> bool:
        """False once nothing more can be learned of it (its host's connection is gone)."""
        return True

    @property
    def unanswering(self) -> bool:
        """Whether its host gave no answer the last time it was asked something (its stacks): cut
        off, likely. A stop after its heartbeats ended does not wait for it (`stop_all(gone=…)`)."""
        return False

    def release(self) -> None:
        """Let go of what watching it holds (a channel); called once it is stopped or given up."""
        return None

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        """Every thread's stacks of its process, read on its host by `deadline` (time.monotonic()
        here): worker/host/stacks.py's document; one that cannot be read says why. Never raises."""
        return {"pid": self.process.pid, "state": "unknown", "threads": [], "notes": ["not readable here"]}

    def written_error(self) -> Written | None:
        """Once it has exited: the exception it wrote to its error file as it died
        (worker/wire/failure.py), None where it wrote none or the file cannot be had. Read by the
        supervisor when no heartbeat brought the error."""
        return None


#: The grace of a task that saves nothing (`stop_all(quick=…)`: a ParameterServerStrategy server,
#: perhaps blocked in `server.join()`, where Python never sees SIGTERM): enough for its runtime to
#: flush its last lines, not the whole grace period for nothing.
QUICK_GRACE_S = 2.0


def stop_all(
    handles: Sequence[TaskHandle],
    grace_s: float,
    hurry: threading.Event | None = None,
    *,
    quick: Collection[TaskHandle] = (),
    gone: Collection[TaskHandle] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_exit: Callable[[TaskHandle], None] | None = None,
) -> list[TaskHandle]:
    """SIGTERM every handle's group, wait up to `grace_s` (QUICK_GRACE_S at most for the `quick`
    ones, which save nothing; less once `hurry` is set), SIGKILL what is left, wait for the exits to
    be confirmed. The `gone` ones (silent, their hosts cut off) are sent SIGKILL, which reaches
    them if their hosts come back, and not waited for. Returns the handles whose exit could not be
    confirmed. `on_exit` is told of each handle once its exit is confirmed (one already gone
    included), while the others still stop."""
    told: set[int] = set()
    gone_ids = {id(h) for h in gone}

    def settled(hs: Sequence[TaskHandle]) -> bool:
        if on_exit is not None:
            for h in handles:
                if id(h) not in told and h.exited:
                    told.add(id(h))
                    on_exit(h)
        return all(h.exited or not h.reachable or id(h) in gone_ids for h in hs)

    settled(handles)
    for h in gone:
        if not h.exited and h.reachable:
            h.signal(Sig.KILL)
    live = [h for h in handles if not h.exited and h.reachable and id(h) not in gone_ids]
    for h in live:
        h.signal(Sig.TERM)
    start = clock()
    quick_ids = {id(h) for h in quick}
    until = {id(h): start + (min(grace_s, QUICK_GRACE_S) if id(h) in quick_ids else grace_s) for h in live}
    killed: list[TaskHandle] = []
    while True:
        settled(handles)
        pending = [h for h in live if h not in killed and not h.exited and h.reachable]
        hurried = hurry is not None and hurry.is_set()
        now = clock()
        due = [h for h in pending if hurried or now >= until[id(h)]]
        for h in due:
            h.signal(Sig.KILL)
        killed += due
        if len(due) == len(pending):
            break
        sleep(0.05)
    deadline = clock() + max((h.kill_wait_s for h in killed), default=0.0)
    while not settled(killed) and clock() < deadline:
        sleep(0.02)
    settled(handles)
    for h in handles:
        h.release()
    return [h for h in handles if not h.exited]


def stop_in_background(handles: Sequence[TaskHandle], grace_s: float, hurry: threading.Event) -> Future[Any]:
    """`stop_all` on a thread of its own: stopping one task never holds up the supervisor."""
    done: Future[Any] = Future()

    def run() -> None:
        try:
            done.set_result(stop_all(handles, grace_s, hurry))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="stop").start()
    return done


def unconfirmed_reason(handles: Sequence[TaskHandle]) -> str:
    names = ", ".join(f"{h.task.name} on {h.where}" if h.where else h.task.name for h in handles)
    return f"{names}: exit not confirmed; {handles[0].unconfirmed_hint}"


@dataclass(frozen=True)
class CheckReport:
    """`orchestrate check`'s findings: one table row per host, then warnings and problems."""

    title: str
    rows: list[dict[str, str]]
    warnings: list[str]
    problems: list[str]


class Backend(abc.ABC):
    """Where the tasks of one run execute. One instance per run; see the module docstring."""

    name: ClassVar[str]
    listen_key: ClassVar[str | None] = None  # the spec key that sets where heartbeats are heard
    starts_at_once: ClassVar[bool] = False  # start_all starts every task on a thread of its own

    def listen(self) -> tuple[str, int]:
        """Where the coordinator's heartbeat server listens: loopback unless the backend's tasks
        post to it directly from elsewhere."""
        return "127.0.0.1", 0

    @abc.abstractmethod
    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        """Reach and check everything the tasks need (nothing starts if one thing fails:
        LaunchError naming all of it); every task's placement."""

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
        """Give every task what the attempt needs of the earlier ones (where hosts share no disk,
        the owner's latest checkpoint, plan.state); LaunchError if it cannot."""
        return Prepared()

    def machines(self, plan: LaunchPlan, suspects: Mapping[str, tuple[str, str | None]]) -> list[Machine]:
        """Before an attempt after the first: every machine of the run — those that ran `plan`'s
        tasks (`Machine.position`: the spec host whose tasks they ran), the spares, the lost ones
        — and whether each answers. `suspects`: tasks of `plan` whose host may be lost, why and
        since when (their end could not be confirmed: "unreachable"; their last heartbeat).
        Bounded by the backend's connect timeout; a machine that cannot be asked is lost.
        Default: none (a backend whose one machine is never lost)."""
        return []

    def relayout(self, machines: Mapping[int, str | None]) -> Relaid:
        """From the next attempt, hosts[p]'s tasks run on the machine `machines[p]` (a key of
        `machines()`), or nowhere (None: left out). Asked only when something moved."""
        raise LaunchError(f"backend {self.name} cannot move tasks between machines")

    def state_known(self, plan: LaunchPlan) -> None:
        """The job will restart and the owner of plan.state has exited: its last checkpoint is
        known. Where hosts share no disk, bringing it home may begin now, on a thread of its own,
        while the other tasks still stop (`before_attempt` then uses it). Never blocks or raises."""
        return None

    @abc.abstractmethod
    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        """Start one task, `token` its own heartbeat credential for the attempt (secret: never
        on a command line); LaunchError when it cannot be started at all."""

    def start_all(
        self, tasks: list[TaskPlan], attempt: int, tokens: list[str], log_paths: list[Path]
    ) -> list[TaskHandle | LaunchError]:
        """Start every task (at once where `starts_at_once`: a remote start waits on its host);
        per task, its handle or its LaunchError. Any other exception is a bug of ours: raised."""
        if not self.starts_at_once:
            out: list[TaskHandle | LaunchError] = []
            for task, token, log_path in zip(tasks, tokens, log_paths, strict=True):
                try:
                    out.append(self.start(task, attempt, token, log_path))
                except LaunchError as exc:
                    out.append(exc)
            return out
        group = on_all(
            list(range(len(tasks))), lambda i: self.start(tasks[i], attempt, tokens[i], log_paths[i])
        )
        for _, error in group.failed:
            if not isinstance(error, LaunchError):
                raise error
        return cast(list[TaskHandle | LaunchError], group.values())  # every other exception raised above

    def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
        """The attempt trains: a warm standby for every task that has none (launch/standby.py),
        where the backend has them; lines for the record. Never slows the attempt."""
        return []

    def standby_news(self) -> list[str]:
        """Standbys that failed since last asked (they could not import TensorFlow): a line each,
        with the host and the error. Asked once per supervisor iteration: it must be cheap."""
        return []

    def standbys(self) -> list[dict[str, Any]]:
        """The standbys as status.json lists them: task, host, pid, state, rss_bytes."""
        return []

    def degraded(self) -> list[Degraded]:
        """What of the run fell back since last asked (orchestrator/states.py `Degraded`): the
        run's network, a host's standbys. Asked once per supervisor iteration: it must be cheap."""
        return []

    def diagnose_startup(self, plan: LaunchPlan, late: Sequence[str]) -> str | None:
        """At the start-up deadline, with `late` tasks never up: why their cluster did not connect,
        when the backend can tell (hosts that cannot reach each other's TF ports); None otherwise.
        Bounded by a few seconds."""
        return None

    def ended_outside(self) -> str | None:
        """Why the run must end INTERRUPTED when what the backend runs in was taken away from
        outside (a Slurm allocation cancelled); None while it was not. Asked once per supervisor
        iteration: it must be cheap."""
        return None

    @abc.abstractmethod
    def record(self) -> dict[str, Any]:
        """What `reattach` needs to find this run's processes later: {"backend": name, …}."""

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """At the end of the run, whatever its outcome: copy the results (model, TensorBoard, the
        latest checkpoint) into the run directory. Lines for the summary; never raises."""
        return []

    def exposure(self) -> Exposure | None:
        """From where this run's TF ports can be reached, once `listen` was asked; None: as its
        kind's `reach` says of the spec."""
        return None

    def close(self) -> None:
        """Release what the backend holds (ports, connections). Its tasks are stopped first."""
        return None


class Leftovers(abc.ABC):
    """A run's processes found again from its record, once its coordinator is gone."""

    @abc.abstractmethod
    def stop(self, grace_s: float) -> list[tuple[str, bool]]:
        """Stop whatever of the run still runs; per place, a line and whether it could be asked."""
