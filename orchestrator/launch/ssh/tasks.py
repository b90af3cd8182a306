"""Launch layer, ssh backend: its tasks, each under worker/host/shim.py on its host over one SSH
channel per attempt (the job, its environment and credential on the channel's stdin, never on a
command line), and their warm standbys (launch/standby.py). A part of the SshBackend class
(backend.py), kept in a module of its own, as the slurm backend's steps are (slurm/tasks.py)."""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.launch import standby
from orchestrator.launch.api import TaskHandle
from orchestrator.launch.shim import shim_job
from orchestrator.launch.shim_standbys import ShimStandbys, ToldByShims, standby_job
from orchestrator.launch.ssh.channel import SshChannel, SshTaskHandle
from orchestrator.launch.ssh.hosts import Host
from orchestrator.launch.ssh.spec import SshSpec
from orchestrator.launch.ssh.sync import FileEntry, runtime_entry, shim_entry
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan
from orchestrator.record.write import now_iso, private_open
from orchestrator.spec.model import ClusterSpec
from worker import wire


@dataclass(frozen=True)
class HostContext:
    workdir: str  # absolute on that host; runs live in WORKDIR/runs/<run id>
    coordinator_url: str  # where its tasks post heartbeats (a tunnel's port, or the direct address)


class SshTasks(ToldByShims):
    """The ssh backend's tasks (mixed into SshBackend, which sets what is declared here)."""

    _spec: ClusterSpec
    _ssh: SshSpec
    _run_id: str
    _hosts: list[Host]
    _contexts: dict[int, HostContext]
    _suspect: set[int]
    _files: list[FileEntry]
    _standbys: ShimStandbys
    _logs: Path
    _connection: Callable[[int], fabric.Connection]
    _relay_url: Callable[[int], str]

    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        host = self._hosts[task.host_index]
        try:
            job = self._job(task, attempt, token)
            with private_open(log_path) as out:
                marker = (
                    f"===== orchestrate: {task.name} attempt {attempt} started {now_iso()} on {host.label}"
                )
                out.write(f"{marker} =====\n".encode())
            go = {k: job[k] for k in ("attempt", "log", "pidfile", "error_file", "stacks_file")}
            args = standby.command(task.argv)
            go["handover"] = json.loads(standby.handover(args[1] if args else (), job["env"], job["log"]))
            handle, _ = self._standbys.take(task, job["env"], host.label, go, log_path)
            if handle is None:
                handle = self._open(task, job, log_path)
            handle.wait_started(self._ssh.connect_timeout_s + 10.0)
        except (OSError, EOFError, paramiko.SSHException) as exc:  # the connection failed under us
            self._suspect.add(task.host_index)
            raise LaunchError(f"cannot start {task.name}: {type(exc).__name__}: {exc}") from None
        return handle

    def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
        def open_one(task: TaskPlan) -> tuple[SshTaskHandle, dict[str, str], str]:
            job = self._job(task, 0, "")
            job["argv"] = list((standby.command(task.argv) or ((), ()))[0])
            job["env"] = standby.stable_env(job["env"])
            folder = job["folder"]
            log_path = posixpath.join(folder, "logs", "standby", f"{task.name}.log")
            count = sum(1 for t in plan.tasks if t.host_index == task.host_index)
            module = posixpath.join(job["cache"], runtime_entry(self._files, "host/shim_standby.py").sha256)
            job["standby"] = standby_job(self._spec, count, module, log_path)
            return (
                self._open(task, job, self._logs / task.log_name),
                job["env"],
                self._hosts[task.host_index].label,
            )

        return self._standbys.prepare(plan.tasks, open_one)

    def _job(self, task: TaskPlan, attempt: int, token: str) -> dict[str, Any]:
        ctx = self._contexts[task.host_index]
        folder = posixpath.join(ctx.workdir, "runs", self._run_id)
        env = task.launch_env(attempt=attempt, token=token)
        env[wire.ENV_COORDINATOR] = self._relay_url(task.host_index)
        return shim_job(
            task,
            attempt,
            env,
            run_id=self._run_id,
            folder=folder,
            log=posixpath.join(folder, "logs", task.log_name),
            pidfile=posixpath.join(folder, "tasks", f"{task.name}.json"),
            grace_s=self._spec.health.stop_grace_s,
            cache=posixpath.join(ctx.workdir, "cache"),
            files=[[f.rel, f.sha256, f.mode] for f in self._files],
            **{  # the runtime's modules the shim loads from the cache
                f"{name}_module": posixpath.join(
                    ctx.workdir, "cache", runtime_entry(self._files, f"host/{name}.py").sha256
                )
                for name in ("stacks", "follow")
            },
        )

    def _open(self, task: TaskPlan, job: dict[str, Any], log_path: Path) -> SshTaskHandle:
        host = self._hosts[task.host_index]
        conn = self._connection(task.host_index)
        cache = job["cache"]
        shim = posixpath.join(cache, shim_entry(self._files).sha256)  # it fills the run's folder itself
        # -S: the shim needs only the standard library; skipping site-packages starts it ~2x faster
        command = "exec " + shlex.join([*host.python, "-S", shim])
        transport = conn.transport
        assert transport is not None
        try:
            channel = transport.open_session(timeout=self._ssh.connect_timeout_s)
            channel.exec_command(command)
            channel.sendall((json.dumps(job) + "\n").encode())
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._suspect.add(task.host_index)
            raise LaunchError(
                f"cannot start {task.name} on {host.label}: {exc or type(exc).__name__}"
            ) from None
        return SshTaskHandle(task, job["attempt"], log_path, SshChannel(host, channel, self._suspect.add))
