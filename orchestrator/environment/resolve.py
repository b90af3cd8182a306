"""On this machine alone: the requirements resolved to exact wheels for one target, and downloaded.

pip does both (not a resolver of ours): `pip install --dry-run --ignore-installed
--only-binary=:all: --report` with the target's tags gives the exact set (name, version, file,
SHA-256); `pip download --no-deps` fetches those files, which are checked against the report's
hashes and kept by SHA-256 in the cache (`ROOT/cache/<sha256>`, the same layout as a host's file
cache: the local backend builds from it in place). A resolution is kept (`ROOT/resolved/`) per
requirements text and target: a second run asks no index. Changed requirements resolve again.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.environment.elsewhere import compile_for
from orchestrator.environment.request import UV, Request
from orchestrator.environment.target import Target
from orchestrator.errors import LaunchError
from orchestrator.record.write import make_private_dir, write_text_atomic
from worker.host import environment
from worker.host.folders import sha256_file

PIP_TIMEOUT_S = 1800.0  # a first download of TensorFlow on a slow link; pip's own timeouts come first


def cache_root() -> Path:
    """$XDG_CACHE_HOME/orchestrate/environments (default ~/.cache/…): the wheels, the resolutions,
    and the local backend's environments."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (
        (Path(base) if base and os.path.isabs(base) else Path.home() / ".cache")
        / "orchestrate"
        / "environments"
    )


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    file: str  # its file name (uv reads the tags from it)
    sha256: str  # "" until downloaded where the index gave none
    size: int
    url: str = ""  # where pip found it

    def as_data(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "file": self.file, "sha256": self.sha256,
                "size": self.size, "url": self.url}  # fmt: skip


@dataclass(frozen=True)
class Resolved:
    wheels: tuple[Wheel, ...]
    uv: Wheel
    seconds: dict[str, float] = field(default_factory=dict, compare=False)  # resolve, download (this run)
    downloaded: int = field(default=0, compare=False)  # bytes this run

    @property
    def size(self) -> int:
        return sum(w.size for w in self.wheels)

    def key(self, base_python: str) -> str:
        """The environment's name on a host: its exact wheels, uv, and the interpreter it is made from."""
        text = "\n".join(sorted(w.sha256 for w in self.wheels) + [self.uv.sha256, base_python])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def manifest(self, keep: int) -> str:
        """worker/host/environment.py's stdin: one line."""
        wheels = [{"file": w.file, "sha256": w.sha256, "size": w.size} for w in self.wheels]
        uv = {"file": self.uv.file, "sha256": self.uv.sha256, "size": self.uv.size}
        return json.dumps({"wheels": wheels, "uv": uv, "keep": keep}) + "\n"

    def files(self, root: Path) -> dict[str, Path]:
        """sha256 -> the file in this machine's cache."""
        return {w.sha256: root / "cache" / w.sha256 for w in (*self.wheels, self.uv)}


def resolve(request: Request, target: Target, root: Path, *, who: str) -> Resolved:
    """The exact wheels for `target` (hosts `who`), downloaded into `root`'s cache. LaunchError
    naming `who` and the package, in pip's words, where pip cannot."""
    key = hashlib.sha256(json.dumps([request.digest, target.as_data()]).encode()).hexdigest()[:32]
    kept = root / "resolved" / f"{key}.json"
    seconds: dict[str, float] = {}
    started = time.monotonic()
    try:
        data = json.loads(kept.read_text(encoding="utf-8"))
        wheels, uv = [Wheel(**w) for w in data["wheels"]], Wheel(**data["uv"])
    except (OSError, ValueError, KeyError, TypeError):
        wheels = _exact(request, target, root, who)
        uv = _report(request, target, [UV], request.options, who)[0]
        seconds["resolve"] = time.monotonic() - started
    started = time.monotonic()
    (*wheels, uv), downloaded = _download([*wheels, uv], target, request, root, who)
    if downloaded or "resolve" in seconds:
        seconds["download"] = time.monotonic() - started
    if "resolve" in seconds:
        make_private_dir(kept.parent)
        write_text_atomic(kept, json.dumps({"wheels": [w.as_data() for w in wheels], "uv": uv.as_data()}))
    return Resolved(tuple(sorted(wheels, key=lambda w: w.name)), uv, seconds, downloaded)


def _exact(request: Request, target: Target, root: Path, who: str) -> list[Wheel]:
    """pip's resolution for a target like this machine's Python; for another, uv's pins
    (elsewhere.py: pip would judge markers by this machine), each one's wheel chosen by pip."""
    here = Target.of(environment.target())
    if target == here:
        return _report(request, target, [*request.requirements, *request.added], request.options, who)
    tool = _report(request, here, [UV], request.options, "this machine")
    (mine,), _ = _download(tool, here, request, root, "this machine")
    uv = environment.unpack_uv(str(root), mine.as_data())
    pins = compile_for(uv, request, target, who)
    return _report(request, target, pins, (*request.options, "--no-deps"), who)


def _pip(argv: list[str], who: str, target: Target, what: str) -> None:
    command = [sys.executable, "-m", "pip", *argv, "--quiet", "--no-input", "--disable-pip-version-check"]
    try:
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PIP_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"environment: pip could not {what} for {who}: {exc}") from None
    if done.returncode != 0 and "No module named pip" in done.stderr:
        raise LaunchError(
            f"environment: {sys.executable} has no pip, which resolves the requirements; install it"
        )
    if done.returncode != 0:
        said = [
            line for line in done.stderr.splitlines() if line.startswith("ERROR")
        ] or done.stderr.splitlines()
        raise LaunchError(
            f"environment: pip cannot {what} for {who} ({target.said}); nothing was started. pip says:\n  "
            + "\n  ".join(line[:400] for line in said[-6:])
        )


def _report(
    request: Request, target: Target, requirements: list[str], options: tuple[str, ...], who: str
) -> list[Wheel]:
    with tempfile.TemporaryDirectory(prefix="orchestrate-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        argv = ["install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "--report", str(report)]
        argv += ["--target", str(Path(tmp) / "target")]  # pip < 23.3 takes a target's tags only so
        _pip([*argv, *target.pip_args(), *options, *requirements], who, target, "resolve the requirements")
        data = json.loads(report.read_text(encoding="utf-8"))
    wheels = []
    for item in data.get("install", []):
        info, meta = item.get("download_info", {}), item.get("metadata", {})
        url = str(info.get("url", ""))
        sha = (info.get("archive_info") or {}).get("hashes", {}).get("sha256", "")
        wheels.append(Wheel(meta.get("name", "?"), meta.get("version", "?"), _file_name(url), sha, 0, url))
    return wheels


def _file_name(url: str) -> str:
    """A wheel's file name from its URL (`%2B` is the `+` of a local version; no query)."""
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


def _download(
    wheels: list[Wheel], target: Target, request: Request, root: Path, who: str
) -> tuple[list[Wheel], int]:
    """The wheels with their SHA-256 and size, those the cache lacks fetched by pip (checked against
    the index's hash) and kept by SHA-256; and the bytes fetched."""
    cache = root / "cache"
    make_private_dir(cache)
    done: dict[str, Wheel] = {}
    for w in wheels:  # known by the index's hash and here already (another resolution fetched it)
        if w.sha256 and (cache / w.sha256).is_file():
            done[w.file] = Wheel(
                w.name, w.version, w.file, w.sha256, (cache / w.sha256).stat().st_size, w.url
            )
    todo = [w for w in wheels if w.file not in done]
    if not todo:
        return [done[w.file] for w in wheels], 0
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        argv = ["download", "--no-deps", "--only-binary=:all:", "--dest", tmp, *target.pip_args()]
        _pip([*argv, *request.options, *(w.url or w.file for w in todo)], who, target, "download the wheels")
        for w in todo:
            path = Path(tmp) / w.file
            if not path.is_file():
                raise LaunchError(
                    f"environment: pip downloaded no {w.file} for {who} (from {w.url or 'its index'})"
                )
            digest = sha256_file(path)
            if w.sha256 and digest != w.sha256:
                raise LaunchError(f"environment: {w.file} downloaded with SHA-256 {digest}, not {w.sha256}")
            size = path.stat().st_size
            os.chmod(path, 0o600)
            os.replace(path, cache / digest)
            done[w.file] = Wheel(w.name, w.version, w.file, digest, size, w.url)
    return [done[w.file] for w in wheels], sum(done[w.file].size for w in todo)
