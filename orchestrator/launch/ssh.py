"""Launch layer: tasks on lab hosts over SSH (Fabric/paramiko).

Before any task starts, every host is connected and checked in parallel (`prepare`); one host that
fails stops the launch with nothing started anywhere. Each task then runs under `worker/shim.py`
on its host, one SSH channel per attempt: the shim starts the task in its own session (process
group), streams its log back, passes on TERM/KILL, and stops the task when the channel closes for
any reason — the coordinator exiting, dying, or losing the connection. Nothing is ever killed by
name; the task's recorded process group is the only target.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import shlex
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator import preflight
from orchestrator.errors import LaunchError
from orchestrator.launch import ship
from orchestrator.launch.api import Launcher, ProcessInfo, TaskHandle
from orchestrator.launch.hosts import Host, close_all, connect, hosts_of, on_all, raise_if_failed, run_json
from orchestrator.launch.sync import FileEntry, job_files, runtime_entry, shim_entry, upload, worker_files
from orchestrator.launch.tunnel import open_reverse_tunnel
from orchestrator.plan import HostContext, LaunchPlan, StatePlan, TaskPlan, job_files_root, remote_run_folder
from orchestrator.record import now_iso
from orchestrator.spec.model import ClusterSpec, Role, SshSpec
from worker import wire

log = logging.getLogger("orchestrator.ssh")
_KILL_WAIT_S = 5.0  # after SIGKILL, how long a host may take to confirm the exit


class SshTaskHandle(TaskHandle):
    def __init__(self, task: TaskPlan, attempt: int, log_path: Path, host: Host, channel: paramiko.Channel):
        super().__init__(task, attempt, log_path)
        self.host = host
        self._channel = channel
        self._started = threading.Event()
        self._ended = threading.Event()  # exit reported, or the channel closed
        self._exit_code: int | None = None
        self._info: ProcessInfo | None = None
        self._messages: list[str] = []  # stderr text that is not an event (a failed start)
        self._threads = [
            threading.Thread(target=self._pump_output, daemon=True, name=f"{task.name}-out"),
            threading.Thread(target=self._pump_events, daemon=True, name=f"{task.name}-events"),
        ]
        for t in self._threads:
            t.start()

    @property
    def process(self) -> ProcessInfo:
        return self._info or ProcessInfo(pid=0, pgid=0, create_time=0.0)

    def poll(self) -> int | None:
        return self._exit_code

    @property
    def ended(self) -> bool:
        """The task's exit is known, or its channel is gone (nothing more can be learned)."""
        return self._ended.is_set()

    def wait_started(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._started.is_set() and not self._ended.is_set() and time.monotonic() < deadline:
            self._started.wait(0.05)
        if self._started.is_set():
            return
        said = "; ".join(self._messages[-3:]) or (
            "the channel closed" if self._ended.is_set() else f"no answer within {timeout_s:g} s"
        )
        self._channel.close()
        raise LaunchError(f"cannot start {self.task.name} on {self.host.label}: {said}")

    def send(self, command: str) -> None:
        # A channel already gone is fine: the shim stops the task by itself then.
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self._channel.sendall(f"{command}\n".encode())

    def close(self) -> None:
        self._channel.close()

    def _pump_output(self) -> None:
        with open(self.log_path, "ab") as out:
            while True:
                try:
                    data = self._channel.recv(65536)
                except (OSError, EOFError, paramiko.SSHException):
                    data = b""
                if not data:
                    return
                out.write(data)
                out.flush()

    def _pump_events(self) -> None:
        buffer = b""
        try:
            while True:
                data = self._channel.recv_stderr(65536)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._on_line(line.decode(errors="replace"))
        except (OSError, EOFError, paramiko.SSHException):
            pass
        if buffer:
            self._on_line(buffer.decode(errors="replace"))
        self._ended.set()

    def _on_line(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict) or "event" not in event:
            if line.strip():
                self._messages.append(line.strip())
            return
        if event["event"] == "started":
            self._info = ProcessInfo(event["pid"], event["pgid"], float(event["create_time"]))
            self._started.set()
        elif event["event"] == "exit":
            self._exit_code = int(event["code"])
            self._ended.set()
        elif event["event"] == "error":
            self._messages.append(str(event.get("message")))


class SshLauncher(Launcher):
    def __init__(self, spec: ClusterSpec, run_id: str, home: Path):
        self._spec = spec
        self._run_id = run_id
        self._home = home  # the run directory on this machine: results and the latest state come here
        # a copy between hosts gives up on a host silent this long (it was cut off meanwhile)
        self._io_timeout_s = max(10.0, 3 * spec.ssh.connect_timeout_s)
        self._hosts = hosts_of(spec)
        self._conns: dict[int, fabric.Connection] = {}
        self._contexts: dict[int, HostContext] = {}
        self._suspect: set[int] = set()  # hosts whose connection must be renewed before use
        self._heartbeat: tuple[str, int] | None = None
        self._direct_url: str | None = None
        self._locks = {h.index: threading.Lock() for h in self._hosts}  # one reconnect per host at a time
        self._relays: dict[int, _Relay] = {}  # per host: where its tasks post heartbeats
        self._shared_hosts: set[int] = set()  # hosts with several tasks: their heartbeats go via a relay
        self.reports: list[preflight.HostReport] = []
        self._files: list[FileEntry] = []
        self._follower: threading.Thread | None = None  # new checkpoints to the evaluators' hosts
        self._follow_stop = threading.Event()

    # --- before the first attempt ---

    def prepare(
        self, ports: Mapping[str, int], heartbeat: tuple[str, int], direct_url: str | None
    ) -> dict[int, HostContext]:
        """Connect to every host and check it (the fast part of `orchestrate check`); open the
        heartbeat tunnels. Raises LaunchError naming every host with a problem."""
        self._heartbeat, self._direct_url = heartbeat, direct_url
        self._files = worker_files() + job_files(job_files_root(self._spec))
        files = [f.sha256 for f in self._files]
        self.reports = preflight.inspect(self._spec, ports, peers=False, files=files)
        self._conns = {r.host.index: r.conn for r in self.reports if r.conn is not None}
        problems = preflight.problems(self.reports)
        for warning in preflight.warnings(self.reports):
            log.warning("%s", warning)
        if problems:
            raise LaunchError("preflight failed (see `orchestrate check`):\n  " + "\n  ".join(problems))
        for report in self.reports:
            assert report.facts is not None
            self._contexts[report.host.index] = HostContext(
                workdir=report.facts["workdir"], coordinator_url=self._coordinator_url(report.host.index)
            )
        return dict(self._contexts)

    def hosts_record(self) -> dict[str, Any]:
        ssh = self._spec.ssh
        return {
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
        }

    def deploy(self, plan: LaunchPlan) -> None:
        """Send every host the files its cache lacks (the job's folder and the worker runtime)."""
        reports = {r.host.index: r for r in self.reports}
        used = sorted({t.host_index for t in plan.tasks})
        per_host = [t.host_index for t in plan.tasks]
        self._shared_hosts = {i for i in used if per_host.count(i) > 1}

        def one(index: int) -> Any:
            missing = (reports[index].facts or {}).get("missing", [])
            return upload(
                self._conns[index], self._hosts[index], self._contexts[index].workdir, self._files, missing
            )

        results = on_all(used, one)
        raise_if_failed(results, "copying the job's files")
        for index, result in zip(used, results, strict=True):
            log.info(
                "%s: %d file(s) copied (%d bytes), %d unchanged",
                self._hosts[index].label,
                result.uploaded,
                result.uploaded_bytes,
                result.unchanged,
            )

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

    # --- state between hosts (they share no disk) ---

    def before_attempt(self, plan: LaunchPlan, attempt: int) -> list[str]:
        """Attempts after the first restore the owner's latest checkpoint: bring it home, then
        send home's copy to every reader's host whose folder differs (ship.py). An evaluator on
        another host than the owner then gets each new checkpoint while the attempt runs."""
        self._stop_following()
        state = plan.state
        if state is None or state.shared:
            return []
        notes = self._ship(plan, state) if attempt > 0 else []
        evaluators = [t for t in map(plan.task, state.readers) if t.role is Role.EVALUATOR]
        if self._targets(plan, evaluators):
            self._follow_stop = threading.Event()
            self._follower = threading.Thread(
                target=self._follow, args=(plan, evaluators, self._follow_stop), daemon=True, name="ship"
            )
            self._follower.start()
        return notes

    def _targets(self, plan: LaunchPlan, readers: list[TaskPlan]) -> list[tuple[int, str]]:
        """(host, folder) of the readers, but the owner's own."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        source = (owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR])
        return sorted({(t.host_index, t.env[wire.ENV_CHECKPOINT_DIR]) for t in readers} - {source})

    def _ship(self, plan: LaunchPlan, state: StatePlan) -> list[str]:
        owner = plan.task(state.owner)
        host = self._hosts[owner.host_index]
        home = self._home / "checkpoints"
        try:
            got = ship.pull(
                self._connection(owner.host_index),
                host,
                owner.env[wire.ENV_CHECKPOINT_DIR],
                home,
                timeout_s=self._io_timeout_s,
            )
        except LaunchError:
            self._suspect.add(owner.host_index)  # its connection is renewed before the next use
            raise
        notes = [f"checkpoints of {owner.name} ({host.label}) → {home}: {got.describe()}"]
        targets = self._targets(plan, list(map(plan.task, state.readers)))
        if not got.exists and any(home.iterdir() if home.is_dir() else ()):
            # the owner's folder is gone (a --resume after its host was cleaned): home's copy is
            # the latest state there is, so the owner gets it back too
            targets.append((owner.host_index, owner.env[wire.ENV_CHECKPOINT_DIR]))
            notes[0] = f"{owner.name} ({host.label}) has no checkpoint folder; using the copy in {home}"

        ours = ship.local_tree(home)  # once for every host it goes to

        def one(target: tuple[int, str]) -> ship.Transfer:
            index, folder = target
            try:
                return self._push_home(index, folder, ours)
            except LaunchError:
                self._suspect.add(index)
                raise

        results = on_all(targets, one)
        raise_if_failed(results, "copying the checkpoint to the hosts")
        for (index, folder), sent in zip(targets, results, strict=True):
            notes.append(f"→ {self._hosts[index].label} {folder}: {sent.describe()}")
        return notes

    def _push_home(self, index: int, folder: str, ours: dict[str, Any]) -> ship.Transfer:
        """Make `folder` on host `index` a copy of the run directory's checkpoints/ (listed in `ours`)."""
        return ship.push(
            self._connection(index),
            self._hosts[index],
            self._home / "checkpoints",
            folder,
            timeout_s=self._io_timeout_s,
            ours=ours,
        )

    def _follow(self, plan: LaunchPlan, evaluators: list[TaskPlan], stop: threading.Event) -> None:
        """While the attempt runs: each new checkpoint of the owner, home and on to the evaluators'
        hosts. A round that fails (a file changed while copied, a host away) is tried again."""
        assert plan.state is not None
        owner = plan.task(plan.state.owner)
        home = self._home / "checkpoints"
        every_s = max(2.0, self._spec.health.heartbeat_interval_s)
        while not stop.wait(every_s):
            try:
                got = ship.pull(
                    self._connection(owner.host_index),
                    self._hosts[owner.host_index],
                    owner.env[wire.ENV_CHECKPOINT_DIR],
                    home,
                    timeout_s=self._io_timeout_s,
                )
                if not got.exists:
                    continue
                ours = ship.local_tree(home)
                for index, folder in self._targets(plan, evaluators):
                    if stop.is_set():
                        return
                    sent = self._push_home(index, folder, ours)
                    if sent.files:
                        log.debug("%s %s: %s", self._hosts[index].label, folder, sent.describe())
            except LaunchError as exc:
                log.debug("checkpoints to the evaluators, tried again in %g s: %s", every_s, exc)

    def _stop_following(self) -> None:
        if self._follower is not None:
            self._follow_stop.set()
            self._follower.join(timeout=4 * self._io_timeout_s)
            self._follower = None

    def bring_home(self, plan: LaunchPlan) -> list[str]:
        """The owner's model/, tensorboard/ and latest checkpoint, the evaluators' tensorboard/,
        into the run directory. A host that cannot be reached is said, not raised."""
        self._stop_following()
        if plan.state is None:
            return []
        owner = plan.task(plan.state.owner)
        wanted: list[tuple[TaskPlan, str, Path, bool]] = []
        if not plan.state.shared:
            wanted.append((owner, owner.env[wire.ENV_CHECKPOINT_DIR], self._home / "checkpoints", True))
        for task in plan.tasks:
            folder = task.env[wire.ENV_RUN_DIR]
            if task.name == owner.name:
                wanted.append((task, posixpath.join(folder, "model"), self._home / "model", False))
            board = posixpath.join(folder, "tensorboard")
            seen = any(w[0].host_index == task.host_index and w[1] == board for w in wanted)
            if (task.name == owner.name or task.role is Role.EVALUATOR) and not seen:
                wanted.append((task, board, self._home / "tensorboard", False))

        def host_pulls(index: int) -> list[str]:
            # one host's pulls one after another (they share its connection); hosts in parallel
            lines = []
            host = self._hosts[index]
            for task, remote, local, mirror in (w for w in wanted if w[0].host_index == index):
                try:
                    got = ship.pull(
                        self._connection(index),
                        host,
                        remote,
                        local,
                        mirror=mirror,
                        timeout_s=self._io_timeout_s,
                    )
                except LaunchError as exc:
                    lines.append(f"could not bring {remote} home from {task.name}: {exc}")
                    continue
                if got.files:
                    lines.append(f"{local.name}/ from {task.name} ({host.label}): {got.describe()}")
            return lines

        hosts = sorted({w[0].host_index for w in wanted})
        out: list[str] = []
        for index, result in zip(hosts, on_all(hosts, host_pulls), strict=True):
            out += [f"{self._hosts[index].label}: {result}"] if isinstance(result, BaseException) else result
        return out

    # --- per attempt ---

    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        try:
            handle = self._open(task, attempt, token, log_path)
            handle.wait_started(self._spec.ssh.connect_timeout_s + 10.0)
        except (OSError, EOFError, paramiko.SSHException) as exc:  # the connection failed under us
            self._suspect.add(task.host_index)
            raise LaunchError(f"cannot start {task.name}: {type(exc).__name__}: {exc}") from None
        return handle

    def start_all(self, tasks: list[TaskPlan], attempt: int, token: str, log_paths: list[Path]) -> list[Any]:
        def one(i: int) -> Any:
            return self.start(tasks[i], attempt, token, log_paths[i])

        results = on_all(list(range(len(tasks))), one)
        # start() turns every connection failure into a LaunchError; anything else is a bug of ours.
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, LaunchError):
                raise r
        return results

    def _open(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> SshTaskHandle:
        host = self._hosts[task.host_index]
        conn = self._connection(task.host_index)
        ctx = self._contexts[task.host_index]
        folder = remote_run_folder(ctx, self._run_id)
        env = task.launch_env(attempt=attempt, token=token)
        env[wire.ENV_COORDINATOR] = self._relay_url(task.host_index, token)
        cache = posixpath.join(ctx.workdir, "cache")
        job = {
            "cache": cache,
            "folder": folder,
            "files": [[f.rel, f.sha256, f.mode] for f in self._files],
            "argv": list(task.argv),
            "env": env,
            "cwd": task.cwd,
            "log": posixpath.join(folder, "logs", task.log_name),
            "pidfile": posixpath.join(folder, "tasks", f"{task.name}.json"),
            "run_id": self._run_id,
            "task": task.name,
            "attempt": attempt,
            "grace_s": self._spec.health.stop_grace_s,
        }
        with open(log_path, "ab") as out:
            marker = (
                f"===== orchestrate: {task.name} attempt {attempt} started {now_iso()} on {host.label} ====="
            )
            out.write(f"{marker}\n".encode())
        shim = posixpath.join(cache, shim_entry(self._files).sha256)  # it fills the run's folder itself
        # -S: the shim needs only the standard library; skipping site-packages starts it ~2x faster
        command = "exec " + shlex.join([*host.python, "-S", shim])
        transport = conn.transport
        assert transport is not None
        try:
            channel = transport.open_session(timeout=self._spec.ssh.connect_timeout_s)
            channel.exec_command(command)
            channel.sendall((json.dumps(job) + "\n").encode())
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._suspect.add(task.host_index)
            raise LaunchError(
                f"cannot start {task.name} on {host.label}: {exc or type(exc).__name__}"
            ) from None
        return SshTaskHandle(task, attempt, log_path, host, channel)

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
            conn = connect(self._hosts[index], self._spec.ssh)
            self._conns[index] = conn
            self._suspect.discard(index)
            ctx = self._contexts[index]
            self._contexts[index] = HostContext(ctx.workdir, self._coordinator_url(index))
            old = self._relays.pop(index, None)  # it went with the old connection
            if old is not None:
                old.close()
            return conn

    def _relay_url(self, index: int, token: str) -> str:
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
            script = posixpath.join(ctx.workdir, "cache", runtime_entry(self._files, "relay.py").sha256)
            health = self._spec.health
            config = {
                "upstream": ctx.coordinator_url,
                "token": token,
                "interval_s": health.heartbeat_interval_s,
                "give_up_s": health.heartbeat_timeout_s,  # as its tasks (ORCHESTRATE_COORDINATOR_TIMEOUT_S)
            }
            relay = _Relay.start(
                conn, self._hosts[index], script, config, self._spec.ssh.connect_timeout_s + 10
            )
            self._relays[index] = relay
            return relay.url

    def stop(self, handles: list[TaskHandle], grace_s: float, hurry: threading.Event | None = None) -> None:
        mine = [h for h in handles if isinstance(h, SshTaskHandle)]
        live = [h for h in mine if not h.ended]
        for h in live:
            h.send("TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
            if all(h.ended for h in live):
                break
            time.sleep(0.05)
        late = [h for h in live if not h.ended]
        for h in late:
            h.send("KILL")
        deadline = time.monotonic() + _KILL_WAIT_S
        while time.monotonic() < deadline and not all(h.ended for h in late):
            time.sleep(0.05)
        for h in mine:
            h.close()
        unconfirmed = [h for h in mine if h.poll() is None]
        for h in unconfirmed:
            self._suspect.add(h.task.host_index)
        if unconfirmed:
            names = ", ".join(f"{h.task.name} on {h.host.label}" for h in unconfirmed)
            raise LaunchError(
                f"{names}: exit not confirmed (connection lost); such a task stops by itself once its "
                "SSH connection or the coordinator is gone, and a new attempt there stops any leftover first"
            )

    def close(self) -> None:
        self._stop_following()
        for relay in self._relays.values():
            relay.close()
        self._relays = {}
        close_all(self._conns)
        self._conns = {}


class _Relay:
    """One host's heartbeat relay (worker/relay.py), run over an SSH channel of its own: it ends
    when the channel does (the run is over, the coordinator died, the connection was lost)."""

    def __init__(self, channel: paramiko.Channel, port: int, label: str):
        self.channel = channel
        self.url = f"http://127.0.0.1:{port}"
        self.closing = False
        threading.Thread(target=self._watch, args=(label,), daemon=True, name=f"relay-{label}").start()

    def close(self) -> None:
        self.closing = True
        self.channel.close()

    def _watch(self, label: str) -> None:
        code = self.channel.recv_exit_status()  # -1 when the channel closed without one
        if self.closing:
            return
        said = ""
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            if self.channel.recv_stderr_ready():
                said = ": " + self.channel.recv_stderr(4096).decode(errors="replace").strip()
        log.warning(
            "%s: the heartbeat relay ended (exit %s)%s; a new one starts with the host's next task",
            label,
            code,
            said,
        )

    @property
    def alive(self) -> bool:
        return not self.channel.closed and not self.channel.exit_status_ready()

    @classmethod
    def start(
        cls, conn: fabric.Connection, host: Host, script: str, config: dict[str, Any], timeout_s: float
    ) -> _Relay:
        transport = conn.transport
        assert transport is not None
        try:
            channel = transport.open_session(timeout=timeout_s)
            channel.exec_command("exec " + shlex.join([*host.python, "-S", script]))
            channel.sendall((json.dumps(config) + "\n").encode())
            channel.settimeout(timeout_s)
            line = b""
            while not line.endswith(b"\n"):
                data = channel.recv(4096)
                if not data:
                    break
                line += data
            channel.settimeout(None)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise LaunchError(
                f"{host.label}: cannot start the heartbeat relay: {exc or type(exc).__name__}"
            ) from None
        try:
            port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            said = (
                channel.recv_stderr(4096).decode(errors="replace").strip()
                if channel.recv_stderr_ready()
                else ""
            )
            channel.close()
            said = said or line.decode(errors="replace").strip() or "no answer"
            raise LaunchError(f"{host.label}: the heartbeat relay did not start: {said}") from None
        return cls(channel, port, host.label)


def stop_leftovers(record: dict[str, Any], tasks: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """`orchestrate down` when the coordinator is gone: stop, on every host, the recorded process
    groups of this run's tasks (plan.json's) that still carry its run id. Per host: a line, and
    whether the host could be asked."""
    ssh = SshSpec(**record["ssh"])
    run_id = record["run_id"]
    hosts = []
    workdirs = {h["index"]: h["workdir"] for h in record["hosts"]}
    for h in record["hosts"]:
        if h.get("workdir") is None:
            continue
        host = Host(
            index=h["index"],
            address=h["address"],
            ssh_port=h["port"],
            user=h["user"],
            identity_file=Path(h["identity_file"]) if h["identity_file"] else None,
            python=tuple(shlex.split(h["python"])),
        )
        folder = posixpath.join(h["workdir"], "runs", run_id, "tasks")
        names = [t["name"] for t in tasks if t.get("host_index") == h["index"]]
        hosts.append((host, [posixpath.join(folder, f"{n}.json") for n in names]))

    def one(item: tuple[Host, list[str]]) -> str:
        host, pidfiles = item
        if not pidfiles:
            return f"{host.label}: no task"
        conn = connect(host, ssh)
        shim = posixpath.join(workdirs[host.index], "cache", record["shim_sha256"])
        try:
            answer = run_json(conn, host, [*host.python, "-S", shim, "--stop", run_id, *pidfiles], "stop")
        finally:
            close_all({host.index: conn})
        return f"{host.label}: " + "; ".join(f"{posixpath.basename(k)[:-5]} {v}" for k, v in answer.items())

    results = on_all(hosts, one)
    return [(str(r), not isinstance(r, BaseException)) for r in results]
