"""Every host's environment ready before a task starts: asked, resolved, sent, built, in parallel.

A backend gives one `Site` per host (how to run worker/host/environment.py there and how to send it
files); `prepare` does the rest and answers each host's interpreter for the tasks. A second run
with the same requirements asks each host once (its target is remembered here, so the
environment's name is known before the host answers) and sends and builds nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestrator.environment.request import Request, request_of
from orchestrator.environment.resolve import Resolved, cache_root, resolve
from orchestrator.environment.target import Target
from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.record.progress import size_text
from orchestrator.record.write import make_private_dir, write_text_atomic
from orchestrator.spec.environment import EnvironmentSpec

Notify = Callable[[str], None]
PROGRESS_EVERY_S = 5.0
PYTHON_MIN = (3, 10)  # the worker runtime's  # a host's "sent" line at most this often


class Site(Protocol):
    """One host, as the environment step reaches it."""

    label: str  # for people (its address)
    python: str  # the interpreter there that makes the environment, as the spec names it

    def ask(
        self, mode: str, key: str, manifest: str, on_line: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Run worker/host/environment.py MODE WORKDIR KEY there (manifest on stdin, kept open until it
        answers); its lines before the answer go to `on_line`. LaunchError where it fails."""
        ...

    def send(self, files: Mapping[str, Path], missing: Sequence[str], progress: Callable[[int], None]) -> int:
        """The files whose SHA-256 its cache lacks; the bytes sent (`progress` with each part's bytes)."""
        ...


@dataclass
class HostEnvironment:
    """One host's environment, as status.json and `orchestrate check` show it."""

    host: str
    state: str = "asking"  # asking, sending, building, ready, failed
    python: str | None = None  # the tasks' interpreter there
    key: str | None = None
    target: str | None = None
    packages: int = 0
    to_send: int = 0  # bytes its cache lacks
    sent: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # resolve, download (its target's), send, build

    def as_data(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "key"}


def prepare(
    env: EnvironmentSpec, sites: Sequence[Site], notify: Notify, root: Path | None = None
) -> list[HostEnvironment]:
    """Each site's environment ready (built where missing); the hosts' states, in `sites`' order."""
    root, started = root or cache_root(), time.monotonic()
    request, known = request_of(env), _Known(root)
    hosts = [HostEnvironment(s.label) for s in sites]
    seen = known.read()
    guesses = [known.entry(seen, s, request.digest) for s in sites]
    answers = _ask_all(sites, [g.get("key", "-") for g in guesses])
    todo = []
    for i, (answer, guess) in enumerate(zip(answers, guesses, strict=True)):
        if answer.get("ready") and guess.get("target") == answer["target"]:  # as last time: nothing to do
            host = hosts[i]
            host.state, host.python, host.key = "ready", answer.get("python"), guess["key"]
            host.target, host.packages = guess.get("said"), int(guess.get("packages", 0))
        else:
            todo.append(i)
    if todo:
        _make(env, request, [sites[i] for i in todo], [hosts[i] for i in todo], [answers[i] for i in todo],
              root, notify)  # fmt: skip
        known.put([(sites[i], answers[i]["target"], hosts[i]) for i in todo], request.digest)
    for host in hosts:
        host.seconds["step"] = round(time.monotonic() - started, 3)  # the whole step, every host
    return hosts


def _make(
    env: EnvironmentSpec,
    request: Request,
    sites: Sequence[Site],
    hosts: Sequence[HostEnvironment],
    answers: Sequence[Mapping[str, Any]],
    root: Path,
    notify: Notify,
) -> None:
    """Resolved (once per target), sent and built where missing. Hosts that share their
    environments' folder (an NFS home, a cluster's shared work folder) and would make the same
    environment: built there once, by the first of them."""
    old = [f"{s.label}: {s.python} is Python {v}" for s, a in zip(sites, answers, strict=True)
           if _version(v := str(a["target"].get("version"))) < PYTHON_MIN]  # fmt: skip
    if old:
        raise LaunchError(
            "environment: the worker needs Python 3.10+ (environment.python):\n  " + "\n  ".join(old)
        )
    sets = _resolved(request, sites, [a["target"] for a in answers], root, notify)
    builders: dict[tuple[Any, str | None], int] = {}
    for i, resolved in enumerate(sets):
        hosts[i].key = resolved.key(str(answers[i]["target"].get("executable")))
        hosts[i].target, hosts[i].packages = Target.of(answers[i]["target"]).said, len(resolved.wheels)
        hosts[i].seconds.update({k: round(v, 3) for k, v in resolved.seconds.items()})  # its target's
        builders.setdefault((answers[i].get("folder") or i, hosts[i].key), i)
    first = sorted(builders.values())
    on_all(first, lambda i: _ready(sites[i], hosts[i], sets[i], env, root, notify)).raise_if_failed(
        "making the environment"
    )
    others = [i for i in range(len(sites)) if i not in first]
    asked = {i: sites[i].ask("ready", hosts[i].key or "-", "", _ignore) for i in others}
    for i, answer in asked.items():
        hosts[i].state, hosts[i].python = "ready", answer.get("python")
    apart = [i for i, answer in asked.items() if not answer.get("ready")]  # a copied id: not shared
    on_all(apart, lambda i: _ready(sites[i], hosts[i], sets[i], env, root, notify)).raise_if_failed(
        "making the environment"
    )


def survey(
    env: EnvironmentSpec, sites: Sequence[Site], notify: Notify, root: Path | None = None
) -> list[HostEnvironment]:
    """What `prepare` would do (`orchestrate check`): resolved and downloaded here, nothing sent."""
    root = root or cache_root()
    request = request_of(env)
    hosts = [HostEnvironment(s.label) for s in sites]
    targets = [a["target"] for a in _ask_all(sites, ["-"] * len(sites))]
    sets = _resolved(request, sites, targets, root, notify)
    for site, host, resolved, target in zip(sites, hosts, sets, targets, strict=True):
        host.key = resolved.key(str(target.get("executable")))
        host.target, host.packages = Target.of(target).said, len(resolved.wheels)
        answer = site.ask("ready", host.key, resolved.manifest(env.keep), _ignore)
        sizes = {w.sha256: w.size for w in (*resolved.wheels, resolved.uv)}
        host.state, host.python = ("ready" if answer.get("ready") else "to build"), answer.get("python")
        host.to_send = sum(sizes.get(d, 0) for d in answer.get("missing", []))
    return hosts


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (0,)


def _ignore(_: dict[str, Any]) -> None:
    pass


def _ask_all(sites: Sequence[Site], keys: Sequence[str]) -> list[dict[str, Any]]:
    answers = on_all(range(len(sites)), lambda i: sites[i].ask("ready", keys[i], "", _ignore))
    return answers.raise_if_failed("asking the hosts' Python")


def _resolved(
    request: Request, sites: Sequence[Site], targets: Sequence[Mapping[str, Any]], root: Path, notify: Notify
) -> list[Resolved]:
    """Each site's exact wheels, resolved once per distinct target."""
    groups: dict[Target, list[int]] = {}
    for i, reported in enumerate(targets):
        groups.setdefault(Target.of(reported), []).append(i)
    sets: dict[int, Resolved] = {}
    for target, members in groups.items():
        who = ", ".join(sites[i].label for i in members)
        resolved = resolve(request, target, root, who=who)
        if resolved.seconds:
            notify(
                f"environment for {who}: {len(resolved.wheels)} wheels ({size_text(resolved.size)}) for "
                f"{target.said}: resolved in {resolved.seconds.get('resolve', 0):.1f} s, "
                f"{size_text(resolved.downloaded)} downloaded in {resolved.seconds.get('download', 0):.1f} s"
            )
        sets.update(dict.fromkeys(members, resolved))
    return [sets[i] for i in range(len(sites))]


def _ready(
    site: Site, host: HostEnvironment, resolved: Resolved, env: EnvironmentSpec, root: Path, notify: Notify
) -> None:
    assert host.key is not None
    manifest = resolved.manifest(env.keep)
    answer = site.ask("ready", host.key, manifest, _ignore)
    host.python = answer.get("python")
    for _ in range(2):  # files removed meanwhile by another run's clean-up: sent once more
        if answer.get("ready"):
            host.state = "ready"
            return
        _send(site, host, resolved, answer.get("missing", []), root, notify)
        host.state, started = "building", time.monotonic()
        notify(f"{site.label}: building the environment ({len(resolved.wheels)} packages, uv)…")
        answer = site.ask("build", host.key, manifest, _ignore)
        host.seconds["build"] = round(time.monotonic() - started, 3)
        if answer.get("ready") and answer.get("built"):
            took, count = host.seconds["build"], answer.get("packages")
            notify(
                f"{site.label}: environment built in {took:.1f} s, {count} packages ({answer.get('python')})"
            )
        elif answer.get("ready"):
            notify(
                f"{site.label}: environment ready (built meanwhile by another run: {answer.get('python')})"
            )
    if not answer.get("ready"):
        host.state = "failed"
        raise LaunchError(
            f"{site.label}: the environment's wheels keep vanishing from its cache (another run?)"
        )


def _send(
    site: Site, host: HostEnvironment, resolved: Resolved, missing: Sequence[str], root: Path, notify: Notify
) -> None:
    if not missing:
        return
    files = resolved.files(root)
    sizes = {w.sha256: w.size for w in (*resolved.wheels, resolved.uv)}
    host.state, host.to_send, host.sent = "sending", sum(sizes.get(d, 0) for d in missing), 0
    started = time.monotonic()
    notify(f"{site.label}: sending {len(missing)} wheels ({size_text(host.to_send)})…")
    said = [started]
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            host.sent += n
            now = time.monotonic()
            if now - said[0] >= PROGRESS_EVERY_S:
                said[0] = now
                notify(f"{site.label}: {size_text(host.sent)} of {size_text(host.to_send)} sent")

    site.send(files, missing, progress)
    host.seconds["send"] = round(time.monotonic() - started, 3)
    notify(f"{site.label}: {size_text(host.to_send)} sent in {host.seconds['send']:.1f} s")


class _Known:
    """What each host said last time (ROOT/hosts.json): for a host whose interpreter reports the
    same target for the same requirements, the environment's name is known before it answers (a
    second run asks each host once, and resolves nothing)."""

    MAX_ENTRIES = 1000

    def __init__(self, root: Path):
        self._path = root / "hosts.json"

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def entry(data: Mapping[str, Any], site: Site, digest: str) -> dict[str, Any]:
        found = data.get(f"{site.label} {site.python} {digest}")
        return found if isinstance(found, dict) else {}

    def put(self, made: Sequence[tuple[Site, Mapping[str, Any], HostEnvironment]], digest: str) -> None:
        """What these hosts said, written once (newest last; the oldest entries go first)."""
        data = self.read()
        for site, target, host in made:
            data.pop(f"{site.label} {site.python} {digest}", None)
            data[f"{site.label} {site.python} {digest}"] = {
                "key": host.key, "target": dict(target), "said": host.target, "packages": host.packages
            }  # fmt: skip
        make_private_dir(self._path.parent)
        write_text_atomic(self._path, json.dumps(dict(list(data.items())[-self.MAX_ENTRIES :])))
