"""Preflight of the ssh backend: `orchestrate check`, and its fast part before `orchestrate up`.

Per host, in parallel: SSH reachable with a known host key, the host's Python with TensorFlow and
psutil, GPUs, the work folder writable with free disk, the TF ports free, and every folder the
spec declares shared (train.checkpoint_dir, job.checkpoint_dir, ssh.shared_dirs) really shared:
each host writes a nonce there and reads the others'. With `peers=True` also whether every host
reaches every other host's TF ports (each host listens on its ports while the others connect).
Versions are compared across hosts.
"""

from __future__ import annotations

import json
import logging
import secrets
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fabric
import paramiko

from orchestrator.errors import LaunchError
from orchestrator.group import on_all
from orchestrator.launch.api import CheckReport
from orchestrator.launch.check_cells import (
    gpu_cell,
    page_copy_warning,
    size_cell,
    stacks_cell,
    stacks_warning,
    standby_cell,
)
from orchestrator.launch.ssh.hosts import Host, close_all, connect, hosts_of, probe
from orchestrator.launch.ssh.spec import section as ssh_section
from orchestrator.plan.launch_plan import LaunchPlan
from orchestrator.spec.model import ClusterSpec
from orchestrator.spec.roles import task_slots
from worker.host import PROBE_SOURCE

log = logging.getLogger("orchestrator.ssh")

MIN_DISK_BYTES = 256 * 1024**2
_PYTHON_MIN = (3, 10)


@dataclass
class HostReport:
    host: Host
    ports: dict[int, str]  # port -> task that uses it
    conn: fabric.Connection | None = None
    error: str | None = None  # could not connect or run anything
    facts: dict[str, Any] | None = None
    peers: dict[str, str | None] = field(default_factory=dict)  # "addr:port" -> error or None
    shared: list[str] = field(default_factory=list)  # problems with the folders declared shared
    environment: bool = False  # the spec's `environment:` makes the tasks' Python: the host's needs none

    @property
    def own_problems(self) -> list[str]:
        if self.error is not None:
            return [self.error]
        f = self.facts or {}
        i, label, out = self.host.index, self.host.label, []
        python = shlex.join(self.host.python)
        if tuple(int(x) for x in f.get("python", "0.0").split(".")[:2]) < _PYTHON_MIN:
            out.append(
                f"{label}: {python} is Python {f.get('python')}; the worker needs 3.10+ (hosts[{i}].python)"
            )
        if f.get("tensorflow") is None and not self.environment:
            out.append(
                f"{label}: TensorFlow is not installed for {python} (install it, or set hosts[{i}].python)"
            )
        if f.get("psutil") is None and not self.environment:
            out.append(f"{label}: psutil is not installed for {python} (the worker runtime needs it)")
        gpus = f.get("gpus") or {}
        if gpus.get("error"):
            out.append(f"{label}: nvidia-smi failed: {gpus['error']} (the GPUs cannot be used)")
        if f.get("workdir_error"):
            out.append(f"{label}: work folder {f.get('workdir')}: {f['workdir_error']} (hosts[{i}].workdir)")
        elif int(f.get("disk_free_bytes", 0)) < MIN_DISK_BYTES:
            out.append(
                f"{label}: only {size_cell(int(f.get('disk_free_bytes', 0)))} free under {f.get('workdir')}"
            )
        for port, free in (f.get("ports") or {}).items():
            if not free:
                out.append(
                    f"{label}: port {port} ({self.ports[int(port)]}) is in use there; "
                    f"set hosts[{i}].base_port to a free range"
                )
        for target, err in self.peers.items():
            if err is not None:
                out.append(f"{label}: cannot reach {target}: {err} (a firewall between the hosts?)")
        return out + self.shared


def inspect(
    spec: ClusterSpec, ports: Mapping[str, int], *, peers: bool, files: Sequence[str] = ()
) -> list[HostReport]:
    """Connect to every host and gather its facts (including which of `files`, by SHA-256, its
    cache lacks); connections stay open in the reports."""
    wanted = json.dumps(sorted(set(files)))
    slots = task_slots(spec)
    reports = [
        HostReport(
            host,
            {ports[s.name]: s.name for s in slots if s.host_index == host.index},
            environment=spec.environment is not None,
        )
        for host in hosts_of(spec)
    ]

    def one(report: HostReport) -> None:
        try:
            report.conn = connect(report.host, ssh_section(spec))
            workdir = spec.hosts[report.host.index].workdir or "~/.orchestrate"
            ports_here = map(str, sorted(report.ports))
            report.facts = probe(report.conn, report.host, "facts", workdir, *ports_here, stdin=wanted)
        except LaunchError as exc:
            report.error = str(exc)

    on_all(reports, one)
    _check_shared(spec, reports)
    if peers:
        _check_peers(spec, reports, ports)
    return reports


def check(spec: ClusterSpec, ports: Mapping[str, int]) -> CheckReport:
    """Everything `inspect` checks, the peer matrix included; connections closed after."""
    reports = inspect(spec, ports, peers=True)
    try:
        ready = [r for r in reports if r.conn is not None and r.facts is not None]
        for r, found in on_all(ready, lambda r: probe(r.conn, r.host, "stacks")):
            assert r.facts is not None
            r.facts["stacks"] = found if isinstance(found, dict) else {"native": False, "why": str(found)}
        rows = table_rows(reports, shared_declared=bool(declared_shared(spec)), spec=spec)
        found = problems(reports)
        if spec.environment is not None and not found:
            from orchestrator.launch.ssh.environment import survey_cells

            reached = [(r.conn, r.host, str((r.facts or {})["workdir"])) for r in ready if r.conn]
            cells = survey_cells(spec.environment, reached, found)
            for row, r in zip(rows, reports, strict=True):
                row["tensorflow"], row["environment"] = "(environment)", cells.get(r.host.index, "-")
        return CheckReport(
            f"{spec.name}: {len(reports)} host(s)",
            rows,
            warnings(reports)
            + [w for r in ready if (w := stacks_warning(r.host.label, r.facts)) is not None]
            + [w for r in ready if (w := page_copy_warning(r.host.label, r.facts)) is not None],
            found,
        )
    finally:
        close(reports)


def declared_shared(spec: ClusterSpec) -> dict[str, str]:
    """Folders the spec says every host shares: path -> the key that says so."""
    out = {}
    if spec.train is not None and spec.train.checkpoint_dir is not None:
        out[str(spec.train.checkpoint_dir)] = "train.checkpoint_dir"
    if spec.job.checkpoint_dir is not None:
        out[str(spec.job.checkpoint_dir)] = "job.checkpoint_dir"
    for i, path in enumerate(ssh_section(spec).shared_dirs):
        out.setdefault(path, f"ssh.shared_dirs[{i}]")
    return out


def _check_shared(spec: ClusterSpec, reports: list[HostReport]) -> None:
    """A folder declared shared that is not (each host its own disk) would silently split the
    job's state: every host writes a nonce file there, then each looks for the others'."""
    ready = [r for r in reports if r.conn is not None and r.facts is not None]
    for folder, key in declared_shared(spec).items():
        _check_one_shared(ready, folder, key)


def _check_one_shared(ready: list[HostReport], folder: str, key: str) -> None:
    nonces = {r.host.index: secrets.token_hex(8) for r in ready}

    def run(r: HostReport, action: str, *args: str) -> dict[str, Any]:
        assert r.conn is not None
        try:
            answer: dict[str, Any] = probe(r.conn, r.host, "shared", action, folder, *args)
        except LaunchError as exc:
            return {"error": str(exc), "seen": []}
        return answer

    writers = []
    for r, w in on_all(ready, lambda r: run(r, "write", nonces[r.host.index])):
        why = w if isinstance(w, Exception) else w["error"]
        if why:
            r.shared.append(f"{r.host.label}: cannot write in {folder} ({key}): {why}")
        else:
            writers.append(r)
    expected = [nonces[r.host.index] for r in writers]
    for r, s in on_all(ready, lambda r: run(r, "read", *expected)):
        got = set() if isinstance(s, Exception) else set(s["seen"])
        missing = [w.host.label for w in writers if nonces[w.host.index] not in got and w is not r]
        if missing:
            r.shared.append(
                f"{r.host.label}: {folder} is not shared: it does not see what {', '.join(missing)} "
                f"wrote there ({key} declares it shared by every host). Mount it on every host at "
                "the same path, or drop the key and orchestrate copies the checkpoints itself"
            )
    on_all(writers, lambda r: run(r, "remove", nonces[r.host.index]))


def _check_peers(spec: ClusterSpec, reports: list[HostReport], ports: Mapping[str, int]) -> None:
    ready = [r for r in reports if r.conn is not None and r.facts is not None]
    listeners: list[paramiko.Channel] = []
    targets: list[str] = []
    try:
        for r in ready:
            free = [p for p, ok in r.facts["ports"].items() if ok] if r.facts else []
            if not free:
                continue
            assert r.conn is not None and r.conn.transport is not None
            chan = r.conn.transport.open_session(timeout=ssh_section(spec).connect_timeout_s)
            chan.settimeout(ssh_section(spec).connect_timeout_s + 10)
            chan.exec_command(shlex.join([*r.host.python, "-c", PROBE_SOURCE, "listen", *free]))
            listeners.append(chan)
            bound = json.loads(chan.makefile("r").readline() or "{}")
            targets += [f"{r.host.address}:{p}" for p, err in bound.items() if err is None]

        def one(r: HostReport) -> None:
            assert r.conn is not None
            try:
                r.peers = probe(r.conn, r.host, "connect", "3", *targets)
            except LaunchError as exc:
                r.peers = {"(peers)": str(exc)}

        on_all(ready, one)
    finally:
        for chan in listeners:
            chan.close()


def _versions(reports: list[HostReport], name: str) -> dict[str, str]:
    return {r.host.label: str(r.facts[name]) for r in reports if r.facts and r.facts.get(name)}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def problems(reports: list[HostReport]) -> list[str]:
    """What stops a launch: each host's own problems, and TensorFlow minor versions that differ."""
    out = [p for r in reports for p in r.own_problems]
    first: dict[str, HostReport] = {}
    for r in sorted(reports, key=lambda r: r.host.spare):  # a spare on a machine already listed
        name = (r.facts or {}).get("hostname")
        if name and name in first and r.host.spare:
            out.append(
                f"{r.host.label}: this spare is the same machine as {first[name].host.label} (both answer as "
                f"{name}): losing one would lose both; a spare must be another machine"
            )
        first.setdefault(name or f"?{r.host.index}", r)
    tf = _versions(reports, "tensorflow")
    if len({_minor(v) for v in tf.values()}) > 1:
        listed = ", ".join(f"{h} {v}" for h, v in tf.items())
        out.append(f"TensorFlow versions differ across hosts ({listed}); one cluster needs one version")
    return out


def warnings(reports: list[HostReport]) -> list[str]:
    """Worth a look, not a stop: patch versions of TensorFlow or Python that differ."""
    out = []
    for name in ("tensorflow", "python"):
        seen = _versions(reports, name)
        minors_differ = name == "tensorflow" and len({_minor(v) for v in seen.values()}) > 1
        if len(set(seen.values())) > 1 and not minors_differ:
            listed = ", ".join(f"{h} {v}" for h, v in seen.items())
            out.append(f"{name} versions differ across hosts: {listed}")
    return out


def close(reports: list[HostReport]) -> None:
    close_all({r.host.index: r.conn for r in reports if r.conn is not None})


def table_rows(
    reports: list[HostReport], shared_declared: bool = True, spec: ClusterSpec | None = None
) -> list[dict[str, str]]:
    """One row per host for the `check` table (strings, in column order); the shared column says
    "-" where the spec declares no shared folder (nothing was checked); the standbys column, the
    warm standbys the host would keep (with `spec`)."""
    rows = []
    for r in reports:
        f = r.facts or {}
        gpus = f.get("gpus")
        busy = [p for p, ok in (f.get("ports") or {}).items() if not ok]
        unreachable = [t for t, e in r.peers.items() if e is not None]
        rows.append(
            {
                "host": f"{r.host.label} (spare)" if r.host.spare else r.host.label,
                "ssh": "ok" if r.conn is not None and r.error is None else "FAILED",
                "python": f.get("python", "-"),
                "tensorflow": f.get("tensorflow") or ("MISSING" if f else "-"),
                "gpus": "-" if not f else gpu_cell(gpus),
                "disk free": size_cell(int(f["disk_free_bytes"])) if f else "-",
                "ports": "-" if not f else (f"busy: {','.join(busy)}" if busy else f"{len(f['ports'])} free"),
                "peers": "-"
                if not r.peers
                else (f"{len(unreachable)} unreachable" if unreachable else f"{len(r.peers)} ok"),
                "shared": "-"
                if r.error or not f or not shared_declared
                else ("NOT SHARED" if r.shared else "ok"),
            }
        )
        if spec is not None:
            rows[-1]["standbys"] = standby_cell(spec, r.host.index, f.get("memory"))
        if "stacks" in f:
            rows[-1]["stacks"] = stacks_cell(f)
    return rows


def diagnose(
    plan: LaunchPlan, hosts: Sequence[Host], connection: Callable[[int], fabric.Connection]
) -> str | None:
    """At the start-up deadline: can every host reach the other hosts' tasks on their TF ports? A
    firewall or a route between two hosts is why a cluster waits for ever (TF waits for its peers
    silently). None where they can (or there is one host)."""
    tasks = [t for t in plan.tasks if t.in_cluster]
    indexes = sorted({t.host_index for t in tasks})
    if len(indexes) < 2:
        return None
    owner = {f"{t.host}:{t.port}": t.name for t in tasks}
    by_index = {h.index: h for h in hosts}

    def one(index: int) -> list[str]:
        host = by_index[index]
        targets = [f"{t.host}:{t.port}" for t in tasks if t.host_index != index]
        answer = probe(connection(index), host, "connect", "3", *targets, timeout_s=15)
        return [
            f"{host.label} cannot reach {target} ({owner.get(target, '?')}): {err}"
            for target, err in answer.items()
            if err is not None
        ]

    findings: list[str] = []
    for index, result in on_all(indexes, one):
        if isinstance(result, Exception):
            findings.append(f"{by_index[index].label}: its peers could not be probed ({result})")
        else:
            findings += result
    if not findings:
        return None
    more = f"; and {len(findings) - 4} more" if len(findings) > 4 else ""
    return "peer probe: " + "; ".join(findings[:4]) + more
