"""tf-orchestrate coordinator: spec -> plan -> launch -> supervise -> run record.

The Python API: `orchestrator.up(spec, **options) -> RunResult` runs a job to its end;
`orchestrator.start(spec, **options) -> Run` runs it in the background (orchestrator/api.py).

This package never imports TensorFlow: the CLI must start fast, and the coordinator machine
may not even have it installed. The API is imported on first use, so `orchestrate validate`
does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from orchestrator.api import Run, RunResult, start, up
    from orchestrator.errors import OrchestrateError, SpecError

__all__ = ["OrchestrateError", "Run", "RunResult", "SpecError", "__version__", "start", "up"]


def __getattr__(name: str) -> Any:
    if name in ("Run", "RunResult", "start", "up"):
        from orchestrator import api

        return getattr(api, name)
    if name in ("OrchestrateError", "SpecError"):
        from orchestrator import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
