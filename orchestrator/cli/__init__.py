"""The CLI room: `orchestrate …` and everything it prints. Parses arguments (arguments.py), calls
the layers below (commands.py: on a spec; runs.py: on a run directory), shows a run on the console
(view.py), says how it ended (summary.py, hints.py), and maps errors to exit codes
(0 success · 1 job failed · 2 bad spec/usage · 3 preflight/launch failure · 130 interrupted).

It may import every layer below it (the coordinator, the web page, the record, the spec …); only
the Python API (orchestrator/api.py) imports it. Heavy modules are imported inside the commands,
so `validate` and `plan` start fast; nothing here imports TensorFlow.
"""

from __future__ import annotations

import logging
import os
import sys

from orchestrator.cli import arguments
from orchestrator.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LAUNCH,
    EXIT_OK,
    EXIT_USAGE,
    OrchestrateError,
)
from orchestrator.record.quiet import console_writes_anything

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_LAUNCH", "EXIT_OK", "EXIT_USAGE", "main"]


def main(argv: list[str] | None = None) -> int:
    console_writes_anything()
    parser = arguments.parser(_handlers())
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except OrchestrateError as exc:
        print(f"orchestrate: {exc}" if "\n" not in str(exc) else str(exc), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("orchestrate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `orchestrate plan … | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _handlers() -> arguments.Handlers:
    from orchestrator.cli import commands, runs

    return {
        "up": commands.cmd_up,
        "plan": commands.cmd_plan,
        "validate": commands.cmd_validate,
        "check": commands.cmd_check,
        "status": runs.cmd_status,
        "ls": runs.cmd_ls,
        "wait": runs.cmd_wait,
        "logs": runs.cmd_logs,
        "show": runs.cmd_show,
        "stacks": runs.cmd_stacks,
        "down": runs.cmd_down,
        "schema": commands.cmd_schema,
    }
