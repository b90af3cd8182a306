"""Worker runtime: a warm standby that stays (`python -m worker standby`, docs/architecture.md
§6) — each handover forks a task from it, and it waits, TensorFlow still imported, for the next.

worker/standby.py imports TensorFlow as for any standby; then this process never creates
TensorFlow's context (nor starts a thread: the import left none but OpenBLAS's, whose fork
handlers stop and restart them), so a fork of it is a task that has imported TensorFlow at no
cost. Per handover line on stdin (worker/standby.py's JSON) it forks the task and says so on its
events descriptor (its stdout as started; its own output goes on to its log) as one JSON line,
{"event": "started", "pid": N}, and once that task is reaped {"event": "exit", "pid": N, "code": C}
(negative C: killed by signal -C). The task is in a session of its own (stopped as one group,
never with its keeper), dies with its keeper (PR_SET_PDEATHSIG: it is never left without the one
process that can say how it ended) and starts as a fresh process would: its own random state,
its own log and variables, its keeper's parent (the coordinator, a shim) as the reader of its
stacks. End of file on stdin (its coordinator done or gone): it exits once its tasks have ended
(a task stops itself when its coordinator is gone, §6), at once when it has none.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

_PR_SET_PDEATHSIG = 1
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_POPULATE_WRITE = 23
#: A spare is made this long after a handover (the task's start and first step have the cores
#: first), and at once when the keeper starts: its copying costs ~0.2 s of a core.
SPARE_AFTER_S = 3.0
_PASSED_OVER = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


def keep(
    run: Callable[[list[str]], int], become: Callable[[dict[str, Any]], None], lines: Lines, events: int
) -> NoReturn:
    """Fork a task per handover (`become` makes a process its task), say each start and end; keep
    a spare made ahead of the next handover, `SPARE_AFTER_S` after the last."""
    woken_r, woken_w = os.pipe()
    for fd in (woken_r, woken_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: only then does it wake select
    for sig in _PASSED_OVER:  # Slurm signals every process of a step: the tasks answer, not this
        signal.signal(sig, signal.SIG_IGN)  # (it is stopped by SIGKILL or the end of its stdin)
    signal.set_wakeup_fd(woken_w)
    tasks: set[int] = set()
    spare: Spare | None = None
    spare_due = time.monotonic()
    while True:
        line = lines.next()
        while line:
            fds = (events, woken_r, woken_w) + ((spare.pipe,) if spare else ())
            pid = spare.hand(line) if spare else None
            spare, spare_due = None, time.monotonic() + SPARE_AFTER_S
            pid = pid or _fork(run, become, json.loads(line), fds)
            tasks.add(pid)
            _say(events, {"event": "started", "pid": pid})
            line = lines.next()
        tasks -= _reaped(events, tasks)
        if spare is not None and spare.ended():
            spare = None  # a spare that died is no one's task: made again when due
        if lines.ended and not tasks:
            if spare is not None:
                spare.close()
            os._exit(0)
        if spare is None and not lines.ended and time.monotonic() >= spare_due:
            spare = Spare(run, become, (events, woken_r, woken_w))
            spare_due = time.monotonic() + SPARE_AFTER_S  # made again after that, should it die
        waiting = [woken_r] + ([] if lines.ended else [lines.fd])
        wait_s = None if spare is not None or lines.ended else max(0.0, spare_due - time.monotonic())
        with contextlib.suppress(InterruptedError):
            select.select(waiting, [], [], wait_s)
        with contextlib.suppress(BlockingIOError):
            os.read(woken_r, 4096)


class Spare:
    """A task's process forked ahead of its handover: it has copied the keeper's pages it shares
    (single-threaded, where a copy-on-write fault is ~3 µs; a task that faults them in its first
    step, TensorFlow's threads running, pays ~11 µs each: issue 39) and waits on a pipe for the
    handover line; end of file ends it."""

    def __init__(
        self,
        run: Callable[[list[str]], int],
        become: Callable[[dict[str, Any]], None],
        keepers: tuple[int, ...],
    ) -> None:
        read, self.pipe = os.pipe()
        keeper, reader = os.getpid(), os.getppid()
        self.pid = os.fork()
        if self.pid:
            os.close(read)
            return
        code = 0
        try:
            _leave_keeper(keeper, reader, keepers + (self.pipe,))
            _own_pages()
            line = _read_line(read)
            os.close(read)
            if line:
                _be_task(run, become, json.loads(line))
        finally:
            os._exit(code)  # no handover: a spare no one needed

    def hand(self, line: bytes) -> int | None:
        """The spare's pid once it has the handover; None if it is gone (stopped, then)."""
        try:
            os.write(self.pipe, line if line.endswith(b"\n") else line + b"\n")
        except OSError:
            self.close()
            return None
        os.close(self.pipe)
        return self.pid

    def ended(self) -> bool:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(self.pid, os.WNOHANG)[0] != self.pid:
                return False
        os.close(self.pipe)
        return True

    def close(self) -> None:
        """Stopped: end of file on its pipe, or SIGKILL if it has not gone within a second."""
        with contextlib.suppress(OSError):
            os.close(self.pipe)
        deadline = time.monotonic() + 1.0
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(self.pid, os.WNOHANG)[0] != self.pid:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.01)


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
    run: Callable[[list[str]], int],
    become: Callable[[dict[str, Any]], None],
    handover: dict[str, Any],
    keepers: tuple[int, ...],
) -> int:
    keeper, reader = os.getpid(), os.getppid()
    pid = os.fork()
    if pid:
        return pid
    try:
        _leave_keeper(keeper, reader, keepers)
        _be_task(run, become, handover)
    finally:
        os._exit(70)  # EX_SOFTWARE: the child never returns into the keeper's loop


def _be_task(
    run: Callable[[list[str]], int], become: Callable[[dict[str, Any]], None], handover: Any
) -> NoReturn:
    """(In a fork) the task: its log and variables, then the worker's entry point; never returns."""
    code = 70
    try:
        become(handover)
        from worker import runtime

        code = run([str(a) for a in handover["argv"]])
        runtime.flush_and_exit(code)
    except SystemExit as exc:
        from worker import runtime

        code = runtime.exit_code(exc.code)  # None: 0; a message: said, and 1
    except BaseException:  # noqa: BLE001 - said in the task's log, which `become` made its stderr
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _read_line(fd: int) -> bytes:
    """One line from a blocking descriptor (b"": end of file before a whole line)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return data


def _own_pages() -> None:
    """Copy now, while this fork is single-threaded, the pages of its private writable mappings
    that it still shares with its keeper (/proc/self/pagemap: present, not exclusively mapped):
    madvise(MADV_POPULATE_WRITE) over each run of them (Linux 5.14+; a range unmapped meanwhile is
    an error, never a fault). Device mappings are left alone; nothing is done where it cannot be."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for line in maps:
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if fields[1] != "rw-p" or path.startswith("/dev/") or path in ("[vvar]", "[vsyscall]"):
                    continue
                low, high = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(low // _PAGE * 8)
                for first, count in _shared_runs(pagemap.read((high - low) // _PAGE * 8)):
                    if madvise(low + first * _PAGE, count * _PAGE, _MADV_POPULATE_WRITE) and (
                        ctypes.get_errno() == errno.EINVAL  # a kernel before 5.14
                    ):
                        return
    except (OSError, ValueError, AttributeError):
        return


def _shared_runs(entries: bytes) -> list[tuple[int, int]]:
    """(first page, pages) of each run of present pages not exclusively mapped (pagemap entries)."""
    runs: list[tuple[int, int]] = []
    for i, (entry,) in enumerate(struct.iter_unpack("<Q", entries)):
        if entry >> 63 and not (entry >> 56) & 1:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _leave_keeper(keeper: int, reader: int, keepers: tuple[int, ...]) -> None:
    """This fork made a process of its own: a session, its keeper's end its end, the keeper's
    descriptors (stdin: `become` replaces it) and signal handling gone, fresh random state, the
    keeper's parent its reader."""
    os.setsid()
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != keeper:  # the keeper died before the line above: so does this
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in _PASSED_OVER:  # ignored dispositions survive a fork: a task's are a new process's
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for fd in keepers:
        with contextlib.suppress(OSError):
            os.close(fd)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # its legacy global state, seeded from the OS as a new process's
        numpy_random.seed()
    from worker import stack_dump

    stack_dump.READER = reader
