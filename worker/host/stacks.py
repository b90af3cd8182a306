"""Every thread's stacks of a task, read while it hangs (issue 26), from outside it, on its host:
`capture` (the coordinator for local tasks, the shim for remote ones, which loads this file from
its cache: standard library only). In the task, worker/task/stack_dump.py registers the runtime's own
dump on SIGNAL.

`capture` reads a process with py-spy where it can (every Python thread's frames and, with
`native`, the C++ frames under them: TensorFlow's waits), from outside, its Python frames first
(`--nonblocking`: never paused, a few tens of ms) and its native ones alongside, up to a deadline.
Where py-spy is missing or refused, it asks the task's runtime: faulthandler, registered on
`SIGNAL` by `register` and chained to any handler the job sets for it, writes every thread's
Python frames to the task's stacks file. A stopped process (state T) is read without pausing it, or
said as stopped; a zombie or a process gone is said as such. The result is a plain document, bounded
(threads, frames, characters), whatever the process holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

#: The runtime's dump signal: a real-time one, which no library we know of uses.
SIGNAL = signal.SIGRTMIN + 6
FOLDER = "stacks"
MAX_THREADS = 48
MAX_INNER, MAX_OUTER = 80, 20  # frames kept per thread: the innermost, and the outermost
MAX_TEXT = 300  # characters of a function's or a file's name
MAX_DOC_BYTES = 512 * 1024  # a document, as JSON, at most
MAX_OUTPUT = 32 * 1024 * 1024  # of py-spy's JSON, or of a dump, read at most
ENV_PY_SPY = "ORCHESTRATE_PY_SPY"  # py-spy's path, or "none": the runtime's own dump only
HEADER = "orchestrate stacks of pid {pid}\n"


def path(run_folder: str, task: str, attempt: int) -> str:
    """Where a task's attempt writes its dumps, on its own host."""
    return posixpath.join(run_folder, FOLDER, f"{task}.{attempt}.txt")


# --- outside, on the task's host -------------------------------------------------------------


def answer(
    job: dict[str, Any], pid: int, ident: str, asked: str, emit: Callable[[dict[str, Any]], None]
) -> None:
    """The shim's side: the task's stacks, read on a thread of their own and said as an event."""

    def run() -> None:
        try:
            ask = json.loads(asked)
            until = time.monotonic() + float(ask["timeout_s"])
            py_spy = find_py_spy({**os.environ, **job["env"]})
            doc = capture(
                pid, until, stacks_file=job.get("stacks_file"), py_spy=py_spy, native=ask.get("native")
            )
        except Exception as exc:  # noqa: BLE001 - said to the coordinator, never the shim's end
            doc = {
                "pid": pid,
                "state": "unknown",
                "threads": [],
                "notes": [f"the shim could not read them: {exc}"],
            }
        emit({"event": "stacks", "id": ident, "document": doc})

    threading.Thread(target=run, daemon=True, name="stacks").start()


def find_py_spy(env: Mapping[str, str] = os.environ) -> str | None:
    """py-spy beside this Python (its environment's), else on PATH; ORCHESTRATE_PY_SPY overrides."""
    given = env.get(ENV_PY_SPY)
    if given is not None:
        return None if given in ("", "none") else given
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def process_state(pid: int) -> str:
    """running, sleeping (both: "running"), stopped, zombie or gone, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(code, "running")


def capture(
    pid: int,
    deadline: float,
    *,
    stacks_file: str | None = None,
    py_spy: str | None = None,
    native: bool = True,
) -> dict[str, Any]:
    """Every thread's stacks of process `pid`, by `deadline` (time.monotonic()); never raises."""
    start = time.monotonic()
    doc: dict[str, Any] = {"pid": pid, "state": process_state(pid), "method": None, "threads": []}
    doc["notes"] = []
    if doc["state"] in ("zombie", "gone"):
        doc["notes"].append("it had exited" if doc["state"] == "gone" else "it had exited (a zombie)")
    elif py_spy is not None:
        _by_py_spy(doc, py_spy, deadline, native and doc["state"] == "running")
    if not doc["threads"] and doc["state"] == "running" and process_state(pid) in ("zombie", "gone"):
        doc["state"] = process_state(pid)
        doc["notes"].append("it exited while being read")
    elif not doc["threads"] and doc["state"] == "running" and stacks_file is not None:
        _by_runtime(doc, stacks_file, deadline)
    elif not doc["threads"] and doc["state"] == "stopped":
        doc["notes"].append("stopped (state T): its runtime cannot answer; py-spy could read it")
    doc["seconds"] = round(time.monotonic() - start, 3)
    return bounded(doc)


def _by_py_spy(doc: dict[str, Any], py_spy: str, deadline: float, native: bool) -> None:
    """Python frames at once (never pausing it), and native ones (pausing it) by the deadline."""
    base = [py_spy, "dump", "--pid", str(doc["pid"]), "--json"]
    # Python frames only: a live run's, read at a low priority (it trains on every core, maybe)
    runs = {"python": _Run([*base, "--nonblocking", "--locals"], gentle=not native)}
    if native:
        runs["native"] = _Run([*base, "--native"])
    results = {name: run.result(deadline) for name, run in runs.items()}
    quick, slow = results["python"], results.get("native")
    if slow is not None and isinstance(slow, list):
        doc["threads"], doc["method"], doc["native"] = _threads(slow, ops=_ops(quick)), "py-spy", True
    elif isinstance(quick, list):
        doc["threads"], doc["method"], doc["native"] = _threads(quick, ops=_ops(quick)), "py-spy", False
        if native:
            doc["notes"].append(f"native frames: {slow}")
    else:
        doc["notes"].append(f"py-spy: {quick}")


class _Run:
    """One py-spy, its output read (bounded) on a thread of its own."""

    def __init__(self, argv: list[str], gentle: bool = False):
        self.out = bytearray()
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=(lambda: os.nice(10)) if gentle else None,  # noqa: PLW1509 - nice only
            )
        except OSError as exc:
            self.proc, self.error = None, f"cannot run {argv[0]}: {exc.strerror or exc}"
            return
        self.err = bytearray()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, buf), daemon=True)
            for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, buf: bytearray) -> None:
        while chunk := stream.read(65536):
            if len(buf) < MAX_OUTPUT:
                buf += chunk[: MAX_OUTPUT - len(buf)]

    def result(self, deadline: float) -> list[Any] | str:
        """Its threads (py-spy's JSON), or why not."""
        if self.proc is None:
            return self.error
        try:
            code = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return "not read in time"
        for reader in self._readers:
            reader.join(timeout=1.0)
        if code != 0:
            return _py_spy_error(self.err.decode(errors="replace"))
        try:
            threads = json.loads(bytes(self.out))
        except ValueError:
            return "its output was cut short or is not JSON"
        return threads if isinstance(threads, list) else "its output is not a list of threads"


def _py_spy_error(text: str) -> str:
    """py-spy's error, its first lines (its Rust backtrace left off)."""
    lines = [line.strip() for line in text.split("Stack backtrace:")[0].splitlines() if line.strip()]
    said = "; ".join(lines[:4])[:MAX_TEXT] or "failed, saying nothing"
    if "Permission" in said or "Operation not permitted" in said:
        said += " (ptrace refused: see `orchestrate check`)"
    return said


def _ops(threads: list[Any] | str) -> dict[int, str]:
    """Per thread, the TensorFlow operation or function it executes, from the arguments of
    TensorFlow's quick_execute (the only locals kept)."""
    out: dict[int, str] = {}
    for thread in threads if isinstance(threads, list) else []:
        for frame in thread.get("frames") or []:
            if frame.get("name") == "quick_execute" and str(frame.get("filename")).endswith("/execute.py"):
                for local in frame.get("locals") or []:
                    if local.get("name") == "op_name" and isinstance(local.get("repr"), str):
                        out[thread.get("thread_id")] = local["repr"].strip("\"'")[:MAX_TEXT]
                break
    return out


def _threads(raw: list[Any], ops: dict[int, str]) -> list[dict[str, Any]]:
    out = []
    for thread in raw:
        if not isinstance(thread, dict):
            continue
        tid = thread.get("os_thread_id")  # None before Python 3.11 without pausing it
        frames = [
            {
                "function": text(f.get("name")),
                "file": text(f.get("filename")),
                "line": f.get("line") if isinstance(f.get("line"), int) else 0,
                "native": f.get("module") is not None or not _python_file(str(f.get("filename"))),
            }
            for f in thread.get("frames") or []
            if isinstance(f, dict)
        ]
        main = tid == thread.get("pid") if tid is not None else thread.get("thread_name") == "MainThread"
        entry = {
            "name": text(thread.get("thread_name") or f"thread {tid}"),
            "id": tid,
            "main": main,
            # without the OS thread, py-spy guesses `active` from the innermost function: unknown
            "active": thread.get("active") if tid is not None else None,
            "frames": frames,
        }
        if thread.get("thread_id") in ops:  # Python's own id of it: the same in both reads
            entry["executing"] = ops[thread["thread_id"]]
        out.append(entry)
    return out


def _python_file(name: str) -> bool:
    """A Python frame's file: a .py, or Python's own names (<frozen runpy>, <string>); a native
    frame has a library's path, or `?` where py-spy found none."""
    return name.endswith(".py") or name.startswith("<")


_DUMPING: dict[str, threading.Lock] = {}  # per stacks file: one dump asked at a time here


def _by_runtime(doc: dict[str, Any], stacks_file: str, deadline: float) -> None:
    """The runtime's own dump: SIGNAL, then what it appends to its stacks file (read, then cut back
    to its header: a task read once a second keeps one dump at most)."""
    lock = _DUMPING.setdefault(stacks_file, threading.Lock())
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        doc["notes"].append("another read of it took the time")
        return
    try:
        _dump_and_read(doc, stacks_file, deadline)
    finally:
        with contextlib.suppress(OSError):
            fd = os.open(stacks_file, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, len(HEADER.format(pid=doc["pid"])))
            finally:
                os.close(fd)
        lock.release()


def _dump_and_read(doc: dict[str, Any], stacks_file: str, deadline: float) -> None:
    said = _ready_for_signal(doc["pid"], stacks_file)
    if said is None and time.monotonic() >= deadline:
        said = "no time was left to ask its runtime"
    if said is not None:
        doc["notes"].append(said)
        return
    try:
        size = os.path.getsize(stacks_file)
        os.kill(doc["pid"], SIGNAL)
    except OSError as exc:
        doc["notes"].append(f"cannot signal it: {exc.strerror}")
        return
    text, seen, since = "", -1, time.monotonic()
    while time.monotonic() < deadline and process_state(doc["pid"]) == "running":
        text = _read_from(stacks_file, size)
        if len(text) != seen:
            seen, since = len(text), time.monotonic()
        elif text and time.monotonic() - since > 0.1:
            break  # written whole: nothing more for 0.1 s
        time.sleep(0.02)
    if not text and process_state(doc["pid"]) != "running":
        doc["state"] = process_state(doc["pid"])
        doc["notes"].append("it exited while being read")
        return
    if not text:
        doc["notes"].append("its runtime wrote no dump in time (the job's own handler took the signal?)")
        return
    doc["threads"], doc["method"], doc["native"] = parse_dump(text), "faulthandler", False


def _ready_for_signal(pid: int, stacks_file: str) -> str | None:
    """None when the runtime's dump answers SIGNAL in `pid`; else why it is not sent (unanswered,
    it could end the task)."""
    try:
        fd = os.open(stacks_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            header = f.readline()
    except OSError:
        return "its runtime has no stacks file (not started yet, or it could not write one)"
    if header != HEADER.format(pid=pid):
        return "its stacks file is not this process's (its runtime is not running yet)"
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return "cannot read its signal mask"
    if not caught >> (SIGNAL - 1) & 1:
        return f"it does not catch signal {int(SIGNAL)} any more (the job reset it): not sent"
    return None


def _read_from(file: str, offset: int) -> str:
    with contextlib.suppress(OSError), open(file, "rb") as f:
        f.seek(offset)
        return f.read(MAX_OUTPUT).decode(errors="replace")
    return ""


def parse_dump(dump: str) -> list[dict[str, Any]]:
    """faulthandler's dump: `Thread 0x… (most recent call first):` (or `Current thread …`), then
    `  File "…", line N in FUNCTION` per frame, innermost first."""
    threads: list[dict[str, Any]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            tid = line.split("0x", 1)[1].split()[0]
            threads.append({"name": f"thread 0x{tid}", "id": None, "main": False, "active": None})
            threads[-1]["frames"] = []
        elif line.startswith('  File "') and threads:
            file, _, rest = line[len('  File "') :].rpartition('", line ')
            number, _, function = rest.partition(" in ")
            threads[-1]["frames"].append(
                {
                    "function": text(function),
                    "file": text(file),
                    "line": int(number) if number.isdigit() else 0,
                    "native": False,
                }
            )
        elif line == "  ..." and threads:  # faulthandler keeps 100 frames a thread
            threads[-1]["frames_left_out"] = threads[-1].get("frames_left_out", 0) + 1
    # the main thread runs the runtime's entry point, outermost; else it is the last one listed
    # (faulthandler lists the newest thread first)
    entry = ("<module>", "_run_module_as_main", "_run_code")
    main = next((t for t in threads if t["frames"] and t["frames"][-1]["function"] in entry), None)
    if main is None and threads:
        main = threads[-1]
    if main is not None:
        main.update(main=True, name="MainThread")
    return threads


def text(value: object) -> str:
    text = str(value) if value is not None else ""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def bounded(doc: dict[str, Any], threads: int = MAX_THREADS, inner: int = MAX_INNER) -> dict[str, Any]:
    """At most `threads` threads (the main one first) of at most `inner` + MAX_OUTER frames each,
    what is left out counted; fewer where the document would pass MAX_DOC_BYTES (one line of the
    shim's: a megabyte at most)."""
    kept = sorted(doc["threads"], key=lambda t: not t.get("main"))
    if len(kept) > threads:
        doc["threads_left_out"] = doc.get("threads_left_out", 0) + len(kept) - threads
        kept = kept[:threads]
    for thread in kept:
        frames = thread["frames"]
        if len(frames) > inner + MAX_OUTER:
            thread["frames_left_out"] = thread.get("frames_left_out", 0) + len(frames) - inner - MAX_OUTER
            thread["frames"] = frames[:inner] + frames[-MAX_OUTER:]
    doc["threads"] = kept
    if len(json.dumps(doc)) <= MAX_DOC_BYTES:
        return doc
    if inner > 10:
        return bounded(doc, max(4, threads // 2), inner // 2)
    for thread in kept:  # names of many non-ASCII characters: their text shortened too
        for frame in thread["frames"]:
            frame["function"], frame["file"] = frame["function"][:60], frame["file"][-60:]
    doc["threads"], doc["threads_left_out"] = kept[:4], doc.get("threads_left_out", 0) + len(kept[4:])
    return doc
