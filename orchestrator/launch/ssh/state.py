"""Launch layer, ssh backend: a host's folders moved over SSH (ship.py: SFTP, the host's own
`folders.py`), for the state exchange every backend whose hosts share no disk uses
(launch/exchange.py decides what moves)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fabric

from orchestrator.errors import LaunchError
from orchestrator.launch.ssh import ship
from orchestrator.launch.ssh.hosts import Host, probe
from orchestrator.launch.transfer import Folders, Transfer


class SshFolders(Folders):
    def __init__(
        self,
        hosts: list[Host],
        connection: Callable[[int], fabric.Connection],
        suspect: Callable[[int], None],
        *,
        io_timeout_s: float,
    ):
        self._hosts = hosts
        self._connection = connection  # a host's connection, renewed when needed
        self._suspect = suspect  # a host whose copy failed: renew its connection before the next use
        self._io_timeout_s = io_timeout_s  # a copy gives up on a host silent this long
        self._stampers: dict[int, tuple[Any, Any]] = {}  # host -> (its transport, an SFTP session)

    def label(self, host: int) -> str:
        return self._hosts[host].label

    def pull(self, host: int, remote: str, local: Path, *, mirror: bool) -> Transfer:
        conn = self._connection(host)
        return ship.pull(conn, self._hosts[host], remote, local, mirror=mirror, timeout_s=self._io_timeout_s)

    def push(self, host: int, local: Path, remote: str, ours: dict[str, Any]) -> Transfer:
        conn = self._connection(host)
        return ship.push(conn, self._hosts[host], local, remote, timeout_s=self._io_timeout_s, ours=ours)

    def stamp(self, host: int, remote: str) -> str | None:
        """Over an SFTP session kept for it (the follower's alone), opened again after a failure."""
        conn = self._connection(host)
        kept = self._stampers.get(host)
        if kept is None or kept[0] is not conn.transport:
            if kept is not None:
                kept[1].close()
            with ship.connection_errors(self._hosts[host], "looking at a checkpoint folder"):
                kept = (conn.transport, ship.open_sftp(conn, self._io_timeout_s))
            self._stampers[host] = kept
        try:
            with ship.connection_errors(self._hosts[host], f"looking at {remote}"):
                return ship.stamp(kept[1], remote)
        except LaunchError:
            self._stampers.pop(host, None)
            kept[1].close()
            raise

    def lost(self, host: int) -> None:
        self._suspect(host)

    def shared(self, host: int, action: str, folder: str, nonce: str) -> bool:
        conn = self._connection(host)
        answer = probe(conn, self._hosts[host], "shared", action, folder, nonce, timeout_s=self._io_timeout_s)
        return (
            isinstance(answer, dict)
            and not answer.get("error")
            and (action != "read" or nonce in answer["seen"])
        )
