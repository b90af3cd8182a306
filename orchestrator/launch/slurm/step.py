"""Launch layer, slurm backend: one task attempt as one job step (a kept standby's step serves all
its attempts, a handle each: ShimHandle.next_attempt) — the shim's transport (its events
from srun's stderr, TERM/KILL on its stdin, the log streamed back when nothing is shared) and the
node-local lock of its TF port.

The step runs worker/host/shim.py as the ssh backend does; srun carries its stdin, stdout and stderr.
A step whose node does not answer is given up: srun is killed and the step cancelled (Slurm
cleans the node once it is back); its task stops by itself once the coordinator is out of reach.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
from collections.abc import Mapping
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.shim import ShimEvents, ShimHandle, Transport
from orchestrator.launch.slurm.cluster import Slurm, srun_argv

log = logging.getLogger("orchestrator.slurm")


def port_lock(node: str, port: str) -> str:
    """The lock of a TF port on a node: node-local (/tmp), private to the user, named after the node
    as well (a /tmp shared by nodes would otherwise mix theirs)."""
    return f"/tmp/orchestrate-{os.getuid()}/ports/{node}-{port}.lock"


class SrunStep(Transport):
    """A shim's streams through `srun` (its stdin, stdout and stderr): one job step."""

    closed_text = "its step ended"

    def __init__(self, node: str, popen: subprocess.Popen[bytes], slurm: Slurm):
        self.where = self.node = node
        self.streams_output = popen.stdout is not None  # the task's log, from its node (nothing shared)
        self._popen = popen
        self._slurm = slurm
        self._given_up = False  # its srun killed by us, the task's end unknown
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.write(data)
            self._popen.stdin.flush()

    def end_input(self) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.close()

    def read_events(self) -> bytes:
        assert self._popen.stderr is not None
        data = os.read(self._popen.stderr.fileno(), 65536)
        if not data:
            self._popen.wait()  # srun's end is known before the stream's end is said
        return data

    def read_output(self) -> bytes:
        assert self._popen.stdout is not None
        return os.read(self._popen.stdout.fileno(), 65536)

    def ended_code(self, events: ShimEvents) -> int | None:
        if self._given_up:
            return None  # srun was stopped by us: nothing is known of the task
        if events.ended.is_set() and self._popen.poll() is not None:
            return self._popen.returncode or 1  # the step ended with no word from the shim (node failure)
        return None

    def close(self, confirmed: bool, events: ShimEvents) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.close()  # end of file: the shim stops the task, if it is still there
        if self._popen.poll() is None and not confirmed:
            # its node did not answer: cancel the step (Slurm cleans the node once it is back)
            self._given_up = True
            if events.step is not None:
                with contextlib.suppress(LaunchError):
                    self._slurm.run(["scancel", events.step], "cancelling a step", timeout_s=5)
            self._popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)


def start_step(
    slurm: Slurm,
    job_id: str,
    node: str,
    name: str,
    python: tuple[str, ...],
    job: Mapping[str, Any],
    *,
    stream: bool,
) -> SrunStep:
    """The shim as a step on `node`, given `job` (shim.shim_job) on its stdin; `stream`: the task's
    output comes back on its stdout (the node does not share this machine's files)."""
    try:
        popen = subprocess.Popen(
            srun_argv(job_id, node, name, python),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if stream else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=slurm.env,
            start_new_session=True,
        )
    except OSError as exc:
        raise LaunchError(f"cannot start {job['task']}: srun: {exc.strerror or exc}") from None
    step = SrunStep(node, popen, slurm)
    step.send((json.dumps(job) + "\n").encode())
    return step


class SlurmTaskHandle(ShimHandle):
    """A task attempt as a job step."""

    kill_wait_s = 5.0
    unconfirmed_hint = (
        "its node did not confirm (cut off?); it was left out of later attempts, its step goes with "
        "the allocation, and its task stops by itself once the coordinator is out of reach"
    )
