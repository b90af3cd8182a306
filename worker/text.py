"""Worker and coordinator: what a job may report, shown as text (the one rule, worker.wire.safe_text)."""

from __future__ import annotations

import re

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
