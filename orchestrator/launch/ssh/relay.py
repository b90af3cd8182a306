"""Launch layer, ssh backend: a host's heartbeat relay (worker/host/relay.py), run over an SSH channel of
its own, for hosts with several tasks: their heartbeats go home as one request per interval."""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import threading
from typing import Any

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.launch.ssh.hosts import Host

log = logging.getLogger("orchestrator.ssh")


class Relay:
    """One host's heartbeat relay (worker/host/relay.py), run over an SSH channel of its own: it ends
    when the channel does (the run is over, the coordinator died, the connection was lost)."""

    def __init__(self, channel: paramiko.Channel, port: int, label: str):
        self.channel = channel
        self.url = f"http://127.0.0.1:{port}"
        self.closing = False
        threading.Thread(target=self._watch, args=(label,), daemon=True, name=f"relay-{label}").start()

    def close(self) -> None:
        self.closing = True
        self.channel.close()

    def _watch(self, label: str) -> None:
        """Logs what the relay says (it speaks when the coordinator stops or starts answering
        it, and when it gives up), and its end unless we ended it."""
        last = ""
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException, ValueError):
            for raw in self.channel.makefile_stderr("rb"):  # until the channel closes
                last = raw.decode(errors="replace").strip()[:500]
                if last and not self.closing:
                    log.warning("%s: %s", label, last)
        code = self.channel.recv_exit_status()  # -1 when the channel closed without one
        if self.closing:
            return
        log.warning(
            "%s: the heartbeat relay ended (exit %s)%s; a new one starts with the host's next task",
            label,
            code,
            f": {last}" if last else "",
        )

    @property
    def alive(self) -> bool:
        return not self.channel.closed and not self.channel.exit_status_ready()

    @classmethod
    def start(
        cls, conn: fabric.Connection, host: Host, script: str, config: dict[str, Any], timeout_s: float
    ) -> Relay:
        transport = conn.transport
        assert transport is not None
        try:
            channel = transport.open_session(timeout=timeout_s)
            channel.exec_command("exec " + shlex.join([*host.python, "-S", script]))
            channel.sendall((json.dumps(config) + "\n").encode())
            channel.settimeout(timeout_s)
            line = b""
            while not line.endswith(b"\n"):
                data = channel.recv(4096)
                if not data:
                    break
                line += data
            channel.settimeout(None)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise LaunchError(
                f"{host.label}: cannot start the heartbeat relay: {exc or type(exc).__name__}"
            ) from None
        try:
            port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            said = (
                channel.recv_stderr(4096).decode(errors="replace").strip()
                if channel.recv_stderr_ready()
                else ""
            )
            channel.close()
            said = said or line.decode(errors="replace").strip() or "no answer"
            raise LaunchError(f"{host.label}: the heartbeat relay did not start: {said}") from None
        return cls(channel, port, host.label)
