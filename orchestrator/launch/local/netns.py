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
shares the one namespace, so NCCL and TF between them work over its loopback.

Where the kernel refuses user namespaces (kernel.unprivileged_userns_clone=0, AppArmor's
apparmor_restrict_unprivileged_userns, user.max_user_namespaces=0, a container whose seccomp
profile forbids them) or nsenter is missing, `make` says why, read from the kernel's answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import Field, field_validator

from orchestrator.errors import LaunchError
from orchestrator.launch.exposure import Exposure
from orchestrator.spec.model import ClusterSpec, Strict, yaml_switch
from orchestrator.spec.roles import task_slots

#: The holder: its own user and network namespace, its uid and gid mapped (one line each, as an
#: unprivileged process may), loopback up (SIOCGIFFLAGS, SIOCSIFFLAGS | IFF_UP), "ready", then it
#: waits for its stdin to close. Single-threaded (unshare of a user namespace requires it).
_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
def fail(what, err):
    print(f"{what}: {os.strerror(err)}", flush=True)
    sys.exit(1)
uid, gid = os.geteuid(), os.getegid()
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
    fail("unshare(CLONE_NEWUSER|CLONE_NEWNET) refused", ctypes.get_errno())
for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
    try:
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    except OSError as exc:
        fail(f"cannot map the user into its namespace ({name})", exc.errno)
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


class LocalSpec(Strict):
    """The spec's `local:` section."""

    isolate_network: str = Field(
        default="auto",
        pattern="^(auto|on|off)$",
        description="auto | on | off: the tasks in a private network namespace, their TF ports "
        "out of every other user's reach (auto: where the kernel allows it; on: refuse to run "
        "without it, exit 3)",
    )

    _yaml_switch = field_validator("isolate_network", mode="before")(yaml_switch)


ISOLATED = "this run's own network namespace only"
OPEN = "every address of this machine, by every user of it"


def isolated() -> Exposure:
    why = "a private network namespace, its loopback alone: the tasks reach nothing outside the run either"
    return Exposure(True, ISOLATED, why)


def open_because(why: str, warn: bool = True) -> Exposure:
    """Open to every user; `warn`: said on the console (not where the spec asked for it: off)."""
    return Exposure(False, OPEN, why, warn=warn)


#: What the spec's `isolate_network: off` gives (asked for: not warned of).
OFF = open_because("the spec's local.isolate_network is off", warn=False)


class Namespace:
    """A made namespace, held by two descriptors (closed by `close`, or by the process ending)."""

    def __init__(self, user_fd: int, net_fd: int, nsenter: str):
        self._fds = (user_fd, net_fd)
        self._nsenter = nsenter

    @property
    def fds(self) -> tuple[int, int]:
        return self._fds

    def enter(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (start it with `pass_fds=self.fds`)."""
        user, net = self._fds
        return [
            self._nsenter,
            f"--user=/proc/self/fd/{user}",
            f"--net=/proc/self/fd/{net}",
            "--preserve-credentials",
            "--",
            *argv,
        ]

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = (-1, -1)


def make(timeout_s: float = _READY_S) -> Namespace | str:
    """A new namespace, or why none can be made (the kernel's or the tool's own words)."""
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        return "nsenter (util-linux) not found on PATH"
    try:
        holder = subprocess.Popen(
            [sys.executable, "-S", "-c", _HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return f"cannot start the namespace's holder: {exc.strerror or exc}"
    assert holder.stdin is not None and holder.stdout is not None
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
        try:
            user = _above_stdio(os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            return f"cannot open the namespace: {exc.strerror or exc}"
        try:
            net = _above_stdio(os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            os.close(user)
            return f"cannot open the namespace: {exc.strerror or exc}"
        return Namespace(user, net, nsenter)
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


#: sun_path holds 108 bytes with its terminating NUL.
_SUN_PATH_MAX = 107


def socket_folder(run_dir: Path) -> Path:
    """A new private (0700) folder for the run's heartbeat socket: in the run directory where the
    socket's path fits a Unix socket address, else in the user's runtime folder or the temp one
    (OSError where none fits). Folders left there by coordinators killed before are removed."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    for base in (run_dir.resolve(), Path(runtime), Path(tempfile.gettempdir()), Path("/tmp")):
        if not base.is_absolute() or not base.is_dir():
            continue
        if len(os.fsencode(base)) + len("/.heartbeats-XXXXXXXX/hb") <= _SUN_PATH_MAX:
            _sweep(base, in_run=base == run_dir.resolve())
            return Path(tempfile.mkdtemp(prefix=".heartbeats-", dir=base))
    raise OSError(f"no folder whose path leaves room for a Unix socket ({_SUN_PATH_MAX} bytes)")


def _sweep(base: Path, in_run: bool) -> None:
    """Our socket folders in `base` whose coordinator is gone: in the run directory, any (the run's
    lock is this coordinator's); elsewhere, those whose socket no longer answers (another run's
    coordinator, alive, keeps its own)."""
    for stale in base.glob(".heartbeats-*"):
        with contextlib.suppress(OSError):
            st = os.lstat(stale)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if not in_run:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.settimeout(1.0)  # a live one's backlog full: a wait, then kept
                    try:
                        probe.connect(str(stale / "hb"))
                        continue  # a live coordinator's
                    except ConnectionRefusedError:
                        pass  # its coordinator is gone
            shutil.rmtree(stale)


class Network:
    """A run's network as its local tasks see it: a namespace of their own (the spec's
    `local.isolate_network` and the kernel allowing), or this machine's."""

    def __init__(self, spec: ClusterSpec):
        section = spec.section("local")
        self.mode = section.isolate_network if isinstance(section, LocalSpec) else "auto"
        self._spec = spec
        self.namespace: Namespace | None = None
        self.exposure: Exposure | None = None  # said once `make` was asked
        self._folder: Path | None = None

    def make(self, run_dir: Path) -> Path | None:
        """The namespace, and the path of the heartbeat socket the tasks post to from it; None
        where they run on this machine's network (`exposure` says why). LaunchError where the
        spec says `on` and no namespace can be made."""
        assert self.namespace is None, "one namespace a run"
        if self.mode == "off":
            self.exposure = OFF
            return None
        made = make()
        if not isinstance(made, str):
            try:
                self._folder = socket_folder(run_dir)
            except OSError as exc:
                made.close()
                made = f"no folder for the heartbeat socket: {exc}"
            else:
                self.namespace, self.exposure = made, isolated()
                return self._folder / "hb"
        if self.mode == "on":
            raise LaunchError(
                f"local.isolate_network is on, but no private network namespace can be made here: {made}"
            )
        self.exposure = open_because(f"no private network namespace: {made}")
        return None

    def probe(self) -> Exposure:
        """What `make` would give now (`orchestrate plan` and `check`), holding nothing; asked
        once a process (plan asks for the placements and for its line)."""
        return _probe(self.mode)

    def ports(self) -> dict[str, int] | None:
        """Every task's TF port inside the namespace (None: there is none)."""
        return inside_ports(self._spec) if self.namespace is not None else None

    def enter(self, argv: list[str]) -> list[str]:
        return self.namespace.enter(argv) if self.namespace is not None else argv

    @property
    def fds(self) -> tuple[int, ...]:
        return self.namespace.fds if self.namespace is not None else ()

    def close(self) -> None:
        if self.namespace is not None:
            self.namespace.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


@functools.cache
def _probe(mode: str) -> Exposure:
    if mode == "off":
        return OFF
    made = make()
    if isinstance(made, str):
        stop = "; `orchestrate up` would stop (exit 3): local.isolate_network is on" if mode == "on" else ""
        return open_because(f"no private network namespace: {made}{stop}")
    made.close()
    return isolated()


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
