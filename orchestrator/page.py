"""The run's page, as `orchestrate up --web` serves it (orchestrator/web/ builds it; its modules,
~0.4 s of imports, are loaded only here, when it is served)."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.control import View
from orchestrator.errors import LaunchError
from orchestrator.spec.model import ClusterSpec

if TYPE_CHECKING:
    from orchestrator.web.server import WebServer


def serve_when(
    spec: ClusterSpec, cleanup: contextlib.ExitStack, run_dir: Path, web: tuple[str, int] | None, view: View
) -> Callable[[], Mapping[str, str]]:
    """How the run's page is served: once the job trains (its imports then cost the tasks
    nothing); at once where the run first makes its environment, whose progress (minutes on a
    first build) the page's events show."""
    if spec.environment is None or web is None:
        return functools.partial(serve, cleanup, run_dir, web, view)
    urls = serve(cleanup, run_dir, web, view)
    return lambda: urls


def serve(
    cleanup: contextlib.ExitStack, run_dir: Path, web: tuple[str, int] | None, view: View
) -> dict[str, str]:
    """The run's page and /metrics, served while the run lives (until `cleanup`); their addresses."""
    if web is None:
        return {}
    page = cleanup.enter_context(_web_server(run_dir, web))
    view.notice(f"the run's page: {page.page_url}   (Prometheus: {page.metrics_url})")
    return {"page": page.page_url, "metrics": page.metrics_url}


def check_address(web: tuple[str, int] | None) -> None:
    """LaunchError, as the page's server says it, when `--web`'s address cannot be bound now."""
    if web is None:
        return
    host, port = web
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise LaunchError(
            f"cannot serve the run's page on {host}:{port} (--web): {exc.strerror or exc}"
        ) from None


@contextlib.contextmanager
def _web_server(run_dir: Path, where: tuple[str, int]) -> Iterator[WebServer]:
    from orchestrator.web.server import serve_run

    server = serve_run(run_dir, *where)
    try:
        yield server
        server.linger()  # a page open now is shown how the run ended (bounded: ~1 s, at most 2.5)
    finally:
        server.close()
