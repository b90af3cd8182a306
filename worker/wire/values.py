"""Worker and coordinator: what a job may report, as everything else shows it — as text (the one
rule, `safe_text`) and as strict JSON (NaN and ±inf as strings, `dumps`, `number`)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: Characters no name or message is shown with as they are: C0 and C1 controls (a terminal acts
#: on them), the Unicode line and paragraph separators, the bidi controls (they reorder the text
#: around them: `loss\u202e` could read as another name, and reverse the words beside it) and lone
#: surrogates (valid JSON, a valid Python str, but no encoding writes them: the console, /metrics
#: and every file writer would raise). Everything else, any script, emoji and joiners, stays.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
#: The same in a message or a traceback, whose lines and tabs are its own.
_UNSAFE_IN_LINES = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def safe_text(text: str, lines: bool = False) -> str:
    """`text` as every view shows it: each character of `UNSAFE` written as its Python escape
    (`bad\\ud800name`, `loss\\u202e`), the rest as it is. `lines`: keep newlines and tabs (a
    message, a traceback). The one rule for what a job may report: the coordinator applies it to
    every name and text a heartbeat brings, the worker to the names it is given (said once)."""
    pattern = _UNSAFE_IN_LINES if lines else UNSAFE
    return pattern.sub(_escaped, text) if pattern.search(text) else text


#: NaN and ±inf are worth seeing (a diverging loss) and JSON has no number for them: every document
#: and API of the run writes them as these strings, where a number would be (as protobuf's JSON
#: mapping does). `number()` reads either back.
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict(value: Any) -> Any:
    """`value` with every NaN or ±inf float (in dicts and lists, at any depth) as its string."""
    if isinstance(value, float):  # numpy's float64 too
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON (no bare NaN or Infinity, which browsers and most parsers refuse): non-finite
    numbers as `NONFINITE`'s strings. Costs nothing more when there are none (the common case)."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:
        return json.dumps(strict(value), allow_nan=False, **options)


def number(value: Any) -> float | None:
    """A reported value as a float: a JSON number (an integer past a float's range as ±inf), or one
    of `NONFINITE`'s strings; else None."""
    if type(value) in (int, float):  # exact: a JSON true/false is a bool, no number
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return NONFINITE.get(value) if type(value) is str else None


def loads(body: bytes) -> Any:
    """JSON from a request body; ValueError when it is not (or nests too deep to parse)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("not JSON we read: nested too deep") from None
