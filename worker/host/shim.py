"""The shim that runs one task on a lab host (ssh and slurm backends).

The coordinator copies this file (with the rest of the package) into each host's file cache and
runs it from there over an SSH channel as `PYTHON -S WORKDIR/cache/<sha256>`. Standard library
only, and it imports nothing of this package: it is what puts the package in place.

Protocol (one SSH channel per task attempt):
- stdin, first line: JSON {cache, folder, files, argv, env, cwd, log, pidfile, run_id, task,
  attempt, grace_s, and optionally error_file, stacks_file, stacks_module, follow,
  forward_signals, port_lock and standby}. The shim fills the run's folder from the cache
  (`files`: [relpath, sha256, mode]), then starts the task (`standby`: a standby kept for the
  run, each attempt on "GO {…}": shim_standby.py). The environment travels here, never on argv.
- stdin, later lines: "TERM" (SIGTERM + SIGCONT to the task's process group), "KILL", or
  "STACKS ID {timeout_s, native}" (the task's stacks read: worker/host/stacks.py). End of file (the
  coordinator closed the channel, died, or lost the connection) means TERM, then SIGKILL after
  grace_s: a task never outlives its SSH connection.
- stdout: the task's output, followed live from its log file on the host (the task writes to the
  file itself, so a slow or dead connection never blocks it and the host keeps the full log).
- Slurm runs the same shim as a job step with `follow: false` (the log is on a filesystem the
  coordinator shares), `forward_signals: false` (Slurm signals the task itself) and `port_lock`:
  a node-local file held locked while the task lives (another run's probe avoids its port).
- stderr: one JSON line per event: {"event": "started", pid, pgid, create_time, node, step}, then,
  for a task that failed and wrote its error file (worker/wire/failure.py), {"event": "failure",
  "document": {…}}, then {"event": "exit", "code": N} (negative N: killed by signal -N); and
  {"event": "stacks", "id", "document"} when asked. Other text comes from a failed start.

Before starting, the shim stops a previous attempt of the same task still alive on this host
(recorded in the pidfile and checked by its run id), so a task is never running twice.
`shim.py --stop RUN_ID GRACE_S PIDFILE…` does only that, for `orchestrate down` without a coordinator.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any

_RUN_ID_ENV = "ORCHESTRATE_RUN_ID"
_MAX_ERROR_FILE_BYTES = 128 * 1024  # worker/wire/failure.py's MAX_BYTES
_LOADED: dict[str, Any] = {}  # the runtime's modules loaded from the cache, by path


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stop"]:  # `orchestrate down` with the coordinator gone: RUN_ID GRACE_S PIDFILE…
        return _stop_only(argv[1], float(argv[2]), argv[3:])
    line = sys.stdin.buffer.readline()
    if not line:
        return 2
    job: dict[str, Any] = json.loads(line)
    if job.get("standby") is not None:  # a warm standby kept for the run; each attempt on "GO {…}"
        return int(_load(job, "shim_standby", job["standby"]["module"]).keep(job, sys.modules[__name__]))
    ready = _ready(job)
    if isinstance(ready, str):
        _emit({"event": "error", "message": ready})
        return 1
    started = _start(job, stale=ready)
    if isinstance(started, int):
        return started
    return _watch(job, *started)


def _ready(job: dict[str, Any], files: bool = True) -> int | None | str:
    """_prepare, and what the watch needs loaded before the task starts: nothing fails once it runs."""
    ready = _prepare(job, files)
    try:
        _load(job, "follow")
        _load(job, "stacks")
    except Exception as exc:  # noqa: BLE001 - said: the task is not started
        ready = f"cannot load the runtime's modules: {exc}"
    return ready


def _load(job: dict[str, Any], name: str, path: str | None = None) -> Any:
    """A module of the runtime: the cache's copy the job names (`NAME_module`, named by its
    checksum: the shim runs alone, without the package), else the one beside this file; loaded
    once."""
    path = path or job.get(f"{name}_module") or os.path.join(os.path.dirname(__file__), f"{name}.py")
    if path in _LOADED:
        return _LOADED[path]
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _LOADED[path] = module
    return module


def _stop_only(run_id: str, grace_s: float, pidfiles: list[str]) -> int:
    found = {path: _recorded_group(path, run_id) for path in pidfiles}
    _terminate_groups([g for g, _ in found.values() if g is not None], grace_s)  # together
    answer = {path: said for path, (_, said) in found.items()}
    os.write(1, (json.dumps(answer) + "\n").encode())
    return 0


def _prepare(job: dict[str, Any], files: bool = True) -> int | None | str:
    """The run's folder filled (unless a standby did), a previous attempt of the task still
    running here stopped (its process group, or None), its TF port's lock held; or why not."""
    try:
        if files:
            _materialize(job["cache"], job["folder"], job["files"])
    except OSError as exc:
        return f"cannot fill {job['folder']} from {job['cache']}: {exc}"
    for path in (job["log"], job["pidfile"]):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    # A previous attempt of this task still running here (its host was cut off): stop it first.
    stale, _ = stop_recorded(job["pidfile"], job["run_id"], grace_s=5.0)
    if job.get("error_file"):  # a process of this task before (restarted alone): not this one's
        with contextlib.suppress(OSError):
            os.unlink(job["error_file"])
    if job.get("port_lock"):
        try:
            held = _lock_port(job["port_lock"])
        except OSError as exc:
            return f"cannot lock its TF port ({job['port_lock']}): {exc}"
        if held is None:
            return "its TF port is taken by another orchestrate run on this node"
        job["port_fd"] = held  # a kept shim lets it go once the task has ended
    return stale


def _start(job: dict[str, Any], stale: int | None, fork: Any = None) -> tuple[Any, int] | int:
    """The task started in its own session (or forked by its keeper: `fork(handover)`), its
    output to its log (after a marker line), and said ("started"); the child and where its output
    begins, or the exit code of a failed start."""
    out = open(job["log"], "ab")  # noqa: SIM115 - handed to the child, closed at exit
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    out.write(f"===== orchestrate: {job['task']} attempt {job['attempt']} started {stamp} =====\n".encode())
    if stale is not None:
        out.write(
            f"orchestrate: stopped a previous attempt still running here (process group {stale})\n".encode()
        )
    out.flush()
    offset = out.tell()
    if fork is not None:
        out.close()
        try:
            return _said_started(job, fork(job["handover"])), offset
        except OSError as exc:
            _emit({"event": "error", "message": f"cannot hand the attempt to the standby: {exc}"})
            return 1
    try:
        child = subprocess.Popen(
            job["argv"],
            cwd=job["cwd"],
            env={**os.environ, **job["env"]},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
    except OSError as exc:
        _emit({"event": "error", "message": f"cannot start {job['argv'][0]}: {exc}"})
        return 127
    finally:
        out.close()
    return _said_started(job, child), offset


def _said_started(job: dict[str, Any], child: Any) -> Any:
    info = {"pid": child.pid, "pgid": child.pid, "create_time": _create_time(child.pid)}
    with open(tmp := f"{job['pidfile']}.tmp{os.getpid()}", "w") as f:
        json.dump({**info, "run_id": job["run_id"], "task": job["task"], "shim": os.getpid()}, f)
    os.replace(tmp, job["pidfile"])
    step = os.environ.get("SLURM_STEP_ID")
    where = {
        "node": socket.gethostname(),
        "step": f"{os.environ.get('SLURM_JOB_ID')}.{step}" if step else None,
    }
    _emit({"event": "started", **info, **where})
    return child


def _watch(job: dict[str, Any], child: Any, offset: int, attach: Any = None) -> int:
    """Until the task ends: its log followed, TERM/KILL from stdin passed on (by a kept shim's
    `attach`ed reader); then its error file (if it failed and wrote one) and its exit said."""
    pgid = child.pid
    follower = _load(job, "follow").Follower(job["log"], offset) if job.get("follow", True) else None
    if follower is not None:
        follower.start()
    if attach is None:
        threading.Thread(target=_control, args=(job, pgid), daemon=True).start()
    else:
        attach(job, pgid)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:
        if job.get("forward_signals", True):
            # sshd or an admin stopping the shim: the task goes too
            signal.signal(sig, lambda *_: _terminate_group(pgid, float(job["grace_s"])))
        else:
            signal.signal(sig, signal.SIG_IGN)  # the task had it too; the shim reports its exit
    code = int(child.wait())
    for sig, handler in previous.items():  # the ended task's group is no one's to signal now
        signal.signal(sig, handler)
    _terminate_group(pgid, grace_s=2.0)  # nothing of the task outlives it (its own children included)
    if follower is not None:
        follower.finish()
    if code != 0 and job.get("error_file"):
        written = _read_error_file(job["error_file"])
        if written is not None:
            _emit({"event": "failure", "document": written})
    _emit({"event": "exit", "code": code})
    return code if code >= 0 else 128 - code


def _read_error_file(path: str) -> Any:
    """The task's error file (worker/wire/failure.py), parsed; None where it wrote none. Read whole up
    to _MAX_ERROR_FILE_BYTES, never through a symlink; the coordinator checks what it says."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(_MAX_ERROR_FILE_BYTES + 1)
        except OSError:
            return None
    if len(data) > _MAX_ERROR_FILE_BYTES:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _lock_port(path: str) -> int | None:
    """Hold the node-local lock of the task's TF port for the task's life (a plain shim's life; a
    kept standby's shim lets go of it after each attempt): another run's probe on this node then
    chooses another port, and two TensorFlow servers (which bind with SO_REUSEPORT) never share
    one. None when another process holds it. The folders are private and ours; no symlink is
    followed."""
    ports = os.path.dirname(path)
    for folder in (os.path.dirname(ports), ports):
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{folder} is not a private folder of this user")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd  # kept open (close-on-exec: the task does not inherit it)


def _materialize(cache: str, folder: str, files: list[list[Any]]) -> None:
    """Copy each file from the cache into the run's folder: written under a temporary name, then
    renamed, so tasks starting side by side on one host never see half a file."""
    for rel, digest, mode in files:
        target = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp{os.getpid()}"
        shutil.copyfile(os.path.join(cache, digest), tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)


def _control(job: dict[str, Any], pgid: int) -> None:
    for raw in sys.stdin.buffer:
        command(job, pgid, raw.strip().decode(errors="replace"))
    # End of file: the coordinator or its connection is gone. Stop the task; never orphan it.
    _terminate_group(pgid, float(job["grace_s"]))


def command(job: dict[str, Any], pgid: int, said: str) -> None:
    """The coordinator's TERM, KILL, or STACKS ID {…} (read on a thread: worker/host/stacks.py)."""
    if said == "TERM":
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)
    elif said == "KILL":
        _signal_group(pgid, signal.SIGKILL)
    elif said.startswith("STACKS "):
        ident, _, asked = said[7:].partition(" ")
        try:
            _load(job, "stacks").answer(job, pgid, ident, asked, _emit)
        except Exception as exc:  # noqa: BLE001 - said; the reader of stdin goes on
            _emit({"event": "stacks", "id": ident, "document": {"notes": [f"cannot read them: {exc}"]}})


def _terminate_groups(pgids: list[int], grace_s: float) -> None:
    """SIGTERM (with SIGCONT) to what is left of the groups, up to grace_s for them to go, then
    SIGKILL. (The coordinator's own routine is orchestrator/launch/api.py's stop_all; this one
    must stay standard-library only.)"""
    live = [g for g in pgids if _group_alive(g)]
    for pgid in live:
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(g) for g in live):
        time.sleep(0.05)
    for pgid in live:
        _signal_group(pgid, signal.SIGKILL)


def _terminate_group(pgid: int, grace_s: float) -> None:
    _terminate_groups([pgid], grace_s)


def _recorded_group(pidfile: str, run_id: str) -> tuple[int | None, str]:
    """The live process group a pidfile records, if it carries this run's id (never someone
    else's process): (the group or None, what was found)."""
    try:
        with open(pidfile) as f:
            pgid = int(json.load(f).get("pgid", 0))
    except (OSError, ValueError):
        return None, "no record"
    if pgid <= 1 or not _group_alive(pgid):
        return None, "not running"
    if not _has_run_id(pgid, run_id):
        return None, f"process group {pgid} is not this run's; left alone"
    return pgid, f"stopped process group {pgid}"


def stop_recorded(pidfile: str, run_id: str, grace_s: float) -> tuple[int | None, str]:
    """Stop the process group a pidfile records, if it is this run's. Returns (the group stopped
    or None, what was found)."""
    pgid, said = _recorded_group(pidfile, run_id)
    if pgid is not None:
        _terminate_group(pgid, grace_s)
    return pgid, said


def _has_run_id(pid: int, run_id: str) -> bool:
    """The run tag: a process of ours carries ORCHESTRATE_RUN_ID in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{_RUN_ID_ENV}={run_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group of zombies still answers; look for a live member.
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _create_time(pid: int) -> float:
    """As psutil computes it: boot time + start ticks (guards a recorded pid against reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return 0.0


_EMITTING = threading.Lock()  # a long event (stacks) is written in pieces: never two at once


def _emit(event: dict[str, Any]) -> None:
    data = (json.dumps(event) + "\n").encode()
    with _EMITTING, contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


if __name__ == "__main__":
    # os._exit: the control thread may be blocked reading stdin, and an ordinary interpreter exit
    # would wait on that buffer's lock and abort. Everything is written with os.write already.
    os._exit(main(sys.argv[1:]))
