"""A keeper's spare (worker/warm/keeper.py, docs/architecture.md §6) — the next task's
process, forked from the keeper ahead of its handover.

A task forked from its keeper shares the keeper's private pages, and each one it writes first is
copied on a fault: ~3 µs while the process has one thread, ~11 µs of the faulting thread's CPU
once TensorFlow's threads run on the other cores (the copy's TLB shootdown must reach them), and a
first step writes to thousands (Python's reference counts alone: issue 39,
scripts/bench/fork_pages.py). A spare copies them all at once, single-threaded, before the
failure: madvise(MADV_POPULATE_WRITE) over each run of pages of its private writable mappings
that /proc/self/pagemap says are present and not exclusively its own (~47,000 pages, 0.1 s,
~190 MiB of its own). Then it waits on a pipe for a handover line; having it, it says so on
another pipe and becomes the task. End of file ends it (exit 0, said by no one). The keeper has
one spare at a time (`Slot`): made when the keeper is ready and `SPARE_AFTER_S` after each
handover (the task's start and first step have the cores first); a handover with no spare, or
whose spare did not take it, is forked as before; spares that die unused are made again later,
and after `GIVE_UP_AFTER` in a row no more (said once in the standby's log).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import select
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from worker.host import probe

SPARE_AFTER_S = 3.0
GIVE_UP_AFTER = 3
_TAKE_S = 10.0  # a spare still copying takes its handover once done (0.1-0.3 s)
_PAGE = mmap.PAGESIZE
_PAGEMAP_CHUNK = 1 << 16  # entries read at a time (512 KiB)


class Spare:
    """One spare: `leave(fds)` makes the fork a process of its own (closing the keeper's `fds`),
    `be_task(handover)` makes it the task and never returns (it raises keeper.Become, which the
    spare lets through)."""

    def __init__(
        self,
        leave: Callable[[tuple[int, ...]], None],
        be_task: Callable[[Any], NoReturn],
        fds: tuple[int, ...],
    ) -> None:
        read, self._pipe = os.pipe()  # the handover: keeper → spare
        self._took, took = os.pipe()  # the spare's answer, one byte once it has it
        try:
            self.pid = os.fork()
        except OSError:
            for fd in (read, self._pipe, self._took, took):
                os.close(fd)
            raise
        if self.pid:
            os.close(read)
            os.close(took)
            return
        try:
            leave(fds + (self._pipe, self._took))
            nothing = os.open(os.devnull, os.O_RDONLY)
            os.dup2(nothing, 0)  # the keeper's stdin is the keeper's alone
            os.close(nothing)
            short = own_pages()
            if short is not None:  # in the standby's log: a handover served still, forked as before
                print(
                    f"orchestrate-standby: a spare's page copy fell short: {short}",
                    file=sys.stderr,
                    flush=True,
                )
            line = _read_line(read)
            if not line:
                os._exit(0)  # no handover: a spare no one needed
            handover = json.loads(line)
            os.write(took, b"!")
            os.close(took)
            os.close(read)
        except BaseException:  # noqa: BLE001 - in the standby's log; the keeper forks the task itself
            import traceback

            traceback.print_exc()
            os._exit(70)  # EX_SOFTWARE: a task that did not run
        be_task(handover)  # never returns here: it raises out of the keeper's frames (worker/warm/keeper.py)
        os._exit(70)  # not reached (be_task raises): a spare never goes back into the keeper's loop

    def hand(self, line: bytes) -> int | None:
        """The spare's pid once it has taken the handover line; None (and it stopped) if not."""
        took = False
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._pipe, view) :]
            if select.select([self._took], [], [], _TAKE_S)[0]:
                took = os.read(self._took, 1) == b"!"
        except OSError:
            took = False
        if not took:
            self.close(kill=True)
            return None
        self._close()
        return self.pid

    def ended(self) -> bool:
        """It exited (reaped)."""
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(self.pid, os.WNOHANG)[0] != self.pid:
                return False
        self._close()
        return True

    def close(self, kill: bool = False) -> None:
        """Stopped and reaped: end of file on its pipe (SIGKILL at once with `kill`, or if it has
        not gone within a second)."""
        self._close()
        deadline = time.monotonic() + 1.0
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if kill:
                os.kill(self.pid, signal.SIGKILL)
            while os.waitpid(self.pid, os.WNOHANG)[0] != self.pid:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.01)

    def _close(self) -> None:
        for fd in (self._pipe, self._took):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipe = self._took = -1


class Slot:
    """The keeper's one spare, made by `make` when due."""

    def __init__(self, make: Callable[[], Spare]) -> None:
        self._make = make
        self._spare: Spare | None = None
        self._due = time.monotonic()
        self._deaths = 0  # spares in a row that died unused

    def hand(self, line: bytes) -> int | None:
        """The task's pid if the spare took this handover; None: fork it."""
        spare, self._spare = self._spare, None
        self._due = time.monotonic() + SPARE_AFTER_S
        if spare is None:
            return None
        pid = spare.hand(line)
        if pid is None:
            self._died()
        else:
            self._deaths = 0
        return pid

    def tend(self, closing: bool) -> float | None:
        """A dead spare reaped, the spare stopped when `closing`, a new one made when due; the
        seconds until one is (None: nothing to wait for)."""
        if self._spare is not None and (closing or self._spare.ended()):
            if closing:
                self._spare.close()
            else:
                self._died()
            self._spare = None
        if closing or self._deaths >= GIVE_UP_AFTER:
            return None
        now = time.monotonic()
        if self._spare is None and now >= self._due:
            self._due = now + SPARE_AFTER_S
            try:
                self._spare = self._make()
            except OSError:  # no fork or pipe to be had now (memory, descriptors): as a spare lost
                self._died()
        return None if self._spare is not None else max(0.0, self._due - now)

    def _died(self) -> None:
        self._deaths += 1
        self._due = time.monotonic() + SPARE_AFTER_S * 2**self._deaths
        if self._deaths == GIVE_UP_AFTER:
            print(
                f"orchestrate-standby: {GIVE_UP_AFTER} spares in a row died unused; each task is "
                "forked at its handover from now on",
                file=sys.stderr,
                flush=True,
            )


def own_pages() -> str | None:
    """Copy now, while this fork is single-threaded, the pages of its private writable mappings
    that it still shares with its keeper. Mappings of files under /dev are left alone; a range
    unmapped meanwhile is an error, never a fault. What it could not copy, in words (None: all
    of it); the keeper has said already where the kernel cannot (worker/host/probe.py `page_copy`)."""
    failed, first, pages = 0, "", 0
    try:
        madvise = probe.populating_madvise()
        if madvise is None:
            return "no madvise(MADV_POPULATE_WRITE) here"
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for line in maps:
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if fields[1] != "rw-p" or path.startswith("/dev/") or path in ("[vvar]", "[vsyscall]"):
                    continue
                low, high = (int(x, 16) for x in fields[0].split("-"))
                for page in range(low // _PAGE, high // _PAGE, _PAGEMAP_CHUNK):
                    pagemap.seek(page * 8)
                    entries = pagemap.read(min(_PAGEMAP_CHUNK, high // _PAGE - page) * 8)
                    for first_page, count in shared_runs(entries):
                        pages += count
                        address, size = (page + first_page) * _PAGE, count * _PAGE
                        if madvise(address, size, probe.MADV_POPULATE_WRITE) != 0:
                            failed += count
                            first = first or os.strerror(ctypes.get_errno())
    except Exception as exc:  # noqa: BLE001 - copying is an optimisation: the spare serves without it
        return f"{type(exc).__name__}: {exc}"
    return f"{failed} of {pages} pages not copied ({first})" if failed else None


def shared_runs(entries: bytes) -> list[tuple[int, int]]:
    """(first page, pages) of each run of present pages not exclusively mapped (pagemap entries:
    bit 63 present, bit 56 exclusively mapped)."""
    runs: list[tuple[int, int]] = []
    for i, (entry,) in enumerate(struct.iter_unpack("<Q", entries)):
        if entry >> 63 and not (entry >> 56) & 1:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _read_line(fd: int) -> bytes:
    """One line from a blocking descriptor (b"": end of file before a whole line)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return data
