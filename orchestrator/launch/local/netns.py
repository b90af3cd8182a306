"""Launch layer, local backend: a run's private network namespace, so that its TensorFlow ports
exist only inside it (TF's gRPC servers listen on *:PORT, unauthenticated: on a shared machine any
other user could run TensorFlow operations as the person training).

Made without root: a holder (Python, -S) calls unshare(CLONE_NEWUSER | CLONE_NEWNET) itself, maps
its own uid and gid into the new user namespace (as `unshare --map-current-user` does, with no
util-linux version to depend on), brings the new namespace's loopback up (with the namespace's own
CAP_NET_ADMIN, nothing on the host) and waits. The coordinator opens the holder's namespace files
(/proc/PID/ns/user, /ns/net) and lets the holder go: those descriptors keep the namespace while the
run lasts, and close with the coordinator however it ends (even SIGKILL) — no holder process is
left to stop. Each task enters with `nsenter --preserve-credentials` (util-linux ≥ 2.28; its own
uid, so its files on disk are owned as before), which then executes the task: the task's pid is
the one started. Heartbeats come back over a Unix socket (a path in the filesystem crosses network
namespaces; an abstract one would not).

Files, /dev/nvidia* and /dev/shm are not network-namespaced: a task sees them as it did. Every task
shares the one namespace, so NCCL and TF between them work over its loopback. Its way out (pasta,
nothing published; a resolv.conf of its own where the machine's resolver is on its loopback, in a
mount namespace the holder makes too) is outbound.py's; `Network` puts the two together.

Where the kernel refuses user namespaces (kernel.unprivileged_userns_clone=0, AppArmor's
apparmor_restrict_unprivileged_userns, user.max_user_namespaces=0, a container whose seccomp
profile forbids them) or nsenter is missing, `make` says why, read from the kernel's answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.launch.exposure import Exposure
from orchestrator.launch.local import outbound
from orchestrator.launch.local.section import OFF, LocalSpec, isolated, open_because
from orchestrator.launch.local.socketdir import socket_folder
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from orchestrator.states import Degraded

#: The holder: its own user and network namespace, its uid and gid mapped (one line each, as an
#: unprivileged process may), loopback up (SIOCGIFFLAGS, SIOCSIFFLAGS | IFF_UP), "ready", then it
#: waits for its stdin to close. Single-threaded (unshare of a user namespace requires it).
_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
def fail(what, err):
    print(f"{what}: {os.strerror(err)}", flush=True)
    sys.exit(1)
uid, gid = os.geteuid(), os.getegid()
resolv = sys.argv[1] if len(sys.argv) > 1 else None  # the namespace's own resolv.conf: a mount namespace too
new = 0x10000000 | 0x40000000 | (0x00020000 if resolv else 0)  # CLONE_NEWUSER | CLONE_NEWNET (| CLONE_NEWNS)
if libc.unshare(new) != 0:
    fail(f"unshare(CLONE_NEWUSER|CLONE_NEWNET{'|CLONE_NEWNS' if resolv else ''}) refused", ctypes.get_errno())
for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
    try:
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    except OSError as exc:
        fail(f"cannot map the user into its namespace ({name})", exc.errno)
if resolv and libc.mount(resolv.encode(), b"/etc/resolv.conf", None, 4096, None) != 0:  # MS_BIND
    fail("cannot give the namespace its own /etc/resolv.conf", ctypes.get_errno())
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
except OSError as exc:
    fail("cannot bring up the namespace's loopback", exc.errno)
print("ready", flush=True)
sys.stdin.read()
"""

_READY_S = 10.0


class Namespace:
    """A made namespace, held by its descriptors (user, network and, where it has a resolv.conf
    of its own, mount), closed by `close` or by the process ending."""

    def __init__(self, user_fd: int, net_fd: int, nsenter: str, mount_fd: int | None = None):
        self._fds = (user_fd, net_fd) + ((mount_fd,) if mount_fd is not None else ())
        self._nsenter = nsenter

    @property
    def fds(self) -> tuple[int, ...]:
        return self._fds

    def enter(self, argv: list[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """`argv` run inside the namespace, in `cwd` (default: ours), started with
        `pass_fds=self.fds` (entering a mount namespace moves to its root: nsenter moves back)."""
        user, net, *mount = self._fds
        into = [f"--mount=/proc/self/fd/{mount[0]}", f"--wd={os.fspath(cwd or os.getcwd())}"] if mount else []
        return [
            self._nsenter,
            f"--user=/proc/self/fd/{user}",
            f"--net=/proc/self/fd/{net}",
            *into,
            "--preserve-credentials",
            "--",
            *argv,
        ]

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = tuple(-1 for _ in self._fds)


def make(timeout_s: float = _READY_S, resolv: Path | None = None) -> Namespace | str:
    """A new namespace (with `resolv` as its /etc/resolv.conf: a mount namespace too), or why none
    can be made (the kernel's or the tool's own words)."""
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        return "nsenter (util-linux) not found on PATH"
    try:
        holder = subprocess.Popen(
            [sys.executable, "-S", "-c", _HOLDER, *([str(resolv)] if resolv else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return f"cannot start the namespace's holder: {exc.strerror or exc}"
    assert holder.stdin is not None and holder.stdout is not None
    opened: list[int] = []
    try:
        said = _first_line(holder, timeout_s)
        if said != "ready":
            holder.stdin.close()
            try:
                holder.wait(timeout=min(timeout_s, 2.0))
            except subprocess.TimeoutExpired:
                _kill(holder)  # said nothing, or something else and went on: not our holder's way
            rest = holder.stdout.read().decode(errors="replace").strip()
            return refusal(" ".join(x for x in (said, rest) if x) or f"the holder exited {holder.returncode}")
        for kind in ("user", "net", "mnt")[: 3 if resolv else 2]:
            try:
                ns = os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                for fd in opened:
                    os.close(fd)
                return f"cannot open the namespace: {exc.strerror or exc}"
            opened.append(_above_stdio(ns))
        return Namespace(opened[0], opened[1], nsenter, opened[2] if resolv else None)
    finally:
        if not holder.stdin.closed:
            holder.stdin.close()  # the holder's signal to go (the namespace stays with our descriptors)
        try:
            holder.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(holder)
        holder.stdout.close()


def _above_stdio(fd: int) -> int:
    """`fd` moved above 0-2 (a coordinator started with one of them closed would get one; a task's
    stdin or output would then take its place in the child)."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _kill(holder: subprocess.Popen[bytes]) -> None:
    """The holder and whatever it started (its own session): nothing of it may hold our pipe."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()


def _first_line(holder: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The holder's first line ("ready", or its error), or all it said before it ended."""
    assert holder.stdout is not None
    fd = holder.stdout.fileno()
    deadline, got = time.monotonic() + timeout_s, b""
    while b"\n" not in got:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return (
                got.decode(errors="replace").strip()
                or f"no answer from the namespace's holder in {timeout_s:g} s"
            )
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace").strip().split("\n", 1)[0]


def refusal(said: str) -> str:
    """The holder's words, with the kernel setting that explains them where one does (a refusal:
    not permitted, or a limit reached)."""
    said = " ".join(said.split())[:300]
    refused = any(w in said for w in ("Operation not permitted", "Permission denied", "No space left"))
    cause = kernel_setting() if refused else None
    return f"{said}: {cause}" if cause else said


def kernel_setting() -> str | None:
    """The setting of this kernel that refuses user namespaces to unprivileged users, if any."""
    for path, bad, name in (
        ("/proc/sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone=0"),
        (
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            "1",
            "AppArmor's kernel.apparmor_restrict_unprivileged_userns=1",
        ),
        ("/proc/sys/user/max_user_namespaces", "0", "user.max_user_namespaces=0"),
    ):
        try:
            if Path(path).read_text().strip() == bad:
                return f"{name} on this machine"
        except OSError:
            continue
    return None


class Network:
    """A run's network as its local tasks see it: a namespace of their own (the spec's
    `local.isolate_network` and the kernel allowing), connected outward (`local.outbound`, pasta
    installed), or this machine's."""

    def __init__(self, spec: ClusterSpec):
        section = spec.section("local")
        self.local = section if isinstance(section, LocalSpec) else LocalSpec()
        self.mode = self.local.isolate_network
        self._spec = spec
        self.namespace: Namespace | None = None
        self.exposure: Exposure | None = None  # said once `make` was asked
        self._stack: outbound.Watched | None = None
        self._folder: Path | None = None

    def make(self, run_dir: Path) -> Path | None:
        """The namespace, and the path of the heartbeat socket the tasks post to from it; None
        where they run on this machine's network (`exposure` says why). LaunchError where the
        spec says `on` and no namespace (or, for `outbound`, no outgoing network) can be made."""
        assert self.namespace is None, "one namespace a run"
        if self.mode == "off":
            self.exposure = OFF
            return None
        try:
            self._folder = socket_folder(run_dir)
        except OSError as exc:
            made: _Made | str = f"no folder for the heartbeat socket: {exc}"
        else:
            try:
                made = _connect(self.local, self._folder)
            except LaunchError:
                self.close()
                raise
        if isinstance(made, str):
            self.close()
            if self.mode == "on":
                raise LaunchError(
                    f"local.isolate_network is on, but no private network namespace can be made here: {made}"
                )
            self.exposure = open_because(f"no private network namespace: {made}")
            return None
        self.namespace, self._stack, self.exposure = made.namespace, made.stack, made.exposure
        assert self._folder is not None
        return self._folder / "hb"

    def watch(self) -> list[Degraded]:
        """pasta's end, where it ended while the run lives (asked each supervisor iteration: one
        poll of its guard): started again, or the run offline from then on (`exposure` says so)."""
        if self._stack is None:
            return []
        said, offline = self._stack.look()
        if offline is not None and self.exposure is not None:
            self.exposure = dataclasses.replace(self.exposure, outbound=offline)
        return said

    def probe(self) -> Exposure:
        """What `make` would give now (`orchestrate plan` and `check`), holding nothing; asked
        once a process (plan asks for the placements and for its line)."""
        return _probe(self.local)

    def ports(self) -> dict[str, int] | None:
        """Every task's TF port inside the namespace (None: there is none)."""
        return inside_ports(self._spec) if self.namespace is not None else None

    def enter(self, argv: list[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        return self.namespace.enter(argv, cwd) if self.namespace is not None else argv

    @property
    def fds(self) -> tuple[int, ...]:
        return self.namespace.fds if self.namespace is not None else ()

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if self.namespace is not None:
            self.namespace.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


@dataclass
class _Made:
    namespace: Namespace
    stack: outbound.Watched | None
    exposure: Exposure


def _connect(local: LocalSpec, folder: Path) -> _Made | str:
    """A namespace connected outward as `local` says, its files (resolv.conf, pasta's pid and
    log) in the private `folder`; or why no namespace can be made. LaunchError where
    `local.outbound` is on and there is no outgoing network."""
    pasta = outbound.find() if local.outbound != "off" else None
    if pasta is None and local.outbound == "on":
        raise LaunchError(f"local.outbound is on, but pasta is not installed: {outbound.INSTALL}")
    resolv, machine = None, ""
    if pasta is not None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            own = outbound.resolv_conf(machine := Path("/etc/resolv.conf").read_text())
            if own is not None:
                (resolv := folder / "resolv.conf").write_text(own)
    made = make(resolv=resolv)
    unresolved = None
    if isinstance(made, str) and resolv is not None:  # no mount namespace here: private still,
        unresolved = (  # but the machine's resolver out of its reach: said (Degraded "names")
            f"this machine's resolver ({outbound.first_resolver(machine)}) is on its loopback, out of "
            f"the run's reach, and the run's own /etc/resolv.conf could not be given to it ({made})"
        )
        made, resolv = make(), None
    if isinstance(made, str):
        return made
    if pasta is None:
        asked = local.outbound == "off"
        said = outbound.OFF_BY_SPEC if asked else f"{outbound.INSTALL} (pasta not found)"
        return _Made(made, None, isolated(f"offline: {said}", warn=not asked))
    user, net, *_ = made.fds
    start = functools.partial(
        outbound.start, pasta, (user, net), folder, local.reach_host_loopback, resolv is not None
    )
    stack = start()
    if isinstance(stack, str):
        if local.outbound == "on":
            made.close()
            raise LaunchError(f"local.outbound is on, but {stack}")
        return _Made(made, None, isolated(f"offline: {stack}", warn=True))
    exposure = dataclasses.replace(
        isolated(outbound.reached(local.reach_host_loopback)), unresolved=unresolved
    )
    return _Made(made, outbound.Watched(stack, start), exposure)


@functools.cache
def _probe(local: LocalSpec) -> Exposure:
    if local.isolate_network == "off":
        return OFF
    with tempfile.TemporaryDirectory(prefix="orchestrate-probe-") as folder:
        try:
            made = _connect(local, Path(folder))
        except LaunchError as exc:  # local.outbound is on, and there is none to be had
            return isolated(f"offline: {exc}; `orchestrate up` would stop (exit 3)", warn=True)
        if isinstance(made, str):
            on = local.isolate_network == "on"
            stop = "; `orchestrate up` would stop (exit 3): local.isolate_network is on" if on else ""
            return open_because(f"no private network namespace: {made}{stop}")
        if made.stack is not None:
            made.stack.close()
        made.namespace.close()
        return made.exposure


_FIRST_PORT = 20000


def inside_ports(spec: ClusterSpec) -> dict[str, int]:
    """The tasks' TF ports in a namespace of their own, where nobody else binds: base_port onwards
    where the spec fixes one, else from 20000."""
    slots = task_slots(spec)
    fixed = {}
    for h, host in enumerate(spec.hosts):
        for i, slot in enumerate(s for s in slots if s.host_index == h):
            if host.base_port is not None:
                fixed[slot.name] = host.base_port + i
    taken = set(fixed.values())
    free = (p for p in itertools.count(_FIRST_PORT) if p not in taken)
    return {slot.name: fixed.get(slot.name) or next(free) for slot in slots}
