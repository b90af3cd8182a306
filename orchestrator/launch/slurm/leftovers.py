"""Launch layer, slurm backend: `orchestrate down` once a run's coordinator is gone — its allocation
(found by name: a renewed one too) cancelled; inside an allocation that is not ours, only this
run's steps."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from orchestrator.errors import LaunchError
from orchestrator.launch.api import Leftovers
from orchestrator.launch.slurm.cluster import Slurm, cancel_steps, job_name


class SlurmLeftovers(Leftovers):
    """`orchestrate down` with the coordinator gone: its allocation (found by name: a renewed one
    too) is cancelled; inside an allocation that is not ours, only this run's steps."""

    def __init__(self, record: Mapping[str, Any], slurm: Slurm | None = None):
        self._record = record
        self._slurm = slurm  # default: Slurm's commands under the record's timeout

    def stop(self, grace_s: float) -> list[tuple[str, bool]]:
        slurm = self._slurm or Slurm(float(self._record.get("connect_timeout_s") or 10.0))
        name = str(self._record.get("job_name") or job_name(str(self._record.get("run_id"))))
        try:
            if self._record.get("owned") is False:
                steps = cancel_steps(slurm, str(self._record.get("job_id")), name)
                what = f"cancelled step(s) {', '.join(steps)}" if steps else "no step of this run left"
                return [(f"Slurm job {self._record.get('job_id')} (not ours, left running): {what}", True)]
            out = slurm.checked(["squeue", "-h", "--name", name, "-o", "%i"], "listing this run's allocation")
            jobs = out.split()
            if jobs:
                slurm.checked(["scancel", "--signal=TERM", *jobs], "asking the tasks to stop")
                deadline = time.monotonic() + grace_s
                while (
                    time.monotonic() < deadline
                    and slurm.checked(
                        ["squeue", "-h", "-s", "-j", ",".join(jobs), "-o", "%i"], "waiting"
                    ).strip()
                ):
                    time.sleep(0.2)
                slurm.checked(["scancel", *jobs], "releasing the allocation")
            what = f"cancelled job(s) {', '.join(jobs)}" if jobs else "no allocation of this run left"
            return [(f"Slurm: {what}", True)]
        except LaunchError as exc:
            return [(f"Slurm: {exc}", False)]
