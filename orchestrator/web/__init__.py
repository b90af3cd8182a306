"""Web layer: a run's live page and its Prometheus metrics, served by the coordinator while the run
lives (`orchestrate show RUN_DIR` serves a finished run's). Everything it shows is read from the run
directory, so a live run and a finished one look the same; the page is shipped in the package
(no CDN, no outside request).
"""

from __future__ import annotations

from orchestrator.errors import UsageError


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `HOST` (a free port) or `:PORT` (loopback), as `--web` takes it."""
    host, _, port = text.rpartition(":") if ":" in text else (text, ":", "0")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port or 0)
    except ValueError:
        raise UsageError(f"--web {text}: HOST:PORT, e.g. 127.0.0.1:8080") from None
    if not 0 <= number < 65536:
        raise UsageError(f"--web {text}: the port must be 0-65535")
    return host, number
