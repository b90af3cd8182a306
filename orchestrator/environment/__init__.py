"""The job's Python environment, the same on every host (the spec's `environment:`; issue 38).

1. `request.py`: what pip is asked for: the spec's requirements, plus what the worker runtime
   needs (TensorFlow where none is named, psutil, py-spy).
2. `target.py`: which wheels an interpreter installs (its version, ABI, platform), as each host's
   interpreter reports it (worker/host/environment.py `target`).
3. `resolve.py`: on this machine alone, once per requirements and target: pip resolves them to
   exact wheels (`pip install --dry-run --report`, with the target's tags) and downloads them into
   the cache here; hosts need no route to any index.
4. `prepare.py`: each host (in parallel) is asked whether its environment for that set is ready;
   where not, it is sent the wheels its file cache lacks and builds it (worker/host/environment.py:
   uv, into a staging folder renamed when complete). The tasks then run its `bin/python`.
"""

from __future__ import annotations

import posixpath

from worker.host.environment import ENV_ENVIRONMENT
from worker.host.stacks import ENV_PY_SPY


def task_env(python: str) -> dict[str, str]:
    """What a task run by an environment's `bin/python` adds to its env: the environment (the
    worker holds it while it lives, and stops where it is gone) and its stacks reader."""
    folder = posixpath.dirname(posixpath.dirname(python))
    return {ENV_ENVIRONMENT: folder, ENV_PY_SPY: posixpath.join(folder, "bin", "py-spy")}
