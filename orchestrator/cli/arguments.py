"""CLI room: `orchestrate`'s arguments (argparse), every command's handler given by cli/__init__.py."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

Handlers = Mapping[str, Callable[[argparse.Namespace], int]]

_BACKEND_HELP = "override the spec's `backend:` (the names `orchestrate schema` lists)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a suggestion for a mistyped command or choice (`stauts`: did you mean `status`?)."""

    def error(self, message: str) -> NoReturn:
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            from orchestrator.errors import did_you_mean

            choices = re.findall(r"'([^']*)'", found.group(2))
            close = did_you_mean(found.group(1), choices)
            if close is not None:
                message += f"; did you mean '{close}'?"
        super().error(message)


def parser(handlers: Handlers) -> argparse.ArgumentParser:
    """The parser; each command's `func` is `handlers[its name]`."""
    from orchestrator import __version__

    p = _Parser(prog="orchestrate", description="Run TensorFlow multi-worker training from one YAML spec.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"orchestrate (tf-orchestrate) {__version__}")
    sub: Any = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _spec_commands(sub, handlers)
    _run_commands(sub, handlers)
    return p


def _spec_commands(sub: Any, handlers: Handlers) -> None:
    """The commands that take a spec: up, plan, validate, check."""
    up = sub.add_parser("up", help="validate, plan, launch and supervise a job until it ends")
    up.add_argument("spec", type=Path)
    up.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    up.add_argument("--run-dir", type=Path, help="run directory (default runs/<name>-<time>/)")
    up.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue an earlier run in its directory, from its checkpoints",
    )
    up.add_argument(
        "--detach", action="store_true", help="run in the background; inspect with status/logs/down"
    )
    up.add_argument("--plain", action="store_true", help="plain log lines even on a terminal")
    up.add_argument(
        "--progress-every",
        type=float,
        default=15.0,
        metavar="S",
        help="plain lines: a progress line every S seconds while training (default 15; 0: none)",
    )
    up.add_argument(
        "--web",
        metavar="HOST:PORT",
        default="127.0.0.1:0",
        help="where the run's page and Prometheus metrics are served (default 127.0.0.1, a free port; "
        "every request needs the run's token)",
    )
    up.add_argument("--no-web", action="store_true", help="serve no page")
    up.set_defaults(func=handlers["up"])

    plan = sub.add_parser("plan", help="print every task: host, role, port, command, env and TF_CONFIG")
    plan.add_argument("spec", type=Path)
    plan.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=handlers["plan"])

    validate = sub.add_parser("validate", help="check a spec; errors name file:line and the key")
    validate.add_argument("spec", type=Path)
    validate.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    validate.set_defaults(func=handlers["validate"])

    check = sub.add_parser(
        "check", help="preflight every host: SSH, host keys, Python/TensorFlow versions, ports, disk, peers"
    )
    check.add_argument("spec", type=Path)
    check.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    check.set_defaults(func=handlers["check"])


def _run_commands(sub: Any, handlers: Handlers) -> None:
    """The commands that read a run's record: status, ls, wait, logs, show, down; and schema."""
    status = sub.add_parser("status", help="show a run's state (default: the latest run under runs/)")
    status.add_argument("run_dir", nargs="?")
    status.add_argument(
        "--json",
        action="store_true",
        help="status.json, and whether its coordinator lives (`orchestrate schema status`)",
    )
    status.set_defaults(func=handlers["status"])

    runs = sub.add_parser("ls", help="list the runs under runs/: state, age, attempts, restarts")
    runs.add_argument("--runs", type=Path, default=None, metavar="DIR", help="where to look (default runs/)")
    runs.add_argument("--json", action="store_true", help="one JSON object per run")
    runs.set_defaults(func=handlers["ls"])

    wait = sub.add_parser(
        "wait", help="wait for a run to end; exit with its exit code (default: the latest run)"
    )
    wait.add_argument("run_dir", nargs="?")
    wait.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 124)")
    wait.set_defaults(func=handlers["wait"])

    logs = sub.add_parser("logs", help="print a run's task logs (default: the latest run)")
    logs.add_argument("run_dir", nargs="?", help="a run directory (default: the latest run under runs/)")
    logs.add_argument("task", nargs="?", help="e.g. worker-1 (default: all)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=handlers["logs"])

    _stacks_command(sub, handlers)

    show = sub.add_parser("show", help="serve a run's page (default: the latest run) until Ctrl-C")
    show.add_argument("run_dir", nargs="?")
    show.add_argument("--web", metavar="HOST:PORT", default="127.0.0.1:0", help="where (default: loopback)")
    show.set_defaults(func=handlers["show"])

    down = sub.add_parser("down", help="stop a run (detached or from another terminal); idempotent")
    down.add_argument("run_dir")
    down.set_defaults(func=handlers["down"])

    schema = sub.add_parser(
        "schema", help="print a JSON Schema: of the spec (for editors), or of a run's records"
    )
    schema.add_argument(
        "document",
        nargs="?",
        default="spec",
        choices=["spec", "status", "event", "metrics"],
        help="spec (default) · status: status.json · event, metrics: a line of events.jsonl, metrics.jsonl",
    )
    schema.set_defaults(func=handlers["schema"])


def _stacks_command(sub: Any, handlers: Handlers) -> None:
    stacks = sub.add_parser(
        "stacks",
        help="every task's stacks: read now on a live run, the last read (before a stop) on an ended one",
    )
    stacks.add_argument("run_dir", nargs="?", help="a run directory (default: the latest run under runs/)")
    stacks.add_argument("task", nargs="?", help="e.g. worker-1 (default: all)")
    stacks.add_argument(
        "--native",
        action="store_true",
        help="a live run's C++ frames too (py-spy pauses each task while it reads them: a second or more)",
    )
    stacks.add_argument("--json", action="store_true", help="the documents as JSON")
    stacks.set_defaults(func=handlers["stacks"])
