"""Launch layer, slurm backend: one task attempt as one job step — its handle (the shim's events
from srun's stderr, TERM/KILL on its stdin, the log streamed back when nothing is shared) and the
node-local lock of its TF port.

The step runs worker/shim.py as the ssh backend does; srun carries its stdin, stdout and stderr.
A step whose node does not answer is given up: srun is killed and the step cancelled (Slurm
cleans the node once it is back); its task stops by itself once the coordinator is out of reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.launch.api import ProcessInfo, Sig, TaskHandle
from orchestrator.launch.shim_events import ShimEvents
from orchestrator.launch.slurm.cluster import Slurm
from orchestrator.plan import TaskPlan
from orchestrator.record import private_open

log = logging.getLogger("orchestrator.slurm")


def port_lock(node: str, port: str) -> str:
    """The lock of a TF port on a node: node-local (/tmp), private to the user, named after the node
    as well (a /tmp shared by nodes would otherwise mix theirs)."""
    return f"/tmp/orchestrate-{os.getuid()}/ports/{node}-{port}.lock"


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
        self._events = ShimEvents()  # ended: the exit reported, or srun done
        self._given_up = False  # its srun killed by us, the task's end unknown
        self._lock = threading.Lock()
        threading.Thread(target=self._pump_events, daemon=True, name=f"{task.name}-events").start()
        if popen.stdout is not None:  # the task's log, streamed from its node (nothing shared)
            threading.Thread(target=self._pump_output, daemon=True, name=f"{task.name}-out").start()

    def _pump_output(self) -> None:
        assert self._popen.stdout is not None
        with private_open(self.log_path) as out:
            while data := os.read(self._popen.stdout.fileno(), 65536):
                out.write(data)
                out.flush()

    @property
    def process(self) -> ProcessInfo:
        return self._events.info or ProcessInfo(pid=0, pgid=0, create_time=0.0)

    @property
    def where(self) -> str:
        return self.node

    def poll(self) -> int | None:
        if self._events.exit_code is not None:
            return self._events.exit_code
        if self._given_up:
            return None  # srun was stopped by us: nothing is known of the task
        if self._events.ended.is_set() and self._popen.poll() is not None:
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
        said = self._events.wait_started(timeout_s, closed="its step ended")
        if said is None:
            return
        self.release()
        raise LaunchError(f"cannot start {self.task.name} on {self.node}: {said}")

    def release(self) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.close()  # end of file: the shim stops the task, if it is still there
        if self._popen.poll() is None and not self.exited:
            # its node did not answer: cancel the step (Slurm cleans the node once it is back)
            self._given_up = True
            if self._events.step is not None:
                with contextlib.suppress(LaunchError):
                    self._slurm.run(["scancel", self._events.step], "cancelling a step", timeout_s=5)
            self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)

    def _pump_events(self) -> None:
        assert self._popen.stderr is not None
        for raw in self._popen.stderr:
            self._events.feed(raw.decode(errors="replace").rstrip("\n"))
        self._popen.wait()
        self._events.close()
