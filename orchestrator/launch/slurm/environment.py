"""Launch layer, slurm backend: a node as the environment step reaches it (orchestrator/environment/).

worker/host/environment.py runs on the node as a job step of the run's allocation; the wheels its
cache lacks travel as one tar streamed through another step's stdin (worker/host/folders.py `unpack`
into `WORKDIR/cache`). Nodes that share the work folder (a cluster's shared file system) answer
the same folder id: the environment is built there once (prepare.py).
"""

from __future__ import annotations

import io
import posixpath
import shlex
import subprocess
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from orchestrator.environment.local import CommandSite
from orchestrator.environment.prepare import HostEnvironment, prepare
from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.cluster import Slurm, job_name, step_argv
from orchestrator.launch.slurm.files import NodeFiles
from orchestrator.spec.environment import EnvironmentSpec
from worker.host import FOLDERS_SOURCE

SEND_TIMEOUT_S = 1800.0


class SlurmSite(CommandSite):
    def __init__(self, slurm: Slurm, job_id: str, node: str, run_id: str, python: str, workdir: str):
        self._step = step_argv(job_id, node, f"{job_name(run_id)}-env")
        super().__init__(node, python, workdir, self._step, slurm.env)
        self._slurm, self._cache = slurm, posixpath.join(workdir, "cache")

    def send(self, files: Mapping[str, Path], missing: Sequence[str], progress: Callable[[int], None]) -> int:
        argv = [*self._step, *shlex.split(self.python), "-S", "-c", FOLDERS_SOURCE, "unpack", self._cache]
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._slurm.env,
            start_new_session=True,
        )
        assert child.stdin is not None
        sent = 0
        try:
            with tarfile.open(fileobj=_Counted(child.stdin, progress), mode="w|") as tar:
                for digest in missing:
                    info = tar.gettarinfo(str(files[digest]), arcname=digest)
                    info.mode, info.uid, info.gid, info.uname, info.gname = 0o600, 0, 0, "", ""
                    with open(files[digest], "rb") as f:
                        tar.addfile(info, f)
                    sent += info.size
            child.stdin.close()
        except BrokenPipeError:  # the step ended early: its words say why
            pass
        assert child.stdout is not None and child.stderr is not None
        child.stdout.read()
        err = child.stderr.read()
        try:
            child.wait(timeout=SEND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.returncode != 0:
            said = " ".join(err.decode(errors="replace").split())[-400:] or f"exit {child.returncode}"
            raise LaunchError(f"{self.label}: sending the environment's wheels: {said}")
        return sent


class _Counted(io.RawIOBase):
    """A pipe that tells `progress` what went through it."""

    def __init__(self, out: IO[bytes], progress: Callable[[int], None]):
        self._out, self._progress = out, progress

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._out.write(data)
        self._progress(len(data))
        return len(data)


def slurm_environments(
    env: EnvironmentSpec,
    slurm: Slurm,
    job_id: str,
    nodes: Sequence[str],
    files: NodeFiles,
    notify: Callable[[str], None],
) -> tuple[list[HostEnvironment], dict[str, str]]:
    """Every node's environment ready, under the nodes' work folder (`files.workdir`): their
    states, and each one's interpreter by node."""
    maker = env.python or shlex.join(files.python)
    sites = [SlurmSite(slurm, job_id, node, files.run_id, maker, files.workdir) for node in nodes]
    made = prepare(env, sites, notify)
    return made, {n: h.python for n, h in zip(nodes, made, strict=True) if h.python}
