"""In the task: the runtime's own dump of every thread's frames on worker/host/stacks.py's SIGNAL,
into the task's stacks file — what a coordinator reads where py-spy is missing or refused. A
handler the job sets for that signal later (signal.signal) runs after the dump, not instead."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Callable
from typing import Any

from worker.host import stacks

_registered: dict[str, Any] = {}
#: Who reads this task's stacks where its parent does not: a task forked by a keeper (worker/warm/keeper.py)
#: is read by its keeper's parent.
READER: int | None = None


def register(target: str) -> bool:
    """Dump every thread's frames into `target` on SIGNAL (a private file, made anew, appended to:
    a reader cuts it back to its header); a job's own handler for SIGNAL, set later through
    signal.signal, is chained after the dump. False where the file cannot be made (the task then
    has no dump of its own; py-spy may still read it). From the main thread (signal.signal's)."""
    try:
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(target, flags, 0o600)
    except OSError:
        return False
    out = os.fdopen(fd, "w", buffering=1)
    out.write(stacks.HEADER.format(pid=os.getpid()))
    _let_parent_read()
    original = _registered.setdefault("signal", signal.signal)
    # what faulthandler puts back whenever it is unregistered: ignored, never the default, which
    # for a real-time signal ends the process (a dump asked in that instant is lost, not the task)
    original(stacks.SIGNAL, signal.SIG_IGN)
    faulthandler.register(stacks.SIGNAL, out, all_threads=True, chain=False)
    _registered["file"] = out
    if signal.signal is original:
        setattr(signal, "signal", _chaining(original))  # noqa: B010 - the module's own name
    return True


def _let_parent_read() -> None:
    """Under Yama's ptrace_scope 1 only a process's ancestors may read it, and py-spy is started by
    the task's parent (the coordinator, or its shim; a keeper's parent, READER) beside it: the
    parent, and what it starts, is declared this task's reader (PR_SET_PTRACER). Elsewhere nothing
    is needed, or nothing helps; an orphan (its parent gone: init or a subreaper adopted it)
    declares no one."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            reader = READER or os.getppid()
            if f.read().strip() != "1" or reader == 1:
                return
        import ctypes

        ctypes.CDLL(None).prctl(0x59616D61, reader, 0, 0, 0)  # PR_SET_PTRACER
    except (OSError, AttributeError, ValueError):
        return


def _chaining(original: Callable[..., Any]) -> Callable[..., Any]:
    """signal.signal, but a handler set for SIGNAL runs after the runtime's dump, not instead; a
    job's SIG_DFL or SIG_IGN leaves the dump alone. Never the default disposition in between."""

    def set_handler(signalnum: int, handler: Any) -> Any:
        if signalnum != stacks.SIGNAL or "file" not in _registered:
            return original(signalnum, handler)
        before = original(signalnum, signal.SIG_IGN)  # over faulthandler's handler: ignored meanwhile
        faulthandler.unregister(stacks.SIGNAL)  # puts back what it replaced: SIG_IGN, or a function
        if callable(handler):
            original(signalnum, handler)
        faulthandler.register(stacks.SIGNAL, _registered["file"], all_threads=True, chain=callable(handler))
        return before

    return set_handler
