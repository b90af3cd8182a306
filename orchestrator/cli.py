"""CLI layer: `orchestrate …`. Parses arguments, calls the layers, maps errors to exit codes
(0 success · 1 job failed · 2 bad spec/usage · 3 preflight/launch failure · 130 interrupted).

Heavy modules are imported inside the commands, so `validate` and `plan` start fast; nothing
here imports TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_LAUNCH,
    EXIT_OK,
    EXIT_USAGE,
    OrchestrateError,
    UsageError,
)
from orchestrator.quiet import console_writes_anything

if TYPE_CHECKING:
    from orchestrator.control import RunResult

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_LAUNCH", "EXIT_OK", "EXIT_USAGE", "main"]

#: `orchestrate wait --timeout` ran out (as timeout(1) does).
EXIT_TIMEOUT = 124
_TASK_NAME = re.compile(r"^(chief|worker|ps|evaluator)-[0-9]+$")


def main(argv: list[str] | None = None) -> int:
    console_writes_anything()
    parser = _parser()
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


def _parser() -> argparse.ArgumentParser:
    from orchestrator import __version__

    p = _Parser(prog="orchestrate", description="Run TensorFlow multi-worker training from one YAML spec.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"orchestrate (tf-orchestrate) {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

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
    up.set_defaults(func=cmd_up)

    plan = sub.add_parser("plan", help="print every task: host, role, port, command, env and TF_CONFIG")
    plan.add_argument("spec", type=Path)
    plan.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=cmd_plan)

    validate = sub.add_parser("validate", help="check a spec; errors name file:line and the key")
    validate.add_argument("spec", type=Path)
    validate.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    validate.set_defaults(func=cmd_validate)

    check = sub.add_parser(
        "check", help="preflight every host: SSH, host keys, Python/TensorFlow versions, ports, disk, peers"
    )
    check.add_argument("spec", type=Path)
    check.add_argument("--backend", metavar="NAME", help=_BACKEND_HELP)
    check.set_defaults(func=cmd_check)

    status = sub.add_parser("status", help="show a run's state (default: the latest run under runs/)")
    status.add_argument("run_dir", nargs="?")
    status.add_argument(
        "--json",
        action="store_true",
        help="status.json, and whether its coordinator lives (`orchestrate schema status`)",
    )
    status.set_defaults(func=cmd_status)

    runs = sub.add_parser("ls", help="list the runs under runs/: state, age, attempts, restarts")
    runs.add_argument("--runs", type=Path, default=None, metavar="DIR", help="where to look (default runs/)")
    runs.add_argument("--json", action="store_true", help="one JSON object per run")
    runs.set_defaults(func=cmd_ls)

    wait = sub.add_parser(
        "wait", help="wait for a run to end; exit with its exit code (default: the latest run)"
    )
    wait.add_argument("run_dir", nargs="?")
    wait.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (exit 124)")
    wait.set_defaults(func=cmd_wait)

    logs = sub.add_parser("logs", help="print a run's task logs (default: the latest run)")
    logs.add_argument("run_dir", nargs="?", help="a run directory (default: the latest run under runs/)")
    logs.add_argument("task", nargs="?", help="e.g. worker-1 (default: all)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=cmd_logs)

    show = sub.add_parser("show", help="serve a run's page (default: the latest run) until Ctrl-C")
    show.add_argument("run_dir", nargs="?")
    show.add_argument("--web", metavar="HOST:PORT", default="127.0.0.1:0", help="where (default: loopback)")
    show.set_defaults(func=cmd_show)

    down = sub.add_parser("down", help="stop a run (detached or from another terminal); idempotent")
    down.add_argument("run_dir")
    down.set_defaults(func=cmd_down)

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
    schema.set_defaults(func=cmd_schema)
    return p


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
    from orchestrator.plan import make_plan

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
        print(json.dumps(plan.to_json(), indent=2))
        return EXIT_OK
    print(f"{plan.name}: {plan.strategy.value} on the {plan.backend} backend, {len(plan.tasks)} tasks")
    print(f"cluster: {json.dumps(dict(plan.cluster))}")
    print("policy (spec key policy: <role>: {decides, on_failure, at_end}):")
    for role, rule in plan.policy.items():
        decides = str(rule.decides).lower()
        keys = f"decides: {decides}, on_failure: {rule.on_failure.value}, at_end: {rule.at_end.value}"
        print(f"  {role.value + ':':<11}{keys}\n  {'':<11}({rule.describe()})")
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


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from orchestrator import launch

    spec = _load(args)
    report = launch.check(spec)
    if report is None:
        print(f"{args.spec}: backend {spec.backend} runs every task on this machine; nothing to check")
        return EXIT_OK
    table = Table(title=report.title)
    for column in report.rows[0]:
        table.add_column(column)
    for row in report.rows:
        table.add_row(*row.values())
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
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
    from orchestrator.record import new_run_dir
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
    return _summarize(outcome)


def _summarize(outcome: RunResult) -> int:
    """The end of `orchestrate up`: how it ended and why, what it took, every restart's cause, the
    final metrics, where the results are; for a failure, the first one with its traceback and log."""
    from orchestrator.hints import hints
    from orchestrator.logtail import tail_lines
    from orchestrator.quiet import collapse_redraws
    from orchestrator.rundir import resume_command, spec_path
    from orchestrator.supervise.states import ClusterState
    from orchestrator.view import duration_text, elapsed_s, progress_of

    r = outcome.result
    print(f"\norchestrate: {outcome.plan.name} {r.state.value} — {r.reason}")
    took = elapsed_s({"started_at": r.started_at, "ended_at": r.ended_at})
    took_text = f"took {duration_text(took)} · " if took is not None else ""
    print(f"  {took_text}attempts {r.attempt + 1} · restarts {r.restarts}")
    if len(r.failures) > 1 or (r.failures and r.state is ClusterState.SUCCEEDED):
        for f in r.failures:  # each restart's cause (one alone is the first failure, below)
            print(f"  attempt {f.attempt} ended: {f.describe()}")
    for f in r.task_restarts:
        print(f"  restarted alone: {f.describe()}")
    for f in r.ignored:
        print(f"  reported, did not stop the job: {f.describe()}")
    final = progress_of(outcome.status).parts(ended=True)
    if final:
        print(f"  final: {' · '.join(final)}")
    model = outcome.run_dir / "model"
    if model.is_dir():
        saved = sorted(model.glob("*.keras")) or [model]
        print(f"  model: {saved[0]}")
    print(f"  run record: {outcome.run_dir}")
    if outcome.hidden_lines:
        print(
            f"  ({outcome.hidden_lines} lines of TensorFlow start-up output and traceback frames were left "
            f"off the console: `orchestrate logs {outcome.run_dir}` has them)"
        )
    if outcome.brought_home:
        print(f"  brought home from the hosts into {outcome.run_dir}:")
        for line in outcome.brought_home:
            print(f"    {line}")
    cause = r.root_cause
    if r.state is not ClusterState.SUCCEEDED and cause is not None:
        print(f"  first failure: {cause.describe()}")
        if cause.exit_code is not None:
            print(f"  exit code: {cause.exit_code}")
        if cause.error is not None and cause.error.traceback:
            print("  traceback:")
            for line in cause.error.traceback.rstrip().splitlines()[-15:]:
                print(f"    {line}")
        for hint in hints(
            r.failures, outcome.plan, outcome.run_dir, spec_path(outcome.run_dir) or "spec.yaml"
        ):
            print(f"  {hint}")
        shown_tb = cause.error is not None and bool(cause.error.traceback)
        for name in r.failed_tasks:
            log_path = outcome.run_dir / "logs" / f"{name}.log"
            lines = [collapse_redraws(line) for line in tail_lines(log_path, 100)]
            if shown_tb:  # the traceback is above: the lines that led to it
                tb = [
                    i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")
                ]
                lines = lines[: tb[-1]] if tb else lines
            lines = lines[-20:]
            if lines:
                print(f"  last lines of {log_path}{' before the traceback' if shown_tb else ''}:")
                for line in lines:
                    print(f"    | {line}")
    if r.state is not ClusterState.SUCCEEDED:
        again = resume_command(outcome.run_dir)
        if again is not None:
            print(f"  continue it from its checkpoints: {again}")
    code = r.exit_code
    assert code is not None  # `up` returns an ended run
    return code


def cmd_show(args: argparse.Namespace) -> int:
    import time

    from orchestrator.rundir import resolve_run_dir
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

    from orchestrator.rundir import coordinator_alive, has_ended, read_events, read_status, resolve_run_dir
    from orchestrator.view import recent_events, render_status

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
    from orchestrator.record import RUNS_DIR
    from orchestrator.rundir import list_run_dirs, run_summary
    from orchestrator.view import age_text
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
    from orchestrator.rundir import resolve_run_dir, wait

    run_dir = resolve_run_dir(args.run_dir, starting_ok=True)
    code, line = wait(run_dir, args.timeout)
    print(line, file=sys.stdout if code in (EXIT_OK, None) else sys.stderr)
    return EXIT_TIMEOUT if code is None else code


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.rundir import follow_logs, resolve_run_dir, task_names

    run_arg, task = args.run_dir, args.task
    if run_arg is not None and task is None and _TASK_NAME.match(run_arg) and not Path(run_arg).is_dir():
        run_arg, task = None, run_arg  # `orchestrate logs worker-1`: that task of the latest run
    run_dir = resolve_run_dir(run_arg)
    tasks = [task] if task else task_names(run_dir)
    return follow_logs(run_dir, tasks, args.follow)


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.rundir import down, resolve_run_dir

    return down(resolve_run_dir(args.run_dir))


def cmd_schema(args: argparse.Namespace) -> int:
    if args.document == "spec":
        from orchestrator.spec import sections

        print(json.dumps(sections.json_schema(), indent=2))
    else:
        from orchestrator.schemas import json_schema

        print(json.dumps(json_schema(args.document), indent=2))
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
