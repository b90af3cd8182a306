"""Python API: `orchestrator.up(spec, **options) -> RunResult`, and `orchestrator.start(…)` for a
run that goes on in the background of a notebook or a program.

The options are the CLI's (`backend`, `run_dir`, `resume`, `view`, `progress_every_s`). It works
from any thread: signal handlers are installed only on the main thread (elsewhere, `Run.stop()`
or the caller's own handling stops the run). The same teardown runs whatever ends the call, an
exception of the caller's callback included: no task is left behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from orchestrator.control import RunResult, StopRequest, UpOptions
from orchestrator.errors import UsageError
from orchestrator.spec.model import ClusterSpec

SpecLike = str | Path | Mapping[str, Any] | ClusterSpec
ViewName = Literal["none", "plain", "live"]

__all__ = ["Run", "RunResult", "start", "up"]


def up(
    spec: SpecLike,
    *,
    backend: str | None = None,
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    view: ViewName = "none",
    progress_every_s: float = 15.0,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    base_dir: str | Path | None = None,
    web: str | None = "127.0.0.1:0",
    _stop: StopRequest | None = None,
) -> RunResult:
    """Run a job to its end and return how it ended (`result.ok`, `.exit_code`, `.reason`,
    `.metrics`, `.run_dir`, `.status`).

    `spec`: a YAML file's path, a dict with the YAML's keys, or a ClusterSpec. `backend`: overrides
    the spec's (`--backend`). `run_dir`: where the record goes (default runs/<name>-<time>/).
    `resume`: an earlier run's directory to continue from its checkpoints (`--resume`). `view`:
    what the console shows — nothing (default), plain lines (`--plain`) or the live view.
    `on_event`: called on the coordinator's thread with every events.jsonl line as it is written
    (keep it quick). `base_dir`: the folder a dict's relative paths are relative to (default: the
    current one). `web`: where the run's page is served, `HOST:PORT` (None: no page; its address
    is in `status.json`'s `urls` while the run lives). A bad spec raises SpecError, a launch
    failure ends the run with exit code 3.
    """
    from orchestrator import coordinator
    from orchestrator.cli.view import LiveView, PlainView
    from orchestrator.control import SilentView, View
    from orchestrator.web import parse_address

    model, path, text, folder = _spec(spec, backend, base_dir)
    if resume is not None and run_dir is not None and Path(resume) != Path(run_dir):
        raise UsageError("give either resume or run_dir, not both")
    shown: View
    if view == "none":
        shown = SilentView()
    elif view == "plain":
        shown = PlainView(progress_every_s=progress_every_s)
    elif view == "live":
        shown = LiveView()
    else:
        raise UsageError(f"view={view!r}: one of none, plain, live")
    where = Path(resume) if resume is not None else (Path(run_dir) if run_dir is not None else None)
    options = UpOptions(
        run_dir=where,
        resume=resume is not None,
        view=shown,
        on_event=on_event,
        stop=_stop,
        backend_option=backend,
        web=None if web is None else parse_address(web),
    )
    return coordinator.up(model, path, options, spec_text=text, spec_dir=folder)


class Run:
    """A run going on in the background (`orchestrator.start`): its events as they come, a way to
    stop it, and its result."""

    def __init__(self, spec: SpecLike, options: dict[str, Any]):
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stop = StopRequest()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        caller = options.pop("on_event", None)

        def on_event(event: dict[str, Any]) -> None:
            self._events.put(event)
            if caller is not None:
                caller(event)

        def main() -> None:
            try:
                self._result = up(spec, on_event=on_event, _stop=self._stop, **options)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
                self._error = exc
            finally:
                self._events.put(None)

        self._thread = threading.Thread(target=main, name="orchestrate-run", daemon=False)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def events(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Every events.jsonl line of the run as it is written, until the run ends (each event is
        handed out once: to one iterator). `timeout_s`: the longest wait for the next one
        (TimeoutError past it)."""
        while True:
            try:
                event = self._events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no event within {timeout_s} s") from None
            if event is None:
                self._events.put(None)  # another iterator ends too
                return
            yield event

    def stop(self, reason: str = "stopped by the caller") -> None:
        """Stop the run cleanly (every task gets SIGTERM, then its grace); a second call skips the grace."""
        self._stop(reason)

    def result(self, timeout_s: float | None = None) -> RunResult:
        """Wait for the run to end; its result (or the exception that ended `up`)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the run has not ended within {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def start(spec: SpecLike, **options: Any) -> Run:
    """Start a run on a thread of its own and return at once (`orchestrate up --detach`'s
    counterpart in a program): `run.events()`, `run.stop()`, `run.result()`. Options: `up`'s."""
    return Run(spec, options)


def _spec(
    spec: SpecLike, backend: str | None, base_dir: str | Path | None
) -> tuple[ClusterSpec, Path | None, str, Path]:
    """The spec as a model, its file (if it has one), its text and the folder its paths are relative to."""
    from orchestrator.spec.load import load_spec, parse_spec

    override = _backend(backend)
    folder = Path(base_dir).resolve() if base_dir is not None else Path.cwd()
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        model = load_spec(path, backend=override)
        return model, path, path.read_text(encoding="utf-8"), path.resolve().parent
    if isinstance(spec, ClusterSpec):
        data = spec.as_data()
        if override is not None:
            data["backend"] = override
        text = yaml.safe_dump(data, sort_keys=False)
        return parse_spec(text, file="<ClusterSpec>", base_dir=folder), None, text, folder
    if isinstance(spec, Mapping):
        text = yaml.safe_dump(dict(spec), sort_keys=False)
        return parse_spec(text, file="<dict>", base_dir=folder, backend=override), None, text, folder
    raise UsageError(f"spec: a path, a dict or a ClusterSpec, not {type(spec).__name__}")


def _backend(name: str | None) -> str | None:
    from orchestrator.spec.load import backend_named

    return None if name is None else backend_named(name, f"backend={name!r}")
