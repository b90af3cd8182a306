"""How a task reaches its coordinator — the host and port of an http:// URL, or the
Unix socket of a "unix:PATH" one (local tasks in a network namespace of their own reach nothing
of the host's network: the socket's path in the run's private folder crosses to the coordinator)."""

from __future__ import annotations

import socket
import urllib.parse

from worker import wire


def dial(url: str, timeout: float) -> socket.socket:
    """A blocking connection to `url`'s listener (OSError where it cannot be made)."""
    if url.startswith(wire.UNIX_SCHEME):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(url.removeprefix(wire.UNIX_SCHEME))
        except OSError:
            sock.close()
            raise
        return sock
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
