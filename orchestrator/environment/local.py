"""The local backend's site: this machine, its environments under the cache (`cache_root()`, where
the wheels already are: nothing is sent), worker/host/environment.py run as a child process."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from orchestrator.errors import LaunchError
from orchestrator.record.write import make_private_dir
from orchestrator.spec.environment import EnvironmentSpec
from worker.host import ENVIRONMENT_SOURCE, RUNTIME_ROOT

BUILD_TIMEOUT_S = 1800.0  # a build that takes longer is stuck (TensorFlow: ~6 s here)
ASK_TIMEOUT_S = 120.0  # a question: answered at once (a Slurm step's start included)
STOP_GRACE_S = 10.0  # a build told to stop removes its part within this


class CommandSite:
    """A host reached by running a command here: this machine (`LocalSite`), or a Slurm node
    through a job step (`prefix`: srun's words)."""

    def __init__(
        self,
        label: str,
        python: str,
        workdir: str | Path,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.label, self.python = label, python
        self._workdir, self._prefix, self._env = str(workdir), list(prefix), env

    def ask(
        self, mode: str, key: str, manifest: str, on_line: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        argv = [
            *self._prefix,
            *shlex.split(self.python),
            "-S",
            "-c",
            ENVIRONMENT_SOURCE,
            mode,
            self._workdir,
            key,
        ]
        try:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                start_new_session=True,  # a Ctrl-C in the terminal is the coordinator's to handle
            )
        except OSError as exc:
            raise LaunchError(
                f"{self.label}: {argv[0]}: {exc.strerror or exc} (environment.python)"
            ) from None
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        err: list[bytes] = []
        reader = threading.Thread(target=lambda: err.append(child.stderr.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        limit_s = BUILD_TIMEOUT_S if mode == "build" else ASK_TIMEOUT_S
        fired = threading.Event()

        def too_late() -> None:  # a hung host (NFS, a step that never starts)
            fired.set()
            _stop(child)

        late = threading.Timer(limit_s, too_late)
        late.start()
        answer = None
        try:
            child.stdin.write(manifest.encode() or b"\n")
            child.stdin.flush()
            answer = read_answer(child.stdout, on_line)
        except BrokenPipeError:
            pass  # it ended first: its words say why
        finally:
            late.cancel()
            code = _stop(child)  # stdin closed (the lifeline: a build stops and removes its part)
        reader.join(timeout=5.0)
        if fired.is_set() and answer is None:
            raise LaunchError(f"{self.label}: environment {mode} gave no answer within {limit_s:g} s")
        return answered(self.label, mode, code, answer, b"".join(err).decode(errors="replace"))


def _stop(child: subprocess.Popen[bytes]) -> int:
    """Its stdin closed; its exit code once it ends, within a grace, else its group killed."""
    with contextlib.suppress(OSError, ValueError):
        assert child.stdin is not None
        child.stdin.close()
    try:
        return child.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)  # its own session: uv with it
        return child.wait()


class LocalSite(CommandSite):
    def __init__(self, python: str | None, workdir: Path):
        super().__init__("this machine", python or shlex.quote(sys.executable), workdir)

    def send(self, files: Mapping[str, Path], missing: Sequence[str], progress: Callable[[int], None]) -> int:
        return 0  # built from the cache the wheels were downloaded into


def read_answer(out: IO[bytes], on_line: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """worker/host/environment.py's JSON lines: steps to `on_line`, the last line is the answer."""
    answer = None
    for raw in out:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and "step" in line:
            on_line(line)
        elif isinstance(line, dict):
            answer = line
    return answer


def answered(label: str, mode: str, code: int, answer: dict[str, Any] | None, err: str) -> dict[str, Any]:
    if code == 0 and answer is not None:
        return answer
    said = err.strip().splitlines()[-1] if err.strip() else f"exit code {code}"
    what = "building the environment" if mode == "build" else "asking for the environment"
    raise LaunchError(f"{label}: {what} failed: {said[-2000:]}")


def runtime_copy(run_dir: Path) -> Path:
    """The worker runtime copied into the run's folder (`lib/worker`), for an environment that
    has only the job's packages; the folder to put on PYTHONPATH."""
    lib = run_dir / "lib"
    target = lib / "worker"
    if not target.is_dir():
        make_private_dir(lib)
        shutil.copytree(RUNTIME_ROOT / "worker", target, ignore=shutil.ignore_patterns("__pycache__"))
    return lib


def check_line(env: EnvironmentSpec) -> tuple[str, bool]:
    """`orchestrate check` on this machine: the environment ready, or what `up` would build
    (resolved and downloaded now); False where it cannot be made."""
    from orchestrator.environment.prepare import survey
    from orchestrator.environment.resolve import cache_root

    try:
        (host,) = survey(env, [LocalSite(env.python, cache_root())], lambda _: None)
    except LaunchError as exc:
        return f"problem: {exc}", False
    if host.state == "ready":
        return f"environment: ready ({host.packages} packages, {host.target}): {host.python}", True
    return f"environment: to build ({host.packages} wheels, {host.target}) at the first `up`", True
