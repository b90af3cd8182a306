"""Hostile spec input: does `orchestrate validate FILE` stay bounded whatever FILE holds?

The requirement (orchestrator/spec/load.py): every YAML, decoding, size and recursion problem is a
SpecError, so `validate` exits 2 with `FILE:LINE: ` on stderr, never a traceback, in under 1 s and
100 MB for any input up to the 256 KiB cap (MAX_SPEC_BYTES).

Two parts:

1. Mutation campaign, in this process (fast): N mutants (default 6000, seeded) of the shipped specs
   (cluster_specs/*.yaml) and of the spec texts of tests/unit/test_spec.py (MINIMAL, GOOD_SPECS,
   BAD_SPECS). Each mutant gets 1-4 mutations: byte flips, control characters and NUL, invalid
   UTF-8, odd Unicode, duplicated/dropped/swapped/truncated lines, indentation and tabs, anchors,
   aliases and merges (`&a`, `*a`, `<<: *a`), deep nesting (`[[[`, `{a: {a:`, block, alias chains
   that nest deeper than the text), huge numbers, long strings, unclosed quotes and brackets, BOMs
   and UTF-16, several documents and directives, tags (`!!python/object`, `!!int x`, ...), odd
   values and keys, CR/CRLF, splices of other specs. Each is written to a file and checked with
   `orchestrator.cli.main(["validate", FILE])`, stdout and stderr captured. Recorded per call:
   exit code, an exception escaping main() (a "traceback"), whether every stderr line of an exit 2
   starts with `FILE:LINE: ` (optionally after `orchestrate: `), wall time, and any rise of this
   process's max RSS (the call that raised it was the largest so far). A call running past 10 s is
   stopped (SIGALRM) and counted as hung. Failures are grouped, shrunk line by line to a small
   input that fails the same way, and saved under OUT/fail/.

2. Worst cases, each in a fresh `python -m orchestrator validate FILE` (what a user runs): alias
   bombs (lists 9 levels deep, mapping merges, one just under MAX_VALUES), alias chains that nest
   past Python's recursion limit, 256 KiB of `[`, of `{a: `, of block indentation, alias cycles,
   a 256 KiB scalar, 256 KiB of keys, of hosts, of invalid items (one error each), numbers of
   4300+ digits and sexagesimal ones, a file of cap + 1 bytes, /dev/zero, a FIFO (10 s timeout),
   a folder, `tasks: {worker: 1000000000000}`; then the slowest and the most memory-hungry mutants
   of part 1. Each runs --repeats times; reported: exit code, median wall time, max RSS
   (/usr/bin/time -f %M), the first stderr line, and the baseline (the same command on a tiny
   valid spec: interpreter and imports) to subtract.

Prints a JSON summary (also written to OUT/summary.json) and a table. Uses one core; the campaign
takes a few minutes, the worst cases under a minute.

    .venv/bin/python scripts/bench/spec_fuzz.py [--n 6000] [--seed 1] [--repeats 3]
        [--out /tmp/specfuzz] [--only campaign|worst]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orchestrator.cli import main as cli_main  # noqa: E402
from orchestrator.spec.yamlread import MAX_DEPTH, MAX_SPEC_BYTES, MAX_VALUES  # noqa: E402

PYTHON = str(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists() else sys.executable
LIMIT_S, LIMIT_MB, HANG_S = 1.0, 100.0, 10.0

# --------------------------------------------------------------------------------------------------
# Seeds


def seeds() -> list[tuple[str, bytes]]:
    out = [(p.name, p.read_bytes()) for p in sorted((REPO / "cluster_specs").glob("*.yaml"))]
    try:
        spec = importlib.util.spec_from_file_location("_test_spec", REPO / "tests/unit/test_spec.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append(("MINIMAL", mod.y(mod.MINIMAL).encode()))
        out += [(f"GOOD:{c[0]}", mod.y(c[1]).encode()) for c in mod.GOOD_SPECS]
        out += [(f"BAD:{c[0]}", mod.y(c[1]).encode()) for c in mod.BAD_SPECS]
    except Exception as exc:  # the shipped specs are enough
        print(f"(tests/unit/test_spec.py not used: {exc})", file=sys.stderr)
    return out


MINIMAL = b"name: demo\nhosts:\n  - address: 127.0.0.1\n    tasks: {worker: 2}\njob:\n  script: train.py\n"

# --------------------------------------------------------------------------------------------------
# Mutations: each takes (rng, data, all seeds) and returns new bytes.

Rng = random.Random
_VALUE = re.compile(rb":[ \t]+([^\s#,\[\]{}][^\n,\]}#]*)")
_KEY = re.compile(rb"(?:^|\n|[{,] ?)[ \t]*(?:- )?([A-Za-z_][\w.-]*):")


def _pos(rng: Rng, data: bytes) -> int:
    return rng.randrange(len(data) + 1)


def _insert(rng: Rng, data: bytes, piece: bytes) -> bytes:
    i = _pos(rng, data)
    return data[:i] + piece + data[i:]


def _replace_value(rng: Rng, data: bytes, new: bytes) -> bytes:
    spans = [m.span(1) for m in _VALUE.finditer(data)]
    if not spans:
        return _insert(rng, data, b": " + new)
    a, b = rng.choice(spans)
    return data[:a] + new + data[b:]


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def m_flip(rng: Rng, data: bytes, _s: Any) -> bytes:
    buf = bytearray(data or b"\n")
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def m_control(rng: Rng, data: bytes, _s: Any) -> bytes:
    c = rng.choice([*range(0x20), 0x7F])
    return _insert(rng, data, bytes([c]) * rng.choice([1, 1, 2, 100]))


_ESCAPES = [
    rb'"\x00"',
    rb'"\0"',
    rb'"\e[31mred"',
    rb'"a\x07b"',
    rb'"\ud800"',
    rb'"\udfff"',
    rb'"\U0010FFFF"',
    rb'"\U00110000"',
    rb'"\N\_\L\P"',
    rb'"\x7f"',
    rb'"\t\n\r"',
    rb'"\u0000"',
    rb'"\uFFFE"',
    rb'"\q"',
]


def m_escape(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _replace_value(rng, data, rng.choice(_ESCAPES))


_BAD_UTF8 = [
    b"\xff",
    b"\xfe",
    b"\xc0\xaf",
    b"\xc3",
    b"\x80",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xf8\x88\x80\x80\x80",
    b"\xe2\x82",
    b"\xef\xbf",
]


def m_bad_utf8(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _insert(rng, data, rng.choice(_BAD_UTF8))


_ODD_UNICODE = [
    "\u0085",
    "\u2028",
    "\u2029",
    "\u200b",
    "\ufeff",
    "\u202e",
    "\ufffe",
    "\uffff",
    "\U0001f600",
    "e\u0301",
    "\uff1a",
    "\u00a0",
    "\U000e0001",
    "\ud7ff",
]


def m_unicode(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _insert(rng, data, rng.choice(_ODD_UNICODE).encode("utf-8"))


def m_dup_line(rng: Rng, data: bytes, _s: Any) -> bytes:
    ls = _lines(data)
    i = rng.randrange(len(ls))
    return b"\n".join(ls[: i + 1] + [ls[i]] * rng.choice([1, 1, 2, 10, 1000]) + ls[i + 1 :])


def m_drop_line(rng: Rng, data: bytes, _s: Any) -> bytes:
    ls = _lines(data)
    del ls[rng.randrange(len(ls))]
    return b"\n".join(ls)


def m_swap_lines(rng: Rng, data: bytes, _s: Any) -> bytes:
    ls = _lines(data)
    i, j = rng.randrange(len(ls)), rng.randrange(len(ls))
    ls[i], ls[j] = ls[j], ls[i]
    return b"\n".join(ls)


def m_truncate(rng: Rng, data: bytes, _s: Any) -> bytes:
    return data[: _pos(rng, data)]


def m_indent(rng: Rng, data: bytes, _s: Any) -> bytes:
    ls = _lines(data)
    i = rng.randrange(len(ls))
    how = rng.randrange(3)
    if how == 0:
        ls[i] = b" " * rng.randint(1, 4) + ls[i]
    elif how == 1:
        ls[i] = ls[i][rng.randint(1, 4) :] if ls[i].startswith(b" ") else ls[i]
    else:
        stripped = ls[i].lstrip(b" ")
        ls[i] = b"\t" * max(1, (len(ls[i]) - len(stripped)) // 2) + stripped
    return b"\n".join(ls)


def m_tab(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _insert(rng, data, b"\t")


def m_anchor(rng: Rng, data: bytes, _s: Any) -> bytes:
    name = rng.choice([b"a", b"a", b"b", b"x" * 300])
    spans = [m.span(1) for m in _VALUE.finditer(data)]
    if spans:  # anchor a value
        a, _b = rng.choice(spans)
        data = data[:a] + b"&" + name + b" " + data[a:]
    use = rng.randrange(5)
    if use == 0:
        return _replace_value(rng, data, b"*" + name)
    if use == 1:  # a merge into a mapping line's block
        ls = _lines(data)
        i = rng.randrange(len(ls))
        indent = ls[i][: len(ls[i]) - len(ls[i].lstrip(b" "))]
        ls.insert(i, indent + b"<<: *" + name)
        return b"\n".join(ls)
    if use == 2:
        return _replace_value(rng, data, b"{<<: *" + name + b", k: 1}")
    if use == 3:
        return _replace_value(rng, data, b"*undefined")
    return _replace_value(rng, data, b"&" + name + b" [*" + name + b"]")  # a cycle


def m_alias_deep(rng: Rng, data: bytes, _s: Any) -> bytes:
    """Anchors each nested `per` deep, chained: the value nests `per * levels` deep, the text at
    most `per`."""
    per = rng.choice([8, 16, 30])
    depth = rng.choice([100, 500, 900, 950, 970, 980, 990, 1000, 1100, 3000, 20000])
    levels = max(1, depth // per)
    defs = [b"&d0 [1]"]
    for k in range(1, levels + 1):
        defs.append(b"&d%d " % k + b"[" * per + b"*d%d" % (k - 1) + b"]" * per)
    where = rng.randrange(3)
    if where == 0:
        return b"defs: [" + b", ".join(defs) + b"]\n" + _replace_value(rng, data, b"*d%d" % levels)
    if where == 1:
        return data + b"\ndefs: [" + b", ".join(defs) + b"]\n"
    return (
        b"defs: [" + b", ".join(defs) + b"]\n" + data.replace(b"{worker: 2}", b"{worker: *d%d}" % levels, 1)
    )


def m_nest_flow(rng: Rng, data: bytes, _s: Any) -> bytes:
    k = rng.choice([5, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 64, 1000, 10000, 60000])
    balanced = rng.random() < 0.7
    if rng.random() < 0.5:
        new = b"[" * k + b"1" + (b"]" * k if balanced else b"")
    else:
        new = b"{a: " * k + b"1" + (b"}" * k if balanced else b"")
    return _replace_value(rng, data, new)


def m_nest_block(rng: Rng, data: bytes, _s: Any) -> bytes:
    k = rng.choice([MAX_DEPTH - 2, MAX_DEPTH + 1, 200, 700])
    if rng.random() < 0.5:
        block = b"".join(b"  " * j + b"a:\n" for j in range(k)) + b"  " * k + b"1\n"
    else:
        block = b"x:\n  " + b"- " * k + b"1\n"
    return block + data if rng.random() < 0.5 else data + b"\n" + block


_NUMBERS = [
    b"9" * 20,
    b"9" * 4300,
    b"9" * 4301,
    b"9" * 100_000,
    b"1e309",
    b"-1e309",
    b".inf",
    b"-.inf",
    b".nan",
    b"0x" + b"f" * 5000,
    b"0o777",
    b"0b" + b"1" * 200,
    b"1_000_000",
    b"-0",
    b"18446744073709551616",
    b"1.7976931348623157e308",
    b"4.9e-324",
    b"1e-400",
    b"+12",
    b"010",
    b"08",
    b"1:20",
    b"190:20:30",
    b"1:" * 2000 + b"1",
    b"1:" * 20000 + b"1.5",
    b"0x_",
    b"1__2",
    b"-" + b"9" * 5000 + b".5",
]


def m_number(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _replace_value(rng, data, rng.choice(_NUMBERS))


def m_long_string(rng: Rng, data: bytes, _s: Any) -> bytes:
    n = rng.choice([1000, 10_000, 100_000, MAX_SPEC_BYTES - len(data) - 20, MAX_SPEC_BYTES + 10])
    n = max(1, n)
    form = rng.randrange(4)
    if form == 0:
        new = b"x" * n
    elif form == 1:
        new = b'"' + b"x" * n + b'"'
    elif form == 2:
        new = b"|\n" + b"  xxxxxxxxxxxxxx\n" * (n // 17 + 1)
    else:  # a long key
        return _insert(rng, data, b"\n" + b"k" * n + b": 1\n")
    return _replace_value(rng, data, new)


_UNCLOSED = [
    b'"',
    b"'",
    b"[",
    b"{",
    b"]",
    b"}",
    b'"""',
    b"|",
    b">",
    b"? ",
    b"- ",
    b": ",
    b"#",
    b"&",
    b"*",
    b"!",
    b"%",
    b"@",
    b"`",
]


def m_unclosed(rng: Rng, data: bytes, _s: Any) -> bytes:
    if rng.random() < 0.5:
        return _insert(rng, data, rng.choice(_UNCLOSED))
    return _replace_value(rng, data, rng.choice([b'"abc', b"'abc", b"[a, b", b"{a: 1", b'"a\\', b"'it''s"]))


def m_bom(rng: Rng, data: bytes, _s: Any) -> bytes:
    how = rng.randrange(6)
    if how == 0:
        return b"\xef\xbb\xbf" + data
    if how == 1:
        return b"\xef\xbb\xbf\xef\xbb\xbf" + data
    if how == 2:
        return _insert(rng, data, b"\xef\xbb\xbf")
    text = data.decode("utf-8", "replace")
    return text.encode(["utf-16", "utf-16-be", "utf-32"][how - 3])


_DIRECTIVES = [
    b"%YAML 1.1\n---\n",
    b"%YAML 1.2\n---\n",
    b"%YAML 2.0\n---\n",
    b"%YAML 1.1\n%YAML 1.1\n---\n",
    b"%TAG ! tag:example.com,2000:\n---\n",
    b"%TAG !! tag:evil,2000:\n---\n",
    b"%FOO bar\n---\n",
]


def m_documents(rng: Rng, data: bytes, _s: Any) -> bytes:
    how = rng.randrange(6)
    if how == 0:
        return b"---\n" + data
    if how == 1:
        return data + b"\n---\n" + data
    if how == 2:
        return data + b"\n...\n"
    if how == 3:
        ls = _lines(data)
        ls.insert(rng.randrange(len(ls) + 1), rng.choice([b"---", b"...", b"--- !!map", b"--- |"]))
        return b"\n".join(ls)
    if how == 4:
        return rng.choice(_DIRECTIVES) + data
    return data + b"\n---\n" * rng.choice([1, 1000])


_TAGS = [
    b'!!python/object/apply:os.system ["true"]',
    b"!!python/object:object {}",
    b"!!python/name:os.system",
    b"!!python/tuple [1, 2]",
    b"!!binary aGVsbG8=",
    b"!!binary ***",
    b"!!set {a, b}",
    b"!!omap [a: 1]",
    b"!!omap [1]",
    b"!!pairs [a: 1]",
    b"!!timestamp 2001-12-14",
    b"!!timestamp x",
    b"!!int x",
    b"!!int",
    b"!!float x",
    b"!!bool maybe",
    b"!!null x",
    b"!!str 1",
    b"!!str [1]",
    b"!custom x",
    b"!<tag:yaml.org,2002:str> x",
    b"!!map [1]",
    b"!!seq {a: 1}",
    b"!!merge x",
    b"!!value x",
    b"!<!> x",
    b"! x",
    b"!!yaml x",
]


def m_tag(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _replace_value(rng, data, rng.choice(_TAGS))


_VALUES = [
    b"null",
    b"~",
    b"''",
    b"[]",
    b"{}",
    b"true",
    b"yes",
    b"no",
    b"on",
    b"off",
    b"y",
    b"2001-12-14",
    b"2001-13-01",
    b"0000-01-01",
    b"2001-02-30",
    b"2001-12-14t21:59:43.10-05:00",
    b"2001-12-14 25:00:00",
    b"2001-12-14t21:59:43.1234567890123-99:99",
    b"=",
    b"<<",
    b"?",
    b"- x",
    b"-",
    b"|",
    b">-",
    b"!",
    b"&",
    b"*",
    b"'\\x00'",
    b"[[]]",
    b"[{}]",
    b"{a: [b, {c: d}]}",
    b"\xf0\x9f\x98\x80",
    b"a: b",
    b"x #y",
    b'""',
    b"-1",
    b"0",
    b"1000000000000",
    b"3.5",
    b"0.0000001",
]


def m_value(rng: Rng, data: bytes, _s: Any) -> bytes:
    return _replace_value(rng, data, rng.choice(_VALUES))


_KEYS = [
    b"1",
    b"null",
    b"~",
    b"[a, b]",
    b"{a: 1}",
    b"? [a]\n",
    b"true",
    b'"with space"',
    b"<<",
    b"name",
    b"",
    b"!!python/name:os.system",
    b"!!binary aGk=",
    b"2001-12-14",
    b"1.5",
    b"&k key",
    b"*k",
    b'"\\x00"',
    b"? |\n  x\n",
]


def m_key(rng: Rng, data: bytes, _s: Any) -> bytes:
    spans = [m.span(1) for m in _KEY.finditer(data)]
    if not spans:
        return data
    a, b = rng.choice(spans)
    return data[:a] + rng.choice(_KEYS) + data[b:]


def m_newlines(rng: Rng, data: bytes, _s: Any) -> bytes:
    return data.replace(b"\n", rng.choice([b"\r\n", b"\r", b"\n\n", b"\x85", b"\xe2\x80\xa8"]))


def m_splice(rng: Rng, data: bytes, all_seeds: list[tuple[str, bytes]]) -> bytes:
    other = rng.choice(all_seeds)[1]
    a = rng.randrange(len(other) + 1)
    b = min(len(other), a + rng.randint(1, 200))
    return _insert(rng, data, other[a:b])


def m_replace_all(rng: Rng, data: bytes, _s: Any) -> bytes:
    return rng.choice(
        [
            b"",
            b"\n",
            b" ",
            b"---",
            b"~",
            b"[]",
            b"{}",
            b"1",
            b'"x"',
            b"\x00",
            b"\xef\xbb\xbf",
            b"#",
            b"...",
            b"- a",
            b"*a",
            b"&a",
            b"!!python/object/apply:os.system [true]",
            b"%YAML 1.1",
        ]
    )


MUTATIONS: dict[str, Callable[[Rng, bytes, Any], bytes]] = {
    f.__name__[2:]: f
    for f in (
        m_flip,
        m_control,
        m_escape,
        m_bad_utf8,
        m_unicode,
        m_dup_line,
        m_drop_line,
        m_swap_lines,
        m_truncate,
        m_indent,
        m_tab,
        m_anchor,
        m_alias_deep,
        m_nest_flow,
        m_nest_block,
        m_number,
        m_long_string,
        m_unclosed,
        m_bom,
        m_documents,
        m_tag,
        m_value,
        m_key,
        m_newlines,
        m_splice,
        m_replace_all,
    )
}
WEIGHTS = {"alias_deep": 0.5, "long_string": 0.5, "replace_all": 0.2, "nest_block": 0.5}


def mutate(rng: Rng, all_seeds: list[tuple[str, bytes]]) -> tuple[str, list[str], bytes]:
    name, data = rng.choice(all_seeds)
    k = rng.choices([1, 2, 3, 4], weights=[50, 30, 12, 8])[0]
    names = list(MUTATIONS)
    ops = rng.choices(names, weights=[WEIGHTS.get(n, 1.0) for n in names], k=k)
    for op in ops:
        data = MUTATIONS[op](rng, data, all_seeds)
    return name, ops, data


# --------------------------------------------------------------------------------------------------
# One in-process check


class _Hung(BaseException):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Hung()


def _file_line_re(path: Path) -> re.Pattern[str]:
    return re.compile(r"^(orchestrate: )?" + re.escape(str(path)) + r":\d+: ")


def check_in_process(path: Path, data: bytes) -> dict[str, Any]:
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    exc_info: dict[str, str] | None = None
    code: int | None = None
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["validate", str(path)])
    except _Hung:
        code = None
        exc_info = {"type": "hung", "where": "", "message": f"still running after {HANG_S:.0f} s"}
    except SystemExit as exc:  # argparse; not a traceback
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:  # noqa: BLE001 - this is what we are looking for
        tb = traceback.extract_tb(exc.__traceback__)
        last = tb[-1] if tb else None
        where = f"{Path(last.filename).name}:{last.lineno} {last.name}" if last else "?"
        exc_info = {"type": type(exc).__name__, "where": where, "message": str(exc)[:200]}
    finally:
        wall = time.perf_counter() - t0
        signal.setitimer(signal.ITIMER_REAL, 0)
    rss_rise_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    stderr = err.getvalue()
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    pat = _file_line_re(path)
    return {
        "exit": code,
        "exc": exc_info,
        "wall_s": wall,
        "rss_rise_mb": rss_rise_mb,
        "stderr_first": lines[0][:200] if lines else "",
        "stderr_lines": len(lines),
        "file_line_first": bool(lines) and bool(pat.match(lines[0])),
        "file_line_all": bool(lines) and all(pat.match(ln) for ln in lines),
        "stderr_unmatched": next((ln[:200] for ln in lines if not pat.match(ln)), ""),
    }


def failure_kind(r: dict[str, Any]) -> str | None:
    """The requirement this result breaks, as a group key (None: it holds)."""
    if r["exc"] is not None:
        e = r["exc"]
        return f"traceback {e['type']} at {e['where']}" if e["type"] != "hung" else "hung"
    if r["exit"] not in (0, 2):
        return f"exit {r['exit']}"
    if r["exit"] == 2 and not r["file_line_first"]:
        return "exit 2 without FILE:LINE"
    if r["exit"] == 2 and not r["file_line_all"]:
        return "exit 2, a later stderr line without FILE:LINE"
    return None


def shrink(path: Path, data: bytes, kind: str, budget: int = 400) -> bytes:
    """Drop lines, then trim bytes from the end, while the same failure kind remains (a few hundred calls)."""

    def same(d: bytes) -> bool:
        return failure_kind(check_in_process(path, d)) == kind

    calls = 0
    lines = data.split(b"\n")
    chunk = max(1, len(lines) // 2)
    while chunk >= 1 and calls < budget:
        i, changed = 0, False
        while i < len(lines) and calls < budget:
            trial = lines[:i] + lines[i + chunk :]
            calls += 1
            if trial and same(b"\n".join(trial)):
                lines, changed = trial, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return b"\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Part 1: the campaign


def campaign(n: int, seed: int, out: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    all_seeds = seeds()
    work = out / "work" / "specs"
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.py").write_text("print('hi')\n")
    examples = out / "work" / "examples"  # the shipped specs name ../examples/*.py
    if not examples.exists():
        examples.symlink_to(REPO / "examples")
    path = work / "mutant.yaml"
    root = logging.getLogger()
    if not root.handlers:  # main()'s basicConfig would bind the first captured stderr
        root.addHandler(logging.NullHandler())
    signal.signal(signal.SIGALRM, _alarm)

    results: list[dict[str, Any]] = []
    failures: dict[str, list[tuple[int, bytes]]] = {}
    slow: list[tuple[float, int, bytes]] = []
    hungry: list[tuple[float, int, bytes]] = []
    ops_count: Counter[str] = Counter()
    t_start = time.perf_counter()
    for i in range(n):
        seed_name, ops, data = mutate(rng, all_seeds)
        ops_count.update(ops)
        r = check_in_process(path, data)
        r.update(i=i, seed=seed_name, ops=ops, size=len(data))
        results.append(r)
        kind = failure_kind(r)
        if kind is not None:
            failures.setdefault(kind, []).append((i, data))
        if r["wall_s"] > LIMIT_S:
            failures.setdefault("slower than 1 s (in-process)", []).append((i, data))
        slow.append((r["wall_s"], i, data))
        slow = sorted(slow, key=lambda t: -t[0])[:5]
        if r["rss_rise_mb"] > 1:
            hungry.append((r["rss_rise_mb"], i, data))
            hungry = sorted(hungry, key=lambda t: -t[0])[:3]
        if (i + 1) % 500 == 0:
            print(
                f"  {i + 1}/{n} mutants, {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True
            )
    elapsed = time.perf_counter() - t_start

    fail_dir = out / "fail"
    fail_dir.mkdir(exist_ok=True)
    groups = []
    for kind, items in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-")[:60]
        i0, data0 = items[0]
        (fail_dir / f"{slug}.yaml").write_bytes(data0)
        minimal = data0 if kind.startswith(("slower", "hung")) else shrink(path, data0, kind)
        (fail_dir / f"{slug}.min.yaml").write_bytes(minimal)
        example = results[i0]
        groups.append(
            {
                "kind": kind,
                "count": len(items),
                "first_mutant": i0,
                "ops": example["ops"],
                "seed": example["seed"],
                "message": (example["exc"] or {}).get("message")
                or example["stderr_unmatched"]
                or example["stderr_first"],
                "file": str(fail_dir / f"{slug}.yaml"),
                "minimal_file": str(fail_dir / f"{slug}.min.yaml"),
                "minimal": minimal.decode("utf-8", "backslashreplace")[:400],
            }
        )
    saved = []
    for tag, lst in (("slowest", slow), ("hungriest", hungry)):
        for rank, (_v, i, data) in enumerate(lst):
            p = fail_dir.parent / "mutants" / f"{tag}-{rank}-m{i}.yaml"
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(data)
            saved.append((tag, i, p))

    walls = sorted(r["wall_s"] for r in results)
    exit2 = [r for r in results if r["exit"] == 2 and r["exc"] is None]
    worst = max(results, key=lambda r: r["wall_s"])
    return {
        "mutants": n,
        "seed": seed,
        "seeds": len(all_seeds),
        "elapsed_s": round(elapsed, 1),
        "exit_codes": dict(Counter(str(r["exit"]) if r["exc"] is None else "exception" for r in results)),
        "tracebacks": sum(1 for r in results if r["exc"] is not None and r["exc"]["type"] != "hung"),
        "hung": sum(1 for r in results if r["exc"] is not None and r["exc"]["type"] == "hung"),
        "exit2_lacking_file_line_first": sum(1 for r in exit2 if not r["file_line_first"]),
        "exit2_lacking_file_line_any_line": sum(1 for r in exit2 if not r["file_line_all"]),
        "over_1s": sum(1 for r in results if r["wall_s"] > LIMIT_S),
        "wall_s": {
            "median": round(statistics.median(walls), 5),
            "p99": round(walls[int(0.99 * (len(walls) - 1))], 4),
            "worst": round(walls[-1], 3),
            "worst_input": {
                "mutant": worst["i"],
                "ops": worst["ops"],
                "size": worst["size"],
                "exit": worst["exit"],
                "stderr": worst["stderr_first"][:120],
            },
        },
        "max_rss_mb_this_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "largest_rss_rise_mb": round(max((r["rss_rise_mb"] for r in results), default=0), 1),
        "input_bytes": {
            "median": int(statistics.median(r["size"] for r in results)),
            "max": max(r["size"] for r in results),
            "over_cap": sum(1 for r in results if r["size"] > MAX_SPEC_BYTES),
        },
        "mutations_applied": dict(ops_count.most_common()),
        "failure_groups": groups,
        "_remeasure": [(f"mutant {i} ({tag})", p) for tag, i, p in saved],
    }


# --------------------------------------------------------------------------------------------------
# Part 2: worst cases, one process each


TIME = "/usr/bin/time"


def run_child(path: Path, timeout: float = HANG_S) -> dict[str, Any]:
    """One `python -m orchestrator validate FILE`. Max RSS from /usr/bin/time -f %M: a child forked
    from this process would report this process's RSS at fork time (os.wait4's ru_maxrss does)."""
    err_path, rss_path = path.parent / ".stderr", path.parent / ".rss"
    cmd = [PYTHON, "-m", "orchestrator", "validate", str(path)]
    use_time = os.access(TIME, os.X_OK)
    if use_time:
        cmd = [TIME, "-f", "%M", "-o", str(rss_path), *cmd]
    with open(err_path, "w+b") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
            start_new_session=True,
        )
        killed: list[bool] = []  # p.wait(timeout) would poll every 50 ms: a timer kills instead

        def kill() -> None:
            killed.append(True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        p.wait()
        wall = time.perf_counter() - t0
        timer.cancel()
        timed_out = bool(killed)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    rss_mb = None
    if use_time:
        with contextlib.suppress(OSError, ValueError, IndexError):
            rss_mb = int(rss_path.read_text().split()[-1]) / 1024
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return {
        "exit": p.returncode,
        "timed_out": timed_out,
        "wall_s": wall,
        "max_rss_mb": rss_mb if rss_mb is not None else float("nan"),
        "stderr_first": lines[0][:160] if lines else "",
        "stderr_lines": len(lines),
        "traceback": "Traceback (most recent call last)" in stderr,
        "file_line": bool(lines) and bool(_file_line_re(path).match(lines[0])),
    }


def _laughs_lists(levels: int, fan: int = 9) -> bytes:
    out = [b"a0: &a0 [" + b", ".join([b"lol"] * fan) + b"]"]
    for k in range(1, levels + 1):
        out.append(b"a%d: &a%d [" % (k, k) + b", ".join([b"*a%d" % (k - 1)] * fan) + b"]")
    return b"\n".join(out) + b"\n"


def _laughs_merge_values(levels: int, fan: int = 9) -> bytes:
    out = [b"m0: &m0 {" + b", ".join(b"k%d: %d" % (j, j) for j in range(fan)) + b"}"]
    for k in range(1, levels + 1):
        vals = b", ".join(b"x%d: *m%d" % (j, k - 1) for j in range(fan))
        out.append(b"m%d: &m%d {<<: *m%d, %s}" % (k, k, k - 1, vals))
    return b"\n".join(out) + b"\n"


def _laughs_merge_lists(levels: int, fan: int = 9) -> bytes:
    out = [b"m0: &m0 {" + b", ".join(b"k%d: %d" % (j, j) for j in range(fan)) + b"}"]
    for k in range(1, levels + 1):
        out.append(b"m%d: &m%d {<<: [" % (k, k) + b", ".join([b"*m%d" % (k - 1)] * fan) + b"]}")
    return b"\n".join(out) + b"\n"


def _alias_depth(depth: int, per: int = 30, bottom: int = 1) -> bytes:
    """A chain of anchors, each `per` deep in the text, the last `depth` deep once expanded; the
    innermost list has `bottom` items (each link of the chain holds them once more)."""
    levels = max(1, depth // per)
    defs = [b"&d0 [" + b", ".join([b"1"] * bottom) + b"]"]
    defs += [b"&d%d " % k + b"[" * per + b"*d%d" % (k - 1) + b"]" * per for k in range(1, levels + 1)]
    return MINIMAL + b"defs: [" + b", ".join(defs) + b"]\n"


def _fill(head: bytes, unit: bytes, tail: bytes = b"", size: int = MAX_SPEC_BYTES) -> bytes:
    n = (size - len(head) - len(tail)) // len(unit)
    return head + unit * n + tail


def _indent_block(size: int = MAX_SPEC_BYTES) -> bytes:
    out, j = [], 0
    total = 0
    while True:
        line = b" " * j + b"a:\n"
        if total + len(line) + j + 3 > size:
            break
        out.append(line)
        total += len(line)
        j += 1
    return b"".join(out) + b" " * j + b"1\n"


def _many_hosts() -> bytes:
    head = b"name: many\nbackend: ssh\njob: {script: train.py}\nhosts:\n"
    units, size, k = [], len(head), 0
    while True:
        u = b"  - {address: 10.%d.%d.%d, tasks: {worker: 1}}\n" % (k >> 16 & 255, k >> 8 & 255, k & 255)
        if size + len(u) > MAX_SPEC_BYTES:
            break
        units.append(u)
        size += len(u)
        k += 1
    return head + b"".join(units)


def _ports() -> bytes:
    """The most tasks the model admits, each host with a base_port: check_spec walks every port."""
    head = b"name: ports\nbackend: ssh\nstrategy: parameter_server\njob: {script: train.py}\nhosts:\n"
    unit = (
        b"  - {address: 10.0.%d.%d, base_port: 1024, "
        b"tasks: {chief: 1024, worker: 1024, ps: 1024, evaluator: 1024}}\n"
    )
    return head + b"".join(unit % (k >> 8, k & 255) for k in range(1024))


def _many_env_keys() -> bytes:
    head = MINIMAL + b"  env:\n"
    units, size, k = [], len(head), 0
    while size + 20 <= MAX_SPEC_BYTES:
        u = b"    K%07d: v\n" % k
        units.append(u)
        size += len(u)
        k += 1
    return head + b"".join(units)


def _many_top_keys() -> bytes:
    units, size, k = [], len(MINIMAL), 0
    while size + 20 <= MAX_SPEC_BYTES:
        u = b"k%07d: 1\n" % k
        units.append(u)
        size += len(u)
        k += 1
    return MINIMAL + b"".join(units)


def worst_case_inputs() -> list[tuple[str, bytes | str, str]]:
    """(name, file content or a special path, what exit is right: '2' or '0|2')."""
    cap = MAX_SPEC_BYTES
    deep_seq = b"x: " + b"[" * (cap - 3)
    balanced = b"x: " + b"[" * ((cap - 3) // 2) + b"]" * ((cap - 3) // 2)
    return [
        ("alias bomb: lists, 9 levels of 9", _laughs_lists(9), "2"),
        ("alias bomb: lists, 30 levels of 2", _laughs_lists(30, 2), "2"),
        ("alias bomb: in job.env of a valid spec", _laughs_lists(9) + MINIMAL + b"  env: {BOMB: *a9}\n", "2"),
        ("alias bomb: lists, just under MAX_VALUES", MINIMAL + _laughs_lists(4), "2"),
        ("merge bomb: <<: *m plus 9 alias values", _laughs_merge_values(9), "2"),
        ("merge bomb: <<: [*m x9], 9 levels", _laughs_merge_lists(9), "2"),
        ("merge bomb: <<: [*m x9], under MAX_VALUES", MINIMAL + _laughs_merge_lists(3), "2"),
        ("alias chain nesting 960 deep", _alias_depth(960), "2"),
        ("alias chain nesting 990 deep", _alias_depth(990), "2"),
        ("alias chain nesting 1020 deep", _alias_depth(1020), "2"),
        ("alias chain nesting 30000 deep", _alias_depth(30000), "2"),
        ("alias chain 984 deep, 8 per anchor", _alias_depth(984, per=8), "2"),
        ("alias chain 990 deep, 2400 values at bottom", _alias_depth(990, bottom=2400), "2"),
        ("alias cycle x: &a [*a]", b"x: &a [*a]\n", "2"),
        ("alias cycle x: &a {b: *a}", b"x: &a {b: *a}\n", "2"),
        ("merge cycle x: &a {<<: *a}", b"x: &a {<<: *a}\n", "2"),
        ("256 KiB of [", deep_seq, "2"),
        ("256 KiB of [ ] balanced", balanced, "2"),
        ("256 KiB of {a: ", _fill(b"", b"{a: "), "2"),
        ("256 KiB of block indentation", _indent_block(), "2"),
        ("256 KiB of '- '", _fill(b"x:\n", b"- ", b"1\n"), "2"),
        ("256 KiB plain scalar (name:)", _fill(b"name: ", b"x", b"\n"), "2"),
        ("256 KiB quoted scalar, unclosed", _fill(b'name: "', b"x"), "2"),
        ("256 KiB key", _fill(b"", b"k", b": 1\n"), "2"),
        ("256 KiB of env keys (valid)", _many_env_keys(), "0|2"),
        ("256 KiB of top-level keys (~18k errors)", _many_top_keys(), "2"),
        ("256 KiB of hosts (~5.8k)", _many_hosts(), "0|2"),
        ("1024 hosts x 4 roles x 1024 tasks, base_port", _ports(), "2"),
        (
            "256 KiB of invalid hosts (~65k errors)",
            _fill(b"name: x\njob: {script: train.py}\nhosts:\n", b"- 1\n"),
            "2",
        ),
        ("256 KiB of aliases [*a, *a, ...]", _fill(b"a: &a [1, 2]\nb: [", b"*a, ", b"*a]\n"), "2"),
        ("256 KiB of anchors", _fill(b"x: [", b"&a 1, ", b"1]\n"), "2"),
        ("256 KiB of comments", _fill(b"", b"# comment comment comment\n"), "2"),
        ("256 KiB of NUL", b"\x00" * cap, "2"),
        ("256 KiB of invalid UTF-8", b"\xff" * cap, "2"),
        ("256 KiB of ---", _fill(b"", b"---\n"), "2"),
        ("int of 4300 digits (train.steps)", MINIMAL + b"train: {steps: " + b"9" * 4300 + b"}\n", "2"),
        ("int of 4301 digits (train.steps)", MINIMAL + b"train: {steps: " + b"9" * 4301 + b"}\n", "2"),
        ("int of 256 KiB digits", _fill(b"name: ", b"9", b"\n"), "2"),
        ("sexagesimal int 1:1:...:1, 256 KiB", _fill(b"name: 1", b":1", b"\n"), "2"),
        ("hex int of 256 KiB", _fill(b"name: 0x", b"f", b"\n"), "2"),
        ("date 2001-13-01", MINIMAL.replace(b"name: demo", b"name: 2001-13-01"), "2"),
        (
            "!!python/object/apply",
            MINIMAL.replace(b"name: demo", b'name: !!python/object/apply:os.system ["true"]'),
            "2",
        ),
        ("tasks: {worker: 1000000000000}", MINIMAL.replace(b"{worker: 2}", b"{worker: 1000000000000}"), "2"),
        ("file of 256 KiB + 1 bytes", _fill(MINIMAL, b"#", b"\n", cap + 1), "2"),
        ("/dev/zero", "/dev/zero", "2"),
        ("FIFO (no writer)", "fifo", "2"),
        ("a folder", "folder", "2"),
        ("missing file", "missing", "2"),
    ]


def worst_cases(out: Path, repeats: int, remeasure: list[tuple[str, Path]]) -> dict[str, Any]:
    d = out / "worst" / "specs"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.py").write_text("print('hi')\n")
    base = d / "baseline.yaml"
    base.write_bytes(MINIMAL)
    runs = [run_child(base) for _ in range(max(3, repeats))]
    baseline = {
        "exit": runs[0]["exit"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "max_rss_mb": max(r["max_rss_mb"] for r in runs),
        "stderr_first": runs[0]["stderr_first"],
    }

    cases: list[tuple[str, Path, str]] = []
    for k, (name, content, expect) in enumerate(worst_case_inputs()):
        if isinstance(content, bytes):
            p = d / f"w{k:02d}.yaml"
            p.write_bytes(content)
            if len(content) > MAX_SPEC_BYTES and "+ 1" not in name:
                print(f"  note: {name} is {len(content)} bytes, over the cap", file=sys.stderr)
        elif content == "fifo":
            p = d / "fifo.yaml"
            if p.exists():
                p.unlink()
            os.mkfifo(p)
        elif content == "folder":
            p = d / "folder.yaml"
            p.mkdir(exist_ok=True)
        elif content == "missing":
            p = d / "missing.yaml"
        else:
            p = Path(content)
        cases.append((name, p, expect))
    cases += [(name, p, "0|2") for name, p in remeasure]

    rows = []
    for name, p, expect in cases:
        runs = [run_child(p) for _ in range(repeats)]
        r0 = runs[0]
        row = {
            "case": name,
            "file": str(p),
            "bytes": p.stat().st_size if p.is_file() else None,
            "exit": r0["exit"],
            "exits": sorted({r["exit"] for r in runs}),
            "wall_s": round(statistics.median(r["wall_s"] for r in runs), 3),
            "wall_s_max": round(max(r["wall_s"] for r in runs), 3),
            "max_rss_mb": round(max(r["max_rss_mb"] for r in runs), 1),
            "rss_above_baseline_mb": round(max(r["max_rss_mb"] for r in runs) - baseline["max_rss_mb"], 1),
            "timed_out": any(r["timed_out"] for r in runs),
            "traceback": any(r["traceback"] for r in runs),
            "file_line": r0["file_line"],
            "stderr_lines": r0["stderr_lines"],
            "stderr_first": r0["stderr_first"],
        }
        broken = []
        if row["traceback"]:
            broken.append("traceback")
        if row["timed_out"]:
            broken.append("timed out")
        if any(str(e) not in expect.split("|") for e in row["exits"]):
            broken.append(f"exit {row['exits']}")
        if row["exit"] == 2 and not row["file_line"]:
            broken.append("no FILE:LINE")
        if row["wall_s"] > LIMIT_S:
            broken.append(f"> {LIMIT_S:g} s")
        if row["max_rss_mb"] > LIMIT_MB:
            broken.append(f"> {LIMIT_MB:g} MB")
        row["broken"] = broken
        rows.append(row)
        print(
            f"  {name}: exit {row['exit']}, {row['wall_s']} s, {row['max_rss_mb']} MB"
            + (f"  BROKEN: {', '.join(broken)}" if broken else ""),
            file=sys.stderr,
            flush=True,
        )
    return {
        "baseline": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in baseline.items()},
        "repeats": repeats,
        "cases": rows,
    }


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=6000, help="mutants in the campaign")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each worst case")
    ap.add_argument("--out", type=Path, default=Path("/tmp/specfuzz"))
    ap.add_argument("--only", choices=["campaign", "worst"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    summary: dict[str, Any] = {
        "python": sys.version.split()[0],
        "limits": {
            "bytes": MAX_SPEC_BYTES,
            "depth": MAX_DEPTH,
            "values": MAX_VALUES,
            "s": LIMIT_S,
            "mb": LIMIT_MB,
        },
    }
    remeasure: list[tuple[str, Path]] = []
    if args.only != "worst":
        print(f"campaign: {args.n} mutants, seed {args.seed}", file=sys.stderr)
        summary["campaign"] = campaign(args.n, args.seed, args.out)
        remeasure = summary["campaign"].pop("_remeasure")
    if args.only != "campaign":
        print("worst cases:", file=sys.stderr)
        summary["worst"] = worst_cases(args.out, args.repeats, remeasure)

    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))

    print()
    if "campaign" in summary:
        c = summary["campaign"]
        print(
            f"campaign: {c['mutants']} mutants (seed {c['seed']}, {c['seeds']} seed specs) "
            f"in {c['elapsed_s']} s"
        )
        print(
            f"  exit codes {c['exit_codes']}; tracebacks {c['tracebacks']}; hung {c['hung']}; "
            f"exit 2 lacking FILE:LINE {c['exit2_lacking_file_line_first']} (first line), "
            f"{c['exit2_lacking_file_line_any_line']} (any line)"
        )
        w = c["wall_s"]
        print(
            f"  wall per call: median {w['median'] * 1000:.2f} ms, p99 {w['p99'] * 1000:.1f} ms, "
            f"worst {w['worst']:.3f} s; over 1 s: {c['over_1s']}; "
            f"max RSS of this process {c['max_rss_mb_this_process']} MB"
        )
        for g in c["failure_groups"]:
            print(f"  FAIL x{g['count']}: {g['kind']}: {g['message'][:90]!r}  ({g['minimal_file']})")
    if "worst" in summary:
        b = summary["worst"]["baseline"]
        print(
            f"\nworst cases (median of {summary['worst']['repeats']}; baseline: exit {b['exit']}, "
            f"{b['wall_s']:.3f} s, {b['max_rss_mb']:.1f} MB)"
        )
        print(f"  {'case':44} {'exit':>4} {'wall s':>7} {'RSS MB':>7} {'+MB':>6}  first stderr line / broken")
        for r in summary["worst"]["cases"]:
            note = ("BROKEN: " + ", ".join(r["broken"]) + " | ") if r["broken"] else ""
            print(
                f"  {r['case'][:44]:44} {r['exit']!s:>4} {r['wall_s']:7.3f} {r['max_rss_mb']:7.1f} "
                f"{r['rss_above_baseline_mb']:6.1f}  {note}{r['stderr_first'][-70:]}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
