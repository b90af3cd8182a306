"""Launch layer, local backend: reserve a TF port for every task on this machine before planning.

Ports come from below the kernel's ephemeral range (so no outgoing connection, ours included, can
take one between reservation and TensorFlow's bind). Each chosen port is also locked with flock in
the user's own folder for the coordinator's lifetime, so two concurrent runs never pick the same
port, and a restart finds its ports still ours. The locks vanish with the coordinator, even on
SIGKILL. The folder is private (0700, owned by the user, never a symlink; its lock files are
opened without following one): another user can neither squat the locks nor point them elsewhere.
Another user's runs are kept off our ports by the bind check alone.
"""

from __future__ import annotations

import fcntl
import os
import random
import stat
from collections.abc import Mapping
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from worker.host.probe import port_free


def default_lock_dir() -> Path:
    """$XDG_RUNTIME_DIR/orchestrate/ports (a per-user tmpfs), else ~/.cache/orchestrate/ports."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isabs(runtime) else Path.home() / ".cache"
    return base / "orchestrate" / "ports"


_LOW = 15000


class PortReservation:
    def __init__(
        self,
        ports: Mapping[str, int],
        fds: Mapping[str, int],
        lock_dir: Path | None = None,
        rng: random.Random | None = None,
    ):
        self.ports = dict(ports)
        self._fds = dict(fds)  # task -> lock of its port (local backend only)
        self._lock_dir = lock_dir or default_lock_dir()
        self._rng = rng or random.Random()

    def renew_busy(self) -> dict[str, tuple[int, int]]:
        """Move every task whose port another program took meanwhile to a new free port.

        Returns {task: (old port, new port)}. Our own tasks are stopped when this is asked (between
        attempts), so a port that cannot be bound now is taken by someone else.
        """
        moved = {}
        for task, fd in list(self._fds.items()):
            old = self.ports[task]
            if port_is_free(old):
                continue
            new, new_fd = _claim_free(self._lock_dir, self._rng)
            os.close(fd)
            self._fds[task], self.ports[task] = new_fd, new
            moved[task] = (old, new)
        return moved

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def reserve_ports(
    spec: ClusterSpec, *, lock_dir: Path | None = None, rng: random.Random | None = None
) -> PortReservation:
    rng = rng or random.Random()
    slots = task_slots(spec)
    ports: dict[str, int] = {}
    lock_dir = lock_dir or default_lock_dir()
    _make_lock_dir(lock_dir)
    fds: dict[str, int] = {}
    try:
        for h, host in enumerate(spec.hosts):
            for i, slot in enumerate(s for s in slots if s.host_index == h):
                if host.base_port is not None:
                    port = host.base_port + i
                    fd = _claim(port, lock_dir)
                    if fd is None:
                        raise LaunchError(
                            f"port {port} for {slot.name} (hosts[{h}].base_port) is in use on this machine; "
                            "choose another base_port, or leave it out to get free ports"
                        )
                else:
                    port, fd = _claim_free(lock_dir, rng)
                fds[slot.name] = fd
                ports[slot.name] = port
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return PortReservation(ports, fds, lock_dir, rng)


def preview_ports(spec: ClusterSpec, rng: random.Random | None = None) -> tuple[dict[str, int], list[str]]:
    """The ports `up` would use now (`orchestrate plan`), claiming none, and a note for each port a
    spec fixes (base_port) that is in use: `up` would refuse to start (exit 3)."""
    rng = rng or random.Random()
    high = max(_LOW + 1000, _ephemeral_low())
    ports: dict[str, int] = {}
    busy: list[str] = []
    slots = task_slots(spec)
    for h, host in enumerate(spec.hosts):
        for i, slot in enumerate(s for s in slots if s.host_index == h):
            if host.base_port is None:
                ports[slot.name] = next(
                    (p for p in (rng.randrange(_LOW, high) for _ in range(500)) if port_is_free(p)), _LOW
                )
                continue
            ports[slot.name] = port = host.base_port + i
            if not port_is_free(port):
                busy.append(
                    f"port {port} for {slot.name} (hosts[{h}].base_port) is in use on this machine now: "
                    "`orchestrate up` would stop there (exit 3); choose another base_port or leave it out"
                )
    return ports, busy


def port_is_free(port: int) -> bool:
    """True when a TCP listener could bind `port` on all interfaces (as TF's gRPC server does);
    the same check worker/host/probe.py runs on remote hosts."""
    return port_free(port)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim_free(lock_dir: Path, rng: random.Random) -> tuple[int, int]:
    high = max(_LOW + 1000, _ephemeral_low())
    for _ in range(500):
        port = rng.randrange(_LOW, high)
        fd = _claim(port, lock_dir)
        if fd is not None:
            return port, fd
    raise LaunchError(f"no free TCP port found in {_LOW}-{high - 1} after 500 tries")


def _claim(port: int, lock_dir: Path) -> int | None:
    try:
        fd = os.open(
            lock_dir / f"{port}.lock", os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError:  # a symlink planted there (ELOOP), or not ours: never followed, the port skipped
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not port_is_free(port):
        os.close(fd)
        return None
    return fd


def _make_lock_dir(lock_dir: Path) -> None:
    """Create the user's lock folder (0700), or check that the one there is private and ours."""
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(lock_dir)
    except OSError as exc:
        raise LaunchError(f"cannot create the port lock folder {lock_dir}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise LaunchError(f"the port lock folder {lock_dir} is not a folder (a symlink?); remove it")
    if st.st_uid != os.getuid():
        raise LaunchError(
            f"the port lock folder {lock_dir} belongs to uid {st.st_uid}, not to you; remove it"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(lock_dir, 0o700)  # ours, but others could enter: close it
