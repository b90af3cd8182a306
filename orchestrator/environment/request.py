"""What pip is asked for: the spec's requirements and what the worker runtime adds."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.spec.environment import EnvironmentSpec

#: The worker runtime's own needs (worker/): psutil always; py-spy to read a task's stacks.
RUNTIME_NEEDS = ("psutil", "py-spy")
#: Distributions that are TensorFlow: where the requirements name none, `tensorflow` is added.
TENSORFLOWS = {
    "tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-rocm", "tensorflow-macos",
    "tensorflow-intel", "tensorflow-aarch64", "tensorflow-cpu-aws", "tf-nightly", "tf-nightly-cpu",
    "tf-nightly-gpu", "intel-tensorflow", "intel-tensorflow-avx512",
}  # fmt: skip
#: uv, which builds the environment on each host (measured against pip: docs/benchmarks.md).
UV = "uv==0.13.9"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_INCLUDE = re.compile(r"^\s*(-r|--requirement|-c|--constraint)[\s=]+(\S+)")
MAX_INCLUDE_DEPTH = 8


@dataclass(frozen=True)
class Request:
    requirements: tuple[str, ...]  # pip's arguments naming them: ("-r", FILE, …) or the list's items
    added: tuple[str, ...]  # what the worker runtime added
    options: tuple[str, ...]  # where pip looks (--index-url, --find-links, --no-index)
    digest: str  # of everything the resolution depends on: texts (includes too), options, uv

    @property
    def described(self) -> str:
        return " ".join(self.requirements) + (f" (+ {', '.join(self.added)})" if self.added else "")


def request_of(env: EnvironmentSpec) -> Request:
    texts: list[str] = []
    if isinstance(env.requirements, Path):
        names = _file_names(env.requirements, texts, 0)
        requirements: tuple[str, ...] = ("-r", str(env.requirements))
    else:
        requirements = tuple(env.requirements)
        names = {m.group(1) for r in requirements if (m := _NAME.match(r))}
        texts.append("\n".join(requirements))
    normal = {_normal(n) for n in names}
    added = [n for n in RUNTIME_NEEDS if _normal(n) not in normal]
    if not normal & TENSORFLOWS:
        added.insert(0, "tensorflow")
    options: list[str] = []
    if env.index_url:
        options += ["--index-url", env.index_url]
    for url in env.extra_index_urls:
        options += ["--extra-index-url", url]
    for folder in env.find_links:
        options += ["--find-links", str(folder)]
    if env.no_index:
        options.append("--no-index")
    texts += [_listing(folder) for folder in env.find_links]  # a wheel dropped in: resolved again
    digest = hashlib.sha256("\0".join([*texts, *added, *options, UV]).encode()).hexdigest()
    return Request(requirements, tuple(added), tuple(options), digest)


def _listing(folder: Path) -> str:
    """A find_links folder as what pip would see in it: its files' names, sizes and times."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return f"{folder}: unreadable"
    lines = []
    for e in entries:
        with contextlib.suppress(OSError):
            st = e.stat()
            lines.append(f"{e.name} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(lines)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _file_names(path: Path, texts: list[str], depth: int) -> set[str]:
    """The names a requirements file asks for; its text and its includes' (-r, -c) go to `texts`."""
    text = path.read_text(encoding="utf-8", errors="replace")
    texts.append(text)
    names = set()
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        include = _INCLUDE.match(line)
        if include and depth < MAX_INCLUDE_DEPTH:
            other = (path.parent / include.group(2)).resolve()
            if other.is_file():
                found = _file_names(other, texts, depth + 1)
                names |= found if include.group(1) in ("-r", "--requirement") else set()
            continue
        if line and not line.startswith(("#", "-")) and (m := _NAME.match(line)):
            names.add(m.group(1))
    return names
