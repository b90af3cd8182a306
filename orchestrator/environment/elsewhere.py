"""Resolving for hosts unlike this machine (another Python version, platform or architecture).

pip takes a target's tags (`--platform`, `--python-version`…) when it chooses wheels, but judges
the requirements' markers (`python_version < "3.12"`, `sys_platform`, `platform_machine`) by the
Python it runs in (pypa/pip#11664): for such a target it could choose the wrong set. uv resolves
for a named target (`uv pip compile --python-version --python-platform`), markers included; its
pins (`name==version`) then go to pip with `--no-deps`, which picks each one's wheel for the
target's tags and downloads it, as for any target.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from orchestrator.environment.request import Request
from orchestrator.environment.target import Target
from orchestrator.errors import LaunchError

COMPILE_TIMEOUT_S = 600.0
_MANYLINUX = (17, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40)  # what uv's --python-platform names


def uv_platform(target: Target) -> str | None:
    """uv's name for the target's platform: `x86_64-manylinux_2_36`, `aarch64-apple-darwin`…;
    None where uv has none."""
    tag = target.platforms[0]
    for arch in ("x86_64", "aarch64"):
        if tag.startswith("manylinux_2_") and tag.endswith(f"_{arch}"):
            minor = int(tag.removeprefix("manylinux_2_").removesuffix(f"_{arch}"))
            fits = [m for m in _MANYLINUX if m <= minor]
            return f"{arch}-manylinux_2_{fits[-1]}" if fits else None
        if tag.startswith("macosx_") and tag.endswith("_arm64" if arch == "aarch64" else "_x86_64"):
            return f"{arch}-apple-darwin"
    return None


def compile_for(uv: str, request: Request, target: Target, who: str) -> list[str]:
    """The exact versions (`name==version`) the requirements come to on `target`, in uv's words
    where it cannot."""
    platform = uv_platform(target)
    if platform is None:
        raise LaunchError(
            f"environment: cannot resolve for {who} ({target.said}) from this machine; "
            "run orchestrate on a machine of that platform"
        )
    with tempfile.TemporaryDirectory(prefix="orchestrate-compile-") as tmp:
        wanted = Path(tmp) / "requirements.in"
        lines = (
            [f"-r {request.requirements[1]}"]
            if request.requirements[:1] == ("-r",)
            else list(request.requirements)
        )
        wanted.write_text("\n".join([*lines, *request.added]) + "\n", encoding="utf-8")
        argv = [uv, "pip", "compile", str(wanted), "--quiet", "--no-header", "--no-annotate", "--no-config"]
        argv += ["--python-version", target.version, "--python-platform", platform, "--only-binary", ":all:"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
        env["UV_PYTHON_DOWNLOADS"] = "never"
        try:
            done = subprocess.run(
                [*argv, *request.options], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, env=env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(f"environment: uv could not resolve for {who}: {exc}") from None
    if done.returncode != 0:
        said = [line for line in done.stderr.strip().splitlines() if line.strip()][-8:]
        raise LaunchError(
            f"environment: uv cannot resolve the requirements for {who} ({target.said}); nothing was "
            "started. uv says:\n  " + "\n  ".join(line[:400] for line in said)
        )
    return [
        line.strip() for line in done.stdout.splitlines() if line.strip() and not line.startswith(("#", "-"))
    ]
