"""Launch layer, slurm backend: its tasks as job steps, and their warm standbys as steps that
wait (launch/standby.py). A part of the SlurmBackend class (backend.py), kept in a module of its
own: every step runs worker/host/shim.py on its node, given its job on its stdin.
"""

from __future__ import annotations

import json
import posixpath
import threading
from pathlib import Path
from typing import Any

from orchestrator.launch import standby
from orchestrator.launch.api import TaskHandle
from orchestrator.launch.shim import shim_job
from orchestrator.launch.shim_standbys import ShimStandbys, ToldByShims, standby_job
from orchestrator.launch.slurm.allocation import Allocation
from orchestrator.launch.slurm.cluster import Slurm, job_name
from orchestrator.launch.slurm.files import NodeFiles
from orchestrator.launch.slurm.spec import SlurmSpec
from orchestrator.launch.slurm.step import SlurmTaskHandle, port_lock, start_step
from orchestrator.plan.launch_plan import LaunchPlan, TaskPlan
from orchestrator.record.write import now_iso, private_open
from orchestrator.spec.model import ClusterSpec
from worker.host import SHIM


class SlurmTasks(ToldByShims):
    """The slurm backend's steps (mixed into SlurmBackend, which sets what is declared here)."""

    _spec: ClusterSpec
    _conf: SlurmSpec
    _run_id: str
    _run_dir: Path
    _slurm: Slurm
    _python: tuple[str, ...]
    _folder: Path
    _alloc: Allocation | None
    _node_of: dict[str, str]
    _handles: dict[str, SlurmTaskHandle]
    _lock: threading.Lock
    _shipping: bool
    _files: NodeFiles
    _standbys: ShimStandbys
    _logs: Path

    def start(self, task: TaskPlan, attempt: int, token: str, log_path: Path) -> TaskHandle:
        job = self._step_job(task, attempt, token, log_path)
        go = {k: job[k] for k in ("attempt", "log", "pidfile", "error_file", "stacks_file", "port_lock")}
        args = standby.command(task.argv)
        go["handover"] = json.loads(standby.handover(args[1] if args else (), job["env"], job["log"]))
        warm, _ = self._standbys.take(task, job["env"], self._node_of[task.name], go, log_path)
        handle = warm if isinstance(warm, SlurmTaskHandle) else self._open_step(task, job, log_path)
        with self._lock:
            self._handles[task.name] = handle
        handle.wait_started(self._conf.connect_timeout_s + 20)
        return handle

    def prepare_standbys(self, plan: LaunchPlan) -> list[str]:
        if self._alloc is None:
            return []

        def open_one(task: TaskPlan) -> tuple[SlurmTaskHandle, dict[str, str], str]:
            node = self._node_of[task.name]
            job = self._step_job(task, 0, "", self._logs / task.log_name, marker=False)
            job["argv"] = list((standby.command(task.argv) or ((), ()))[0])
            job["env"] = standby.stable_env(job["env"])
            folder = self._files.folder if self._shipping else str(self._run_dir)
            log_path = posixpath.join(folder, "logs", "standby", f"{task.name}.log")
            count = sum(1 for t in plan.tasks if self._node_of.get(t.name) == node)
            module = str(SHIM.parent / "shim_standby.py")
            job["standby"] = standby_job(self._spec, count, module, log_path)
            return self._open_step(task, job, self._logs / task.log_name), job["env"], node

        return self._standbys.prepare(plan.tasks, open_one)

    def _step_job(
        self, task: TaskPlan, attempt: int, token: str, log_path: Path, marker: bool = True
    ) -> dict[str, Any]:
        node = self._node_of[task.name]
        pidfile = self._folder / "nodes" / node / f"{task.name}.json"
        log_on_node = ""
        if self._shipping:
            pidfile = Path(posixpath.join(self._files.folder, "tasks", f"{task.name}.json"))
            log_on_node = posixpath.join(self._files.folder, "logs", task.log_name)
            if marker:
                with private_open(log_path) as out:
                    said = f"{task.name} attempt {attempt} started {now_iso()} on {node}"
                    out.write(f"===== orchestrate: {said} =====\n".encode())
        return shim_job(
            task,
            attempt,
            task.launch_env(attempt=attempt, token=token),
            run_id=self._run_id,
            folder=str(self._run_dir),
            log=log_on_node if self._shipping else str(log_path.resolve()),
            pidfile=str(pidfile),
            grace_s=self._spec.health.stop_grace_s,
            port_lock=port_lock(node, str(task.port)),  # held while the task lives
            follow=self._shipping,  # shared: the coordinator reads the log file in place
            forward_signals=False,  # Slurm signals the task itself
            stacks_module=str(SHIM.parent / "stacks.py"),  # the shim's own folder: every node sees it
        )

    def _open_step(self, task: TaskPlan, job: dict[str, Any], log_path: Path) -> SlurmTaskHandle:
        assert self._alloc is not None
        node = self._node_of[task.name]
        name = f"{job_name(self._run_id)}-{task.name}"
        step = start_step(
            self._slurm, self._alloc.job_id, node, name, self._python, job, stream=self._shipping
        )
        return SlurmTaskHandle(task, job["attempt"], log_path, step)
