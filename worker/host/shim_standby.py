"""A task's warm standby (orchestrator/launch/standby.py), kept by its shim for the
run (docs/architecture.md §6).

worker/host/shim.py loads this file from the path its job names (`standby.module`: the cache's copy
over ssh, the package's under Slurm) when the job asks for a standby. Standard library only, as
the shim: it imports nothing of this package, and uses the shim's own helpers (`shim`).

The standby starts where the host keeps the memory for it (`standby.need` bytes leave at least
`standby.keep` and a tenth of the host's memory available; else "standby_refused" with the
figures) and is said ("standby"; "standby_ready" once TensorFlow is imported; "standby_failed"
with its log's last lines when it exits, a broken host found before it was needed). It is a
keeper (worker/warm/keeper.py): each line "GO {…}" (attempt, env, log, pidfile, error_file,
stacks_file, port_lock, and the `handover` line the keeper reads) forks the attempt's task from
it, which the shim watches as it would a task it started ("started", "failure", "exit"; TERM,
KILL and STACKS passed on); then it waits for the next GO, the standby still there. End of file
stops it (a task still running first, as any shim's), and so does silence: the coordinator says
"ALIVE" every few seconds, and a shim that hears nothing for `standby.alive_s` (its host cut
off, where sshd may never see the connection end) stops its standby and task.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import Any

_FORK_S = 5.0  # how long a keeper may take to say it forked (a fork: at once)


def keep(job: dict[str, Any], shim: Any) -> int:
    """The task's standby started (where the host keeps the memory for it) and kept: each GO an
    attempt, until end of file or silence. The shim's exit code."""
    started = _start(job, shim)
    if isinstance(started, int):
        return started
    keeper, log, start = started
    inbox = _Inbox(shim, float(job["standby"].get("alive_s") or 0) or None)
    assert keeper.stdout is not None
    events = KeeperEvents(keeper.stdout.fileno())
    stopping = threading.Event()
    attempt: dict[str, Any] = {}
    ready = threading.Thread(target=_ready, args=(shim, log, start, keeper, stopping), daemon=True)
    ready.start()

    def fork(handover: Any) -> _Forked:
        line = (json.dumps(handover) + "\n").encode()
        try:
            forked = _Forked(events.fork(keeper.stdin, line, _FORK_S), events)
        except OSError:
            shim._terminate_group(keeper.pid, 0.0)  # a late fork would be no one's: no keeper left
            raise
        inbox.attach(attempt, forked.pid)  # before "started": TERM, KILL, end of file reach it
        return forked

    while (go := inbox.next_go(keeper)) is not None:
        attempt.clear()
        attempt.update(job, **go)
        try:
            _attempt(attempt, shim, fork, inbox)
        finally:
            inbox.attach(attempt, None)
            if attempt.get("port_fd") is not None:
                os.close(attempt["port_fd"])  # the task's TF port: free for the next attempt's
    if keeper.poll() is None:  # the coordinator is done with it, or gone
        stopping.set()
        shim._terminate_group(keeper.pid, 0.0)
    keeper.wait()
    ready.join(timeout=2.0)  # a keeper that ended by itself is said first
    shim._emit({"event": "exit", "code": 0})
    return 0


def _attempt(job: dict[str, Any], shim: Any, fork: Any, inbox: _Inbox) -> None:
    """One attempt: prepared as any shim's, its task forked, watched, its exit said ("error" and
    an exit code where it could not start: the standby stays for the next)."""
    stale = shim._ready(job, files=False)
    if isinstance(stale, str):
        shim._emit({"event": "error", "message": stale})
        shim._emit({"event": "exit", "code": 1})
        return
    begun = shim._start(job, stale, fork=fork)
    if isinstance(begun, int):
        shim._emit({"event": "exit", "code": begun})
        return
    shim._watch(job, *begun, attach=inbox.attach)


def _start(job: dict[str, Any], shim: Any) -> tuple[subprocess.Popen[bytes], str, int] | int:
    memory = _meminfo()
    need, keep_free = job["standby"].get("need"), job["standby"].get("keep")
    if need is not None and memory and memory[0] - need < max(keep_free, memory[1] // 10):
        shim._emit({"event": "standby_refused", "available": memory[0], "total": memory[1]})
        shim._emit({"event": "exit", "code": 0})
        return 0
    log = job["standby"]["log"]
    try:
        shim._materialize(job["cache"], job["folder"], job["files"])
        os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(log, flags, 0o600), "ab") as out:
            out.write(
                f"===== orchestrate: standby of {job['task']} ({time.strftime('%H:%M:%S')}) =====\n".encode()
            )
            out.flush()
            start = os.fstat(out.fileno()).st_size  # its own lines: a log may hold an earlier standby's
            keeper = subprocess.Popen(
                job["argv"],
                cwd=job["cwd"],
                env={**os.environ, **job["env"]},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # its events: each task forked, and its end
                stderr=out,
                start_new_session=True,
            )
    except OSError as exc:
        shim._emit({"event": "error", "message": f"cannot start the standby of {job['task']}: {exc}"})
        return 1
    info = {"pid": keeper.pid, "pgid": keeper.pid, "create_time": shim._create_time(keeper.pid)}
    shim._emit({"event": "standby", **info})
    return keeper, log, start


class _Forked:
    """A task the keeper forked, as the shim watches it: its pid, and its end (waited for)."""

    def __init__(self, pid: int, events: KeeperEvents):
        self.pid = pid
        self._events = events

    def wait(self) -> int:
        code = self._events.exit_of(self.pid, wait=True)
        return -9 if code is None else code  # its keeper gone unreaped: it died with it (PDEATHSIG)


class KeeperEvents:
    """A keeper's stdout (worker/warm/keeper.py) as it comes: {"event": "started", "pid"} per fork,
    {"event": "exit", "pid", "code"} per task reaped. Read by one thread at a time (the shim's
    main thread; the local backend's under its lock); nothing else the keeper says goes there."""

    def __init__(self, fd: int):
        self._fd = fd
        self._buffer = b""
        self.ended = False
        self.started: list[int] = []
        self.exits: dict[int, int] = {}

    def fork(self, stdin: Any, handover: bytes, within_s: float) -> int:
        """The pid of the task forked with this handover line (OSError: the keeper is gone, or
        said nothing in time)."""
        stdin.write(handover)
        stdin.flush()
        deadline = time.monotonic() + within_s
        while not self.started:
            if self.ended:
                raise OSError("its keeper exited")
            if not self.read(deadline - time.monotonic()) and time.monotonic() >= deadline:
                raise OSError(f"its keeper forked no task within {within_s:g} s")
        return self.started.pop(0)

    def exit_of(self, pid: int, wait: bool) -> int | None:
        """The task's exit code once its keeper reaped it; None while it runs (`wait`: until it
        ends) and once the keeper is gone without saying."""
        while pid not in self.exits and self.read(None if wait else 0.0):
            pass
        return self.exits.get(pid)

    def read(self, timeout_s: float | None) -> bool:
        """What came within `timeout_s` (None: until something does) taken; False if nothing."""
        if self.ended:
            return False
        if timeout_s is not None and not select.select([self._fd], [], [], max(0.0, timeout_s))[0]:
            return False
        data = os.read(self._fd, 65536)
        self.ended = not data
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                event = json.loads(line)
                if event["event"] == "started":
                    self.started.append(int(event["pid"]))
                    self.exits.pop(int(event["pid"]), None)  # a pid used again: not the old task's end
                elif event["event"] == "exit":
                    self.exits[int(event["pid"])] = int(event["code"])
            except (ValueError, KeyError, TypeError):
                continue
        return True


class _Inbox(threading.Thread):
    """The shim's stdin, read for its whole life: each GO queued, ALIVE heard, TERM/KILL/STACKS
    passed on to the attempt's task (shim.command); end of file stops a task still running, as
    any shim's."""

    def __init__(self, shim: Any, alive_s: float | None):
        super().__init__(name="inbox", daemon=True)
        self._shim = shim
        self._alive_s = alive_s
        self._gos: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._heard = time.monotonic()
        self._lock = threading.Lock()
        self._task: tuple[dict[str, Any], int] | None = None
        self._eof = False
        self.start()

    def attach(self, job: dict[str, Any], pgid: int | None) -> None:
        with self._lock:
            self._task = (job, pgid) if pgid is not None else None
            self._heard = time.monotonic()  # silence is counted from the task's end on
            late = pgid is not None and self._eof
        if late:  # its coordinator went after its GO: never orphan the task
            self._shim._terminate_group(pgid, float(job["grace_s"]))

    def run(self) -> None:
        for raw in sys.stdin.buffer:
            said = raw.strip().decode(errors="replace")
            self._heard = time.monotonic()
            if said.startswith("GO "):
                self._gos.put(json.loads(said[3:]))
            elif said != "ALIVE":
                with self._lock:
                    task = self._task
                if task is not None:
                    self._shim.command(task[0], task[1], said)
        with self._lock:
            task, self._task, self._eof = self._task, None, True
        if task is not None:  # the coordinator or its connection is gone: never orphan the task
            self._shim._terminate_group(task[1], float(task[0]["grace_s"]))
        self._gos.put(None)

    def next_go(self, keeper: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        """The next attempt; None at end of file, after silence, or once the keeper is gone."""
        while True:
            try:
                go = self._gos.get(timeout=0.2)
                with self._lock:
                    return None if self._eof else go  # a GO before end of file: no one to run it for
            except queue.Empty:
                pass
            if keeper.poll() is not None:
                return None
            if self._alive_s is not None and time.monotonic() - self._heard > self._alive_s:
                return None


def _ready(
    shim: Any, log: str, start: int, keeper: subprocess.Popen[bytes], stopping: threading.Event
) -> None:
    """ "standby_ready" once the keeper has imported TensorFlow; "standby_failed" with its log's
    last lines once it exits unless the shim stopped it (it could not import TensorFlow, or died)."""
    while keeper.poll() is None:
        tail = _tail(log, start)
        if b"orchestrate-standby: ready" in tail:
            # where its spares cannot copy their pages (worker/warm/spare.py): said with it
            said = [x for x in tail.decode(errors="replace").splitlines() if x.startswith(_NO_PAGE_COPY)]
            missing = said[-1][len(_NO_PAGE_COPY) :].strip()[:500] if said else None
            shim._emit({"event": "standby_ready", "page_copy": missing})
            keeper.wait()
        time.sleep(0.2)
    if not stopping.is_set():
        text = _tail(log, start).decode(errors="replace")
        shim._emit({"event": "standby_failed", "code": keeper.returncode, "tail": text})


_NO_PAGE_COPY = "orchestrate-standby: no page copy:"  # wire.STANDBY_NO_PAGE_COPY (this file loads no module)


def _tail(path: str, start: int = 0, size: int = 2048) -> bytes:
    """The last `size` bytes of the log from `start` on."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - size))
            return f.read()
    except OSError:
        return b""


def _meminfo() -> tuple[int, int] | None:
    """(available, total) bytes of this host's memory."""
    try:
        with open("/proc/meminfo") as f:
            fields = {
                k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)
            }
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        return None
