"""A test lab of SSH hosts on this machine (docs/architecture.md §8), for the ssh backend's tests.

- `NetnsLab` (needs root): each host is as separate as a real machine, but for its processes'
  ids. Its own network namespace on a private bridge with its own address (10.77.N.0/24, made
  only inside this machine; no forwarding, no NAT), so TensorFlow's gRPC between "hosts" crosses
  real (virtual) links and a host can be cut off (`cut`); its own hostname (h0, h1...); its own
  disk: a mount namespace with empty private tmpfs folders over /tmp, /var/tmp, its home
  (`LabHost.home`, where orchestrate's default work folder ~/.orchestrate lives) and the lab's
  scratch path (`lab.scratch`: one path, other contents on each host, like a local /scratch).
  What every host does see: the lab's shared folder (`lab.shared`, like an NFS mount: the same
  on every host and outside) and this Python's install (the tests' `python` on every host is
  `sys.executable`), bound back in where a private folder hid them; the rest of the machine's
  filesystem outside the private folders. Each host's sshd (`tests/lab_host.py` prepares the
  namespaces, then execs it) reads its key and authorized_keys from the host's private /tmp.
- `LoopbackLab` (no root needed): one sshd per host on a loopback alias (127.0.0.N) and a high
  port. Hosts share one network and one disk, so nothing can be cut off and a file written on
  one host is on all; enough for launch, keys and teardown. `lab.separate_disks` says which.

A host's files, seen from outside: `host.path(p)` (through `/proc/SSHD_PID/root`, which shows
that host's mounts; just `p` on a loopback lab). A command run "on" host i: `host.exec_prefix()`
(enters its network, mount and UTS namespaces).

Both write a client key, an authorized_keys file and a known_hosts file that lists every host key,
and stop everything they started (the hosts' leftover processes included) on close.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
BOOTSTRAP = Path(__file__).resolve().with_name("lab_host.py")
HOST_SSHD_DIR = "/tmp/.lab-sshd"  # inside each netns host's private /tmp: its sshd's config and keys


def why_no_lab() -> str | None:
    """None when a lab can be built here; else the reason (for pytest.skip)."""
    if not Path(SSHD).exists():
        return "sshd not installed (apt-get install openssh-server; .ci/run does this)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not installed"
    return None


def can_netns() -> bool:
    return os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "nsenter", "unshare"))


@dataclass
class LabHost:
    name: str
    address: str
    ssh_port: int
    netns: str | None
    host_key_pub: str
    home: Path
    sshd_pid: int = 0
    separate_disk: bool = False

    @property
    def known_name(self) -> str:
        """How known_hosts names this host."""
        return self.address if self.ssh_port == 22 else f"[{self.address}]:{self.ssh_port}"

    @property
    def workdir(self) -> Path:
        """Where orchestrate keeps runs on this host (its default, ~/.orchestrate): a path on the
        host; `path(workdir)` reaches it from outside."""
        return self.home / ".orchestrate"

    def path(self, p: str | os.PathLike[str]) -> Path:
        """The absolute path `p` on this host, as seen from outside (only while its sshd runs; an
        absolute symlink met on the way resolves outside, as /proc/PID/root does)."""
        if not self.separate_disk:
            return Path(p)
        return Path(f"/proc/{self.sshd_pid}/root") / Path(p).relative_to("/")

    def exec_prefix(self) -> list[str]:
        """Put before a command to run it on this host (its network, disk and hostname)."""
        if self.netns is None:
            return []
        return ["nsenter", f"--target={self.sshd_pid}", "--net", "--mount", "--uts", "--"]


class _Lab:
    separate_disks = False  # whether each host has a disk of its own (NetnsLab)

    def __init__(self, root: Path, count: int):
        self.root = root
        self.count = count
        self.hosts: list[LabHost] = []
        self.client_key = root / "id_lab"
        self.known_hosts = root / "known_hosts"
        self.authorized_keys = root / "authorized_keys"
        self.shared = root / "shared"  # the same folder on every host and outside
        self.scratch = root / "scratch"  # a folder of its own on each host (when separate_disks)
        self.tf_base_port: int | None = None
        root.mkdir(parents=True, exist_ok=True)
        self.shared.mkdir(exist_ok=True)
        self.scratch.mkdir(exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab-client", "-f", str(self.client_key)])
        shutil.copy(f"{self.client_key}.pub", self.authorized_keys)
        os.chmod(self.authorized_keys, 0o600)

    # --- built by the subclasses ---
    def _sshd_config(self, host: LabHost, key: str, authorized_keys: str, pidfile: str) -> str:
        return "\n".join(
            [
                f"Port {host.ssh_port}",
                f"ListenAddress {host.address}",
                f"HostKey {key}",
                f"PidFile {pidfile}",
                f"AuthorizedKeysFile {authorized_keys}",
                "PermitUserEnvironment yes",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowTcpForwarding yes",
                "MaxSessions 64",
                "MaxStartups 64",
                "Subsystem sftp internal-sftp",
                "LogLevel ERROR",
                "",
            ]
        )

    def _start_sshd(self, host: LabHost, key: Path, authorized_keys: Path) -> None:
        raise NotImplementedError

    def _port_open(self, host: LabHost) -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host.address, host.ssh_port), timeout=0.5),
        ):
            return True
        return False

    def _add_host(self, name: str, address: str, port: int, netns: str | None) -> LabHost:
        key = self.root / f"hostkey-{name}"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)])
        pub = " ".join(Path(f"{key}.pub").read_text().split()[:2])
        # Each host has a home of its own, as separate machines do (and no shell start-up files:
        # the account's real ~/.bashrc would run on every remote command).
        home = self.root / f"{name}-home"
        home.mkdir()
        client = self.authorized_keys.read_text().strip()
        keys = self.root / f"authorized_keys-{name}"
        keys.write_text(f'environment="HOME={home}" {client}\n')
        keys.chmod(0o600)
        host = LabHost(name, address, port, netns, pub, home=home, separate_disk=self.separate_disks)
        self._start_sshd(host, key, keys)
        with open(self.known_hosts, "a") as f:
            f.write(f"{host.known_name} {pub}\n")
        self.hosts.append(host)
        return host

    # --- used by tests ---
    def host_spec(self, i: int, **extra: object) -> dict[str, object]:
        """The spec's `hosts:` entry for host i (one worker unless `tasks` is given)."""
        h = self.hosts[i]
        spec: dict[str, object] = {
            "address": h.address,
            "port": h.ssh_port,
            "user": _user(),
            "identity_file": str(self.client_key),
            "python": _python(),
            "tasks": {"worker": 1},
        }
        if self.tf_base_port is not None:  # hosts that share one network need their own TF ports
            spec["base_port"] = self.tf_base_port + 10 * i
        spec.update(extra)
        return spec

    def ssh_spec(self, **extra: object) -> dict[str, object]:
        return {"known_hosts": str(self.known_hosts), "connect_timeout_s": 5, **extra}

    def pids(self, i: int) -> list[int]:
        """Processes in host i other than its sshd listener (sessions and tasks)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetnsLab(_Lab):
    """Hosts as network, mount and UTS namespaces (root only)."""

    separate_disks = True

    def __init__(self, root: Path, count: int):
        self._sshds: dict[str, subprocess.Popen[bytes]] = {}
        self._namespaces: dict[str, set[tuple[int, int]]] = {}  # host name: its namespaces (dev, inode)
        super().__init__(root, count)
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.subnet = _free_subnet()
        self.bridge = f"olb{self.tag}"
        self.gateway = f"10.77.{self.subnet}.1"
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(count):
                ns = f"olab{self.tag}h{i}"
                veth = f"olv{self.tag}{i}"
                address = f"10.77.{self.subnet}.{10 + i}"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
                _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                self._add_host(f"h{i}", address, 22, ns)
        except BaseException:
            self.close()
            raise

    def _private_folders(self, host: LabHost) -> list[tuple[str, int]]:
        """What each host has of its own: (path, mode) of an empty tmpfs mounted there."""
        return [("/tmp", 0o1777), ("/var/tmp", 0o1777), (str(host.home), 0o755), (str(self.scratch), 0o1777)]

    def _kept_folders(self, private: list[str]) -> list[tuple[str, bool]]:
        """(path, read only) of what every host sees although a private folder would hide it: the
        shared folder, and this Python (a venv, its base install, the real folder of the binary)."""
        wanted = [(str(self.shared.resolve()), False)]
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
            wanted.append((os.path.realpath(p), True))
            wanted.append((os.path.abspath(p), True))
        wanted.append((os.path.realpath(os.path.dirname(sys.executable)), True))
        wanted.append((os.path.abspath(os.path.dirname(sys.executable)), True))

        def under(path: str, folder: str) -> bool:
            return path == folder or path.startswith(folder.rstrip("/") + "/")

        private = [os.path.realpath(p) for p in private]
        hidden = [(p, ro) for p, ro in dict(wanted).items() if any(under(p, f) for f in private)]
        # a folder inside another kept one comes back with it
        return [(p, ro) for p, ro in hidden if not any(q != p and under(p, q) for q, _ in hidden)]

    def _start_sshd(self, host: LabHost, key: Path, authorized_keys: Path) -> None:
        assert host.netns is not None
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
        private_key, private_keys, private_conf = (
            f"{HOST_SSHD_DIR}/{n}" for n in ("hostkey", "authorized_keys", "sshd_config")
        )
        conf = self.root / f"sshd-{host.name}.conf"  # a copy for the curious; the host reads its own
        conf.write_text(self._sshd_config(host, private_key, private_keys, "none"))
        private = self._private_folders(host)
        plan = {
            "hostname": host.name,
            "private": private,
            "keep": self._kept_folders([p for p, _ in private]),
            "folders": [(HOST_SSHD_DIR, 0o700)],
            "files": [
                (str(conf), private_conf, 0o600),
                (str(key), private_key, 0o600),
                (str(authorized_keys), private_keys, 0o600),
            ],
            # in the foreground (its pid is ours), logging to stderr (the log file outside)
            "exec": [SSHD, "-D", "-e", "-f", private_conf],
        }
        log = self.root / f"sshd-{host.name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{host.netns}",
                    "--",
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    "-I",
                    "-S",
                    str(BOOTSTRAP),
                    json.dumps(plan),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self._sshds[host.name] = proc
        host.sshd_pid = proc.pid  # nsenter, unshare and the bootstrap each exec the next: sshd's pid
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if self._port_open(host):
                ids = (_ns_id(proc.pid, kind) for kind in ("net", "mnt", "uts"))
                self._namespaces[host.name] = {i for i in ids if i is not None}
                if os.path.realpath(f"/proc/{proc.pid}/exe") != os.path.realpath(SSHD):
                    raise RuntimeError(f"{host.name}: pid {proc.pid} is not sshd")
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd for {host.name} did not start; {log}: {log.read_text()[-500:]}")

    def cut(self, i: int) -> None:
        """Cut host i off the network (its link goes down; its processes keep running)."""
        _run(["ip", "-n", self.hosts[i].netns or "", "link", "set", "eth0", "down"])

    def restore(self, i: int) -> None:
        _run(["ip", "-n", self.hosts[i].netns or "", "link", "set", "eth0", "up"])

    def blackhole(self, i: int, j: int, on: bool = True) -> None:
        """Host i can no longer reach host j (a route that drops what it sends there: a firewall
        between two lab machines); the coordinator still reaches both."""
        verb = "add" if on else "del"
        _run(
            ["ip", "-n", self.hosts[i].netns or "", "route", verb, "blackhole", f"{self.hosts[j].address}/32"]
        )

    def pids(self, i: int) -> list[int]:
        return [p for p in self._in_namespaces(self.hosts[i].name) if p != self.hosts[i].sshd_pid]

    def _in_namespaces(self, name: str) -> list[int]:
        """Every process in one of the host's network, mount or UTS namespaces."""
        mine = self._namespaces.get(name, set())
        found = []
        for entry in os.listdir("/proc") if mine else []:
            if entry.isdigit() and any(_ns_id(int(entry), k) in mine for k in ("net", "mnt", "uts")):
                found.append(int(entry))
        return found

    def close(self) -> None:
        for h in self.hosts:
            for pid in self._in_namespaces(h.name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._sshds.values():  # sshd itself, even if it never got its namespaces
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # a host's mount namespace (and its private folders) goes with its last process
        deadline = time.monotonic() + 5
        while any(self._in_namespaces(h.name) for h in self.hosts) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(self.count):
            subprocess.run(["ip", "netns", "del", f"olab{self.tag}h{i}"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


class LoopbackLab(_Lab):
    """Hosts as sshd instances on loopback aliases (no root); they share this machine's disk."""

    def __init__(self, root: Path, count: int):
        super().__init__(root, count)
        base = random.randrange(20000, 30000, 10)
        self.tf_base_port = base + 100
        try:
            for i in range(count):
                self._add_host(f"h{i}", f"127.0.0.{2 + i}", base + i, None)
        except BaseException:
            self.close()
            raise

    def _start_sshd(self, host: LabHost, key: Path, authorized_keys: Path) -> None:
        conf = self.root / f"sshd-{host.name}.conf"
        pidfile = self.root / f"sshd-{host.name}.pid"
        conf.write_text(self._sshd_config(host, str(key), str(authorized_keys), str(pidfile)))
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
        log = self.root / f"sshd-{host.name}.log"
        _run([SSHD, "-f", str(conf), "-E", str(log)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if pidfile.exists() and pidfile.read_text().strip() and self._port_open(host):
                host.sshd_pid = int(pidfile.read_text())
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd for {host.name} did not start; {log}: {log.read_text()[-500:]}")

    def pids(self, i: int) -> list[int]:
        import psutil

        host = self.hosts[i]
        try:
            sshd = psutil.Process(host.sshd_pid)
            return [p.pid for p in sshd.children(recursive=True)]
        except psutil.Error:
            return []

    def close(self) -> None:
        for i, h in enumerate(self.hosts):
            for pid in self.pids(i) + [h.sshd_pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def make_lab(root: Path, count: int) -> _Lab:
    """Namespaces when root can make them, else loopback; ORCHESTRATE_LAB=loopback forces the latter."""
    if can_netns() and os.environ.get("ORCHESTRATE_LAB") != "loopback":
        return NetnsLab(root, count)
    return LoopbackLab(root, count)


def _ns_id(pid: int, kind: str) -> tuple[int, int] | None:
    """Which namespace of a kind ("net", "mnt", "uts") a process is in; None once it is gone."""
    try:
        st = os.stat(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=False).stdout
    choices = [n for n in range(1, 250) if f"10.77.{n}." not in used]
    return random.choice(choices)


def _user() -> str:
    import getpass

    return getpass.getuser()


def _python() -> str:
    return sys.executable


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
