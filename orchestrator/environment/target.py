"""Which wheels an interpreter installs, as it reports itself (worker/host/environment.py `target`), in
the words pip's `--platform/--python-version/--implementation/--abi` take."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_OLDEST_GLIBC_MINOR = 5  # manylinux_2_5 (manylinux1) is the oldest tag there is
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
_IMPLEMENTATION = {"cpython": "cp", "pypy": "pp"}


@dataclass(frozen=True)
class Target:
    implementation: str  # cp
    version: str  # 3.11
    abi: str  # cp311
    platforms: tuple[str, ...]  # every platform tag it accepts, the most specific first

    @classmethod
    def of(cls, reported: Mapping[str, Any]) -> Target:
        return cls(
            _IMPLEMENTATION.get(str(reported.get("implementation")), str(reported.get("implementation"))),
            str(reported.get("version")),
            str(reported.get("abi")),
            platform_tags(str(reported.get("platform")), reported.get("glibc")),
        )

    @property
    def said(self) -> str:
        """`Python 3.11 (cp311) on manylinux_2_36_x86_64`"""
        return f"Python {self.version} ({self.abi}) on {self.platforms[0]}"

    def pip_args(self) -> list[str]:
        args = ["--python-version", self.version, "--implementation", self.implementation, "--abi", self.abi]
        for tag in self.platforms:
            args += ["--platform", tag]
        return args

    def as_data(self) -> dict[str, Any]:
        return {"implementation": self.implementation, "version": self.version, "abi": self.abi,
                "platforms": list(self.platforms)}  # fmt: skip


def platform_tags(platform: str, glibc: Any) -> tuple[str, ...]:
    """`linux-x86_64` with glibc 2.36: manylinux_2_36_x86_64 … manylinux_2_5_x86_64 (and their
    legacy names), then linux_x86_64. Other platforms: their one tag (pip widens macOS's itself)."""
    tag = re.sub(r"[-.]", "_", platform)
    if not platform.startswith("linux-") or not isinstance(glibc, str):
        return (tag,)
    arch = platform.removeprefix("linux-")
    major, _, minor = glibc.partition(".")
    if major != "2" or not minor.isdigit():
        return (tag,)
    tags = []
    for m in range(int(minor), _OLDEST_GLIBC_MINOR - 1, -1):
        tags.append(f"manylinux_2_{m}_{arch}")
        if m in _LEGACY:
            tags.append(f"{_LEGACY[m]}_{arch}")
    return (*tags, tag)
