"""A task's failure, made durable: the exception it dies of, written to a file in its run folder
(torch elastic's `@record` error file is the model), so the coordinator learns the cause even when
the final heartbeat that carries it never arrives (the network cut, the coordinator unreachable
for a while, the process killed while sending).

The worker runtime writes `<run folder>/errors/<task>.<attempt>.json` as it dies; the coordinator
reads it when the task exited non-zero and no heartbeat brought its error: in place (local), or
brought home by the task's shim as one event (ssh, slurm). Part of the wire contract: stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import stat
import time
from dataclasses import dataclass
from typing import Any

from worker.wire import TaskError, safe_text

FOLDER = "errors"
#: The file is read whole up to this size (worker/host/shim.py keeps a copy; tests/unit/test_wire.py
#: keeps them equal); a longer one is not read.
MAX_BYTES = 128 * 1024
_MAX_TYPE, _MAX_MESSAGE, _MAX_TRACEBACK = 200, 16 * 1024, 64 * 1024


@dataclass(frozen=True)
class Written:
    """What a task wrote as it died."""

    error: TaskError
    step: int | None  # the latest step it reported, if any


def path(run_folder: str, task: str, attempt: int) -> str:
    """Where a task's attempt writes its failure, on its own host."""
    return posixpath.join(run_folder, FOLDER, f"{task}.{attempt}.json")


def document(error: TaskError, step: int | None) -> bytes:
    """The file's content: the error cut to size, the step it was at, when, and who wrote it."""
    message, trace = error.message[:_MAX_MESSAGE], error.traceback[-_MAX_TRACEBACK:]
    for _ in range(2):
        doc = {
            "type": error.type[:_MAX_TYPE],
            "message": message,
            "traceback": trace,
            "step": step,
            "time": time.time(),
            "pid": os.getpid(),
        }
        data = json.dumps(doc, ensure_ascii=True).encode()
        if len(data) <= MAX_BYTES:
            break
        # escaped text grows (a message of emoji is 12 bytes a character): both give way
        message, trace = message[: _MAX_MESSAGE // 8], "…" + trace[-(_MAX_TRACEBACK // 8) :]
    return data


def write(target: str, error: TaskError, step: int | None) -> bool:
    """Write the file (private, whole or not at all: a temporary name renamed); False where the
    folder cannot be written (the task's failure is then known from its heartbeat and log only)."""
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(document(error, step))
        os.replace(tmp, target)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def parse(data: bytes | str | Any) -> Written | None:
    """The error and step a file (or the shim's copy of it, already parsed) says; None for anything
    that is not such a document. Text is shown as `safe_text` makes it, cut to size."""
    if isinstance(data, (bytes, str)):
        if len(data) > MAX_BYTES:
            return None
        try:
            data = json.loads(data)
        except ValueError:
            return None
    if not isinstance(data, dict):
        return None
    kind, message, trace, step = (data.get(k) for k in ("type", "message", "traceback", "step"))
    if not isinstance(kind, str) or not kind or not isinstance(message, str) or not isinstance(trace, str):
        return None
    error = TaskError(
        type=safe_text(kind[:_MAX_TYPE]),
        message=safe_text(message[:_MAX_MESSAGE], lines=True),
        traceback=safe_text(trace[-_MAX_TRACEBACK:], lines=True),
    )
    return Written(error, step if type(step) is int and 0 <= step < 2**63 else None)


def read(target: str) -> Written | None:
    """The file at `target` on this machine, parsed; None where there is none (or not a regular
    file of ours: no symlink is followed)."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return parse(f.read(MAX_BYTES + 1))
        except OSError:
            return None
