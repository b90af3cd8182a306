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
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import OrchestrateError, UsageError

if TYPE_CHECKING:
    from orchestrator.coordinator import UpResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_LAUNCH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def main(argv: list[str] | None = None) -> int:
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orchestrate", description="Run TensorFlow multi-worker training from one YAML spec."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", help="print a run's task logs")
    logs.add_argument("run_dir")
    logs.add_argument("task", nargs="?", help="e.g. worker-1 (default: all)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=cmd_logs)

    down = sub.add_parser("down", help="stop a run (detached or from another terminal); idempotent")
    down.add_argument("run_dir")
    down.set_defaults(func=cmd_down)

    schema = sub.add_parser("schema", help="print the JSON Schema of the spec (for editors)")
    schema.set_defaults(func=cmd_schema)
    return p


def _load(args: argparse.Namespace) -> Any:
    from orchestrator.spec import Backend, load_spec

    name = getattr(args, "backend", None)
    if name is None:
        return load_spec(args.spec)
    try:
        backend = Backend(name)
    except ValueError:
        names = ", ".join(b.value for b in Backend)
        raise UsageError(f"--backend {name}: no such backend (one of: {names})") from None
    return load_spec(args.spec, backend=backend)


def cmd_validate(args: argparse.Namespace) -> int:
    spec = _load(args)
    tasks = sum(sum(h.tasks.values()) for h in spec.hosts)
    print(
        f"{args.spec}: ok — {spec.name}: {spec.strategy.value}, {tasks} tasks on {len(spec.hosts)} host(s), "
        f"backend {spec.backend.value}"
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
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return EXIT_OK
    print(f"{plan.name}: {plan.strategy.value} on the {plan.backend.value} backend, {len(plan.tasks)} tasks")
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
        print(f"{args.spec}: backend {spec.backend.value} runs every task on this machine; nothing to check")
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
    from orchestrator.record import new_run_dir

    spec = _load(args)
    if args.resume and args.run_dir and args.resume != args.run_dir:
        raise UsageError("give either --resume RUN_DIR or --run-dir DIR, not both")
    if args.detach:
        run_dir = args.resume or args.run_dir or new_run_dir(spec.name)
        argv = ["up", str(args.spec), "--plain"]
        argv += ["--resume", str(run_dir)] if args.resume else ["--run-dir", str(run_dir)]
        if args.backend:
            argv += ["--backend", args.backend]
        pid = coordinator.detach(argv, run_dir)
        print(f"started {spec.name} in the background (coordinator pid {pid})")
        print(f"  run directory: {run_dir}")
        print(f"  follow it:     orchestrate status {run_dir}   |   orchestrate logs {run_dir} -f")
        print(f"  stop it:       orchestrate down {run_dir}")
        return EXIT_OK
    outcome = coordinator.up(
        spec,
        args.spec,
        run_dir=args.resume or args.run_dir,
        resume=args.resume is not None,
        live=False if args.plain else None,
    )
    return _summarize(outcome)


def _summarize(outcome: UpResult) -> int:
    from orchestrator.logtail import tail_lines
    from orchestrator.supervise.policy import FailureKind
    from orchestrator.supervise.states import ClusterState

    r = outcome.result
    print(f"\norchestrate: {outcome.plan.name} {r.state.value} — {r.reason}")
    print(f"  attempts {r.attempt + 1}, restarts {r.restarts}; run record: {outcome.run_dir}")
    if outcome.brought_home:
        print(f"  brought home from the hosts into {outcome.run_dir}:")
        for line in outcome.brought_home:
            print(f"    {line}")
    for f in r.task_restarts:
        print(f"  restarted alone: {f.describe()}")
    for f in r.ignored:
        print(f"  reported, did not stop the job: {f.describe()}")
    cause = r.root_cause
    if r.state is not ClusterState.SUCCEEDED and cause is not None:
        print(f"  first failure: {cause.describe()}")
        if cause.exit_code is not None:
            print(f"  exit code: {cause.exit_code}")
        if cause.error is not None and cause.error.traceback:
            print("  traceback:")
            for line in cause.error.traceback.rstrip().splitlines()[-15:]:
                print(f"    {line}")
        for name in r.failed_tasks:
            log_path = outcome.run_dir / "logs" / f"{name}.log"
            lines = tail_lines(log_path, 20)
            if lines:
                print(f"  last lines of {log_path}:")
                for line in lines:
                    print(f"    | {line}")
    if r.state is ClusterState.SUCCEEDED:
        return EXIT_OK
    if r.state is ClusterState.INTERRUPTED:
        return EXIT_INTERRUPTED
    if cause is not None and cause.kind is FailureKind.LAUNCH:
        return EXIT_LAUNCH
    return EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.rundir import coordinator_alive, read_status, resolve_run_dir
    from orchestrator.supervise.states import ClusterState
    from orchestrator.view import render_status

    run_dir = resolve_run_dir(args.run_dir)
    status = read_status(run_dir)
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    console = Console()
    console.print(f"run directory: {run_dir}")
    console.print(render_status(status))
    if not ClusterState(status["state"]).is_terminal and coordinator_alive(run_dir) is None:
        console.print(
            "[yellow]its coordinator is gone: this is the last recorded state; "
            f"`orchestrate down {run_dir}` stops anything it left[/yellow]"
        )
    return EXIT_OK if status["state"] != "FAILED" else EXIT_FAILED


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.rundir import follow_logs, resolve_run_dir, task_names

    run_dir = resolve_run_dir(args.run_dir)
    tasks = [args.task] if args.task else task_names(run_dir)
    return follow_logs(run_dir, tasks, args.follow)


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.rundir import down, resolve_run_dir

    return down(resolve_run_dir(args.run_dir))


def cmd_schema(args: argparse.Namespace) -> int:
    from orchestrator.spec.model import ClusterSpec

    print(json.dumps(ClusterSpec.model_json_schema(), indent=2))
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
