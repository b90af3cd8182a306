"""Spec layer: YAML read safely, each key with its line (load.py turns what it finds into a
ClusterSpec or a SpecError).

Bounded whatever the text holds (a spec may come from someone else): at most MAX_SPEC_BYTES; its
nesting checked on libyaml's event stream before any tree is built, and the tree's size with every
alias expanded before anything walks it (a kilobyte of nested aliases otherwise expands to
gigabytes). Duplicate keys (which PyYAML silently collapses) are errors. Every problem — YAML,
encoding, size — is a SpecError with a line. Also: a spec's text with its secrets redacted.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import yaml

from orchestrator.errors import SpecError, SpecProblem
from orchestrator.spec.model import MAX_HOSTS

Path_ = tuple[str | int, ...]

MAX_SPEC_BYTES = 256 * 1024  # a 1,000-host spec is ~60 KB; parsing the cap takes ~0.3 s
MAX_DEPTH = 32  # a spec nests 5 deep
MAX_VALUES = 100_000  # keys, items and scalars, every alias expanded


def read_yaml(text: str, file: str) -> tuple[Any, dict[Path_, int]]:
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


INDEX_DEPTH = 8


def _index(node: yaml.Node, path: Path_, lines: dict[Path_, int], problems: list[SpecProblem]) -> None:
    """Record the line of every key and list item below `node`."""
    if len(path) >= INDEX_DEPTH:
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
