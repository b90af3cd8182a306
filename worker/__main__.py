"""`python -m worker run --script FILE [-- ARGS…]`: the entry point of every task (and `python -m
worker standby`: a warm standby, worker/warm/standby.py, which forks a task per handover that runs the
same entry point, worker/warm/keeper.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from worker.task import held, runtime


def main(argv: list[str] | None = None) -> int:
    held.hold()  # the job's environment (`environment:`), kept while this task lives
    parser = argparse.ArgumentParser(prog="python -m worker", description="tf-orchestrate task runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a TF program (mode 1) with heartbeats and progress reporting")
    run.add_argument("--script", required=True)
    run.add_argument("args", nargs=argparse.REMAINDER)
    loop = sub.add_parser("loop", help="run the built-in training loop (mode 2) on a user module")
    loop.add_argument("--module", required=True)
    loop.add_argument("--strategy", default="multi_worker_mirrored")
    length = loop.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int)
    length.add_argument("--epochs", type=int)
    loop.add_argument("--global-batch-size", type=int, required=True)
    loop.add_argument("--checkpoint-every", type=int, required=True)
    loop.add_argument("--checkpoint-dir", required=True)
    loop.add_argument("--cpu-replicas", type=int, help="mirrored without GPUs: logical CPU devices")
    loop.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("server", help="a ps or worker task of ParameterServerStrategy: serve until stopped")
    evaluate = sub.add_parser("evaluate", help="the evaluator: score every new checkpoint of a loop module")
    evaluate.add_argument("--module", required=True)
    evaluate.add_argument("--checkpoint-dir", required=True)
    evaluate.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    # Our own logger only: the user's program configures the root logger as it likes.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[orchestrate] %(levelname)s: %(message)s"))
    logging.getLogger("worker").addHandler(handler)
    rest = getattr(ns, "args", [])
    args = rest[1:] if rest[:1] == ["--"] else rest
    if ns.command == "server":
        from worker.task import ps

        return runtime.run_reported(ps.serve)
    if ns.command == "evaluate":
        from worker.task import evaluate as evaluator

        sys.argv = [ns.module, *args]
        return runtime.run_reported(lambda: evaluator.run(Path(ns.module), Path(ns.checkpoint_dir)))
    if ns.command == "loop":
        from worker.task import loop as builtin_loop

        config = builtin_loop.config_from_args(ns)
        sys.argv = [str(config.module), *args]  # the module may read its own arguments
        return runtime.run_reported(lambda: builtin_loop.run(config))
    return runtime.run_script(ns.script, args)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv == ["standby"]:  # a warm standby, whose forks come back here as tasks (worker/warm/keeper.py)
        from worker.warm import keeper, standby

        held.hold()  # its environment, kept while it waits too
        try:
            standby.main()
        except keeper.Become as task:  # a fork, now the task: run below, as a cold task is
            argv = task.argv
    runtime.flush_and_exit(main(argv))
