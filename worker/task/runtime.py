"""Runs the user's program (mode 1) inside a reporting task.

`python -m worker run --script FILE -- ARGS` starts the heartbeat thread first (before TensorFlow's
seconds-long import), then runs FILE as `__main__` with the arguments. An exception is reported
to the coordinator as the root cause (type, message, traceback) in its last heartbeat and in its
error file (worker/wire/failure.py), and the task exits 1.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from worker import wire
from worker.host import stacks
from worker.task import checkpoints, stack_dump, strategy_hook, tf_tuning
from worker.task.process import keeps_points
from worker.task.reporter import Reporter, ReporterConfig
from worker.wire import failure

_reporter: Reporter | None = None


def reporter() -> Reporter:
    """The process's reporter, created on first use (works without a coordinator, too)."""
    global _reporter
    if _reporter is None:
        _reporter = Reporter(ReporterConfig.from_env())
    return _reporter


def start_reporting() -> Reporter:
    """Start heartbeats and watch for the distribution strategy coming up."""
    rep = reporter()

    def connecting(extended: object) -> None:
        tf_tuning.configure_coordination(extended)
        rep.mark_connecting()
        tf_tuning.wait_for_leader(extended)  # its first attempt then never meets a closed port
        tf_tuning.wait_for_servers(extended)  # a ParameterServerStrategy's chief: the strategy itself

    def up(_strategy: object) -> None:
        rep.mark_ready()
        # Connecting the cluster installed TF's C++ SIGTERM watcher over ours; put ours back
        # unless the program has set its own handler meanwhile.
        if signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    strategy_hook.install(connecting, up)
    rep.start()
    return rep


def run_script(script: str, args: list[str]) -> int:
    run_dir, task = os.environ.get(wire.ENV_RUN_DIR), os.environ.get(wire.ENV_TASK)
    if run_dir and task and keeps_points():  # the chief's points, as metrics.jsonl keeps them
        reporter().write_tensorboard(Path(run_dir) / "tensorboard" / task)
    rep = reporter()
    # the job's own checkpoint folders, and what each task restored before its first step
    watch = checkpoints.Watch(
        rep.add_folder,
        rep.mark_restored,
        known=os.environ.get(wire.ENV_CHECKPOINT_DIR),
        on_restore=rep.mark_restored,
    )
    checkpoints.install(watch)
    path = Path(script).resolve()
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    return run_reported(lambda: runpy.run_path(str(path), run_name="__main__"))


def run_reported(main: Callable[[], object]) -> int:
    """Run `main` with heartbeats; report how it ended (done, or the exception) and return the exit code."""
    rep = start_reporting()
    dump_stacks_on_signal()
    # TF's own C++ SIGTERM watcher would swallow the coordinator's stop; end the task instead (a
    # PreemptionCheckpointHandler installed later replaces this with its save-then-exit).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        main()
    except SystemExit as exc:
        code = exit_code(exc.code)
        rep.finish(None if code == 0 else wire.TaskError("SystemExit", f"exit code {code}", ""))
        return code
    except BaseException as exc:  # noqa: BLE001 - the user's code may raise anything; we report it
        error = describe(exc)
        record_failure(error, rep.step)  # first: the heartbeat that carries it may never arrive
        traceback.print_exc()
        sys.stderr.flush()
        rep.finish(error)
        return 1
    rep.finish()
    return 0


def record_failure(error: wire.TaskError, step: int | None) -> None:
    """The task's failure, written to its error file (worker/wire/failure.py) where it runs under a
    coordinator; said in its log where the file cannot be written."""
    run_dir, task, attempt = (os.environ.get(k) for k in (wire.ENV_RUN_DIR, wire.ENV_TASK, wire.ENV_ATTEMPT))
    if not run_dir or not task or not attempt or not attempt.isdigit():
        return
    target = failure.path(run_dir, task, int(attempt))
    if not failure.write(target, error, step):
        print(f"orchestrate: could not write the error file {target}", file=sys.stderr)


def dump_stacks_on_signal() -> None:
    """Where the task runs under a coordinator: its stacks dumped on stacks.SIGNAL (worker/host/stacks.py),
    for a coordinator without py-spy on this host."""
    run_dir, task, attempt = (os.environ.get(k) for k in (wire.ENV_RUN_DIR, wire.ENV_TASK, wire.ENV_ATTEMPT))
    if run_dir and task and attempt and attempt.isdigit():
        stack_dump.register(stacks.path(run_dir, task, int(attempt)))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def describe(exc: BaseException) -> wire.TaskError:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    lines = tb.splitlines()
    if len(lines) > 80:  # keep the report small; the full traceback is in the task's log
        tb = "\n".join(["…", *lines[-80:]])
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    return wire.TaskError(type=name, message=str(exc)[:2000], traceback=tb)


def exit_code(code: object) -> int:
    """A SystemExit's code as an exit status: None is 0, a message is said and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def flush_and_exit(code: int) -> None:
    # Run the user's atexit handlers (summary writers flush there), then leave without waiting on
    # TensorFlow's non-daemon threads, which can keep an interpreter from exiting once the job is done.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
