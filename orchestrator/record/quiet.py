"""Record room, as people read it: what of a task's output the console shows. The log files keep everything.

Left out of the console:
- TensorFlow's C++ start-up lines, printed by every process whatever TF_CPP_MIN_LOG_LEVEL says
  (`cudart_stub.cc] Could not find cuda drivers`, `failed call to cuInit … (303)`, oneDNN,
  `cpu_feature_guard`, `absl::InitializeLog`) and its C++ INFO lines; its warnings and errors stay;
- the frames of a Python traceback (the summary shows the root cause's once, the log has them
  all): its first line and the exception's lines stay;
- Keras' progress bar redrawn with backspaces or carriage returns: its last state stays.

The summary's traceback starts at the job's own code (`job_traceback`): the frames of our runtime
that call it (`python -m worker`, runpy) are left to the log.

And whatever a job prints or reports, the console writes (`console_writes_anything`).
"""

from __future__ import annotations

import functools
import io
import re
import sys
from typing import Any

from worker.host import WORKER, runtime_files

#: TensorFlow's C++ log prefix: absl (`I0000 00:00:1796150547.581546   29018 file.cc:31] `) or the
#: older one (`2026-12-01 12:00:00.123456: I tensorflow/core/….cc:153] `).
_CPP = re.compile(
    r"^(?:(?P<absl>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<old>[IWEF]) \S+:\d+\])"
)
#: Start-up lines whatever their level: no GPU on this host (or no TensorRT), CPU features, oneDNN.
_STARTUP = re.compile(
    r"Could not find cuda drivers|failed call to cuInit|cpu_feature_guard|oneDNN custom operations"
    r"|Unable to register cu(?:DNN|FFT|BLAS) factory|computation placer already registered"
    r"|TF-TRT Warning|Could not find TensorRT|absl::InitializeLog\(\) is called"
    r"|^To enable the following instructions: .* rebuild TensorFlow"
)
_TRACEBACK = "Traceback (most recent call last):"


class ConsoleFilter:
    """Per task, decides which log lines reach the console; counts what it held back."""

    def __init__(self) -> None:
        self.hidden = 0
        self._frames: dict[str, int] = {}  # task → frames of the traceback being printed

    def __call__(self, task: str, line: str) -> list[str]:
        """The lines the console shows for this log line (none: the log file keeps it)."""
        line = collapse_redraws(line)
        frames = self._frames.get(task)
        if frames is not None:
            if line.startswith(" "):  # a frame or its source line
                self._frames[task] = frames + 1
                self.hidden += 1
                return []
            del self._frames[task]  # the exception's line ends it
            if frames:
                return [f"  … ({frames} lines of traceback in the log)", line]
        if line.startswith(_TRACEBACK):
            self._frames[task] = 0
            return [line]
        if noise(line):
            self.hidden += 1
            return []
        return [line]


def collapse_redraws(line: str) -> str:
    """A line redrawn in place (Keras' progress bar: backspaces, then a carriage return, then the
    new state, a whole epoch on one line) as its last state."""
    if "\r" in line or "\b" in line:
        return line.rsplit("\r", 1)[-1].replace("\b", "")
    return line


def noise(line: str) -> bool:
    """TensorFlow's C++ start-up chatter, or a C++ INFO line."""
    if _STARTUP.search(line):
        return True
    cpp = _CPP.match(line)
    return cpp is not None and (cpp.group("absl") or cpp.group("old")) == "I"


def console_writes_anything(*streams: Any) -> None:
    """Whatever a job reports or prints, the console writes it: a character the terminal's
    encoding has no room for (a C locale, PYTHONIOENCODING=ascii, a name reported in any script)
    goes out as its backslash escape instead of raising UnicodeEncodeError in the coordinator."""
    for stream in streams or (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors not in _WRITES_ANYTHING:
            stream.reconfigure(errors="backslashreplace")  # strict, or surrogateescape (C locale)


#: Error handlers with which a stream writes any str (what else it may have: strict, surrogateescape).
_WRITES_ANYTHING = frozenset({"backslashreplace", "replace", "xmlcharrefreplace", "namereplace", "ignore"})


@functools.cache
def runtime_pattern() -> str:
    """The worker runtime's files, as a pattern of their paths under worker/ (`task[/\\]runtime`):
    they are ours wherever a host keeps them (the ssh backend ships them as `lib/worker/`). Made
    when first asked (a traceback to show): `orchestrate validate` never walks the folder."""
    return "|".join(
        r"[/\\]".join(re.escape(part) for part in p.relative_to(WORKER).with_suffix("").parts)
        for p in runtime_files()
    )


@functools.cache
def _ours() -> re.Pattern[str]:
    """A frame of the worker runtime (any of its modules, wherever a host keeps them) or of runpy,
    which runs the job: `  File "/…/worker/task/runtime.py", line 78, in run_reported`."""
    return re.compile(
        r'^  File "(?:<frozen runpy>|.*[/\\]runpy\.py|.*[/\\]worker[/\\](?:'
        + runtime_pattern()
        + r')\.py)", line \d+'
    )


def job_traceback(text: str, limit: int = 15) -> list[str]:
    """A task's traceback as the summary shows it: each traceback of the chain starting at the
    job's own first frame (the runtime's frames before it left off, unless no frame is the job's);
    past `limit` lines, its beginning and its end, with how many lines the log has between."""
    out: list[str] = []
    block: list[list[str]] = []  # the frames of the traceback being read, each with its lines

    def flush() -> None:
        first = next((i for i, frame in enumerate(block) if not _ours().match(frame[0])), 0)
        out.extend(line for frame in block[first:] for line in frame)
        block.clear()

    for line in text.rstrip().splitlines():
        if line.startswith('  File "'):
            block.append([line])
        elif block and line.startswith("    "):
            block[-1].append(line)  # its source line, its carets
        else:
            flush()
            out.append(line)
    flush()
    if len(out) <= limit:
        return out
    head, tail = 4, limit - 5
    return [*out[:head], f"  … ({len(out) - head - tail} lines: the log has them all)", *out[-tail:]]
