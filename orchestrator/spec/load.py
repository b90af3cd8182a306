"""Spec layer: read a YAML cluster spec into a ClusterSpec, or raise SpecError naming file:line and key.

PyYAML's node tree keeps the line of every key, so each pydantic error location is mapped back
to the line the user must edit. Duplicate keys (which PyYAML silently collapses) are errors too.

Loading is bounded whatever the file holds (a spec may come from someone else): only a regular
file of at most MAX_SPEC_BYTES is read (a FIFO or a device never is); its nesting is checked on
libyaml's event stream before any tree is built, and the tree's size with every alias expanded
before anything walks it (a kilobyte of nested aliases otherwise expands to gigabytes). Every
problem — YAML, encoding, control characters, size — is a SpecError with a line.
"""

from __future__ import annotations

import os
import re
import stat
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from orchestrator.errors import SpecError, SpecProblem, UsageError, did_you_mean
from orchestrator.launch import registry
from orchestrator.spec import sections
from orchestrator.spec.checks import check_spec
from orchestrator.spec.model import MAX_HOSTS, ClusterSpec

Path_ = tuple[str | int, ...]


MAX_SPEC_BYTES = 256 * 1024  # a 1,000-host spec is ~60 KB; parsing the cap takes ~0.3 s
MAX_DEPTH = 32  # a spec nests 5 deep
MAX_VALUES = 100_000  # keys, items and scalars, every alias expanded


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
    data, lines = _read_yaml(text, file)
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
    problems = check_spec(spec)
    if problems:
        raise SpecError(file, [_locate(p, lines) for p in problems])
    return spec


def key_lines(text: str, file: str = "spec.yaml") -> dict[Path_, int]:
    """The line of every key and list item of a spec's text (`("job", "env")` → 9), for a hint
    that names the line to edit; {} when the text does not parse."""
    try:
        return _read_yaml(text, file)[1]
    except SpecError:
        return {}


def _read_yaml(text: str, file: str) -> tuple[Any, dict[Path_, int]]:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(file, [SpecProblem((), f"the spec has more than {MAX_SPEC_BYTES:,} bytes", 1)])
    try:
        _check_nesting(text, file)
        loader = _CLoader(text) if _LIBYAML else _PyLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                raise SpecError(file, [SpecProblem((), "the spec is empty", 1)])
            _check_size(node, file)
            _check_hosts(node, file)
            lines: dict[Path_, int] = {(): node.start_mark.line + 1}
            problems: list[SpecProblem] = []
            _index(node, (), lines, problems)
            if problems:
                raise SpecError(file, problems)
            return loader.construct_document(node), lines
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        if exc.context_mark is not None and mark is not None and mark.index >= len(text):
            # Hit the end of the file (an unclosed quote or bracket): the line to fix is where it opened,
            # not the end of the stream (which can be one past the last line).
            mark = exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        line = min(line, max(1, len(text.rstrip().splitlines())))  # never past the last line
        msg = " ".join(filter(None, [exc.context, exc.problem])) or str(exc)
        kind = "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise SpecError(file, [SpecProblem((), f"{kind}: {msg}", line)]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow, written as itself
        if _LIBYAML:  # libyaml counts bytes of UTF-8, PyYAML's own reader characters
            line = text.encode("utf-8", "surrogatepass").count(b"\n", 0, exc.position) + 1
        else:
            line = text.count("\n", 0, exc.position) + 1
        what = f"the character #x{exc.character:04x}" if isinstance(exc.character, int) else "a character"
        message = f"{what} is not allowed in a spec ({exc.reason}); remove it"
        raise SpecError(file, [SpecProblem((), message, line)]) from None
    except yaml.YAMLError as exc:
        raise SpecError(file, [SpecProblem((), f"YAML error: {' '.join(str(exc).split())}", 1)]) from None
    except RecursionError:
        raise SpecError(file, [SpecProblem((), "YAML error: nested too deeply", 1)]) from None


_LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class _Located:
    """A value YAML parses but cannot build (`2001-02-30`, `!!bool maybe`, `!!int`, a sexagesimal
    number too large for a float, an integer of over 4,300 digits) is a ConstructorError at its
    own line, like any other YAML problem, not a ValueError, KeyError, … from PyYAML's inside."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if node.tag in _NUMBER_TAGS and isinstance(node, yaml.ScalarNode) and len(node.value) > 100:
            # no spec key wants one; and PyYAML builds `1:1:…` (base 60) in quadratic time
            raise yaml.constructor.ConstructorError(
                None, None, "a number of more than 100 characters", node.start_mark
            )
        try:
            return super().construct_object(node, deep)  # type: ignore[misc]
        except (ValueError, KeyError, IndexError, AttributeError, OverflowError, TypeError) as exc:
            problem = f"this value cannot be read ({type(exc).__name__}: {str(exc)[:100]})"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


class _CLoader(_Located, yaml.CSafeLoader if _LIBYAML else yaml.SafeLoader):  # type: ignore[misc]
    pass


class _PyLoader(_Located, yaml.SafeLoader):
    pass


_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_nesting(text: str, file: str) -> None:
    """Nesting deeper than MAX_DEPTH is refused on the event stream (no tree, no recursion yet)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader if _LIBYAML else yaml.SafeLoader):
        if isinstance(event, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark is not None else 1
                raise SpecError(file, [SpecProblem((), f"nested more than {MAX_DEPTH} deep", line)])
        elif isinstance(event, _CLOSES):
            depth -= 1


def _check_size(root: yaml.Node, file: str) -> None:
    """The tree's size with every alias expanded (counted once per node, iteratively): at most
    MAX_VALUES, and no alias inside the node it names (`a: &x [*x]` never ends). Scalars count 1
    and are never pushed (a spec of 65,000 list items took 0.45 s here otherwise)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]

    def never_ends(node: yaml.Node) -> SpecError:
        message = "a YAML alias inside the value it names never ends"
        return SpecError(file, [SpecProblem((), message, node.start_mark.line + 1)])

    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            total = 1
            for child in _children(node):
                total += size.get(id(child), 1)  # a scalar: 1
                if total > MAX_VALUES:
                    line = node.start_mark.line + 1
                    raise SpecError(
                        file,
                        [
                            SpecProblem(
                                (), f"expands to more than {MAX_VALUES:,} values (YAML aliases?)", line
                            )
                        ],
                    )
            size[key] = total
            continue
        if key in size or isinstance(node, yaml.ScalarNode):
            continue
        if key in on_path:
            raise never_ends(node)
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if isinstance(child, yaml.ScalarNode):
                continue
            if id(child) in on_path:
                raise never_ends(child)
            if id(child) not in size:
                stack.append((child, False))


def _check_hosts(root: yaml.Node, file: str) -> None:
    """More than MAX_HOSTS hosts is said before any is built or validated (65,000 took a second)."""
    pairs = root.value if isinstance(root, yaml.MappingNode) else []
    for key, value in pairs:
        named = isinstance(key, yaml.ScalarNode) and key.value == "hosts"
        if named and isinstance(value, yaml.SequenceNode) and len(value.value) > MAX_HOSTS:
            message = f"{len(value.value):,} hosts; a spec may have at most {MAX_HOSTS:,}"
            raise SpecError(file, [SpecProblem(("hosts",), message, key.start_mark.line + 1)])


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


_CONTROL = {chr(c) for c in (*range(0x20), 0x7F)} - {"\t", "\n"}


def _control_characters(value: Any, path: Path_) -> list[SpecProblem]:
    """Control characters (NUL, ESC, …) written as escapes: no environment, argument or path can
    carry a NUL, and the others only garble a terminal. Tabs and newlines are fine."""
    if len(path) > _INDEX_DEPTH:
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
_INDEX_DEPTH = 8


def _index(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[SpecProblem]) -> None:
    """Record the line of every key and list item below `node`."""
    if len(path) >= _INDEX_DEPTH:
        return
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


def redact_text(text: str, names: Collection[str]) -> str:
    """The spec's text with the values of `names` in job.env and hosts[].env replaced by
    "<redacted>", everything else as written (for the run's copy of a spec already validated)."""
    if not names:
        return text
    root = yaml.compose(text, Loader=yaml.SafeLoader)  # character marks (libyaml's may count bytes)
    spans = set()
    for env in _env_nodes(root):
        for key, value in env.value:
            if isinstance(key, yaml.ScalarNode) and key.value in names and isinstance(value, yaml.ScalarNode):
                spans.add((value.start_mark.index, value.end_mark.index))
    for start, end in sorted(spans, reverse=True):
        value = text[start:end]
        keep = _PROPERTIES.match(value)  # its anchor (&name) or tag stays: an alias may name it
        start += keep.end() if keep else 0
        text = text[:start] + '"<redacted>"' + ("\n" if value.endswith("\n") else "") + text[end:]
    return text


_PROPERTIES = re.compile(r"(?:[&!]\S*\s+)+")


def _env_nodes(root: Any) -> list[yaml.MappingNode]:
    def child(node: Any, key: str) -> Any:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == key:
                    return v
        return None

    found = [child(child(root, "job"), "env")]
    hosts = child(root, "hosts")
    if isinstance(hosts, yaml.SequenceNode):
        found += [child(h, "env") for h in hosts.value]
    return [n for n in found if isinstance(n, yaml.MappingNode)]
