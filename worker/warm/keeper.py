"""A warm standby that stays (`python -m worker standby`, docs/architecture.md
§6) — each handover makes a task of a fork of it, and it waits, TensorFlow still imported, for
the next.

worker/warm/standby.py imports TensorFlow as for any standby; then this process never creates
TensorFlow's context (nor starts a thread: the import left none but OpenBLAS's, whose fork
handlers stop and restart them), so a fork of it is a task that has imported TensorFlow at no
cost. Per handover line on stdin (worker/warm/standby.py's JSON) its spare, forked ahead and done
copying the pages it shares with the keeper (worker/warm/spare.py), becomes the task, or, without
one, a fork made then; it says so on its events descriptor (its stdout as started; its own
output goes on to its log) as one JSON line, {"event": "started", "pid": N}, and once that task
is reaped {"event": "exit", "pid": N, "code": C} (negative C: killed by signal -C). The task is
in a session of its own (stopped as one group, never with its keeper), dies with its keeper
(PR_SET_PDEATHSIG: it is never left without the one process that can say how it ended) and
starts as a fresh process would: its own random state, its own log and variables, its keeper's
parent (the coordinator, a shim) as the reader of its stacks. A fork leaves the keeper's code by
raising `Become` up to `python -m worker`'s top level, which runs the task from there as a cold
task's process does: the same Python frames beneath it. End of file on stdin (its coordinator
done or gone): its spare is stopped, and it exits once its tasks have ended (a task stops itself
when its coordinator is gone, §6), at once when it has none.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from worker.warm import spare

_PR_SET_PDEATHSIG = 1
_PASSED_OVER = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Become(BaseException):
    """Raised in a fork made the task (its log, variables and signals its own): it unwinds the
    keeper's frames to `python -m worker`'s top level, which runs the worker's entry point with
    `argv` from there, beneath the same Python frames as a cold task's. Run from inside the
    keeper's loop instead, the task ran 5-7 frames deeper than a cold one: CPython 3.11 allocates its
    frames in 16 KiB chunks and maps and unmaps one whenever a call crosses a chunk's start, so a
    different depth crosses at other calls; in a Keras `fit` with a `py_function` map, 7,400 such
    crossings in a first step against 4,000 cold (issue 39, docs/architecture.md §6). It also keeps
    a job's recursion limit where a cold task has it."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__("a fork of the keeper, now its task")
        self.argv = argv


class Lines:
    """Lines of a descriptor, read only as they come (select-able: nothing waits in a buffer)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self.ended = False

    def push_back(self, line: bytes) -> None:
        self._buffer = line + self._buffer

    def next(self) -> bytes | None:
        """A whole line if one came; b"" at end of file; None: nothing yet."""
        while b"\n" not in self._buffer and not self.ended:
            if not select.select([self.fd], [], [], 0)[0]:
                return None
            data = os.read(self.fd, 65536)
            self._buffer += data
            self.ended = not data
        if b"\n" not in self._buffer:
            return b""  # a line cut short by the end is no handover
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line + b"\n"


def events_descriptor() -> int:
    """The events' own descriptor (what stdout was); stdout from now on goes to the log (stderr)."""
    sys.stdout.flush()
    events = os.dup(1)
    os.dup2(2, 1)
    return events


def keep(become: Callable[[dict[str, Any]], None], lines: Lines, events: int) -> NoReturn:
    """Fork a task per handover (`become` makes a process its task), say each start and end; a
    spare made ahead takes the handover where there is one (worker/warm/spare.py). Returns in no
    process: a fork made the task raises `Become`."""
    woken_r, woken_w = os.pipe()
    for fd in (woken_r, woken_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: only then does it wake select
    for sig in _PASSED_OVER:  # Slurm signals every process of a step: the tasks answer, not this
        signal.signal(sig, signal.SIG_IGN)  # (it is stopped by SIGKILL or the end of its stdin)
    signal.set_wakeup_fd(woken_w)
    fds = (events, woken_r, woken_w)
    keeper, reader = os.getpid(), os.getppid()
    slot = spare.Slot(
        lambda: spare.Spare(
            lambda closing: _leave_keeper(keeper, reader, closing),
            lambda handover: _be_task(become, handover),
            fds,
        )
    )
    tasks: set[int] = set()
    while True:
        line = lines.next()
        while line:
            handover = json.loads(line)
            pid = slot.hand(line) or _fork(become, handover, fds)
            tasks.add(pid)
            _say(events, {"event": "started", "pid": pid})
            line = lines.next()
        tasks -= _reaped(events, tasks)
        wait_s = slot.tend(closing=lines.ended)
        if lines.ended and not tasks:
            os._exit(0)
        waiting = [woken_r] + ([] if lines.ended else [lines.fd])
        with contextlib.suppress(InterruptedError):
            select.select(waiting, [], [], wait_s)
        with contextlib.suppress(BlockingIOError):
            os.read(woken_r, 4096)


def _reaped(events: int, tasks: set[int]) -> set[int]:
    done = set()
    for pid in tasks:
        with contextlib.suppress(ChildProcessError):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                done.add(pid)
                _say(events, {"event": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
    return done


def _say(events: int, event: dict[str, Any]) -> None:
    data = (json.dumps(event) + "\n").encode()
    with contextlib.suppress(OSError):  # its reader gone: the tasks still end as they would
        os.write(events, data)


def _fork(
    become: Callable[[dict[str, Any]], None], handover: dict[str, Any], keepers: tuple[int, ...]
) -> int:
    keeper, reader = os.getpid(), os.getppid()
    pid = os.fork()
    if pid:
        return pid
    try:
        _leave_keeper(keeper, reader, keepers)
    except BaseException:  # noqa: BLE001 - the child never returns into the keeper's loop
        _said_and_gone()
    _be_task(become, handover)


def _be_task(become: Callable[[dict[str, Any]], None], handover: Any) -> NoReturn:
    """(In a fork) the task: its log, variables and signals; then `Become` to run it."""
    try:
        for sig in _PASSED_OVER:  # ignored dispositions survive a fork: a task's are a new process's
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        become(handover)
        argv = [str(a) for a in handover["argv"]]
    except BaseException:  # noqa: BLE001 - said in the task's log if `become` made it its stderr
        _said_and_gone()
    raise Become(argv)


def _said_and_gone() -> NoReturn:
    """(In a fork, handling an exception) its traceback said; the process ends (EX_SOFTWARE)."""
    import traceback

    with contextlib.suppress(BaseException):
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(70)


def _leave_keeper(keeper: int, reader: int, keepers: tuple[int, ...]) -> None:
    """This fork made a process of its own: a session, its keeper's end its end, the keeper's
    descriptors (stdin: `become` replaces it), wakeup descriptor and SIGCHLD handler gone, fresh
    random state, the keeper's parent its reader. (The signals a keeper ignores stay ignored until
    `_be_task`: Slurm's SIGTERM to a whole step does not end a spare.)"""
    os.setsid()
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != keeper:  # the keeper died before the line above: so does this
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keepers:
        with contextlib.suppress(OSError):
            os.close(fd)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # its legacy global state, seeded from the OS as a new process's
        numpy_random.seed()
    from worker.task import stack_dump

    stack_dump.READER = reader
