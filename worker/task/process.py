"""The task's own process and place — its process group (killed but itself when
its coordinator is gone), where it executes the job's own code right now, and whether it is the
task that speaks for its cluster."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping

import psutil


def kill_group_but_me(within_s: float = 2.0) -> None:
    """SIGKILL every other process of this process's group (again while new ones appear)."""
    me = os.getpid()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        others = []
        for proc in psutil.process_iter():
            try:
                # a zombie (a killed child of ours, not yet reaped) is gone already
                if proc.pid != me and os.getpgid(proc.pid) == me and proc.status() != psutil.STATUS_ZOMBIE:
                    others.append(proc)
            except (OSError, psutil.Error):
                continue
        if not others:
            return
        for proc in others:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        time.sleep(0.01)


_LIBRARY_PATHS = tuple(
    {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    | {os.path.dirname(os.path.realpath(__file__))}  # this package
)


def user_frame() -> str | None:
    """Where a thread is executing the job's own code right now (main thread first), if any.

    A task stuck in its own code shows it here; one waiting on its peers sits inside TensorFlow.
    That tells the stalled task from the ones it makes wait.
    """
    frames = sys._current_frames()
    main = threading.main_thread().ident
    for ident in sorted(frames, key=lambda i: i != main):
        frame = frames[ident]
        path = frame.f_code.co_filename
        if path.startswith("<") or os.path.realpath(path).startswith(_LIBRARY_PATHS):
            continue
        return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
    return None


def is_chief(task_type: str | None, task_id: int, has_chief: bool) -> bool:
    """The task that speaks for a synchronous cluster (writes its checkpoints and its per-step
    record): the chief, or worker 0 when the cluster has none; a process outside any cluster
    speaks for itself."""
    if task_type in (None, "chief"):
        return True
    return task_type == "worker" and task_id == 0 and not has_chief


def keeps_points(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this task's training steps go to metrics.jsonl: the chief's (`is_chief`), or a task
    outside the training cluster. Under a synchronous strategy every worker holds the same reduced
    loss, so the others' lines would only repeat it, N times over (and cost the coordinator most of
    its time with many tasks, P6); they report their progress alone."""
    try:
        config = json.loads(env.get("TF_CONFIG") or "{}")
        task, cluster = config.get("task") or {}, config.get("cluster") or {}
        if task.get("type") == "worker":
            return is_chief("worker", int(task.get("index", 0)), "chief" in cluster)
    except (ValueError, TypeError, AttributeError):
        pass
    return True
