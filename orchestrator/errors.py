"""Error types of the coordinator. Each one says what to change; the CLI maps them to exit codes."""

from __future__ import annotations

import difflib
import heapq
from collections.abc import Collection
from dataclasses import dataclass

#: `orchestrate`'s exit codes (docs/architecture.md §2); `orchestrate wait` exits with a run's.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LAUNCH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class OrchestrateError(Exception):
    """Base of every error the CLI reports without a traceback."""

    exit_code = 1


@dataclass(frozen=True)
class SpecProblem:
    """One problem in a cluster spec, located by its key path and (when known) its line."""

    path: tuple[str | int, ...]
    message: str
    line: int | None = None

    @property
    def key(self) -> str:
        out = ""
        for part in self.path:
            if isinstance(part, str) and not (part.isprintable() and part.strip() == part and part):
                part = repr(part)  # a key with a newline, a control character: one line, visible
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        return out or "(top level)"


class SpecError(OrchestrateError):
    """The spec cannot be used. Lists every problem as `file:line: key: message`."""

    exit_code = 2

    #: Problems shown: a spec of 20,000 unknown keys is not answered with 20,000 lines (2 MB).
    SHOWN = 50

    def __init__(self, file: str, problems: list[SpecProblem]):
        self.file = file
        by_line = heapq.nsmallest(self.SHOWN, problems, key=lambda p: p.line or 0)  # stable
        self.problems = sorted(by_line, key=lambda p: (p.line or 0, p.key))
        self.more = len(problems) - len(self.problems)
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.file}:{p.line or 1}: {p.key}: {p.message}" for p in self.problems]
        if self.more:
            last = self.problems[-1].line or 1
            lines.append(f"{self.file}:{last}: (and {self.more:,} more problems below this line)")
        return "\n".join(lines)


class UsageError(OrchestrateError):
    exit_code = 2


class LaunchError(OrchestrateError):
    """A task could not be started, or a preflight check failed. Nothing is left running."""

    exit_code = 3


class RunDirError(OrchestrateError):
    """A run directory is missing or is not one of ours."""

    exit_code = 1


def did_you_mean(word: str, choices: Collection[str]) -> str | None:
    """The one choice `word` is most likely a typo of, if any is close (a command, a spec key, a
    backend's name)."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None
