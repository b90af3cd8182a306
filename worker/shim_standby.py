"""Remote side: a task's warm standby (orchestrator/launch/standby.py), kept by its shim.

worker/shim.py loads this file from the path its job names (`standby.module`: the cache's copy
over ssh, the package's under Slurm) when the job asks for a standby. Standard library only, as
the shim: it imports nothing of this package, and uses the shim's own helpers (`shim`).

The standby starts where the host keeps the memory for it (`standby.need` bytes leave at least
`standby.keep` and a tenth of the host's memory available; else "standby_refused" with the
figures) and is said ("standby"; "standby_ready" once TensorFlow is imported; "standby_failed"
with its log's last lines when it exits first, a broken host found before it was needed). The
coordinator's next line is the attempt's part of the job, "GO {…}" (attempt, env, log, pidfile,
error_file, port_lock, and the `handover` line the standby reads); end of file instead stops it,
and so does silence: the coordinator says "ALIVE" every few seconds, and a standby that hears
nothing for `standby.alive_s` (its host cut off, where sshd may never see the connection end)
stops.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import threading
import time
from typing import Any


def standby(job: dict[str, Any], shim: Any) -> tuple[subprocess.Popen[bytes], dict[str, Any]] | int:
    """The task's warm standby (orchestrator/launch/standby.py) started, where the host keeps
    the memory for it, and said ("standby", "standby_ready" once it has imported TensorFlow,
    "standby_failed" with its last lines if it exits first); then the attempt's part of the job
    (the line "GO {…}"). End of file instead: it is stopped. An int: the shim's exit code."""
    memory = _meminfo()
    need, keep = job["standby"].get("need"), job["standby"].get("keep")
    if need is not None and memory and memory[0] - need < max(keep, memory[1] // 10):
        shim._emit({"event": "standby_refused", "available": memory[0], "total": memory[1]})
        shim._emit({"event": "exit", "code": 0})
        return 0
    try:
        shim._materialize(job["cache"], job["folder"], job["files"])
        os.makedirs(os.path.dirname(job["standby"]["log"]), mode=0o700, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(job["standby"]["log"], flags, 0o600), "ab") as out:
            out.write(
                f"===== orchestrate: standby of {job['task']} ({time.strftime('%H:%M:%S')}) =====\n".encode()
            )
            out.flush()
            start = os.fstat(out.fileno()).st_size  # its own lines: a log may hold an earlier standby's
            env = {**os.environ, **job["env"]}
            child = subprocess.Popen(
                job["argv"],
                cwd=job["cwd"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except OSError as exc:
        shim._emit({"event": "error", "message": f"cannot start the standby of {job['task']}: {exc}"})
        return 1
    shim._emit(
        {"event": "standby", "pid": child.pid, "pgid": child.pid, "create_time": shim._create_time(child.pid)}
    )
    told = threading.Event()
    log = job["standby"]["log"]
    threading.Thread(target=_watch, args=(shim, log, start, child, told), daemon=True).start()
    line = _next_line(float(job["standby"].get("alive_s") or 0) or None)
    told.set()
    if not line.startswith(b"GO "):
        shim._terminate_group(child.pid, 0.0)  # the coordinator is done with it, or gone
        child.wait()  # killed: at once
        shim._emit({"event": "exit", "code": 0})
        return 0
    return child, json.loads(line[3:])


def _next_line(alive_s: float | None) -> bytes:
    """The coordinator's next line other than "ALIVE" (it says so every few seconds); b"" at end
    of file, or when it said nothing for `alive_s` (its host cut off: sshd may never notice).
    Read a byte at a time from fd 0: nothing past the line is taken from the shim's stdin, whose
    later lines (TERM, KILL) are the task's."""
    while True:
        line = b""
        while not line.endswith(b"\n"):
            if alive_s is not None and not select.select([0], [], [], alive_s)[0]:
                return b""
            byte = os.read(0, 1)
            if not byte:
                return b""  # end of file (a line cut short is no GO)
            line += byte
        if line.strip() != b"ALIVE":
            return line


def _watch(shim: Any, log: str, start: int, child: subprocess.Popen[bytes], told: threading.Event) -> None:
    ready = False
    while child.poll() is None and not told.is_set():
        if not ready and b"orchestrate-standby: ready" in _tail(log, start):
            ready = True
            shim._emit({"event": "standby_ready"})
        time.sleep(0.2)
    if child.poll() is not None and not told.is_set():  # it could not import TensorFlow
        tail = _tail(log, start).decode(errors="replace")
        shim._emit({"event": "standby_failed", "code": child.returncode, "tail": tail})
        shim._emit({"event": "exit", "code": child.returncode})
        os._exit(0)


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
