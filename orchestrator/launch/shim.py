"""Launch layer: a task run through its shim (worker/shim.py), as every backend whose tasks run
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
from orchestrator.plan import TaskPlan
from orchestrator.record import private_open
from orchestrator.stacks import record as stacks_doc
from worker import failure, stacks, wire

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
    """What the shim reads on its first line (worker/shim.py says each key). `env` is the task's
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
        self.standby_failed: str | None = None  # it exited before its attempt: its log's last lines
        self.standby_refused: tuple[int, int] | None = None  # (available, total): too little memory
        self.stacks: dict[str, Any] = {}  # the answers to STACKS, by their id (until taken)
        self.stacks_came = threading.Condition()

    def feed(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict) or "event" not in event:
            if line.strip():
                self._keep(line.strip())
            return
        if event["event"] == "started":
            self.info = ProcessInfo(int(event["pid"]), int(event["pgid"]), float(event["create_time"]))
            self.step = event.get("step")
            self.started.set()
        elif event["event"] == "standby":
            self.standby = ProcessInfo(int(event["pid"]), int(event["pgid"]), float(event["create_time"]))
        elif event["event"] == "standby_ready":
            self.standby_ready = True
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
    """One task attempt run by its shim, over any transport."""

    def __init__(self, task: TaskPlan, attempt: int, log_path: Path, transport: Transport):
        super().__init__(task, attempt, log_path)
        self.transport = transport
        self._events = ShimEvents()
        pumps = [self._pump_events] + ([self._pump_output] if transport.streams_output else [])
        for pump in pumps:
            threading.Thread(target=pump, daemon=True, name=f"{task.name}-{pump.__name__[6:]}").start()

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

    def release(self) -> None:
        self.transport.close(self.poll() is not None, self._events)

    def wait_started(self, timeout_s: float) -> None:
        """Return once the task started; LaunchError with the shim's last words otherwise."""
        said = self._events.wait_started(timeout_s, closed=self.transport.closed_text)
        if said is None:
            return
        self.release()
        raise LaunchError(f"cannot start {self.task.name} on {self.where}: {said}")

    def stacks(self, deadline: float, native: bool) -> dict[str, Any]:
        """Read by the shim on the task's host (worker/stacks.py), brought back as an event; a
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
        if doc is None:
            if self._events.ended.is_set():
                return gone
            waited = asked["timeout_s"] + stacks_doc.TRANSPORT_S
            note = f"no answer from {self.where or 'its shim'} within {waited:.1f} s (cut off?)"
            return {"pid": self.process.pid, "state": "unknown", "threads": [], "notes": [note]}
        return stacks_doc.checked(doc)

    def written_error(self) -> failure.Written | None:
        return failure.parse(self._events.failure) if self._events.failure is not None else None

    def _pump_output(self) -> None:
        with private_open(self.log_path) as out:
            while data := self.transport.read_output():
                out.write(data)
                out.flush()

    def _pump_events(self) -> None:
        buffer = b""
        while data := self.transport.read_events():
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._events.feed(line.decode(errors="replace"))
            if len(buffer) > _MAX_LINE_BYTES:
                self._events.feed(buffer[:_KEPT_CHARS].decode(errors="replace"))
                buffer = b""
        if buffer:
            self._events.feed(buffer.decode(errors="replace"))
        self._events.close()
