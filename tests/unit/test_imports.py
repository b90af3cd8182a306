"""The import structure of both packages. The layers and the rooms' walls are import-linter's
contracts (pyproject.toml, `lint-imports`): they hold, and a bad import breaks them by name. Read
here from the source (nothing is imported), what a contract cannot say: no cycles, function-level
imports included; the host room's files, which run alone on a host, import only the standard
library."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "worker")
#: Run on a host as single files, away from the package (`python -S cache/<sha256>`, `python -c`):
#: the host room, every module of it, and the wire's HTTP/1.1 side the relay loads by its path.
HOST_ROOM = "worker.host"
ALONE_TOO = ("worker.wire.http1",)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, at_run_time: bool, at_import: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of a module. `at_import`: only those that run when it is imported (not
    in a function); `at_run_time`: leave out `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif at_import and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif at_run_time and isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _import_nodes(child, at_run_time, at_import))
        else:
            yield from _import_nodes(node, at_run_time, at_import)


def imports(module: str, at_run_time: bool = False, at_import: bool = False) -> set[str]:
    """Every module `module` names in an import: `from pkg import mod` is pkg.mod when that is a
    module of ours; a relative import is made absolute."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), at_run_time, at_import):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:
            names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return names


def _ours(name: str) -> str | None:
    """The module of ours an imported name refers to (`orchestrator.x.y` may name a function's module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = {_ours(name) for name in imports(module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                frontier.append(nxt)
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_files_run_alone_on_a_host_import_only_the_standard_library():
    alone = [m for m in MODULES if m == HOST_ROOM or m.startswith(HOST_ROOM + ".")] + list(ALONE_TOO)
    assert len(alone) > len(ALONE_TOO) + 1, alone  # the room was found
    for module in alone:
        others = {
            n
            for n in imports(module, at_run_time=True)
            if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"
        }
        assert not others, f"{module} imports {sorted(others)}"


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the packages under `root` (found first on the path), as the tests run it."""
    tool = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(tool), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_import_contracts_hold():
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and "Contracts: 5 kept" in done.stdout, done.stdout


def test_an_import_back_up_the_layers_breaks_the_contracts_by_name(tmp_path):
    # a copy of both packages, with two function-level imports added: the record's up to the CLI,
    # the host room's into the task room
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "orchestrator" / "record" / "read.py", "a") as f:
        f.write("\n\ndef _shown():\n    from orchestrator.cli import view\n\n    return view\n")
    with open(tmp_path / "worker" / "host" / "probe.py", "a") as f:
        f.write("\n\ndef _task():\n    from worker.task import runtime\n\n    return runtime\n")
    done = _lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    said = done.stdout
    assert "The coordinator's layers: each imports only those below it BROKEN" in said, said
    assert "orchestrator.record is not allowed to import orchestrator.cli" in said, said
    assert "orchestrator.record.read -> orchestrator.cli.view" in said, said
    assert "worker.host is not allowed to import worker.task" in said, said
    assert "worker.host.probe -> worker.task.runtime" in said, said
    # and through the task room, the host room's new import reaches TensorFlow from the coordinator
    assert "orchestrator is not allowed to import tensorflow" in said, said
    assert "Contracts: 2 kept, 3 broken." in said, said
