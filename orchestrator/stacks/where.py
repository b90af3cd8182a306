"""Stacks layer: where a task was, read from its stacks (worker/host/stacks.py's document) — in one line,
and whether it is the one the others wait for: a task in its own code (not in TensorFlow) or
stopped is; a task waiting inside TensorFlow (an all-reduce, a tf.function, its cluster) is not.

A frame is the job's own unless it is Python's standard library, an installed package, or our
runtime (python -m worker, runpy): what the job's author can open and fix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.record.quiet import runtime_pattern
from worker.host import WORKER

_STDLIB = re.compile(r"[/\\]lib[/\\]python3\.\d+t?[/\\](?!site-packages|dist-packages)|^<frozen ")
_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
_TENSORFLOW = re.compile(r"[/\\](?:tensorflow|keras|tf_keras|tensorflow_core)[/\\]")
_GEN_OP = re.compile(r"[/\\]gen_\w+_ops\.py$")
#: The frames of a MultiWorkerMirroredStrategy connecting its cluster (it waits for every peer).
_CONNECTING = ("_initialize_multi_worker", "enable_collective_ops", "ensure_initialized", "_cluster_connect")
#: Operations people know by another name.
_KNOWN = {
    "CollectiveReduceV2": "an all-reduce",
    "CollectiveReduce": "an all-reduce",
    "CollectiveGatherV2": "an all-gather",
    "CollectiveGather": "an all-gather",
    "CollectiveBcastSendV2": "a broadcast",
    "CollectiveBcastRecvV2": "a broadcast",
    "CollectiveAllToAllV2": "an all-to-all",
    "IteratorGetNext": "the input pipeline",
    "IteratorGetNextAsOptional": "the input pipeline",
}
#: AutoGraph's own names in a converted function's qualified name (and its `*_body`, `*_test`).
_AUTOGRAPH = ("outer_factory", "inner_factory", "get_state", "set_state")
_FUNCTION = re.compile(r"^__inference_(?P<name>.+?)_\d+$")


def kind_of(file: str) -> str:
    """job, stdlib, tensorflow, package (another installed one) or runtime."""
    if file == "<frozen runpy>" or _shipped().search(file) or file.startswith(f"{WORKER}/"):
        return "runtime"
    if _STDLIB.search(file):
        return "stdlib"
    if _TENSORFLOW.search(file) and _INSTALLED.search(file):
        return "tensorflow"
    if _INSTALLED.search(file):
        return "package"
    return "job"


@dataclass(frozen=True)
class Where:
    """A task's place in one line; `culprit`: it is not waiting for the others."""

    task: str
    kind: str  # own (its own code), stopped, tensorflow, cluster, exited, unknown
    line: str

    @property
    def culprit(self) -> bool:
        return self.kind in ("own", "stopped")

    def said(self, hung: bool = True) -> str:
        """Its line; `hung`: read before a hung job's stop (on a live run, nobody waits: no blame)."""
        blame = " — the one the others wait for" if self.culprit and hung else ""
        return f"{self.task}: {self.line}{blame}"


def where(task: str, doc: Mapping[str, Any]) -> Where:
    """Where `task` was, from its stacks document."""
    state, threads = doc.get("state"), list(doc.get("threads") or [])
    if state in ("gone", "zombie"):
        return Where(task, "exited", "had exited")
    main = next((t for t in threads if t.get("main")), threads[0] if threads else None)
    if main is None:
        notes = "; ".join(doc.get("notes") or []) or "nothing read"
        return Where(task, "stopped" if state == "stopped" else "unknown", f"stacks not read: {notes}")
    place = _thread_place(main, [t for t in threads if t is not main])
    if state == "stopped":
        return Where(task, "stopped", f"stopped (state T, SIGSTOP?) {place[1]}")
    if place[0] in ("tensorflow", "cluster"):
        for other in threads:
            busy = _busy_in_job_code(other) if other is not main else None
            if busy is not None:
                return Where(task, "own", f"{busy}, while its main thread is {place[1]}")
    return Where(task, *place)


def _thread_place(thread: Mapping[str, Any], helpers: Sequence[Mapping[str, Any]] = ()) -> tuple[str, str]:
    """(kind, the words) for one thread; `helpers`: the threads it may wait on (TensorFlow runs an
    eager all-reduce of MultiWorkerMirroredStrategy on a pool thread of its own)."""
    frames = _python(thread)
    kinds = [kind_of(str(f.get("file"))) for f in frames]
    job = next((i for i, k in enumerate(kinds) if k == "job"), None)
    if not frames:
        return "unknown", "in no Python frame"
    # the innermost frame that is not the standard library's: the job's, TensorFlow's, another's
    first = next((i for i, k in enumerate(kinds) if k != "stdlib"), len(frames) - 1)
    if kinds[first] in ("job", "package"):
        where = f"in {_frame(frames[first])}"
        if first > 0:  # waiting in the standard library (a lock, a queue) from its own code
            where = f"in {_frame(frames[0])} from {_frame(frames[first])}"
        return "own", f"{where}, not in TensorFlow"
    called = f", called from {_frame(frames[job])}" if job is not None else ""
    if kinds[first] == "stdlib":  # nothing but the standard library (a thread of its own)
        return "stdlib", f"in {_frame(frames[0])}, Python's standard library"
    if kinds[first] == "runtime":
        return "runtime", f"in the orchestrate runtime ({_frame(frames[first])})"
    if any(str(f.get("function")).rsplit(".", 1)[-1] in _CONNECTING for f in frames):
        return "cluster", f"waiting for its cluster to connect (every peer must start){called}"
    op = _op(thread) or next((o for o in map(_op, helpers) if o), None)
    return "tensorflow", f"waiting in {_op_words(op)}{called}"


def _op(thread: Mapping[str, Any]) -> str | None:
    """The TensorFlow operation a thread runs: from quick_execute's arguments (an eager op, or a
    tf.function's name), else from the generated wrapper it is in (gen_*_ops.py)."""
    op = thread.get("executing")
    if op:
        return str(op)
    gen = next((f for f in _python(thread) if _GEN_OP.search(str(f.get("file")))), None)
    if gen is None:
        return None
    return "".join(part.capitalize() for part in str(gen.get("function")).rsplit(".", 1)[-1].split("_"))


def _op_words(op: str | None) -> str:
    if not op:
        return "TensorFlow"
    function = _FUNCTION.match(op)
    if function:
        return f"TensorFlow: the tf.function {function.group('name')}"
    known = _KNOWN.get(op)
    return f"{known} ({op})" if known else f"TensorFlow's {op}"


def _busy_in_job_code(thread: Mapping[str, Any]) -> str | None:
    """Where a thread other than the main one is kept busy by the job's code — TensorFlow runs the
    job's Python on it (a tf.data map's py_function: no threading frames; busy even asleep, as its
    pipeline waits on it), or py-spy saw a thread of the job's own active — at its innermost frame
    of the job's; None if it is not."""
    frames = _python(thread)
    job = next((f for f in frames if kind_of(str(f.get("file"))) == "job"), None)
    if job is None:
        return None
    on_tensorflow = kind_of(str(frames[-1].get("file"))) == "tensorflow"
    if not (on_tensorflow or thread.get("active") is True):
        return None
    on = "a TensorFlow thread" if on_tensorflow else f"thread {thread.get('name')}"
    return f"in {_frame(job)}, the job's own code on {on}"


def _python(thread: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A thread's Python frames, innermost first."""
    frames = thread.get("frames") or []
    return [f for f in frames if not f.get("native") and str(f.get("file")).endswith((".py", ">"))]


def _frame(frame: Mapping[str, Any]) -> str:
    name, function = Path(str(frame.get("file"))).name, str(frame.get("function"))
    if name.startswith("__autograph_generated_file"):  # a temporary file: the job's names say more
        parts = [p.removeprefix("tf__") for p in function.split(".<locals>.")]
        kept = [p for p in parts if p not in _AUTOGRAPH and not p.endswith(("_body", "_test"))]
        return f"{'.'.join(kept) or function} (as AutoGraph converted it)"
    return f"{function} ({name}:{frame.get('line')})"


def culprits(wheres: Sequence[Where]) -> list[Where]:
    """The tasks the others wait for, as their stacks show."""
    return [w for w in wheres if w.culprit]


@functools.cache
def _shipped() -> re.Pattern[str]:
    """A file of the runtime as a host keeps it (the ssh backend ships it as `lib/worker/`); a job's
    own package named `worker` elsewhere is the job's."""
    return re.compile(r"[/\\]lib[/\\]worker[/\\](?:" + runtime_pattern() + r")\.py$")
