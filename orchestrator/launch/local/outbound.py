"""Launch layer, local backend: the outgoing network of a run's private namespace (netns.py), so
that a job that downloads a dataset, reads an object store or logs to a tracking server works as
it does without us, while nobody outside the run connects in.

The stack is pasta (Debian/Fedora package `passt`; what rootless Podman uses): a user-mode
network stack that gives the namespace an interface and turns its packets into ordinary sockets
of this machine's, as this user. It is started against the namespace's descriptors with:
- no port of the namespace published (`-t none -u none`): TF's ports stay the run's own;
- this machine's loopback out of reach (`-T none -U none --no-map-gw`), but for the ports the
  spec lists (`local.reach_host_loopback`): the loopback is where other users' unauthenticated
  services listen (a notebook, a database, another run's page);
- an address of its own (169.254.1.2/30, and a ULA for IPv6), not a copy of the machine's: with
  the machine's address the namespace would take the machine's own addresses for its own, and a
  server on them would be out of reach;
- name resolution as the machine does it: where /etc/resolv.conf names a resolver on the loopback
  (systemd-resolved's 127.0.0.53), the namespace gets a resolv.conf of its own (netns.py mounts
  it) naming the gateway, whose DNS pasta forwards to that resolver.

pasta runs under a guard (Python, -S) that holds a pipe from the coordinator: when the
coordinator ends, however (SIGKILL too), the pipe closes and the guard stops pasta; pasta is
also bound to the guard by PR_SET_PDEATHSIG. Nothing of the stack outlives the run. A pasta that
ends while the run lives (killed, crashed) ends its guard, which the coordinator sees on its next
look (netns.py `Network.watch`, each supervisor iteration): it starts pasta again against the same
namespace, at most RESTARTS times a run, and else says the run offline from that moment.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.launch.exposure import OFFLINE
from orchestrator.record.write import iso_time, private_open
from orchestrator.states import Degraded

#: The namespace's side: its address, its gateway (pasta), which also answers DNS where the
#: machine's resolver is on its loopback.
ADDRESS, PREFIX, GATEWAY = "169.254.1.2", 30, "169.254.1.1"
ADDRESS6, GATEWAY6 = "fd74:666f:7263::2", "fe80::1"

INSTALL = "install passt for outgoing network"
#: What an offline run says where the spec asked for it (`local: {outbound: off}`).
OFF_BY_SPEC = "the spec's local.outbound is off"
_READY_S = 10.0
_ENDED = "orchestrate: pasta ended: "  # the guard's line once pasta ended
_AGAIN_S = 3.0  # pasta started again: the supervisor's thread waits for it at most this long
#: How often a run starts pasta again after it ended (more: the run is offline from then, said).
RESTARTS = 3

#: The guard: pasta as its child (bound to it by PR_SET_PDEATHSIG), stopped when the
#: coordinator's pipe (its stdin) closes; pasta's own end is said in the log and in its exit code.
_GUARD = r"""
import ctypes, os, select, signal, subprocess, sys
argv = sys.argv[1:]
fds = tuple(int(a.rsplit("/", 1)[1]) for a in argv if a.startswith("/proc/self/fd/"))
prctl, guard = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()
def bound():
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: pasta ends with its guard
    if os.getppid() != guard:
        os._exit(1)
try:
    pasta = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, preexec_fn=bound)
except OSError as exc:
    print(f"orchestrate: cannot start pasta: {exc.strerror or exc}: {argv[0]}", flush=True)
    sys.exit(1)
for fd in fds:
    os.close(fd)
while pasta.poll() is None:
    if select.select([0], [], [], 0.5)[0] and not os.read(0, 512):
        pasta.kill()
        pasta.wait()
        sys.exit(0)
code = pasta.returncode
how = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exit code {code}"
print(f"orchestrate: pasta ended: {how}", flush=True)
sys.exit(1)
"""


def find() -> str | None:
    """pasta's path, if installed (it lives in /usr/bin; some distributions put it in sbin)."""
    return shutil.which("pasta") or shutil.which("pasta", path="/usr/sbin:/usr/local/sbin:/sbin")


def resolv_conf(text: str) -> str | None:
    """The namespace's own resolv.conf where the machine's first resolver is on its loopback (out
    of the namespace's reach): the gateway first, then the machine's other resolvers, search and
    options kept. None where the machine's file serves as it is."""
    servers, rest = _parsed(text)
    if not servers or not _loopback(servers[0]):
        return None
    kept = [s for s in servers if not _loopback(s)]
    lines = ["# orchestrate: this run's network namespace; its DNS goes to this machine's resolver"]
    return "\n".join([*lines, *(f"nameserver {s}" for s in [GATEWAY, *kept]), *rest]) + "\n"


def first_resolver(text: str) -> str:
    """The first `nameserver` of a resolv.conf's text ("" where none)."""
    return next(iter(_parsed(text)[0]), "")


def _parsed(text: str) -> tuple[list[str], list[str]]:
    """A resolv.conf's nameservers, in order, and its other lines that say anything."""
    servers, rest = [], []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            servers.append(words[1])
        elif line.strip():
            rest.append(line)
    return servers, rest


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def argv(
    pasta: str, user_fd: int, net_fd: int, pid_file: Path, reach: tuple[int, ...], dns: bool
) -> list[str]:
    """pasta's command line: the namespace connected outward only (module docstring)."""
    ports = ",".join(map(str, reach)) or "none"
    line = [pasta, "--foreground", "--quiet", "--config-net"]
    line += ["--userns", f"/proc/self/fd/{user_fd}", "--netns", f"/proc/self/fd/{net_fd}", "--no-netns-quit"]
    line += ["-t", "none", "-u", "none", "-T", ports, "-U", ports, "--no-map-gw"]
    line += ["-a", ADDRESS, "-n", str(PREFIX), "-g", GATEWAY, "-a", ADDRESS6, "-g", GATEWAY6]
    if dns:
        line += ["--dns-forward", GATEWAY]
    if os.geteuid() == 0:  # else pasta turns to `nobody`, who may not enter our namespace
        line += ["--runas", f"{os.getuid()}:{os.getgid()}"]
    return [*line, "--pid", str(pid_file)]


def reached(reach: tuple[int, ...]) -> str:
    """What the namespace reaches, in words (status.json's `network.outbound`)."""
    loopback = f"ports {', '.join(map(str, reach))}" if reach else "none (local.reach_host_loopback)"
    return f"pasta: TCP, UDP and ping to wherever this machine reaches; its loopback: {loopback}"


@dataclass
class Outbound:
    """A running stack: its guard, which holds pasta (closing the guard's stdin stops both)."""

    guard: subprocess.Popen[bytes]
    log: Path
    start: int = 0  # where its words begin in the log

    def ended(self) -> str | None:
        """None while pasta runs; else how it ended (`killed by SIGKILL`, `exit code 1`), with its
        last words since it connected the namespace, where it said any."""
        if self.guard.poll() is None:
            return None
        try:
            with self.log.open("rb") as f:
                f.seek(self.start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            lines = []
        ends = [x.removeprefix(_ENDED) for x in lines if x.startswith(_ENDED)]
        own = [x.strip() for x in lines if x.strip() and not x.startswith("orchestrate:")]
        how = ends[-1] if ends else f"its guard exited {self.guard.returncode}"
        return f"{how}: {' '.join(own[-2:])[:300]}" if own else how

    def close(self) -> None:
        if self.guard.stdin is not None and not self.guard.stdin.closed:
            self.guard.stdin.close()
        try:
            self.guard.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.guard.kill()
            self.guard.wait()


def start(
    pasta: str,
    fds: tuple[int, int],
    folder: Path,
    reach: tuple[int, ...],
    dns: bool,
    timeout_s: float = _READY_S,
) -> Outbound | str:
    """pasta connecting the namespace (its user and network descriptors), its pid file and log in
    `folder` (private); or why it could not, in its own words."""
    pid_file, log = folder / "pasta.pid", folder / "pasta.log"
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()  # an ended pasta's: the new one's is waited for
    line = argv(pasta, *fds, pid_file=pid_file, reach=reach, dns=dns)
    start = log.stat().st_size if log.exists() else 0
    try:
        with private_open(log, "ab") as out:  # an earlier pasta's words kept above
            guard = subprocess.Popen(
                [sys.executable, "-S", "-c", _GUARD, *line],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=fds,
                start_new_session=True,  # a Ctrl-C at the terminal leaves the run's network to its stop
            )
    except OSError as exc:
        return f"cannot start pasta: {exc.strerror or exc}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if guard.poll() is not None:
            return f"pasta could not connect the namespace: {said(log, start) or f'exit {guard.returncode}'}"
        with contextlib.suppress(OSError):
            if pid_file.read_text().strip():
                return Outbound(guard, log, log.stat().st_size)  # its words from now on: its end's
        time.sleep(0.005)
    Outbound(guard, log, start).close()
    return f"pasta did not connect the namespace in {timeout_s:g} s: {said(log, start) or 'it said nothing'}"


class Watched:
    """A run's pasta, looked at each supervisor iteration: where it ended while the run lives, it
    is started again against the same namespace (`argv`: the same line), at most RESTARTS times a
    run; after that, or where it cannot be, the run is offline from that moment, said."""

    def __init__(self, stack: Outbound, again: Callable[[float], Outbound | str]) -> None:
        self._stack: Outbound | None = stack
        self._again = again  # start(...) as first asked, with a timeout
        self._restarts = 0

    def look(self) -> tuple[list[Degraded], str | None]:
        """What to say of pasta's end if it ended (a Degraded: passing where started again), and
        the run's `outbound` from then where it is offline."""
        ended = self._stack.ended() if self._stack is not None else None
        if self._stack is None or ended is None:
            return [], None
        at = time.time()
        when = f"{time.strftime('%H:%M:%S', time.gmtime(at))} UTC"
        self._stack.close()
        self._stack = None
        where = "pasta.log in the run's socket folder has its words"
        if self._restarts < RESTARTS:
            self._restarts += 1
            again = self._again(_AGAIN_S)
            if isinstance(again, Outbound):
                self._stack = again
                said = (
                    f"pasta, this run's outgoing network, ended at {when} ({ended}) and was started again "
                    f"({self._restarts} of {RESTARTS}): connections open then were cut"
                )
                return [Degraded("outbound", "this machine", said, where, iso_time(at), lasting=False)], None
            why = again
        else:
            why = f"it ended {RESTARTS + 1} times this run: not started again"
        said = f"{OFFLINE} since {when}: pasta ended ({ended}); {why}"
        fix = f"{where}; `orchestrate up --resume` with the run directory goes on online"
        return [
            Degraded("outbound", "this machine", said, fix, iso_time(at))
        ], f"offline since {when}: {ended}; {why}"

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def said(log: Path, start: int = 0) -> str:
    """pasta's words (its last lines from `start`; its complaint that there is no system logger
    left out), or its guard's where it said none."""
    try:
        with log.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in text.splitlines() if x.strip() and "to syslog" not in x]
    own = [x for x in lines if not x.startswith("orchestrate:")]  # the guard's word, where pasta said none
    return " ".join(x.removeprefix("orchestrate: ") for x in (own or lines)[-3:])[:300]
