"""Launch layer, slurm backend: the allocation the tasks run in — ours, requested with salloc and
held by a pipe from the coordinator (released when it closes: at the end, or when the coordinator
dies, even by SIGKILL; a request still pending after `slurm.queue_timeout_s` is withdrawn), or the
surrounding one (`salloc … orchestrate up`, an sbatch script), left as it is."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.cluster import NOT_INSTALLED, Request, Slurm, job_name, signal_lead_s
from orchestrator.launch.slurm.spec import section
from orchestrator.spec.model import ClusterSpec

log = logging.getLogger("orchestrator.slurm")


class Allocation:
    """The Slurm job the tasks run in: ours (released at the end) or the surrounding one."""

    def __init__(
        self,
        job_id: str,
        nodes: list[str],
        owned: bool,
        holder: subprocess.Popen[bytes] | None = None,
        log_path: Path | None = None,
    ):
        self.job_id = job_id
        self.nodes = nodes
        self.owned = owned
        self._holder = holder
        self._log_path = log_path
        self.released = False
        self.granted = not owned  # ours: once salloc's command runs
        self._log_size = -1
        self._revoked = False

    @classmethod
    def surrounding(cls, slurm: Slurm, env: Mapping[str, str]) -> Allocation | None:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job or not nodelist:
            return None
        return cls(job, slurm.hostnames(nodelist), owned=False)

    @classmethod
    def request(
        cls, slurm: Slurm, spec: ClusterSpec, run_id: str, folder: Path, cancel: threading.Event
    ) -> Allocation:
        """salloc, holding the allocation with a pipe from us; waits up to slurm.queue_timeout_s."""
        conf = section(spec)
        argv = salloc_argv(spec, run_id)
        n = 1 + sum(1 for _ in folder.glob("salloc-*.log"))  # one pair of files per request
        out, err = folder / f"salloc-{n}.out", folder / f"salloc-{n}.log"
        with open(out, "wb") as o, open(err, "wb") as e:
            try:
                holder = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=o,
                    stderr=e,
                    env=slurm.env,
                    start_new_session=True,
                )
            except FileNotFoundError:
                raise LaunchError(f"{NOT_INSTALLED} (salloc not found on PATH)") from None
        alloc = cls("", [], owned=True, holder=holder, log_path=err)
        deadline = time.monotonic() + conf.queue_timeout_s
        try:
            while True:
                line = out.read_text(errors="replace").strip()
                if line.startswith("ALLOCATED "):
                    _, job, nodelist = line.split(maxsplit=2)
                    alloc.job_id, alloc.granted = job, True
                    alloc.nodes = slurm.hostnames(nodelist)
                    return alloc
                alloc.job_id = alloc.job_id or _pending_job(err)
                if holder.poll() is not None:
                    said = " ".join(_salloc_errors(err)) or f"salloc exited with {holder.returncode}"
                    raise LaunchError(f"Slurm refused the allocation: {said}")
                if cancel.is_set():
                    raise LaunchError("interrupted while waiting for the allocation")
                if time.monotonic() > deadline:
                    why = alloc.pending_reason(slurm)
                    raise LaunchError(
                        f"the allocation (job {alloc.job_id or '?'}) was still pending after "
                        f"{conf.queue_timeout_s:g} s (slurm.queue_timeout_s){why}; "
                        "the request is cancelled"
                    )
                time.sleep(0.05)
        except BaseException:
            alloc.release(slurm)
            raise

    def pending_reason(self, slurm: Slurm) -> str:
        if not self.job_id:
            return ""
        with contextlib.suppress(LaunchError):
            out = slurm.checked(["squeue", "-h", "-j", self.job_id, "-o", "%r"], "asking why").strip()
            if out:
                return f" (Slurm's reason: {out})"
        return ""

    def time_left_s(self, slurm: Slurm) -> float | None:
        """Seconds until the allocation's time limit; None without a limit (or when unknown)."""
        with contextlib.suppress(LaunchError):
            out = slurm.checked(
                ["squeue", "-h", "-j", self.job_id, "-o", "%L"], "asking the time left"
            ).strip()
            return _duration_s(out)
        return None

    def ended(self) -> str | None:
        """Ours, and gone without us releasing it: why (salloc's words). Cheap: salloc's log is
        read only when it grew."""
        if not self.owned or self.released or self._holder is None or self._log_path is None:
            return None
        try:
            size = self._log_path.stat().st_size
        except OSError:
            return None
        if size != self._log_size:
            self._log_size = size
            self._revoked = any(
                "revoked" in line or "time limit" in line for line in _salloc_errors(self._log_path)
            )
        if not self._revoked and self._holder.poll() is None:
            return None
        return " ".join(_salloc_errors(self._log_path)) or f"salloc exited ({self._holder.returncode})"

    def release(self, slurm: Slurm) -> None:
        """Ours: close the holder's pipe (salloc relinquishes it), or while it is still pending
        SIGTERM salloc (it withdraws the request); then scancel, to be sure. The surrounding
        allocation is left alone."""
        if not self.owned or self.released:
            return
        self.released = True
        holder = self._holder
        if holder is not None and holder.poll() is None:
            if self.granted:
                with contextlib.suppress(OSError):
                    assert holder.stdin is not None
                    holder.stdin.close()
            else:
                holder.terminate()
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(timeout=10)
        job = self.job_id or (_pending_job(self._log_path) if self._log_path else "")
        if job:
            with contextlib.suppress(LaunchError):
                slurm.run(["scancel", job], "releasing the allocation")

    def renewed(
        self,
        slurm: Slurm,
        spec: ClusterSpec,
        run_id: str,
        folder: Path,
        cancel: threading.Event,
        notes: list[str],
    ) -> Allocation | None:
        """A new allocation in place of this one (released) when it ended (its time limit) or is
        about to; None while it has time left. Why, in `notes`."""
        ended = self.ended()
        left = None if ended else self.time_left_s(slurm)
        if ended is None and (left is None or left > signal_lead_s(spec)):
            return None
        why = f"it ended ({ended})" if ended else f"its time limit is {left:g} s away"
        self.release(slurm)
        new = Allocation.request(slurm, spec, run_id, folder, cancel)
        notes.append(
            f"a new allocation (job {new.job_id} on {','.join(new.nodes)}): job {self.job_id}: {why}"
        )
        return new


def salloc_argv(spec: ClusterSpec, run_id: str) -> list[str]:
    s = section(spec)
    request = Request.of(spec)
    argv = [
        "salloc",
        "--no-kill",  # a node lost leaves the others (and the spares) allocated
        f"--nodes={s.nodes}",
        f"--ntasks-per-node={request.tasks_per_node}",
        f"--job-name={job_name(run_id)}",
    ]
    if s.partition:
        argv.append(f"--partition={s.partition}")
    if s.account:
        argv.append(f"--account={s.account}")
    if s.time:
        argv += [f"--time={s.time}", f"--signal=TERM@{signal_lead_s(spec)}"]
    argv += s.extra_args
    # the allocation lives as long as this reads our pipe
    holder = 'echo "ALLOCATED $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null'
    return [*argv, "sh", "-c", holder]


def _pending_job(log_path: Path | None) -> str:
    if log_path is None:
        return ""
    with contextlib.suppress(OSError):
        m = re.search(
            r"(?:Pending|Granted) job allocation (\d+)|[Jj]ob (\d+) queued",
            log_path.read_text(errors="replace"),
        )
        if m:
            return m.group(1) or m.group(2)
    return ""


def _salloc_errors(log_path: Path | None) -> list[str]:
    if log_path is None:
        return []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keep = [ln.removeprefix("salloc: ").strip() for ln in lines]
    routine = (
        r"(Pending|Granted) job allocation|Relinquishing|Waiting for|Nodes .* are ready"
        r"|job \d+ (queued|has been allocated)"
    )
    keep = [ln for ln in keep if ln and not re.match(routine, ln)]
    return keep[-4:]


def _duration_s(text: str) -> float | None:
    """Slurm's `[D-]HH:MM:SS` (or MM:SS) as seconds; None for UNLIMITED or not a duration."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
