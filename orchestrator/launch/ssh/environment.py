"""Launch layer, ssh backend: a host as the environment step reaches it (orchestrator/environment/).

worker/host/environment.py runs there over one SSH channel of the host's connection, with the
interpreter that makes the environment (`environment.python`, else the host's); the wheels its
file cache lacks go by SFTP into the same content-addressed cache as the job's files (sync.py).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator.environment.local import answered, read_answer
from orchestrator.environment.prepare import HostEnvironment, prepare, survey
from orchestrator.errors import LaunchError
from orchestrator.launch.ssh.hosts import Host
from orchestrator.launch.ssh.sync import FileEntry, upload
from orchestrator.record.progress import size_text
from orchestrator.spec.environment import EnvironmentSpec
from worker.host import ENVIRONMENT_SOURCE

ASK_TIMEOUT_S = 60.0  # a question: the host answers at once
BUILD_TIMEOUT_S = 1800.0  # silence this long during a build: the host is stuck (TensorFlow: seconds)


class SshSite:
    def __init__(self, conn: fabric.Connection, host: Host, workdir: str, python: str | None):
        self.label = host.label
        self.python = python or shlex.join(host.python)
        self._conn, self._host, self._workdir = conn, host, workdir

    def ask(
        self, mode: str, key: str, manifest: str, on_line: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        argv = [*shlex.split(self.python), "-S", "-c", ENVIRONMENT_SOURCE, mode, self._workdir, key]
        timeout_s = BUILD_TIMEOUT_S if mode == "build" else ASK_TIMEOUT_S
        transport = self._conn.transport
        if transport is None or not transport.is_active():
            raise LaunchError(f"{self.label}: the connection closed")
        try:
            channel = transport.open_session(timeout=ASK_TIMEOUT_S)
        except (TimeoutError, OSError, EOFError, paramiko.SSHException) as exc:
            raise LaunchError(f"{self.label}: environment {mode}: {exc or type(exc).__name__}") from None
        try:
            channel.settimeout(timeout_s)
            channel.exec_command(shlex.join(argv))
            channel.sendall((manifest or "\n").encode())  # stdin stays open: the build's lifeline
            answer = read_answer(channel.makefile("rb"), on_line)
            channel.shutdown_write()
            err = channel.makefile_stderr("rb").read().decode(errors="replace")
            code = channel.recv_exit_status()
        except (TimeoutError, OSError, EOFError, paramiko.SSHException) as exc:
            raise LaunchError(f"{self.label}: environment {mode}: {exc or type(exc).__name__}") from None
        finally:
            channel.close()
        if code == 127:
            raise LaunchError(f"{self.label}: {self.python} not found (set environment.python)")
        return answered(self.label, mode, code, answer, err)

    def send(self, files: Mapping[str, Path], missing: Sequence[str], progress: Callable[[int], None]) -> int:
        entries = [FileEntry(f"wheel/{d}", d, 0o600, files[d].stat().st_size, files[d]) for d in missing]
        return upload(self._conn, self._host, self._workdir, entries, set(missing), progress).uploaded_bytes


def ssh_environments(
    env: EnvironmentSpec,
    conns: Mapping[int, fabric.Connection],
    hosts: Sequence[Host],
    workdirs: Mapping[int, str],
    notify: Callable[[str], None],
) -> tuple[list[HostEnvironment], dict[int, str]]:
    """Every host's environment ready: their states, and each one's interpreter by host index."""
    used = sorted(workdirs)
    made = prepare(env, [SshSite(conns[i], hosts[i], workdirs[i], env.python) for i in used], notify)
    return made, {i: h.python for i, h in zip(used, made, strict=True) if h.python}


def survey_cells(
    env: EnvironmentSpec, reached: Sequence[tuple[fabric.Connection, Host, str]], problems: list[str]
) -> dict[int, str]:
    """`orchestrate check`'s environment column, per host index: `ready`, or `to build (N wheels,
    X MB to send)`, for each host reached (its connection, itself, its work folder); what stops
    it goes to `problems`."""
    try:
        found = survey(
            env, [SshSite(conn, host, workdir, env.python) for conn, host, workdir in reached], _quiet
        )
    except LaunchError as exc:
        problems.append(str(exc))
        return {}
    cells = {}
    for (_, host, _), made in zip(reached, found, strict=True):
        to_build = f"to build ({made.packages} wheels, {size_text(made.to_send)} to send)"
        cells[host.index] = "ready" if made.state == "ready" else to_build
    return cells


def _quiet(_: str) -> None:
    pass
