"""Launch layer: what a task's shim (worker/shim.py) says on its stderr, as the ssh and slurm
backends read it — one JSON event per line ("started" with its pid, process group and, under
Slurm, its step; "exit" with the code; "error"); any other text is kept, a few lines of it, for
the reason of a failed start (the shell's "python3: not found")."""

from __future__ import annotations

import json
import threading
import time

from orchestrator.launch.api import ProcessInfo

_KEPT_LINES = 20
_KEPT_CHARS = 500


class ShimEvents:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.ended = threading.Event()  # exit reported, or the stream closed
        self.exit_code: int | None = None
        self.info: ProcessInfo | None = None
        self.step: str | None = None  # its Slurm step (JOB.STEP), when it runs as one
        self.messages: list[str] = []  # text that is not an event, the latest few

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
        elif event["event"] == "exit":
            self.exit_code = int(event["code"])
            self.ended.set()
        elif event["event"] == "error":
            self._keep(str(event.get("message")))

    def close(self) -> None:
        """The stream ended."""
        self.ended.set()

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
