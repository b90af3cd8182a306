"""Spec layer: read a YAML cluster spec into a ClusterSpec, or raise SpecError naming file:line and key.

PyYAML's node tree keeps the line of every key, so each pydantic error location is mapped back
to the line the user must edit. Duplicate keys (which PyYAML silently collapses) are errors too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.errors import SpecError, SpecProblem
from orchestrator.spec.checks import check_spec
from orchestrator.spec.model import Backend, ClusterSpec

Path_ = tuple[str | int, ...]


def load_spec(path: str | Path, backend: Backend | None = None) -> ClusterSpec:
    """Read and validate the spec at `path`. `backend` (from --backend) overrides the spec's."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(
            str(path), [SpecProblem((), f"cannot read the spec: {exc.strerror or exc}")]
        ) from None
    return parse_spec(text, file=str(path), base_dir=path.resolve().parent, backend=backend)


def parse_spec(text: str, *, file: str, base_dir: Path, backend: Backend | None = None) -> ClusterSpec:
    data, lines = _read_yaml(text, file)
    if not isinstance(data, dict):
        raise SpecError(file, [SpecProblem((), "the spec must be a mapping (name:, hosts:, job:, …)", 1)])
    if backend is not None:
        data = {**data, "backend": backend.value}
    try:
        spec = ClusterSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise SpecError(file, [_problem(err, lines) for err in exc.errors()]) from None
    problems = check_spec(spec)
    if problems:
        raise SpecError(file, [_locate(p, lines) for p in problems])
    return spec


def _read_yaml(text: str, file: str) -> tuple[Any, dict[Path_, int]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise SpecError(file, [SpecProblem((), "the spec is empty", 1)])
        lines: dict[Path_, int] = {(): node.start_mark.line + 1}
        problems: list[SpecProblem] = []
        _index(node, (), lines, problems)
        if problems:
            raise SpecError(file, problems)
        return loader.construct_document(node), lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if exc.context_mark is not None and mark is not None and mark.index >= len(text):
            # Hit the end of the file (an unclosed quote or bracket): the line to fix is where it opened,
            # not the end of the stream (which can be one past the last line).
            mark = exc.context_mark
        line = mark.line + 1 if mark is not None else None
        if line is not None:
            line = min(line, max(1, len(text.rstrip().splitlines())))  # never past the last line
        msg = " ".join(filter(None, [exc.context, exc.problem])) or str(exc)
        raise SpecError(file, [SpecProblem((), f"YAML syntax error: {msg}", line)]) from None
    except yaml.YAMLError as exc:
        raise SpecError(file, [SpecProblem((), f"YAML error: {exc}")]) from None
    finally:
        loader.dispose()


def _index(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[SpecProblem]) -> None:
    """Record the line of every key and list item below `node`."""
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    SpecProblem(path + (key,), "duplicate key (the earlier one would be ignored)", line)
                )
            seen.add(key)
            lines[path + (key,)] = line
            _index(value_node, path + (key,), lines, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _index(item, path + (i,), lines, problems)


def _problem(err: Mapping[str, Any], lines: dict[Path_, int]) -> SpecProblem:
    # pydantic adds markers such as '[key]' or a union member's type name to `loc`; keep the real keys.
    path = tuple(p for p in err["loc"] if isinstance(p, int) or not str(p).startswith(("[", "function-")))
    message = err["msg"]
    if err["type"] == "extra_forbidden":
        message = "unknown key (check its spelling; `orchestrate schema` lists the valid keys)"
    elif err["type"] == "missing":
        message = "required key is missing"
    elif message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return _locate(SpecProblem(path, message), lines)


def _locate(problem: SpecProblem, lines: dict[Path_, int]) -> SpecProblem:
    path = problem.path
    while path not in lines:
        path = path[:-1]
    return SpecProblem(problem.path, problem.message, lines[path])
