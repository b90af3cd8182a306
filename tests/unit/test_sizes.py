"""The product stays readable: no module over 400 lines, no function body over 60 (the docstring
aside), as scripts/sizes.py measures them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_over_400_lines_and_no_function_over_60() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sizes.py")], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout
    assert res.stdout.strip().endswith("0 over the limits (400 lines a module, 60 a function body)")
