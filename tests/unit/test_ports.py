"""Launch layer, local backend: reserve_ports — a free TF port per task on this machine, locked
for the coordinator's lifetime (remote hosts' ports: test_placement.py)."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import stat
import textwrap
import threading
from pathlib import Path

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch.local.ports import default_lock_dir, reserve_ports
from orchestrator.spec import ClusterSpec, parse_spec
from orchestrator.spec.roles import task_slots


def spec_of(tmp_path: Path, hosts: str) -> ClusterSpec:
    (tmp_path / "train.py").write_text("")
    text = (
        "name: demo\nhosts:\n"
        + textwrap.indent(textwrap.dedent(hosts).strip("\n"), "  ")
        + "\njob:\n  script: train.py\n"
    )
    return parse_spec(text, file="spec.yaml", base_dir=tmp_path)


def ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 32768


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port: int = s.getsockname()[1]
        return port


def test_concurrent_reservations_never_share_a_port(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {chief: 1, worker: 3}")
    locks = tmp_path / "locks"
    # the same seed: the second reservation tries exactly the ports the first one took
    with (
        reserve_ports(spec, lock_dir=locks, rng=random.Random(7)) as a,
        reserve_ports(spec, lock_dir=locks, rng=random.Random(7)) as b,
    ):
        assert set(a.ports) == set(b.ports) == {s.name for s in task_slots(spec)}
        assert len(set(a.ports.values())) == 4 and len(set(b.ports.values())) == 4
        assert not set(a.ports.values()) & set(b.ports.values())


def test_reservations_from_threads_never_share_a_port(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 4}")
    locks = tmp_path / "locks"
    start = threading.Barrier(8)
    held, errors = [], []

    def reserve() -> None:
        try:
            start.wait(timeout=10)
            held.append(reserve_ports(spec, lock_dir=locks, rng=random.Random(1)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    try:
        assert not errors and len(held) == 8
        ports = [p for r in held for p in r.ports.values()]
        assert len(ports) == len(set(ports)) == 32
    finally:
        for r in held:
            r.release()


def test_ports_are_below_the_ephemeral_range(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 10}")
    low = ephemeral_low()
    for seed in range(5):
        with reserve_ports(spec, lock_dir=tmp_path / "locks", rng=random.Random(seed)) as r:
            assert all(1024 <= p < low for p in r.ports.values()), r.ports


@pytest.mark.parametrize("listen_on", ["0.0.0.0", "127.0.0.1"])
def test_busy_base_port_raises_launch_error(tmp_path: Path, listen_on: str) -> None:
    with socket.socket() as listener:
        listener.bind((listen_on, 0))
        listener.listen()
        port = listener.getsockname()[1]
        spec = spec_of(tmp_path, f"- address: 127.0.0.1\n  tasks: {{worker: 1}}\n  base_port: {port}")
        with pytest.raises(LaunchError) as info:
            reserve_ports(spec, lock_dir=tmp_path / "locks")
    assert "base_port" in str(info.value) and str(port) in str(info.value)
    assert info.value.exit_code == 3


def test_failed_reservation_releases_what_it_took(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        hosts = f"""
            - address: 10.0.0.1
              tasks: {{worker: 3}}
            - address: 10.0.0.2
              tasks: {{worker: 1}}
              base_port: {busy}
        """
        spec = spec_of(tmp_path, hosts)
        with pytest.raises(LaunchError, match=r"hosts\[1\]\.base_port"):
            reserve_ports(spec, lock_dir=locks, rng=random.Random(5))
    lock_files = list(locks.glob("*.lock"))
    assert len(lock_files) >= 3  # the first host's ports were claimed before the failure …
    for path in lock_files:  # … and every one of them was let go
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_base_port_held_by_another_reservation(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    port = free_port()
    spec = spec_of(tmp_path, f"- address: 127.0.0.1\n  tasks: {{worker: 1}}\n  base_port: {port}")
    with reserve_ports(spec, lock_dir=locks) as first:
        assert first.ports == {"worker-0": port}
        with pytest.raises(LaunchError, match="base_port"):
            reserve_ports(spec, lock_dir=locks)


def test_release_lets_the_same_port_be_reserved_again(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    free = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}")
    first = reserve_ports(free, lock_dir=locks)
    port = first.ports["worker-0"]
    fixed = spec_of(tmp_path, f"- address: 127.0.0.1\n  tasks: {{worker: 1}}\n  base_port: {port}")
    with pytest.raises(LaunchError):
        reserve_ports(fixed, lock_dir=locks)  # still held
    first.release()
    first.release()  # idempotent
    with reserve_ports(fixed, lock_dir=locks) as again:
        assert again.ports == {"worker-0": port}
    with reserve_ports(fixed, lock_dir=locks) as third:  # the context manager released it too
        assert third.ports == {"worker-0": port}


def test_the_lock_folder_is_the_users_own_and_private(tmp_path: Path) -> None:
    locks = tmp_path / "a" / "locks"
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}")
    with reserve_ports(spec, lock_dir=locks) as r:
        st = locks.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        [port] = r.ports.values()
        assert stat.S_IMODE((locks / f"{port}.lock").stat().st_mode) == 0o600
    locks.chmod(0o777)  # ours but opened up: closed again
    with reserve_ports(spec, lock_dir=locks):
        assert stat.S_IMODE(locks.stat().st_mode) == 0o700


def test_the_default_lock_folder_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert default_lock_dir() == tmp_path / "run" / "orchestrate" / "ports"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_lock_dir() == tmp_path / "home" / ".cache" / "orchestrate" / "ports"


def test_a_lock_folder_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "locks").symlink_to(target)
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}")
    with pytest.raises(LaunchError, match="not a folder"):
        reserve_ports(spec, lock_dir=tmp_path / "locks")
    assert list(target.iterdir()) == []


def test_a_lock_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a folder another user owns")
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    os.chown(locks, 65534, 65534)
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}")
    with pytest.raises(LaunchError, match="belongs to uid 65534"):
        reserve_ports(spec, lock_dir=locks)


def test_a_symlink_planted_as_a_lock_file_is_never_followed(tmp_path: Path) -> None:
    locks, victim = tmp_path / "locks", tmp_path / "victim"
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}\n  base_port: 21000")
    locks.mkdir(mode=0o700)
    (locks / "21000.lock").symlink_to(victim)
    with pytest.raises(LaunchError, match="port 21000"):  # the port is skipped, not claimed
        reserve_ports(spec, lock_dir=locks)
    assert not victim.exists()  # nothing was created where the link points
    free = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 3}")
    with reserve_ports(free, lock_dir=locks, rng=random.Random(3)) as r:  # free ports: the link is no harm
        assert len(r.ports) == 3 and 21000 not in r.ports.values() and not victim.exists()


def test_renew_busy_moves_only_a_port_another_program_took(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}")
    with reserve_ports(spec, lock_dir=tmp_path / "locks") as reservation:
        assert reservation.renew_busy() == {}
        before = dict(reservation.ports)
        squatter = socket.socket()
        squatter.bind(("0.0.0.0", before["worker-1"]))
        squatter.listen()
        try:
            moved = reservation.renew_busy()
        finally:
            squatter.close()
        assert list(moved) == ["worker-1"] and moved["worker-1"][0] == before["worker-1"]
        assert reservation.ports["worker-0"] == before["worker-0"]
        assert reservation.ports["worker-1"] == moved["worker-1"][1] != before["worker-1"]
