"""A warm standby — a process that imports TensorFlow before its attempt exists,
at the lowest CPU priority, and forks its task from itself when told (docs/architecture.md §6).

`python -m worker standby` is started with its task's environment except the variables that
change per attempt (wire.PER_ATTEMPT_ENV: TensorFlow reads none of them at import, §7). It
imports numpy at its own priority first (OpenBLAS starts its threads then, and they keep the
priority of the thread that started them), then TensorFlow and Keras on a thread of the lowest
priority (SCHED_IDLE, else nice 19), never creating TensorFlow's context (a
MultiWorkerMirroredStrategy configures it first). Its main thread meanwhile waits for a line on
stdin, the handover (JSON): {"argv": the worker's arguments, "env": the attempt's variables,
"log": the task's log}. Once the import has ended it is a keeper (worker/warm/keeper.py): each
handover makes a task of a fork of it (a spare forked ahead, worker/warm/spare.py, or one forked then)
that writes to the task's log, takes the variables and raises keeper.Become, on which
`python -m worker` runs ARGV as a cold task does; the keeper stays for the next. End of file
before any (its coordinator is done with it, or gone): it exits at once, even mid-import. Its
own output is its log's; when TensorFlow cannot be imported it says why there and exits
EXIT_STANDBY_FAILED.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

from worker import wire
from worker.host import probe
from worker.warm import keeper


def _lowest_priority() -> None:
    """This thread at the lowest CPU priority (Linux: per thread)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _modules() -> list[str]:
    """What a task of this environment will import: TensorFlow, and the Keras its job selects."""
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
    return ["tensorflow", "tf_keras" if legacy else "keras"]


class _Import(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="standby-import", daemon=True)

    def run(self) -> None:
        _lowest_priority()
        start = time.monotonic()
        try:
            for name in _modules():
                try:
                    importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    if name == "tensorflow" or exc.name != name:
                        raise  # TensorFlow itself, or something the Keras present needs
        except BaseException as exc:  # noqa: BLE001 - said at once: a broken host found before it is needed
            traceback.print_exception(type(exc), exc, exc.__traceback__)
            print(f"orchestrate-standby: cannot import {_modules()[0]}: {exc}", file=sys.stderr, flush=True)
            os._exit(wire.EXIT_STANDBY_FAILED)
        print(f"{wire.STANDBY_READY} {time.monotonic() - start:.2f} s", file=sys.stderr, flush=True)


def main() -> NoReturn:
    """Be a standby, then a keeper: each handover forks a task, which leaves here by raising
    keeper.Become (its ARGV for the worker's entry point)."""
    import numpy  # noqa: F401 - here, at this process's priority: its BLAS threads keep it

    events = keeper.events_descriptor()
    missing = probe.page_copy()
    if missing is not None:
        print(f"{wire.STANDBY_NO_PAGE_COPY} {missing}", file=sys.stderr, flush=True)
    loading = _Import()
    loading.start()
    lines = keeper.Lines(0)
    while (line := lines.next()) is None and loading.is_alive():
        select.select([0], [], [], 0.2)  # a handover, or the import's end (a keeper from then on)
    if line == b"":
        os._exit(0)  # nothing to become: at once, even mid-import
    loading.join()  # a failed import has ended the process
    if line:
        lines.push_back(line)
    keeper.keep(_become, lines, events)


def _become(handover: dict[str, Any]) -> None:
    """(In the forked task) output to the task's log, stdin from nothing, the attempt's variables."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(
        handover["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(nothing, 0)
    os.close(log)
    os.close(nothing)
    os.environ.update({str(k): str(v) for k, v in handover["env"].items()})
