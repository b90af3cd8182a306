"""Launch layer, ssh backend: connections to the lab hosts (Fabric over paramiko).

- Host keys are checked against the spec's known_hosts file, never accepted blindly (Fabric's
  default policy accepts any key): `strict` refuses an unknown key and says how to add it;
  `accept-new` records a first-seen key; a changed key is always refused.
- Every operation on several hosts runs in parallel and returns one result per host — a value or
  the exception — so a partial failure is never lost (`on_all`).
- Small remote jobs (`probe`) run `worker/host/probe.py` with the host's own Python; nothing needs to be
  installed there beforehand.
"""

from __future__ import annotations

import json
import logging
import shlex
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.launch.ssh.spec import HostKeyPolicy, SshSpec
from orchestrator.spec.model import ClusterSpec, HostSpec
from worker.host import source_for

log = logging.getLogger("orchestrator.ssh")
T = TypeVar("T")

_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class Host:
    """One lab host as the coordinator reaches it."""

    index: int
    address: str
    ssh_port: int
    user: str | None
    identity_file: Path | None
    python: tuple[str, ...]  # the host's interpreter (a command, possibly several words)
    spare: bool = False  # kept for a lost host's tasks (hosts[].spare)

    @classmethod
    def from_spec(cls, index: int, spec: HostSpec) -> Host:
        return cls(
            index=index,
            address=spec.address,
            ssh_port=spec.port,
            user=spec.user,
            identity_file=spec.identity_file,
            python=tuple(shlex.split(spec.python)),
            spare=spec.spare,
        )

    @property
    def label(self) -> str:
        return f"hosts[{self.index}] {self.where}"

    @property
    def where(self) -> str:
        """Its address (and SSH port when not 22), as people name the machine."""
        return self.address if self.ssh_port == 22 else f"{self.address}:{self.ssh_port}"

    @property
    def known_hosts_name(self) -> str:
        return self.address if self.ssh_port == 22 else f"[{self.address}]:{self.ssh_port}"


def hosts_of(spec: ClusterSpec) -> list[Host]:
    return [Host.from_spec(i, h) for i, h in enumerate(spec.hosts)]


class HostKeyUnknown(paramiko.SSHException):  # type: ignore[misc]  # paramiko is untyped
    def __init__(self, name: str, key: paramiko.PKey):
        super().__init__(name)
        self.name, self.key = name, key


class _RefuseUnknown(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise HostKeyUnknown(hostname, key)


class _RecordNew(paramiko.MissingHostKeyPolicy):  # type: ignore[misc]
    """accept-new: trust a host seen for the first time and append its key to known_hosts."""

    def __init__(self, path: Path):
        self._path = path

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            self._path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self._path, "a", encoding="utf-8") as f:
                f.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)
        log.warning("recorded the new host key of %s (%s) in %s", hostname, fingerprint(key), self._path)


def fingerprint(key: paramiko.PKey) -> str:
    return str(key.fingerprint)  # "SHA256:…", as ssh-keygen -l prints it


def connect(host: Host, ssh: SshSpec) -> fabric.Connection:
    """An open, authenticated connection, or a LaunchError that says what to fix."""
    connect_kwargs: dict[str, Any] = {
        "banner_timeout": ssh.connect_timeout_s,
        "auth_timeout": ssh.connect_timeout_s,
    }
    if host.identity_file is not None:
        if not host.identity_file.is_file():
            raise LaunchError(
                f"{host.label}: hosts[{host.index}].identity_file {host.identity_file} does not exist"
            )
        # Only the key the spec names: a wrong key must fail clearly, not fall back to others.
        connect_kwargs.update(key_filename=str(host.identity_file), look_for_keys=False, allow_agent=False)
    conn = fabric.Connection(
        host.address,
        user=host.user,
        port=host.ssh_port,
        connect_timeout=ssh.connect_timeout_s,
        connect_kwargs=connect_kwargs,
    )
    client = conn.client
    client.get_host_keys().clear()
    if ssh.known_hosts.exists():
        try:
            client.load_host_keys(str(ssh.known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise LaunchError(f"{host.label}: cannot read ssh.known_hosts {ssh.known_hosts}: {exc}") from None
    if ssh.host_key_policy is HostKeyPolicy.ACCEPT_NEW:
        client.set_missing_host_key_policy(_RecordNew(ssh.known_hosts))
    else:
        client.set_missing_host_key_policy(_RefuseUnknown())
    try:
        conn.open()
    except BaseException as exc:
        conn.close()
        raise LaunchError(explain_connect_error(host, ssh, exc)) from None
    transport = conn.transport
    assert transport is not None
    transport.set_keepalive(max(1, int(ssh.connect_timeout_s / 2)))
    return conn


def explain_connect_error(host: Host, ssh: SshSpec, exc: BaseException) -> str:
    who = f"{host.user + '@' if host.user else ''}{host.address}"
    if isinstance(exc, HostKeyUnknown):
        port = "" if host.ssh_port == 22 else f" -p {host.ssh_port}"
        return (
            f"{host.label}: host key unknown ({exc.key.get_name()} {fingerprint(exc.key)}), refused "
            f"(ssh.host_key_policy: strict). After checking that fingerprint with the host's owner, add "
            f"it: ssh-keyscan{port} {host.address} >> {ssh.known_hosts} — or set ssh.host_key_policy: "
            "accept-new to record keys seen for the first time"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"{host.label}: HOST KEY CHANGED — it offers {fingerprint(exc.key)} but {ssh.known_hosts} "
            f"has {fingerprint(exc.expected_key)}. Refused: this can be an attack. If the host was "
            f"reinstalled, remove the old key: ssh-keygen -R '{host.known_hosts_name}' -f {ssh.known_hosts}"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        key = f"the key {host.identity_file}" if host.identity_file else "your SSH agent and ~/.ssh keys"
        return (
            f"{host.label}: authentication failed for {who} with {key} ({exc}); check "
            f"hosts[{host.index}].user and hosts[{host.index}].identity_file, and that the public key "
            "is in the host's authorized_keys"
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return (
            f"{host.label}: no answer within ssh.connect_timeout_s = {ssh.connect_timeout_s:g} s "
            "(host down, wrong address, or a firewall)"
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        why = _first_error(exc)
        return f"{host.label}: cannot connect to port {host.ssh_port} ({why}); is sshd running there?"
    if isinstance(exc, OSError):
        return f"{host.label}: cannot reach {host.address}:{host.ssh_port}: {exc.strerror or exc}"
    return f"{host.label}: SSH failed: {type(exc).__name__}: {exc}"


def _first_error(exc: paramiko.ssh_exception.NoValidConnectionsError) -> str:
    errors = list(exc.errors.values())
    return str(errors[0].strerror if errors and isinstance(errors[0], OSError) else exc)


def probe(
    conn: fabric.Connection,
    host: Host,
    mode: str,
    *args: str,
    stdin: str | None = None,
    timeout_s: float = 60.0,
) -> Any:
    """Run one mode of worker/host/probe.py (or worker/host/folders.py) on the host with its Python; its
    JSON answer."""
    argv = [*host.python, "-c", source_for(mode), mode, *args]
    return run_json(conn, host, argv, mode, stdin, timeout_s)


def run_json(
    conn: fabric.Connection,
    host: Host,
    argv: list[str],
    what: str,
    stdin: str | None = None,
    timeout_s: float = 60.0,
) -> Any:
    """Run a command of ours on the host (no shell parses its words) and return its JSON answer."""
    command = shlex.join(argv)
    transport = conn.transport
    assert transport is not None
    channel = transport.open_session(timeout=timeout_s)
    try:
        channel.settimeout(timeout_s)
        channel.exec_command(command)
        if stdin is not None:
            channel.sendall(stdin.encode())
        channel.shutdown_write()
        out, err = _read_all(channel)
        code = channel.recv_exit_status()
    except TimeoutError:
        raise LaunchError(f"{host.label}: no answer from `{host.python[0]}` within {timeout_s:g} s") from None
    finally:
        channel.close()
    if code != 0:
        detail = err.strip().splitlines()[-1] if err.strip() else f"exit code {code}"
        if code == 127:
            detail = f"{shlex.join(host.python)} not found (set hosts[{host.index}].python)"
        raise LaunchError(f"{host.label}: {what} failed: {detail}")
    try:
        return json.loads(out)
    except ValueError:
        raise LaunchError(f"{host.label}: {what} answered {out[:200]!r}") from None


def _read_all(channel: paramiko.Channel) -> tuple[str, str]:
    out, err = bytearray(), bytearray()
    while True:
        data = channel.recv(65536)
        if not data:
            break
        out += data
    while True:
        data = channel.recv_stderr(65536)
        if not data:
            break
        err += data
    return out.decode(errors="replace"), err.decode(errors="replace")


def close_all(conns: Mapping[int, fabric.Connection]) -> None:
    for conn in conns.values():
        try:
            conn.close()
        except Exception as exc:  # closing must never hide the real outcome
            log.debug("closing %s: %s", conn.host, exc)
