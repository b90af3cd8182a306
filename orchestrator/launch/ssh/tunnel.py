"""Launch layer, ssh backend: heartbeats through the SSH connection (a reverse port forward).

When the hosts cannot reach the coordinator's machine (a laptop behind NAT), each host gets a port
on its own loopback that sshd forwards back over our connection to the local heartbeat server.
Tasks post to http://127.0.0.1:<that port>; the per-run token still guards the endpoint.
"""

from __future__ import annotations

import logging
import select
import socket
import threading

import paramiko

log = logging.getLogger("orchestrator.ssh")


def open_reverse_tunnel(transport: paramiko.Transport, target: tuple[str, int]) -> int:
    """Ask sshd to listen on the host's 127.0.0.1 and forward to `target` here; the port it chose."""

    def handler(channel: paramiko.Channel, origin: tuple[str, int], server: tuple[str, int]) -> None:
        # Called on paramiko's transport thread: hand the connection to a thread of its own.
        threading.Thread(target=_bridge, args=(channel, target), daemon=True, name="tunnel").start()

    return int(transport.request_port_forward("127.0.0.1", 0, handler=handler))


def _bridge(channel: paramiko.Channel, target: tuple[str, int]) -> None:
    try:
        sock = socket.create_connection(target, timeout=5.0)
    except OSError as exc:
        log.debug("tunnel: cannot reach %s:%d: %s", *target, exc)
        channel.close()
        return
    sock.settimeout(None)
    try:
        while True:
            ready, _, _ = select.select([sock, channel], [], [], 30.0)
            if channel.closed:
                return
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    return
                channel.sendall(data)
            if channel in ready:
                data = channel.recv(65536)
                if not data:
                    return
                sock.sendall(data)
    except (OSError, EOFError, paramiko.SSHException):
        return
    finally:
        sock.close()
        channel.close()
