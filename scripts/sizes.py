"""Module and function sizes of the product (issue 23's measure): modules over 400 lines and
function bodies over 60 lines (the docstring aside). `python scripts/sizes.py [--all]`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE, MAX_FUNCTION = 400, 60


def functions(tree: ast.AST) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:] or body
            end = node.end_lineno or node.lineno
            out.append((node.name, end - body[0].lineno + 1))
    return out


def main(argv: list[str]) -> int:
    show_all = "--all" in argv
    over = 0
    for path in sorted([*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]):
        text = path.read_text()
        lines = text.count("\n")
        rel = path.relative_to(ROOT)
        if lines > MAX_MODULE or show_all:
            print(f"{lines:5d}  {rel}")
            over += lines > MAX_MODULE
        for name, length in functions(ast.parse(text)):
            if length > MAX_FUNCTION:
                print(f"{length:5d}  {rel}:{name}()")
                over += 1
    print(f"{over} over the limits ({MAX_MODULE} lines a module, {MAX_FUNCTION} a function body)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
