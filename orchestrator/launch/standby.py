"""Launch layer: warm standbys (docs/architecture.md §6) — what every backend shares: whether a
run has them (`restart.standby`, the memory they cost, a job that sets an import-time variable
itself), a standby's command, the handover that forks its task from it, and the rule that it
is used only where its task's attempt has exactly the environment it was started with.

A standby (worker/warm/standby.py) is started once an attempt trains, imports TensorFlow at the
lowest CPU priority and waits; each later attempt's `start` hands it that attempt, and it forks
the task and stays for the next (a keeper, worker/warm/keeper.py), or the task starts cold, saying why
(a standby that cannot serve is stopped; a new one is prepared once that attempt trains).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.spec.model import ClusterSpec, Standby
from orchestrator.states import Degraded
from worker import wire

#: What TensorFlow reads when it is imported (measured: scripts/bench/env_at_import.py,
#: docs/architecture.md §7), CUDA_VISIBLE_DEVICES taken as such. A job that sets one itself
#: before its own import would find it ignored in a standby: it starts cold.
IMPORT_TIME_ENV = (
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_CPP_VMODULE",
    "TF_ENABLE_ONEDNN_OPTS",
    "KERAS_BACKEND",
    "CUDA_VISIBLE_DEVICES",
)
#: A standby's memory, TensorFlow and Keras imported, with the spare it forks ahead of the next
#: attempt (measured: 545 MiB RSS and 190 MiB of the spare's own, TF 2.21, Keras 3).
STANDBY_BYTES = 750 * 2**20
#: `auto`: a host keeps at least this much memory available with its standbys (and a tenth of it).
KEEP_AVAILABLE_BYTES = 2 * 2**30

_SETS = re.compile(r"\b(" + "|".join(IMPORT_TIME_ENV) + r")\b")


@dataclass(frozen=True)
class Verdict:
    on: bool
    why: str  # for people: why not, or what it costs


def for_run(spec: ClusterSpec) -> Verdict:
    """Whether the run's tasks may have standbys at all (before any host's memory is asked)."""
    mode = spec.restart.standby
    if mode is Standby.OFF:
        return Verdict(False, "restart.standby is off")
    if spec.restart.max_restarts == 0 and mode is Standby.AUTO:
        return Verdict(False, "restart.max_restarts is 0 (restart.standby: on keeps them for preemptions)")
    code = spec.job.script or spec.job.loop
    name = _sets_import_env(code) if code is not None else None
    if name is not None:
        assert code is not None
        return Verdict(
            False,
            f"{code.name} mentions {name}, which TensorFlow reads at import: a standby has imported "
            "TensorFlow before the job's code runs, so its tasks start cold",
        )
    return Verdict(True, "")


def for_host(mode: Standby, tasks: int, available: int | None, total: int | None) -> Verdict:
    """Whether a host with `tasks` tasks of the run keeps standbys for them: `auto` only while its
    available memory stays above the bound with one idle TensorFlow process per task more."""
    cost = tasks * STANDBY_BYTES
    said = f"{tasks} × {mib(STANDBY_BYTES)} = {mib(cost)}"
    if mode is Standby.ON or available is None:
        return Verdict(True, said)
    keep = max(KEEP_AVAILABLE_BYTES, (total or 0) // 10)
    if available - cost < keep:
        return Verdict(
            False,
            f"{mib(available)} available; standbys ({said}) would leave less than {mib(keep)} "
            "(restart.standby: on keeps them anyway)",
        )
    return Verdict(True, said)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _sets_import_env(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    found = _SETS.search(text)
    return found.group(1) if found else None


def command(argv: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """A task's command split into its standby's command and the arguments handed to it; None
    for a command that is not the worker runtime's."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "worker":
            return (*argv[:i], "-m", "worker", "standby"), tuple(argv[i + 2 :])
    return None


def stable_env(env: Mapping[str, str]) -> dict[str, str]:
    """A task's environment as its standby gets it: without what changes per attempt."""
    return {k: v for k, v in env.items() if k not in wire.PER_ATTEMPT_ENV}


def handover(args: Sequence[str], env: Mapping[str, str], log: str) -> bytes:
    """The line that makes a standby its task (worker/warm/standby.py)."""
    attempt = {k: env[k] for k in wire.PER_ATTEMPT_ENV if k in env}
    return (json.dumps({"argv": list(args), "env": attempt, "log": log}) + "\n").encode()


def differs(standby_env: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """Why a standby started with `standby_env` cannot become a task with `env` (a variable that
    is not per attempt changed), or None."""
    mine, theirs = stable_env(standby_env), stable_env(env)
    changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if not changed:
        return None
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"its task's environment is not the one it was started with ({', '.join(changed[:3])}{more})"


class PageCopies:
    """Hosts whose standbys said their spares cannot copy their pages ahead of a handover
    (wire.STANDBY_NO_PAGE_COPY): each said once (a Degraded `page_copy`)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def said(self, where: str, why: str | None) -> list[Degraded]:
        if why is None or where in self._said:
            return []
        self._said.add(where)
        said = (
            f"warm standbys on {where} hand over without their page copy ({why}): a task handed over "
            "copies the pages it shares with its standby as it first writes them, its first step "
            "slower than a cold task's"
        )
        fix = "a kernel of Linux 5.14 or later there; the standbys still save the TensorFlow import"
        return [Degraded("page_copy", where, said, fix)]
