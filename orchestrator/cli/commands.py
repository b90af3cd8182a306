"""CLI layer: `orchestrate …`. Parses arguments, calls the layers, maps errors to exit codes
(0 success · 1 job failed · 2 bad spec/usage · 3 preflight/launch failure · 130 interrupted).

Heavy modules are imported inside the commands, so `validate` and `plan` start fast; nothing
here imports TensorFlow.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import arguments
from orchestrator.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LAUNCH,
    EXIT_OK,
    EXIT_USAGE,
    OrchestrateError,
    UsageError,
)
from orchestrator.record.quiet import console_writes_anything

if TYPE_CHECKING:
    from orchestrator.plan.launch_plan import LaunchPlan
    from orchestrator.spec.model import ClusterSpec

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_LAUNCH", "EXIT_OK", "EXIT_USAGE", "main"]

#: `orchestrate wait --timeout` ran out (as timeout(1) does).
EXIT_TIMEOUT = 124
_TASK_NAME = re.compile(r"^(chief|worker|ps|evaluator)-[0-9]+$")


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


def _load(args: argparse.Namespace) -> Any:
    from orchestrator.spec import load_spec
    from orchestrator.spec.load import backend_named

    name = getattr(args, "backend", None)
    if name is None:
        return load_spec(args.spec)
    return load_spec(args.spec, backend=backend_named(name, f"--backend {name}"))


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _load(args)
    tasks = sum(sum(h.tasks.values()) for h in spec.hosts)
    print(
        f"{args.spec}: ok — {spec.name}: {spec.strategy.value}, {tasks} tasks on {len(spec.hosts)} host(s), "
        f"backend {spec.backend}"
    )
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    import shlex

    from orchestrator import launch
    from orchestrator.plan.launch_plan import make_plan

    spec = _load(args)
    run_id = f"{spec.name}-<time>-<random>"
    run_dir = Path("runs") / f"{spec.name}-<time>"
    placements, note = launch.preview(spec, run_id, run_dir, args.spec.resolve().parent)
    plan = make_plan(spec, run_id, placements)
    warnings = [line for line in note.splitlines() if line.startswith("warning: ")]
    note = "\n".join(line for line in note.splitlines() if not line.startswith("warning: "))
    for warning in warnings:  # the plan is shown all the same: it launches nothing
        print(f"orchestrate: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({**plan.to_json(), "network": launch.reach(spec).to_json()}, indent=2))
        return EXIT_OK
    print(f"{plan.name}: {plan.strategy.value} on the {plan.backend} backend, {len(plan.tasks)} tasks")
    print(f"cluster: {json.dumps(dict(plan.cluster))}")
    print("policy (spec key policy: <role>: {decides, on_failure, at_end}):")
    for role, rule in plan.policy.items():
        decides = str(rule.decides).lower()
        keys = f"decides: {decides}, on_failure: {rule.on_failure.value}, at_end: {rule.at_end.value}"
        print(f"  {role.value + ':':<11}{keys}\n  {'':<11}({rule.describe()})")
    print(standby_lines(spec, plan))
    print(network_line(spec))
    for t in plan.tasks:
        print(
            f"\n{t.name}  host {t.host}  port {t.port}"
            + ("" if t.in_cluster else "  (outside the training cluster)")
        )
        print(f"  command: {shlex.join(t.argv)}")
        print(f"  cwd:     {t.cwd}")
        for k, v in plan.shown_env(t).items():
            print(f"  {k}={v}")
        print("  ORCHESTRATE_ATTEMPT=<0, 1, … per attempt>  ORCHESTRATE_TOKEN=<the task's own credential>")
    print(f"\n({note})")
    return EXIT_OK


def network_line(spec: ClusterSpec) -> str:
    """`plan`'s and `check`'s word on who can reach the tasks' TF ports (unauthenticated)."""
    from orchestrator import launch

    return launch.reach(spec).said


def standby_lines(spec: ClusterSpec, plan: LaunchPlan) -> str:
    """`plan`'s word on warm standbys: per host, what they would take."""
    from collections import Counter

    from orchestrator.launch import standby

    verdict = standby.for_run(spec)
    if not verdict.on:
        return f"warm standbys: none ({verdict.why})"
    hosts = Counter(t.host for t in plan.tasks if standby.command(t.argv))
    mode = spec.restart.standby.value
    keep = standby.mib(standby.KEEP_AVAILABLE_BYTES)
    lines = [f"warm standbys (restart.standby: {mode}; each imports TensorFlow for the next attempt):"]
    for host, n in hosts.items():
        cost = f"{n} × {standby.mib(standby.STANDBY_BYTES)} = {standby.mib(n * standby.STANDBY_BYTES)}"
        lines.append(
            f"  {host}: {cost}" + (f", where {keep} stay available with them" if mode == "auto" else "")
        )
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from orchestrator import launch

    spec = _load(args)
    report = launch.check(spec)
    if report is None:
        from orchestrator.environment.local import check_line
        from orchestrator.launch.ssh.preflight import stacks_warning
        from worker.host import probe

        print(f"{args.spec}: backend {spec.backend} runs every task on this machine")
        print(network_line(spec))
        found = probe.stacks()
        said = stacks_warning("this machine", {"stacks": found})
        print(f"warning: {said}" if said else f"a hung task's stacks: native frames too ({found['py_spy']})")
        line, ready = check_line(spec.environment) if spec.environment else ("", True)
        print(line, end="\n" if line else "")
        return EXIT_OK if ready else EXIT_LAUNCH
    table = Table(title=report.title)
    for column in report.rows[0]:
        table.add_column(column)
    for row in report.rows:
        table.add_row(*row.values())
    # piped or logged: one line per host, however many columns (a terminal's width otherwise)
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    console.print(table)
    console.print(network_line(spec))
    for warning in report.warnings:
        console.print(f"warning: {warning}")
    for problem in report.problems:
        console.print(f"problem: {problem}")
    if report.problems:
        return EXIT_LAUNCH
    console.print("all hosts ready")
    return EXIT_OK


def cmd_up(args: argparse.Namespace) -> int:
    from orchestrator import coordinator
    from orchestrator.control import UpOptions, detach
    from orchestrator.record.write import new_run_dir
    from orchestrator.web import parse_address

    spec = _load(args)
    if args.resume and args.run_dir and args.resume != args.run_dir:
        raise UsageError("give either --resume RUN_DIR or --run-dir DIR, not both")
    if args.detach:
        run_dir = args.resume or args.run_dir or new_run_dir(spec.name)
        argv = ["up", str(args.spec), "--plain", "--progress-every", str(args.progress_every)]
        argv += ["--no-web"] if args.no_web else ["--web", args.web]
        argv += ["--resume", str(run_dir)] if args.resume else ["--run-dir", str(run_dir)]
        if args.backend:
            argv += ["--backend", args.backend]
        pid = detach(argv, run_dir)
        print(f"started {spec.name} in the background (coordinator pid {pid})")
        print(f"  run directory: {run_dir}")
        print(f"  follow it:     orchestrate status {run_dir}   |   orchestrate logs {run_dir} -f")
        print(f"  stop it:       orchestrate down {run_dir}")
        return EXIT_OK
    options = UpOptions(
        run_dir=args.resume or args.run_dir,
        resume=args.resume is not None,
        live=False if args.plain else None,
        backend_option=args.backend,
        progress_every_s=args.progress_every,
        web=None if args.no_web else parse_address(args.web),
        own_process=True,
    )
    outcome = coordinator.up(spec, args.spec, options)
    from orchestrator.cli.summary import summarize

    return summarize(outcome)


def cmd_show(args: argparse.Namespace) -> int:
    import time

    from orchestrator.record.read import resolve_run_dir
    from orchestrator.web import parse_address
    from orchestrator.web.server import serve_run

    run_dir = resolve_run_dir(args.run_dir)
    server = serve_run(run_dir, *parse_address(args.web))
    print(f"{run_dir}: {server.page_url}", flush=True)
    print(
        f"  Prometheus: {server.metrics_url} (Authorization: Bearer {server.token}); Ctrl-C ends", flush=True
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        server.close()


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.record.progress import recent_events
    from orchestrator.record.read import coordinator_alive, has_ended, read_events, read_status, resolve_run_dir
    from orchestrator.cli.view import render_status

    run_dir = resolve_run_dir(args.run_dir)
    status = read_status(run_dir)
    pid = coordinator_alive(run_dir)
    stale = not has_ended(status) and pid is None
    if args.json:
        status["coordinator"] = {"pid": pid, "alive": pid is not None}
        status["stale"] = stale
        from worker.wire import dumps

        print(dumps(status, indent=2))
        return EXIT_OK
    console = Console()
    console.print(f"run directory: {run_dir}")
    # a run whose coordinator died is shown as of its last record: its clock does not tick on
    at = (run_dir / "status.json").stat().st_mtime if stale else None
    console.print(
        render_status(status, recent_events(read_events(run_dir)), width=console.width, now=at, max_rows=None)
    )
    if stale:
        console.print(
            "[yellow]its coordinator is gone: this is the last recorded state; "
            f"`orchestrate down {run_dir}` stops anything it left[/yellow]"
        )
    return EXIT_OK if status["state"] != "FAILED" else EXIT_FAILED


def cmd_ls(args: argparse.Namespace) -> int:
    from orchestrator.record.progress import age_text
    from orchestrator.record.write import RUNS_DIR
    from orchestrator.record.read import list_run_dirs, run_summary
    from worker import wire

    base = args.runs or RUNS_DIR
    runs = [run_summary(p) for p in list_run_dirs(base)]
    if args.json:
        for run in runs:
            print(wire.dumps(run))
        return EXIT_OK
    if not runs:
        print(f"no runs under {base}/")
        return EXIT_OK
    width = max(len(r["run_dir"]) for r in runs)
    print(f"{'RUN':<{width}}  {'STATE':<12} {'AGE':>6}  ATTEMPTS  RESTARTS")
    for r in runs:
        state = r["state"] + ("?" if r.get("stale") else "")
        age = age_text(r.get("age_s"))
        counts = f"{r.get('attempts', ''):>8}  {r.get('restarts', ''):>8}"
        print(f"{r['run_dir']:<{width}}  {state:<12} {age:>6}  {counts}")
    if any(r.get("stale") for r in runs):
        print("?: its coordinator is gone; the state shown is its last record (`orchestrate down` cleans up)")
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    from orchestrator.record.read import resolve_run_dir, wait

    run_dir = resolve_run_dir(args.run_dir, starting_ok=True)
    code, line = wait(run_dir, args.timeout)
    print(line, file=sys.stdout if code in (EXIT_OK, None) else sys.stderr)
    return EXIT_TIMEOUT if code is None else code


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.record.read import follow_logs, resolve_run_dir, task_names

    run_arg, task = args.run_dir, args.task
    if run_arg is not None and task is None and _TASK_NAME.match(run_arg) and not Path(run_arg).is_dir():
        run_arg, task = None, run_arg  # `orchestrate logs worker-1`: that task of the latest run
    run_dir = resolve_run_dir(run_arg)
    tasks = [task] if task else task_names(run_dir)
    return follow_logs(run_dir, tasks, args.follow)


def cmd_stacks(args: argparse.Namespace) -> int:
    # a diagnosis of a run that may be training on every core here: it yields to the training
    with contextlib.suppress(OSError):
        os.nice(10)
    from orchestrator.record.read import coordinator_alive, has_ended, read_status, resolve_run_dir
    from orchestrator.stacks import live, record

    run_arg, task = args.run_dir, args.task
    if run_arg is not None and task is None and _TASK_NAME.match(run_arg) and not Path(run_arg).is_dir():
        run_arg, task = None, run_arg  # `orchestrate stacks worker-1`: that task of the latest run
    run_dir = resolve_run_dir(run_arg)
    if not has_ended(read_status(run_dir)) and coordinator_alive(run_dir) is not None:
        answer = live.request(run_dir, task, args.native, timeout_s=30.0)
        if isinstance(answer, str) or answer.get("error"):
            print(f"orchestrate: {answer if isinstance(answer, str) else answer['error']}", file=sys.stderr)
            return 1
        docs = answer.get("docs") or {}
    else:
        docs = {name: doc for name, doc in record.latest(run_dir).items() if task is None or name == task}
        if not docs:
            what = f"of {task} " if task else ""
            print(f"orchestrate: no stacks {what}were read in {run_dir} (a hung job's are, before its stop)")
            return 1
    if args.json:
        print(json.dumps(docs, indent=1))
        return 0
    for doc in docs.values():
        print("\n".join(record.text(doc)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.record.read import down, resolve_run_dir

    return down(resolve_run_dir(args.run_dir))


def cmd_schema(args: argparse.Namespace) -> int:
    if args.document == "spec":
        from orchestrator.spec import sections

        print(json.dumps(sections.json_schema(), indent=2))
    else:
        from orchestrator.record.schemas import json_schema

        print(json.dumps(json_schema(args.document), indent=2))
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())


def _handlers() -> arguments.Handlers:
    return {
        "up": cmd_up,
        "plan": cmd_plan,
        "validate": cmd_validate,
        "check": cmd_check,
        "status": cmd_status,
        "ls": cmd_ls,
        "wait": cmd_wait,
        "logs": cmd_logs,
        "show": cmd_show,
        "stacks": cmd_stacks,
        "down": cmd_down,
        "schema": cmd_schema,
    }
