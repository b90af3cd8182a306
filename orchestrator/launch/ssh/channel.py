"""Launch layer, ssh backend: a task's shim over one SSH channel (one per task attempt; a kept
standby's, one for the run, its attempts each a handle over it: ShimHandle.next_attempt) — the
transport of the shim's handles (launch/shim.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import paramiko

from orchestrator.launch.shim import ShimEvents, ShimHandle, Transport
from orchestrator.launch.ssh.hosts import Host


class SshTaskHandle(ShimHandle):
    """A task attempt over SSH."""

    kill_wait_s = 5.0  # after SIGKILL, how long a host may take to confirm the exit
    unconfirmed_hint = (
        "its connection was lost; such a task stops by itself once its SSH connection or the "
        "coordinator is gone, and a new attempt there stops any leftover first"
    )


class SshChannel(Transport):
    """A shim's streams over one SSH channel (one per task attempt, or per kept standby)."""

    closed_text = "the channel closed"
    unreachable_at_end = True  # the channel's end: its connection is gone, nothing more is learned

    def __init__(self, host: Host, channel: paramiko.Channel, on_lost: Callable[[int], None]):
        self.host = host
        self.where = host.label
        self._channel = channel
        self._on_lost = on_lost  # its host's connection is renewed before the next use
        self._sending = threading.Lock()  # lines from the supervisor and `orchestrate stacks`, whole

    def send(self, data: bytes) -> None:
        with self._sending, contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self._channel.sendall(data)

    def end_input(self) -> None:
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self._channel.shutdown_write()

    def read_events(self) -> bytes:
        try:
            return bytes(self._channel.recv_stderr(65536))
        except (OSError, EOFError, paramiko.SSHException):
            return b""

    def read_output(self) -> bytes:
        try:
            return bytes(self._channel.recv(65536))
        except (OSError, EOFError, paramiko.SSHException):
            return b""

    def close(self, confirmed: bool, events: ShimEvents) -> None:
        self._channel.close()
        if not confirmed:
            self._on_lost(self.host.index)
