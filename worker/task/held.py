"""The environment a task runs in (`environment:`, docs/environment.md), held while it lives: the
host side (worker/host/environment.py) never removes an environment a process holds. The first
thing `python -m worker` does, before any import past the standard library (a job's environment
may lack even those)."""

from __future__ import annotations

import fcntl
import os
import sys

from worker.host.environment import ENV_ENVIRONMENT, MARKER

_HELD: list[int] = []  # the descriptor of this process's environment's marker (hold)


def hold() -> None:
    """Keep this process's environment from removal while it lives: a shared lock on its marker.
    A task placed in one (ORCHESTRATE_ENVIRONMENT) whose environment is gone stops here, saying
    so; a process in no environment of ours holds nothing."""
    if _HELD:
        return
    expected = os.environ.get(ENV_ENVIRONMENT)
    path = os.path.join(expected or sys.prefix, MARKER)
    gone = f"this task's environment {expected or sys.prefix} is gone (removed as it started?); start again"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if expected:
            raise SystemExit(gone) from None
        return
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal that had begun (it moves the folder away)
    if not os.path.exists(path):
        raise SystemExit(gone)
    _HELD.append(fd)
