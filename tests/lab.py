"""A test lab of SSH hosts on this machine (DESIGN §8), for the ssh backend's tests.

- `NetnsLab` (needs root): each host is a network namespace on a private bridge with its own
  address (10.77.N.0/24, made only inside this machine; no forwarding, no NAT) and its own sshd with
  its own host key. A task started over SSH sees only its namespace's network, so TensorFlow's gRPC
  between "hosts" crosses real (virtual) links, and a host can be cut off (`cut`).
- `LoopbackLab` (no root needed): one sshd per host on a loopback alias (127.0.0.N) and a high
  port. Hosts share one network, so nothing can be cut off; enough for launch, keys and teardown.

Both write a client key, an authorized_keys file and a known_hosts file that lists every host key,
and stop everything they started (the hosts' leftover processes included) on close.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def why_no_lab() -> str | None:
    """None when a lab can be built here; else the reason (for pytest.skip)."""
    if not Path(SSHD).exists():
        return "sshd not installed (apt-get install openssh-server; .ci/run does this)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not installed"
    return None


def can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@dataclass
class LabHost:
    name: str
    address: str
    ssh_port: int
    netns: str | None
    host_key_pub: str
    home: Path
    sshd_pid: int = 0

    @property
    def known_name(self) -> str:
        """How known_hosts names this host."""
        return self.address if self.ssh_port == 22 else f"[{self.address}]:{self.ssh_port}"

    @property
    def workdir(self) -> Path:
        """Where orchestrate keeps runs on this host (its default, ~/.orchestrate)."""
        return self.home / ".orchestrate"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []


class _Lab:
    def __init__(self, root: Path, count: int):
        self.root = root
        self.count = count
        self.hosts: list[LabHost] = []
        self.client_key = root / "id_lab"
        self.known_hosts = root / "known_hosts"
        self.authorized_keys = root / "authorized_keys"
        self.tf_base_port: int | None = None
        root.mkdir(parents=True, exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lab-client", "-f", str(self.client_key)])
        shutil.copy(f"{self.client_key}.pub", self.authorized_keys)
        os.chmod(self.authorized_keys, 0o600)

    # --- built by the subclasses ---
    def _start_sshd(self, host: LabHost, key: Path) -> None:
        conf = self.root / f"sshd-{host.name}.conf"
        conf.write_text(
            "\n".join(
                [
                    f"Port {host.ssh_port}",
                    f"ListenAddress {host.address}",
                    f"HostKey {key}",
                    f"PidFile {self.root / f'sshd-{host.name}.pid'}",
                    f"AuthorizedKeysFile {self.root / f'authorized_keys-{host.name}'}",
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
        )
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation folder
        log = self.root / f"sshd-{host.name}.log"
        _run([*host.exec_prefix(), SSHD, "-f", str(conf), "-E", str(log)])
        pidfile = self.root / f"sshd-{host.name}.pid"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if pidfile.exists() and pidfile.read_text().strip() and self._port_open(host):
                host.sshd_pid = int(pidfile.read_text())
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd for {host.name} did not start; {log}: {log.read_text()[-500:]}")

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
        host = LabHost(name, address, port, netns, pub, home=home)
        self._start_sshd(host, key)
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
    """Hosts as network namespaces (root only)."""

    def __init__(self, root: Path, count: int):
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

    def cut(self, i: int) -> None:
        """Cut host i off the network (its link goes down; its processes keep running)."""
        _run(["ip", "-n", self.hosts[i].netns or "", "link", "set", "eth0", "down"])

    def restore(self, i: int) -> None:
        _run(["ip", "-n", self.hosts[i].netns or "", "link", "set", "eth0", "up"])

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts[i].netns or ""], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split() if int(p) != self.hosts[i].sshd_pid]

    def close(self) -> None:
        for h in self.hosts:
            for pid in self.pids(self.hosts.index(h)) + [h.sshd_pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for i in range(self.count):
            subprocess.run(["ip", "netns", "del", f"olab{self.tag}h{i}"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


class LoopbackLab(_Lab):
    """Hosts as sshd instances on loopback aliases (no root)."""

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


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=False).stdout
    choices = [n for n in range(1, 250) if f"10.77.{n}." not in used]
    return random.choice(choices)


def _user() -> str:
    import getpass

    return getpass.getuser()


def _python() -> str:
    import sys

    return sys.executable


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
