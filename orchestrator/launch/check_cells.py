"""Launch layer: what `orchestrate check` says of a host in its table, whichever backend checked
it — whether a hung task's C++ frames can be read there (and the warning where not), its GPUs, its
free disk, the warm standbys it would keep."""

from __future__ import annotations

from typing import Any

from orchestrator.launch import standby
from orchestrator.spec.model import ClusterSpec
from worker.wire import safe_text


def stacks_cell(facts: dict[str, Any] | None) -> str:
    """Whether a hung task's C++ frames can be read there (worker/host/probe.py's `stacks`)."""
    found = (facts or {}).get("stacks")
    if not isinstance(found, dict):
        return "-"
    return "native" if found.get("native") else "Python only"


def stacks_warning(label: str, facts: dict[str, Any] | None) -> str | None:
    found = (facts or {}).get("stacks")
    if not isinstance(found, dict) or found.get("native"):
        return None
    return (
        f"{label}: a hung task's stacks will have its Python frames only (its runtime's own dump): "
        f"{found.get('why')} (py-spy, installed beside the job's Python, reads C++ frames too)"
    )


def page_copy_warning(label: str, facts: dict[str, Any] | None) -> str | None:
    """Where a standby's spare cannot copy its pages ahead of a handover (worker/host/probe.py's
    `page_copy`): the fallback a run there says once, said before it."""
    why = (facts or {}).get("page_copy")
    if not why or not isinstance(why, str):
        return None
    return (
        f"{label}: warm standbys hand over without their page copy ({safe_text(why[:300])}): a task "
        "handed over copies its pages as it first writes them, its first step slower than a cold "
        "task's (a kernel of Linux 5.14 or later has it)"
    )


def standby_cell(spec: ClusterSpec, index: int, memory: dict[str, int] | None) -> str:
    """What warm standbys the host would keep: `2 × 600 MiB`, or `off` and why in a word."""
    tasks = sum(spec.hosts[index].tasks.values()) if index < len(spec.hosts) else 0
    if not tasks:
        return "-"
    if not standby.for_run(spec).on:
        return "off"
    available, total = (memory or {}).get("available"), (memory or {}).get("total")
    verdict = standby.for_host(spec.restart.standby, tasks, available, total)
    cost = f"{tasks} × {standby.mib(standby.STANDBY_BYTES)}"
    return cost if verdict.on else f"off: low memory ({size_cell(available or 0)} available)"


def gpu_cell(gpus: dict[str, Any] | None) -> str:
    if gpus is None:
        return "none"
    if gpus.get("error"):
        return "nvidia-smi failed"
    cuda = f" (CUDA {gpus['cuda']})" if gpus.get("cuda") else ""
    return f"{len(gpus['names'])}{cuda}"


def size_cell(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
