"""Spec layer: read a YAML cluster spec into a ClusterSpec, or raise SpecError naming file:line and key.

PyYAML's node tree keeps the line of every key (yamlread.py reads it, bounded), so each pydantic
error location is mapped back to the line the user must edit. Only a regular file of at most
MAX_SPEC_BYTES is read (a FIFO or a device never is). Every problem — YAML, encoding, control
characters, size — is a SpecError with a line.
"""

from __future__ import annotations

import os
import stat
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.errors import SpecError, SpecProblem, UsageError, did_you_mean
from orchestrator.launch import registry
from orchestrator.spec import sections
from orchestrator.spec.checks import check_spec
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.yamlread import INDEX_DEPTH, MAX_SPEC_BYTES, Path_, read_yaml, redact_text

__all__ = ["MAX_SPEC_BYTES", "key_lines", "load_spec", "parse_spec", "redact_text"]


def backend_named(name: str, given_as: str) -> str:
    """The backend a user named (`--backend NAME`, the API's `backend=`), when it is registered
    (launch/registry.py); UsageError naming the likely one and listing them otherwise. `given_as`:
    how the user wrote it, for the message."""
    if not registry.is_registered(name):
        raise UsageError(f"{given_as}: {registry.unknown_message(name)}")
    return name


def load_spec(path: str | Path, backend: str | None = None) -> ClusterSpec:
    """Read and validate the spec at `path`. `backend` (from --backend) overrides the spec's."""
    path = Path(path)
    text = _read_text(path)
    return parse_spec(text, file=str(path), base_dir=path.resolve().parent, backend=backend)


def _read_text(path: Path) -> str:
    """The spec's text: a regular file's, at most MAX_SPEC_BYTES, UTF-8."""

    def fail(message: str, line: int = 1) -> SpecError:
        return SpecError(str(path), [SpecProblem((), message, line)])

    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise fail(f"cannot read the spec: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail("cannot read the spec: not a regular file (a folder, FIFO or device is never read)")
        if st.st_size > MAX_SPEC_BYTES:
            raise fail(f"the spec is {st.st_size:,} bytes; a spec may have at most {MAX_SPEC_BYTES:,}")
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > MAX_SPEC_BYTES:  # it grew while read
                raise fail(f"the spec is over {MAX_SPEC_BYTES:,} bytes, the most a spec may have")
            chunks.append(chunk)
    except OSError as exc:
        raise fail(f"cannot read the spec: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise fail(f"not UTF-8 text: byte 0x{data[exc.start]:02x} on this line", line) from None


def parse_spec(text: str, *, file: str, base_dir: Path, backend: str | None = None) -> ClusterSpec:
    data, lines = read_yaml(text, file)
    if not isinstance(data, dict):
        raise SpecError(file, [SpecProblem((), "the spec must be a mapping (name:, hosts:, job:, …)", 1)])
    controls = _control_characters(data, ())
    if controls:
        raise SpecError(file, [_locate(p, lines) for p in controls])
    if backend is not None:
        data = {**data, "backend": backend}
    data, found = sections.split(data)
    # hosts may be left out only where the backend's own section places the tasks; said with the rest
    kind = sections.kind_of(data)
    no_hosts = "hosts" not in data and not (kind is not None and kind.places_tasks)
    hosts_missing = [_locate(SpecProblem(("hosts",), "required key is missing"), lines)] if no_hosts else []
    context = {"base_dir": base_dir}
    models, errors, wrong = sections.validate(found, context)
    try:
        spec = ClusterSpec.model_validate(data, context=context)
    except ValidationError as exc:
        errors = [dict(e) for e in exc.errors()] + errors
    if hosts_missing or errors or wrong:
        raise SpecError(
            file,
            hosts_missing + [_problem(err, lines) for err in errors] + [_locate(p, lines) for p in wrong],
        )
    spec = sections.complete(spec, models)
    problems = check_spec(spec, kind)
    if problems:
        raise SpecError(file, [_locate(p, lines) for p in problems])
    return spec


def key_lines(text: str, file: str = "spec.yaml") -> dict[Path_, int]:
    """The line of every key and list item of a spec's text (`("job", "env")` → 9), for a hint
    that names the line to edit; {} when the text does not parse."""
    try:
        return read_yaml(text, file)[1]
    except SpecError:
        return {}


_CONTROL = {chr(c) for c in (*range(0x20), 0x7F)} - {"\t", "\n"}


def _control_characters(value: Any, path: Path_) -> list[SpecProblem]:
    """Control characters (NUL, ESC, …) written as escapes: no environment, argument or path can
    carry a NUL, and the others only garble a terminal. Tabs and newlines are fine."""
    if len(path) > INDEX_DEPTH:
        return []  # deeper than any key of the schema: refused by it anyway
    if isinstance(value, str):
        bad = sorted({c for c in value if c in _CONTROL})
        if bad:
            chars = ", ".join(f"#x{ord(c):02x}" for c in bad)
            return [SpecProblem(path, f"control character {chars} in this value; remove it")]
        return []
    out: list[SpecProblem] = []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _control_characters(key, path) if isinstance(key, str) else []
            out += _control_characters(item, (*path, key if isinstance(key, (str, int)) else str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _control_characters(item, (*path, i))
    return out


#: Keys and items are located (and checked for control characters) this deep: the schema's
#: deepest key is 4 down (hosts[0].env.NAME); below, a problem takes its ancestor's line, and
#: walking a tree of aliases 100,000 values large at every depth cost seconds (path tuples grow).
def _known_keys(path: Path_) -> list[str]:
    """The keys the spec allows in the section at `path` (`("hosts", 0)`: a host's keys)."""
    model = sections.section_model(str(path[0])) if path else None
    kinds: list[Any] = [model] if model is not None else [ClusterSpec]
    if not path:
        return [*ClusterSpec.model_fields, *(n for n in registry.names() if sections.section_model(n))]
    for part in path[1:] if model is not None else path:
        inner: list[Any] = []
        for kind in kinds:
            if isinstance(part, str) and isinstance(kind, type) and issubclass(kind, BaseModel):
                field = kind.model_fields.get(part)
                if field is not None:
                    inner += _unwrap(field.annotation)
            elif isinstance(part, int):
                inner += [a for arg in typing.get_args(kind) for a in _unwrap(arg)]
        kinds = inner
    return [
        field.alias or name
        for kind in kinds
        if isinstance(kind, type) and issubclass(kind, BaseModel)
        for name, field in kind.model_fields.items()
    ]


def _unwrap(annotation: Any) -> list[Any]:
    """A field's models and containers, through Optional and unions."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _unwrap(arg)]
    return [annotation]


def _problem(err: Mapping[str, Any], lines: dict[Path_, int]) -> SpecProblem:
    # pydantic adds markers such as '[key]' or a union member's type name to `loc`; keep the real keys.
    path = tuple(p for p in err["loc"] if isinstance(p, int) or not str(p).startswith(("[", "function-")))
    message = err["msg"]
    if err["type"] == "extra_forbidden":
        message = "unknown key (check its spelling; `orchestrate schema` lists the valid keys)"
        close = did_you_mean(str(path[-1]), _known_keys(path[:-1])) if path else None
        if close is not None:
            message = f"unknown key; did you mean `{close}`?"
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
