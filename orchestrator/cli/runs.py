"""CLI room: the commands on a run directory — `orchestrate status`, `ls`, `wait`, `logs`, `stacks`,
`show` and `down` (a live run or an ended one, from another terminal)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

from orchestrator.errors import EXIT_FAILED, EXIT_OK

#: `orchestrate wait --timeout` ran out (as timeout(1) does).
EXIT_TIMEOUT = 124
_TASK_NAME = re.compile(r"^(chief|worker|ps|evaluator)-[0-9]+$")


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

    from orchestrator.cli.view import render_status
    from orchestrator.record.progress import recent_events
    from orchestrator.record.read import (
        coordinator_alive,
        has_ended,
        read_events,
        read_status,
        resolve_run_dir,
    )

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
    from orchestrator.record.read import list_run_dirs, run_summary
    from orchestrator.record.write import RUNS_DIR
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
    from orchestrator.control import down
    from orchestrator.record.read import resolve_run_dir

    return down(resolve_run_dir(args.run_dir))
