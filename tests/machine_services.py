"""What a job reaches for on a machine, for the tests of a local run's outgoing network
(tests/unit/test_outbound.py, tests/e2e/test_online.py): TCP and UDP servers on an address of
this machine's, and a DNS resolver on its loopback (as systemd-resolved's 127.0.0.53)."""

from __future__ import annotations

import contextlib
import random
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import psutil
import pytest


def machine_address() -> str:
    """An address of this machine's that is not on its loopback (skipped where there is none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("this machine has no address outside its loopback")


@contextlib.contextmanager
def servers(address: str, count: int = 1) -> Iterator[list[socket.socket]]:
    """TCP listeners on `address` that answer every connection with b"hello"; UDP on the first
    one's port echoes."""
    made = []
    for _ in range(count):
        s = socket.create_server((address, 0))
        made.append(s)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((address, made[0].getsockname()[1]))

    def serve() -> None:
        for ready in select.select([*made, udp], [], [], 0.1)[0]:
            if ready is udp:
                data, peer = udp.recvfrom(100)
                udp.sendto(b"echo " + data, peer)
            else:
                conn, _ = ready.accept()
                conn.sendall(b"hello")
                conn.close()

    try:
        with serving(serve):
            yield made
    finally:
        for s in [*made, udp]:
            s.close()


@contextlib.contextmanager
def serving(step: Callable[[], None]) -> Iterator[None]:
    """`step` (a server's turn, bounded: 0.1 s) over and over on a thread of its own, while the
    block lasts."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            step()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def dns_answer(query: bytes, address: str) -> bytes:
    """An answer (A record, `address`) to a DNS query: a resolver of this machine's, on its loopback."""
    end = query.index(b"\0", 12) + 5
    record = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(address)
    return query[:2] + b"\x81\x80" + struct.pack(">HHHH", 1, 1, 0, 0) + query[12:end] + record


@contextlib.contextmanager
def resolver(answer: str = "192.0.2.77") -> Iterator[str]:
    """A DNS resolver on this machine's loopback (127.x.y.z, port 53: root) answering `answer` to
    every name, as systemd-resolved's 127.0.0.53 answers for a machine; its address."""
    address = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((address, 53))
    udp.settimeout(0.1)

    def serve() -> None:
        with contextlib.suppress(TimeoutError, OSError):
            query, peer = udp.recvfrom(512)
            udp.sendto(dns_answer(query, answer), peer)

    try:
        with serving(serve):
            yield address
    finally:
        udp.close()
