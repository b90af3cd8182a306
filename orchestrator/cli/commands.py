"""CLI room: the commands on a spec — `orchestrate validate`, `plan`, `check`, `up` and `schema`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import EXIT_LAUNCH, EXIT_OK, UsageError

if TYPE_CHECKING:
    from orchestrator.launch.kind import Kind
    from orchestrator.plan.launch_plan import LaunchPlan
    from orchestrator.spec.model import ClusterSpec


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
    kind = launch.kind_of(spec)
    run_id = f"{spec.name}-<time>-<random>"
    run_dir = Path("runs") / f"{spec.name}-<time>"
    placements, note = kind.preview(spec, run_id, run_dir, args.spec.resolve().parent)
    plan = make_plan(spec, run_id, placements)
    warnings = [line for line in note.splitlines() if line.startswith("warning: ")]
    note = "\n".join(line for line in note.splitlines() if not line.startswith("warning: "))
    for warning in warnings:  # the plan is shown all the same: it launches nothing
        print(f"orchestrate: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({**plan.to_json(), "network": kind.reach(spec).to_json()}, indent=2))
        return EXIT_OK
    print(f"{plan.name}: {plan.strategy.value} on the {plan.backend} backend, {len(plan.tasks)} tasks")
    print(f"cluster: {json.dumps(dict(plan.cluster))}")
    print("policy (spec key policy: <role>: {decides, on_failure, at_end}):")
    for role, rule in plan.policy.items():
        decides = str(rule.decides).lower()
        keys = f"decides: {decides}, on_failure: {rule.on_failure.value}, at_end: {rule.at_end.value}"
        print(f"  {role.value + ':':<11}{keys}\n  {'':<11}({rule.describe()})")
    print(standby_lines(spec, plan))
    print(network_line(spec, kind))
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


def network_line(spec: ClusterSpec, kind: Kind) -> str:
    """`plan`'s and `check`'s word on who can reach the tasks' TF ports (unauthenticated), as the
    spec's backend kind (looked up once by the command) says."""
    return kind.reach(spec).said


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
    kind = launch.kind_of(spec)
    report = kind.check(spec)
    if report is None:
        from orchestrator.environment.local import check_line
        from orchestrator.launch.check_cells import page_copy_warning, stacks_warning
        from worker.host import probe

        print(f"{args.spec}: backend {spec.backend} runs every task on this machine")
        print(network_line(spec, kind))
        found = probe.stacks()
        said = stacks_warning("this machine", {"stacks": found})
        print(f"warning: {said}" if said else f"a hung task's stacks: native frames too ({found['py_spy']})")
        if (copy := page_copy_warning("this machine", {"page_copy": probe.page_copy()})) is not None:
            print(f"warning: {copy}")
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
    console.print(network_line(spec, kind))
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
    from orchestrator.cli.view import console_view
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
        view=console_view(False if args.plain else None, args.progress_every),
        backend_option=args.backend,
        progress_every_s=args.progress_every,
        web=None if args.no_web else parse_address(args.web),
        own_process=True,
    )
    outcome = coordinator.up(spec, args.spec, options)
    from orchestrator.cli.summary import summarize

    return summarize(outcome)


def cmd_schema(args: argparse.Namespace) -> int:
    if args.document == "spec":
        from orchestrator.spec import sections

        print(json.dumps(sections.json_schema(), indent=2))
    else:
        from orchestrator.record.schemas import json_schema

        print(json.dumps(json_schema(args.document), indent=2))
    return EXIT_OK
