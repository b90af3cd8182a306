"""Launch layer: a task run through its shim (worker/host/shim.py), as every backend whose tasks run
away from this machine runs it (ssh: over an SSH channel; slurm: as an `srun` step).

One handle for all of them, in the spirit of Fabric's `Remote(Runner)`: only the `Transport`
differs — how the shim's stdin, stdout and stderr travel, and what ending it means. The rest is the
same everywhere: the job the shim is given (`shim_job`), what it says on its stderr (one JSON event
per line: "started" with its pid, process group and, under Slurm, its step; "failure" with the
task's error file; "exit" with the code; "error"; any other text is kept, a few lines of it, for the
reason of a failed start such as the shell's "python3: not found"), TERM/KILL on its stdin, and the
task's output streamed into its log here.
"""

from __future__ import annotations

import abc
import json
import secrets
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.api import ProcessInfo, Sig, TaskHandle
from orchestrator.plan.launch_plan import TaskPlan
from orchestrator.record.write import private_open
from orchestrator.stacks import record as stacks_doc
from worker import wire
from worker.host import stacks
from worker.wire import failure
from worker.wire.values import safe_text

_KEPT_LINES = 20
_KEPT_CHARS = 500
#: A line of the shim's stderr longer than this (text from a failed start that never ends) is cut.
_MAX_LINE_BYTES = 1024 * 1024


def shim_job(
    task: TaskPlan,
    attempt: int,
    env: dict[str, str],
    *,
    run_id: str,
    folder: str,
    log: str,
    pidfile: str,
    grace_s: float,
    cache: str = "",
    files: Iterable[list[Any]] = (),
    **options: Any,
) -> dict[str, Any]:
    """What the shim reads on its first line (worker/host/shim.py says each key). `env` is the task's
    whole environment for this attempt; `options`: follow, forward_signals, port_lock."""
    return {
        "cache": cache,
        "folder": folder,
        "files": list(files),
        "argv": list(task.argv),
        "env": env,
        "cwd": task.cwd,
        "log": log,
        "pidfile": pidfile,
        "error_file": failure.path(env[wire.ENV_RUN_DIR], task.name, attempt),
        "stacks_file": stacks.path(env[wire.ENV_RUN_DIR], task.name, attempt),
        "run_id": run_id,
        "task": task.name,
        "attempt": attempt,
        "grace_s": grace_s,
        **options,
    }


def parse(line: str) -> dict[str, Any] | None:
    """A line of the shim's stderr as its event; None for text that is not one."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


class ShimEvents:
    """What a shim said on its stderr, as it arrives."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.ended = threading.Event()  # exit reported, or the stream closed
        self.exit_code: int | None = None
        self.info: ProcessInfo | None = None
        self.step: str | None = None  # its Slurm step (JOB.STEP), when it runs as one
        self.messages: list[str] = []  # text that is not an event, the latest few
        self.failure: Any = None  # the task's error file, as the shim read it (checked when used)
        self.standby: ProcessInfo | None = None  # a warm standby's process, waiting for its attempt
        self.standby_ready = False  # it has imported TensorFlow
        self.page_copy: str | None = None  # why its host's spares cannot copy their pages, if so
        self.standby_failed: str | None = None  # it exited before its attempt: its log's last lines
        self.standby_refused: tuple[int, int] | None = None  # (available, total): too little memory
        self.stacks: dict[str, Any] = {}  # the answers to STACKS, by their id (until taken)
        self.stacks_came = threading.Condition()

    def feed(self, line: str) -> None:
        event = parse(line)
        if event is None:
            if line.strip():
                self._keep(line.strip())
            return
        self.take(event)

    def take(self, event: dict[str, Any]) -> None:
        if event["event"] == "started":
            self.info = ProcessInfo(int(event["pid"]), int(event["pgid"]), float(event["create_time"]))
            self.step = event.get("step")
            self.started.set()
        elif event["event"] == "standby":
            self.standby = ProcessInfo(int(event["pid"]), int(event["pgid"]), float(event["create_time"]))
        elif event["event"] == "standby_ready":
            self.standby_ready = True
            self.page_copy = safe_text(str(event["page_copy"])[:500]) if event.get("page_copy") else None
        elif event["event"] == "standby_failed":
            self.standby_failed = str(event.get("tail", ""))[-_KEPT_CHARS:]
        elif event["event"] == "standby_refused":
            self.standby_refused = (int(event["available"]), int(event["total"]))
        elif event["event"] == "stacks":
            with self.stacks_came:
                self.stacks[str(event.get("id"))] = event.get("document")
                for late in list(self.stacks)[:-8]:  # answers that came after their asker gave up
                    del self.stacks[late]
                self.stacks_came.notify_all()
        elif event["event"] == "failure":
            self.failure = event.get("document")
        elif event["event"] == "exit":
            self.exit_code = int(event["code"])
            self._end()
        elif event["event"] == "error":
            self._keep(str(event.get("message")))

    def close(self) -> None:
        """The stream ended."""
        self._end()

    def _end(self) -> None:
        with self.stacks_came:  # a read waiting for its answer learns there will be none
            self.ended.set()
            self.stacks_came.notify_all()

    def wait_started(self, timeout_s: float, closed: str) -> str | None:
        """None once the task started; else why not: the shim's last words, or `closed` when the
        stream ended without any, or the time waited."""
        deadline = time.monotonic() + timeout_s
        while not self.started.is_set() and not self.ended.is_set() and time.monotonic() < deadline:
            self.started.wait(0.05)
        if self.started.is_set():
            return None
        return "; ".join(self.messages[-3:]) or (
            closed if self.ended.is_set() else f"no answer within {timeout_s:g} s"
        )

    def _keep(self, text: str) -> None:
        self.messages.append(text[:_KEPT_CHARS])
        del self.messages[:-_KEPT_LINES]


class Transport(abc.ABC):
    """How one shim's streams travel (an SSH channel, an srun step)."""

    #: Where the task runs, for people (a host's label, a node).
    where: str = ""
    #: What the stream's end before the task started means ("the channel closed").
    closed_text: str = "its shim ended"
    #: Whether the stream's end means nothing more can be learned (a connection lost).
    unreachable_at_end: bool = False
    #: Whether the task's output comes on the shim's stdout (else its log is a file shared here).
    streams_output: bool = True

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """To the shim's stdin; a transport already gone is fine (the shim stops the task itself)."""

    def end_input(self) -> None:
        """End of file on the shim's stdin, the transport kept (a standby then stops and says so)."""
        return None

    @abc.abstractmethod
    def read_events(self) -> bytes:
        """The next bytes of the shim's stderr; b"" once it ended."""

    def read_output(self) -> bytes:
        """The next bytes of the shim's stdout (the task's output); b"" once it ended."""
        return b""

    def ended_code(self, events: ShimEvents) -> int | None:
        """What the transport knows of the task's end where the shim said nothing (a step ended
        with its node failing), else None."""
        return None

    @abc.abstractmethod
    def close(self, confirmed: bool, events: ShimEvents) -> None:
        """Let go of the shim; `confirmed`: the task's exit is known (else it is given up)."""


class ShimHandle(TaskHandle):
    """One task attempt run by its shim, over any transport. A kept shim (a standby's,
    worker/host/shim_standby.py) runs an attempt per GO: each has a handle of its own
    (`next_attempt`) over the one transport, whose events and output go to the attempt it runs."""

    def __init__(
        self, task: TaskPlan, attempt: int, log_path: Path, transport: Transport, line: _Line | None = None
    ):
        super().__init__(task, attempt, log_path)
        self.transport = transport
        self._events = ShimEvents()
        if line is None:
            line = _Line(transport, self._events, log_path, task.name)
        else:
            line.attach(self._events, log_path)
        self._line = line
        self._unanswered = False  # its last stacks request went unanswered

    def next_attempt(self, task: TaskPlan, attempt: int, log_path: Path) -> ShimHandle:
        """The handle of the attempt this kept shim is about to be handed (before its GO is sent)."""
        return type(self)(task, attempt, log_path, self.transport, line=self._line)

    @property
    def process(self) -> ProcessInfo:
        return self._events.info or self._events.standby or ProcessInfo(pid=0, pgid=0, create_time=0.0)

    @property
    def events(self) -> ShimEvents:
        return self._events

    @property
    def where(self) -> str:
        return self.transport.where

    def poll(self) -> int | None:
        if self._events.exit_code is not None:
            return self._events.exit_code
        return self.transport.ended_code(self._events)

    def signal(self, sig: Sig) -> None:
        self.transport.send(f"{sig.value}\n".encode())  # the shim signals the group (TERM with CONT)

    @property
    def exited(self) -> bool:
        return self.poll() is not None  # the shim reports the exit once the whole group is gone

    @property
    def reachable(self) -> bool:
        return not (self.transport.unreachable_at_end and self._events.ended.is_set())

    @property
    def unanswering(self) -> bool:
        return self._unanswered and not self._events.ended.is_set()

    def release(self) -> None:
        """A kept shim's attempt that ended lets go of the shim alone (it waits for the next GO);
        anything else lets go of the transport."""
        if self._line.own is not self._events and self.poll() is not None and not self._line.ended:
            self._line.detach(self._events)
            return
        self.transport.close(self.poll() is not None, self._events)

    def wait_started(self, timeout_s: float) -> None:
        """Return once the task started; LaunchError with the shim's last words otherwise."""
        said = self._events.wait_started(timeout_s, closed=self.transport.closed_text)
        if said is None:
            return
        self.release()
        raise LaunchError(f"cannot start {self.task.name} on {self.where}: {said}")

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        """Read by the shim on the task's host (worker/host/stacks.py), brought back as an event; a
        host that does not answer by the deadline (and a little more for the way back) is said."""
        gone = {"pid": self.process.pid, "state": "gone", "threads": [], "notes": ["it had exited"]}
        if self._events.ended.is_set() or self.poll() is not None:
            return gone
        ident = secrets.token_hex(6)
        asked = {"timeout_s": round(max(0.1, deadline - time.monotonic()), 3), "native": native}
        self.transport.send(f"STACKS {ident} {json.dumps(asked)}\n".encode())
        until = deadline + stacks_doc.TRANSPORT_S
        with self._events.stacks_came:
            while ident not in self._events.stacks and not self._events.ended.is_set():
                if not self._events.stacks_came.wait(timeout=max(0.0, until - time.monotonic())):
                    break
            doc = self._events.stacks.pop(ident, None)
        self._unanswered = doc is None
        if doc is None:
            if self._events.ended.is_set():
                return gone
            waited = asked["timeout_s"] + stacks_doc.TRANSPORT_S
            note = f"no answer from {self.where or 'its shim'} within {waited:.1f} s (cut off?)"
            return {"pid": self.process.pid, "state": "unknown", "threads": [], "notes": [note]}
        return stacks_doc.checked(doc)

    def written_error(self) -> failure.Written | None:
        return failure.parse(self._events.failure) if self._events.failure is not None else None


class _Line:
    """A shim's transport, read for the shim's whole life: each event goes to the attempt handed to
    it that listens now (a standby's own events, "standby…", and those between attempts to the
    first handle's), and the task's output to that attempt's log."""

    def __init__(self, transport: Transport, own: ShimEvents, log_path: Path, name: str):
        self.transport = transport
        self.own = own
        self.ended = False
        self._lock = threading.Lock()
        self._current: ShimEvents | None = None
        self._log = log_path  # where output goes: the latest attempt's log (its last lines may come late)
        pumps = [self._pump_events] + ([self._pump_output] if transport.streams_output else [])
        for pump in pumps:
            threading.Thread(target=pump, daemon=True, name=f"{name}-{pump.__name__[6:]}").start()

    def attach(self, events: ShimEvents, log_path: Path) -> None:
        with self._lock:
            self._current, self._log = events, log_path

    def detach(self, events: ShimEvents) -> None:
        with self._lock:
            if self._current is events:
                self._current = None

    def _to(self, event: dict[str, Any] | None) -> ShimEvents:
        with self._lock:
            current = self._current
            if current is None or (event is not None and str(event["event"]).startswith("standby")):
                return self.own
            if event is not None and event["event"] == "exit":
                self._current = None  # the attempt is over: what follows is the shim's own
            return current

    def _feed(self, text: str) -> None:
        event = parse(text)
        target = self._to(event)
        if event is not None:
            target.take(event)
        else:
            target.feed(text)

    def _pump_output(self) -> None:
        path, out = None, None
        try:
            while data := self.transport.read_output():
                with self._lock:
                    wanted = self._log
                if wanted != path:
                    if out is not None:
                        out.close()
                    path, out = wanted, private_open(wanted)
                assert out is not None
                out.write(data)
                out.flush()
        finally:
            if out is not None:
                out.close()

    def _pump_events(self) -> None:
        buffer = b""
        while data := self.transport.read_events():
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._feed(line.decode(errors="replace"))
            if len(buffer) > _MAX_LINE_BYTES:
                self._feed(buffer[:_KEPT_CHARS].decode(errors="replace"))
                buffer = b""
        if buffer:
            self._feed(buffer.decode(errors="replace"))
        with self._lock:
            self.ended = True
            current, self._current = self._current, None
        self.own.close()
        if current is not None:
            current.close()
