"""Launch layer: tasks on lab hosts over SSH (Fabric/paramiko).

Before any task starts, every host is connected and checked in parallel (`prepare`); one host that
fails stops the launch with nothing started anywhere. Each task then runs under `worker/host/shim.py`
on its host, one SSH channel per attempt: the shim starts the task in its own session (process
group), streams its log back, passes on TERM/KILL, and stops the task when the channel closes for
any reason — the coordinator exiting, dying, or losing the connection. Nothing is ever killed by
name; the task's recorded process group is the only target.
"""

from __future__ import annotations

import logging
import posixpath
import shlex
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator.environment.prepare import HostEnvironment
from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.health.credentials import Credentials
from orchestrator.launch.api import (
    Backend,
    Heartbeats,
    Prepared,
)
from orchestrator.launch.exchange import StateExchange
from orchestrator.launch.shim_standbys import ShimStandbys
from orchestrator.launch.ssh import preflight
from orchestrator.launch.ssh.environment import ssh_environments
from orchestrator.launch.ssh.hosts import close_all, connect, hosts_of
from orchestrator.launch.ssh.machines import SshMachines
from orchestrator.launch.ssh.placement import ssh_placements, ssh_ports
from orchestrator.launch.ssh.relay import Relay
from orchestrator.launch.ssh.spec import section as ssh_section
from orchestrator.launch.ssh.state import SshFolders
from orchestrator.launch.ssh.sync import FileEntry, job_files, runtime_entry, shim_entry, upload, worker_files
from orchestrator.launch.ssh.tasks import HostContext, SshTasks
from orchestrator.launch.ssh.tunnel import open_reverse_tunnel
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.plan.placement import Machine, Placement, Relaid, job_files_root
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots

log = logging.getLogger("orchestrator.ssh")


class SshBackend(SshTasks, Backend):
    name = "ssh"
    listen_key = "ssh.coordinator_address"
    starts_at_once = True

    def __init__(self, spec: ClusterSpec, run_id: str, home: Path):
        self._spec = spec
        self._ssh = ssh_section(spec)
        self._run_id = run_id
        self._hosts = hosts_of(spec)
        self._conns: dict[int, fabric.Connection] = {}
        self._contexts: dict[int, HostContext] = {}
        self._suspect: set[int] = set()  # hosts whose connection must be renewed before use
        self._heartbeat: tuple[str, int] | None = None
        self._credentials = Credentials()  # the coordinator's, from open()
        self._direct_url: str | None = None
        self._locks = {h.index: threading.Lock() for h in self._hosts}  # one reconnect per host at a time
        self._relays: dict[int, Relay] = {}  # per host: where its tasks post heartbeats
        per_host = [s.host_index for s in task_slots(spec)]
        # hosts with several tasks: their heartbeats go through a relay
        self._shared_hosts = {i for i in set(per_host) if per_host.count(i) > 1}
        self._files: list[FileEntry] = []
        self._environment: list[HostEnvironment] = []  # each host's (`environment:`)
        self._pythons: dict[int, str] = {}  # its interpreter, per host index
        # a copy between hosts gives up on a host silent this long (it was cut off meanwhile)
        io_timeout_s = max(10.0, 3 * ssh_section(spec).connect_timeout_s)
        folders = SshFolders(self._hosts, self._connection, self._suspect.add, io_timeout_s=io_timeout_s)
        # the owner's checkpoints are looked at every half second (an SFTP listing: no process
        # started there) and come home when they changed: a lost owner loses little (issue 27)
        self._states = StateExchange(folders, home, every_s=0.5, stop_wait_s=4 * io_timeout_s)
        self._standbys = ShimStandbys(spec)
        self._logs = home / "logs"
        self._machines = SshMachines(
            spec,
            self._hosts,
            self._connection,
            timeout_s=self._ssh.connect_timeout_s,
            every_s=max(5.0, self._ssh.connect_timeout_s),
        )

    def listen(self) -> tuple[str, int]:
        """Loopback (the hosts' tasks reach it through SSH tunnels), or ssh.coordinator_address."""
        direct = self._ssh.coordinator_address
        if direct is None:
            return "127.0.0.1", 0
        host, _, port = direct.partition(":")
        return host, int(port or 0)

    def open(self, heartbeats: Heartbeats) -> dict[str, Placement]:
        """Connect to every host and check it (the fast part of `orchestrate check`), open the
        heartbeat tunnels, send every host the files its cache lacks. Raises LaunchError naming
        every host with a problem."""
        self._heartbeat = (heartbeats.host, heartbeats.port)
        self._credentials = heartbeats.credentials
        self._direct_url = heartbeats.url if self._ssh.coordinator_address else None
        self._files = worker_files() + job_files(job_files_root(self._spec))
        files = [f.sha256 for f in self._files]
        reports = preflight.inspect(self._spec, ssh_ports(self._spec), peers=False, files=files)
        self._conns = {r.host.index: r.conn for r in reports if r.conn is not None}
        problems = preflight.problems(reports)
        for warning in preflight.warnings(reports):
            log.warning("%s", warning)
        if problems:
            raise LaunchError("preflight failed (see `orchestrate check`):\n  " + "\n  ".join(problems))
        for report in reports:
            assert report.facts is not None
            self._contexts[report.host.index] = HostContext(
                workdir=report.facts["workdir"], coordinator_url=self._coordinator_url(report.host.index)
            )
        self._upload({r.host.index: (r.facts or {}).get("missing", []) for r in reports})
        if self._spec.environment is not None:  # every host's (spares too): its Python runs the tasks
            workdirs = {i: c.workdir for i, c in self._contexts.items()}
            self._environment, self._pythons = ssh_environments(
                self._spec.environment, self._conns, self._hosts, workdirs, heartbeats.notify
            )
        self._machines.opened({i: c.workdir for i, c in self._contexts.items()})
        return self._placements(self._spec)

    def _placements(self, spec: ClusterSpec) -> dict[str, Placement]:
        return ssh_placements(
            spec,
            self._run_id,
            {i: c.workdir for i, c in self._contexts.items()},
            {i: c.coordinator_url for i, c in self._contexts.items()},
            self._pythons,
        )

    def machines(self, plan: LaunchPlan, suspects: Mapping[str, tuple[str, str | None]]) -> list[Machine]:
        return self._machines.machines(plan, suspects)

    def relayout(self, machines: Mapping[int, str | None]) -> Relaid:
        """A lost host's tasks on a spare (its files were sent when the run opened), or left out."""
        runs = {p: None if key is None else int(key) for p, key in machines.items()}
        laid = self._spec.laid_out(runs)
        self._machines.spec = laid
        per_host = [s.host_index for s in task_slots(laid)]
        self._shared_hosts = {i for i in set(per_host) if per_host.count(i) > 1}
        return Relaid(runs, self._placements(laid))

    def record(self) -> dict[str, Any]:
        ssh = self._ssh
        return {
            "backend": self.name,
            "run_id": self._run_id,
            "ssh": {
                "known_hosts": str(ssh.known_hosts),
                "host_key_policy": ssh.host_key_policy.value,
                "connect_timeout_s": ssh.connect_timeout_s,
            },
            "hosts": [
                {
                    "index": h.index,
                    "address": h.address,
                    "port": h.ssh_port,
                    "user": h.user,
                    "identity_file": str(h.identity_file) if h.identity_file else None,
                    "python": shlex.join(h.python),
                    "workdir": self._contexts[h.index].workdir if h.index in self._contexts else None,
                }
                for h in self._hosts
            ],
            "shim_sha256": shim_entry(self._files).sha256,  # the copy in each host's cache
            "tasks": [s.name for s in task_slots(self._spec)],  # every name a task of the run may have
            "environment": [h.as_data() for h in self._environment] or None,
        }

    def _upload(self, missing: dict[int, list[str]]) -> None:
        """Send every host the files its cache lacks (the job's folder, the runtime): the spares
        too, so that a lost host's tasks start there at once."""
        used = sorted(missing)

        def one(index: int) -> Any:
            return upload(
                self._conns[index],
                self._hosts[index],
                self._contexts[index].workdir,
                self._files,
                missing[index],
            )

        results = on_all(used, one).raise_if_failed("copying the job's files")
        for index, result in zip(used, results, strict=True):
            log.info(
                "%s: %d file(s) copied (%d bytes), %d unchanged",
                self._hosts[index].label,
                result.uploaded,
                result.uploaded_bytes,
                result.unchanged,
            )

    def state_known(self, plan: LaunchPlan) -> None:
        self._states.bring_early(plan)

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> Prepared:
        return Prepared(notes=self._states.before_attempt(plan, attempt, lost=self._machines.lost()))

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        return self._states.bring_home(plan)

    def _coordinator_url(self, index: int) -> str:
        if self._direct_url is not None:
            return self._direct_url
        assert self._heartbeat is not None
        transport = self._conns[index].transport
        assert transport is not None
        try:
            port = open_reverse_tunnel(transport, self._heartbeat)
        except paramiko.SSHException as exc:
            raise LaunchError(
                f"{self._hosts[index].label}: sshd refused the heartbeat tunnel ({exc}); allow "
                "AllowTcpForwarding there, or set ssh.coordinator_address to an address of this "
                "machine the hosts can reach"
            ) from None
        return f"http://127.0.0.1:{port}"

    def _connection(self, index: int) -> fabric.Connection:
        """The host's connection, renewed (with its tunnel) when it was lost or is suspect."""
        with self._locks[index]:
            conn = self._conns.get(index)
            alive = conn is not None and conn.transport is not None and conn.transport.is_active()
            if alive and index not in self._suspect:
                assert conn is not None
                return conn
            if conn is not None:
                close_all({index: conn})
            log.info("%s: reconnecting", self._hosts[index].label)
            conn = connect(self._hosts[index], self._ssh)
            self._conns[index] = conn
            self._suspect.discard(index)
            ctx = self._contexts[index]
            self._contexts[index] = HostContext(ctx.workdir, self._coordinator_url(index))
            old = self._relays.pop(index, None)  # it went with the old connection
            if old is not None:
                old.close()
            return conn

    def _relay_url(self, index: int) -> str:
        """Where the host's tasks post heartbeats. A host with several tasks gets a relay (started
        with its first task, again if it ended) that forwards them as one request per interval;
        a host with one task has nothing to batch: it posts to the coordinator's route itself."""
        conn = self._connection(index)
        if index not in self._shared_hosts:
            return self._contexts[index].coordinator_url  # a renewed tunnel may have a new port
        with self._locks[index]:
            relay = self._relays.get(index)
            if relay is not None and relay.alive:
                return relay.url
            ctx = self._contexts[index]
            cache = posixpath.join(ctx.workdir, "cache")
            script = posixpath.join(cache, runtime_entry(self._files, "host/relay.py").sha256)
            health = self._spec.health
            config = {
                # the relay runs alone from the cache: its HTTP module is found there by checksum
                "http_module": posixpath.join(cache, runtime_entry(self._files, "wire/http1.py").sha256),
                "upstream": ctx.coordinator_url,
                "token": self._credentials.relay_token(index),
                "key": self._credentials.scope_key(index).hex(),  # to check its tasks' credentials
                "interval_s": health.heartbeat_interval_s,
                "give_up_s": health.heartbeat_timeout_s,  # as its tasks (ORCHESTRATE_COORDINATOR_TIMEOUT_S)
            }
            relay = Relay.start(conn, self._hosts[index], script, config, self._ssh.connect_timeout_s + 10)
            self._relays[index] = relay
            return relay.url

    def diagnose_startup(self, plan: LaunchPlan, late: Sequence[str]) -> str | None:
        """Can every host reach the other hosts' tasks on their TF ports? (preflight.diagnose)"""
        return preflight.diagnose(plan, self._hosts, self._connection)

    def close(self) -> None:
        self._machines.close()
        self._standbys.close()
        self._states.stop_following()
        for relay in self._relays.values():
            relay.close()
        self._relays = {}
        close_all(self._conns)
        self._conns = {}
