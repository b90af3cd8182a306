"""A real multi-node Slurm cluster on this machine (docs/architecture.md §8), for the slurm backend's tests.

`SlurmLab` (root, Debian's `slurm-wlm` and `munge`) builds, all of its own and named after one random
tag (`sl-<hex>`), so that two labs, the SSH lab (10.77.x.x) and a system Slurm never meet:

- a private bridge with the host's side at 10.88.N.1 (N free; no forwarding, no NAT): the host's
  root namespace is the login node, where `run()` starts srun/sbatch/squeue/scancel/sinfo with
  `SLURM_CONF` pointing at the lab's slurm.conf;
- one network namespace for slurmctld (10.88.N.2, hostname `slurmctl`, matching `SlurmctldHost`)
  and one per node (n1, n2, n3 at 10.88.N.11...), each daemon in a mount and UTS namespace of its
  own with the lab's hosts file bound over /etc/hosts. The nodes share this machine's disk (so the
  tests' venv python runs on every node), but not its network or its name;
- one munged, as the munge user, with its own key, socket, pid, seed and log files in the lab's
  folder (`AuthInfo=socket=...`), never the system's /run/munge;
- a temporary folder (`lab.root`) with slurm.conf, cgroup.conf, the daemons' state, spool and logs;
  in it `login_only/`, which the nodes do not see (each mounts an empty tmpfs over it: a cluster
  whose nodes share no disk with the login node), and `scratch/`, a disk of each node's own;
- each node's own /tmp (a tmpfs of its own, as a real node's local disk or a per-job private /tmp),
  with what the cluster's shared file system holds bound back at the same paths: the lab's folder,
  the `shared` folders given (where the tests' run directories are), and this repository and its
  Python where they lie under /tmp (a CI clone). Everything else a node sees is this machine's.

Daemons are started so that the pid we hold is the daemon's own (nsenter, unshare and `sh -c exec`
each exec the next; munged and slurm daemons run in the foreground): `close()` stops exactly those,
kills what is left in the lab's node namespaces (slurmstepd, job tasks), then deletes the
namespaces, the bridge and the folder. Start daemons with nsenter, not `ip netns exec`: the latter
remounts /sys, and slurmd dies with "No filesystem mounted on /sys/fs/cgroup".
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO, wait_until
from tests.lab import _ns_id

SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
NS_TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")
CTLD_HOST = "slurmctl"


def why_no_slurm() -> str | None:
    """None when a SlurmLab can be built here; else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "a Slurm lab needs root (network namespaces, munged as the munge user)"
    missing = [t for t in SLURM_TOOLS + NS_TOOLS if _which(t) is None]
    if missing:
        return f"missing {' '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does this)"
    if _which("munged") is None:
        return "munged not installed (apt-get install munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package makes it)"
    return None


@dataclass
class SlurmNode:
    name: str
    address: str
    netns: str
    pid: int = 0  # its slurmd
    namespaces: set[tuple[int, int]] = field(default_factory=set)  # (dev, inode) of its net, mnt, uts


class SlurmLab:
    """Three Slurm nodes (n1..n3) and a slurmctld, each in namespaces of its own (root only)."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2, shared: Sequence[Path] = ()):
        self.tag = secrets.token_hex(3)
        self.prefix = f"sl-{self.tag}"  # every name the lab makes begins with this
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.subnet = _free_subnet()
        self.gateway = f"10.88.{self.subnet}.1"  # the host's side: the login node
        self.ctld_address = f"10.88.{self.subnet}.2"
        self.ctld_netns = f"{self.prefix}-ctl"
        self.bridge = f"{self.prefix}-br"
        self.cpus_per_node = cpus_per_node
        self.nodes = [
            SlurmNode(f"n{i}", f"10.88.{self.subnet}.{10 + i}", f"{self.prefix}-n{i}")
            for i in range(1, nodes + 1)
        ]
        self.ctld_port, self.slurmd_port = _free_ports(2)
        self.conf = self.root / "slurm.conf"
        self.login_only = self.root / "login_only"  # not seen by the nodes
        self.scratch = self.root / "scratch"  # each node's own
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        # seen by every node at the same path (a cluster's shared file system), /tmp being their own
        self.shared = [self.root, *(Path(p).resolve() for p in shared), REPO, Path(sys.prefix).resolve()]
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # daemon name: the daemon itself
        self._netns_made: list[str] = []
        self._bridge_made = False
        self._closed = False
        try:
            self._write_files()
            self._start_munged()
            self._make_network()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
        except BaseException:
            self.close()
            raise

    # --- context manager ---
    def __enter__(self) -> SlurmLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- building ---
    def _write_files(self) -> None:
        self.root.chmod(0o755)  # munged (as munge) must reach its folder below
        for sub in ("state", "spool", "log", "run", "login_only", "scratch", "node_tmp"):
            (self.root / sub).mkdir()
        for n in self.nodes:  # slurmd wants its spool (and socket) folder there before it starts
            (self.root / "spool" / n.name).mkdir()
        node_lines = [
            f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus_per_node} RealMemory=2000 State=UNKNOWN"
            for n in self.nodes
        ]
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName={self.prefix.replace('-', '')}",
                    f"SlurmctldHost={CTLD_HOST}({self.ctld_address})",
                    f"SlurmctldPort={self.ctld_port}",
                    f"SlurmdPort={self.slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    # cgroup tracking would mix the nodes' jobs: they share one cgroup tree
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",  # every node claims its CPUs on 2 real cores
                    "SlurmdTimeout=20",
                    "KillWait=5",
                    "MessageTimeout=5",
                    "MpiDefault=none",
                    "SchedulerType=sched/backfill",
                    f"StateSaveLocation={r}/state",
                    f"SlurmctldPidFile={r}/run/slurmctld.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdSpoolDir={r}/spool/%n",
                    f"SlurmdPidFile={r}/run/slurmd-%n.pid",
                    f"SlurmdLogFile={r}/log/slurmd-%n.log",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    *node_lines,
                    "PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        # read by slurmd even with linuxproc; nothing constrained
        (self.root / "cgroup.conf").write_text(
            "CgroupPlugin=autodetect\nConstrainCores=no\nConstrainRAMSpace=no\n"
        )
        hosts = [
            "127.0.0.1 localhost",
            f"{self.gateway} login",
            f"{self.ctld_address} {CTLD_HOST}",
            *(f"{n.address} {n.name}" for n in self.nodes),
        ]
        (self.root / "hosts").write_text("\n".join(hosts) + "\n")

    def _start_munged(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir()
        self.munge_dir.chmod(0o711)  # munged: its socket's folder must be searchable by all
        key = self.munge_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o400)
        for p in (self.munge_dir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        d = self.munge_dir
        argv = [
            _which("munged") or "munged",
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={d}/munged.pid",
            f"--log-file={d}/munged.log",
            f"--seed-file={d}/munged.seed",
        ]
        # as `runuser -u munge munged`, but the pid we hold is munged's own
        with open(self.root / "log" / "munged.stderr", "ab") as log:
            proc = subprocess.Popen(
                argv,
                user=munge.pw_uid,
                group=munge.pw_gid,
                extra_groups=[],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        self._procs["munged"] = proc
        if (
            not wait_until(lambda: self.munge_socket.exists() or proc.poll() is not None, 10, interval_s=0.05)
            or proc.poll() is not None
        ):
            raise RuntimeError(
                f"munged did not start: {self._tail('log/munged.stderr')} {self._tail('munge/munged.log')}"
            )

    def _make_network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, (ns, address) in enumerate(
            [(self.ctld_netns, self.ctld_address), *((n.netns, n.address) for n in self.nodes)]
        ):
            veth = f"{self.prefix}-v{i}"
            _run(["ip", "netns", "add", ns])
            self._netns_made.append(ns)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _start_daemon(
        self, name: str, netns: str, hostname: str, argv: list[str], before: str = ""
    ) -> subprocess.Popen[bytes]:
        """Start argv in netns with a mount and UTS namespace of its own (propagation slave: the
        host's unmounts, such as `ip netns del` of other labs, still reach it), `before` run there
        first (shell). The pid is argv's."""
        script = f'set -e; {before} mount --bind "$1" /etc/hosts; hostname "$2"; shift 2; exec "$@"'
        with open(self.root / "log" / f"{name}.stderr", "ab") as log:
            proc = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{netns}",
                    "--",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "slave",
                    "--",
                    "sh",
                    "-c",
                    script,
                    "sh",
                    str(self.root / "hosts"),
                    hostname,
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "SLURM_CONF": str(self.conf)},
                start_new_session=True,
            )
        self._procs[name] = proc
        return proc

    def _start_slurmctld(self) -> None:
        exe = _which("slurmctld") or "slurmctld"
        proc = self._start_daemon(
            "slurmctld", self.ctld_netns, CTLD_HOST, [exe, "-D", "-i", "-f", str(self.conf)]
        )
        self._wait_exec(proc, exe, "slurmctld")
        if not wait_until(lambda: proc.poll() is not None or self._ctld_answers(), 20, interval_s=0.1):
            raise RuntimeError(f"slurmctld did not answer in 20 s: {self._tail('log/slurmctld.log')}")
        if proc.poll() is not None:
            raise RuntimeError(f"slurmctld exited ({proc.returncode}): {self._tail('log/slurmctld.log')}")

    def _start_slurmd(self, node: SlurmNode) -> None:
        exe = _which("slurmd") or "slurmd"
        proc = self._start_daemon(
            f"slurmd-{node.name}",
            node.netns,
            node.name,
            [exe, "-D", "-f", str(self.conf)],
            self._own_tmp(node),
        )
        self._wait_exec(proc, exe, f"slurmd on {node.name}")
        node.pid = proc.pid
        for folder in (self.login_only, self.scratch):  # in the node's mount namespace only
            _run(
                [
                    "nsenter",
                    f"--target={proc.pid}",
                    "--mount",
                    "--",
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    "size=256m,mode=0755",
                    f"{self.prefix}-{node.name}",
                    str(folder),
                ]
            )
        ids = (_ns_id(proc.pid, kind) for kind in ("net", "mnt", "uts"))
        node.namespaces = {i for i in ids if i is not None}

    def _own_tmp(self, node: SlurmNode) -> str:
        """Shell that gives the node's mount namespace a /tmp of its own: a tmpfs made in the
        lab's folder, the shared folders under /tmp bound into it at their paths, then it over /tmp."""
        stage = self.root / "node_tmp" / node.name
        stage.mkdir()
        lines = [f"mount -t tmpfs -o size=1g,mode=1777 {self.prefix}-{node.name}-tmp {stage};"]
        under_tmp = {p for p in self.shared if p.is_relative_to("/tmp")}
        for folder in sorted(
            p for p in under_tmp if not any(p != q and p.is_relative_to(q) for q in under_tmp)
        ):
            there, inside = shlex.quote(str(folder)), shlex.quote(str(stage / folder.relative_to("/tmp")))
            lines.append(f"mkdir -p {inside}; mount --bind {there} {inside};")
        lines.append(f"mount --rbind {stage} /tmp;")
        return " ".join(lines)

    def _wait_exec(self, proc: subprocess.Popen[bytes], exe: str, what: str) -> None:
        """Wait until our pid is the daemon itself (the wrappers have exec'd into it)."""

        def there() -> bool:
            with contextlib.suppress(OSError):
                return os.path.realpath(f"/proc/{proc.pid}/exe") == os.path.realpath(exe)
            return False

        if (
            not wait_until(lambda: proc.poll() is not None or there(), 10, interval_s=0.05)
            or proc.poll() is not None
        ):
            name = "slurmctld" if what == "slurmctld" else f"slurmd-{what.split()[-1]}"
            raise RuntimeError(f"{what} did not start: {self._tail(f'log/{name}.stderr')}")

    def _ctld_answers(self) -> bool:
        # a Slurm message, not a bare TCP connect (which slurmctld logs as an error)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.run(["scontrol", "ping"], timeout_s=5).stdout.strip().endswith("UP")
        return False

    def _tail(self, rel: str, chars: int = 800) -> str:
        try:
            return (self.root / rel).read_text(errors="replace")[-chars:]
        except OSError:
            return f"(no {rel})"

    # --- used by tests ---
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, cmd: list[str], timeout_s: float = 30, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """A client command (srun, sbatch, squeue, scancel, sinfo...) on the login node: this
        machine's own namespaces, reaching slurmctld over the bridge."""
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=self.env(), check=False
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout_s=10)
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def wait_ready(self, timeout_s: float = 30) -> None:
        """Until every node is idle in sinfo."""
        names = {n.name for n in self.nodes}
        states: dict[str, str] = {}

        def ready() -> bool:
            nonlocal states
            states = self.node_states()
            return set(states) >= names and all(states[n] == "idle" for n in names)

        if not wait_until(ready, timeout_s, interval_s=0.2):
            raise RuntimeError(
                f"nodes not idle after {timeout_s} s: {states}; {self._tail('log/slurmctld.log')}"
            )

    def node(self, name: str) -> SlurmNode:
        return next(n for n in self.nodes if n.name == name)

    def on_node(self, name: str, path: str) -> str:
        """`path` as the node sees it (its own /tmp), from this machine: through its slurmd's root."""
        return f"/proc/{self.node(name).pid}/root{path}"

    def node_pids(self, name: str) -> list[int]:
        """Every process in one of the node's namespaces (its slurmd included)."""
        mine = self.node(name).namespaces
        found = []
        for entry in os.listdir("/proc") if mine else []:
            if entry.isdigit() and any(_ns_id(int(entry), k) in mine for k in ("net", "mnt", "uts")):
                found.append(int(entry))
        return found

    def cut(self, name: str) -> None:
        """Cut a node off the network (its link goes down; its processes keep running)."""
        _run(["ip", "-n", self.node(name).netns, "link", "set", "eth0", "down"])

    def restore(self, name: str) -> None:
        """Bring a node's link back. Slurm notices by itself only when slurmctld next pings its
        DOWN nodes (measured: ~90 s after the link came back); `rejoin` does not wait for that."""
        _run(["ip", "-n", self.node(name).netns, "link", "set", "eth0", "up"])

    def rejoin(self, name: str, timeout_s: float = 15) -> None:
        """After `restore`, return a node to service as an admin would, and wait until it is idle:
        its slurmd told to register again (SIGHUP: it reconfigures and registers) rather than
        waiting for slurmctld's next ping of a node it thinks gone; a node still COMPLETING a job
        whose end it was cut off from set DOWN (what ends it there), and a DOWN one resumed
        (`scontrol update State=RESUME`). Measured: 0.2 s, where waiting for Slurm took 45-55 s."""
        os.kill(self.node(name).pid, signal.SIGHUP)
        states: dict[str, str] = {}

        def idle() -> bool:
            nonlocal states
            states = self.node_states()
            if states.get(name, "").startswith("comp"):  # still ending a job it was cut off from
                update = [f"NodeName={name}", "State=DOWN", "Reason=rejoined after a cut"]
                self.run(["scontrol", "update", *update], timeout_s=10)
                states[name] = "down"
            if states.get(name, "").startswith("down"):
                self.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"], timeout_s=10)
            return states.get(name) == "idle"

        if not wait_until(idle, timeout_s, interval_s=0.2):
            raise RuntimeError(f"{name} not idle {timeout_s} s after rejoin: {states.get(name)}")

    def pause_controller(self) -> None:
        """slurmctld stops answering (SIGSTOP): every client command waits on it."""
        self._procs["slurmctld"].send_signal(signal.SIGSTOP)

    def resume_controller(self) -> None:
        self._procs["slurmctld"].send_signal(signal.SIGCONT)

    def jobs(self) -> list[str]:
        """`squeue` of every job (id, name, state) on the lab's cluster."""
        out = self.run(["squeue", "-h", "-o", "%i %j %T"], timeout_s=10).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def steps(self) -> list[str]:
        """`squeue -s`: every step (id, name) on the lab's cluster."""
        out = self.run(["squeue", "-h", "-s", "-o", "%i %j"], timeout_s=10).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def leftovers(self) -> list[str]:
        """What of this lab still exists on the machine (empty after close)."""
        found = [f"{name} (pid {p.pid})" for name, p in self._procs.items() if p.poll() is None]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
        found += [f"netns {ln.split()[0]}" for ln in listed.splitlines() if ln.startswith(self.prefix)]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        found += [f"link {ln.split(':')[1].strip()}" for ln in links.splitlines() if f" {self.prefix}-" in ln]
        if self.root.exists():
            found.append(f"folder {self.root}")
        return found

    def close(self) -> None:
        if self._closed:  # once only: a freed namespace's inode may be given to another one later
            return
        self._closed = True
        # slurmds first (the controller would mark them down meanwhile: harmless), then the rest
        order = sorted(self._procs, key=lambda n: (not n.startswith("slurmd"), n == "munged"))
        for name in order:
            _stop(self._procs[name])
        for node in self.nodes:  # slurmstepd and job tasks outlive slurmd
            for pid in self.node_pids(node.name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(self.node_pids(n.name) for n in self.nodes), 5, interval_s=0.05)
        # a namespace's links go when the kernel frees it, a moment after `ip netns del`: delete
        # each veth pair now (either end takes the other), so none is left when close returns
        for i, ns in enumerate(self._netns_made):
            subprocess.run(["ip", "link", "del", f"{self.prefix}-v{i}"], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        if self._bridge_made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 5) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=False).stdout
    return random.choice([n for n in range(1, 250) if f"10.88.{n}." not in used])


def _free_ports(count: int) -> list[int]:
    """Ports free on this machine now. The daemons listen in the lab's own namespaces, where no
    one else does; unique ports still keep two labs' slurm.conf files from ever pointing at each
    other's daemons."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(17000, 19999)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _which(tool: str) -> str | None:
    """A tool on PATH, or in /usr/sbin where Debian puts the daemons (not on every root's PATH)."""
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
