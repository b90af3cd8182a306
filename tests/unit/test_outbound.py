"""The outgoing network of a local run's namespace (orchestrator/launch/local/outbound.py): the
choice of stack and the words said without one, with real namespaces; and, where pasta (Debian's
passt) is installed, the real stack: a task reaches a server on this machine's own address over
TCP and UDP, resolves names through a resolver on this machine's loopback, reaches the loopback
only at the ports the spec lists, and nothing of the stack outlives its coordinator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.errors import LaunchError, SpecError
from orchestrator.launch.local import netns, outbound
from orchestrator.spec.load import parse_spec
from tests.conftest import wait_until
from tests.machine_services import machine_address, resolver, servers

needs_pasta = pytest.mark.skipif(outbound.find() is None, reason="pasta (Debian's passt) is not installed")


def spec_of(tmp_path: Path, local: str = "") -> object:
    (tmp_path / "job.py").write_text("")
    text = "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\njob: {script: job.py}\n" + local
    return parse_spec(text, file="s.yaml", base_dir=tmp_path)


def children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def run_in(made: netns.Network, code: str, *args: str) -> dict:
    """Python `code` run inside the run's namespace as a task is; what it printed (JSON)."""
    out = subprocess.run(
        made.enter([sys.executable, "-c", code, *args], "/"),
        pass_fds=made.fds,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --- the words and the choice, no stack needed -------------------------------------------------


def test_a_resolver_on_the_loopback_is_replaced_by_the_gateway_the_rest_kept() -> None:
    machine = (
        "# systemd-resolved\nnameserver 127.0.0.53\nnameserver 10.0.0.2\noptions edns0 trust-ad\nsearch lab\n"
    )
    own = outbound.resolv_conf(machine)
    assert own is not None
    lines = own.splitlines()
    assert lines[1:] == [
        f"nameserver {outbound.GATEWAY}",
        "nameserver 10.0.0.2",
        "# systemd-resolved",
        "options edns0 trust-ad",
        "search lab",
    ]
    assert (
        outbound.resolv_conf("nameserver ::1\n") == own.splitlines()[0] + f"\nnameserver {outbound.GATEWAY}\n"
    )
    assert outbound.resolv_conf("nameserver 10.255.255.53\nnameserver 127.0.0.1\n") is None  # serves as it is
    assert outbound.resolv_conf("") is None and outbound.resolv_conf("nameserver\n") is None


def test_pasta_publishes_nothing_and_keeps_the_loopback_out_but_the_ports_listed(tmp_path: Path) -> None:
    line = outbound.argv("pasta", 7, 8, pid_file=tmp_path / "p", reach=(), dns=False)
    pairs = dict(zip(line, line[1:], strict=False))
    assert pairs["-t"] == pairs["-u"] == "none"  # nothing of the namespace published
    assert pairs["-T"] == pairs["-U"] == "none" and "--no-map-gw" in line  # the machine's loopback out
    assert pairs["--userns"] == "/proc/self/fd/7" and pairs["--netns"] == "/proc/self/fd/8"
    assert outbound.ADDRESS in line and "--foreground" in line and "--dns-forward" not in line
    line = outbound.argv("pasta", 7, 8, pid_file=tmp_path / "p", reach=(5000, 8125), dns=True)
    pairs = dict(zip(line, line[1:], strict=False))
    assert pairs["-T"] == pairs["-U"] == "5000,8125" and pairs["--dns-forward"] == outbound.GATEWAY


def test_the_spec_keys(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "local: {outbound: off, reach_host_loopback: [5000, 80, 5000]}\n")
    local = spec.section("local")  # type: ignore[attr-defined]
    assert local.outbound == "off" and local.reach_host_loopback == (80, 5000)
    for bad, key in (
        ("local: {reach_host_loopback: [70000]}", "local.reach_host_loopback[0]"),
        ("local: {outbound: sometimes}", "local.outbound"),
        ("local: {reach_host_loopback: 5000}", "local.reach_host_loopback"),
    ):
        with pytest.raises(SpecError) as err:
            spec_of(tmp_path, bad + "\n")
        assert f"s.yaml:4: {key}:" in str(err.value), str(err.value)


def test_without_pasta_the_run_is_offline_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbound, "find", lambda: None)
    netns._probe.cache_clear()
    for local, words, warned in (
        ("", "offline: install passt for outgoing network (pasta not found)", True),
        ("local: {outbound: off}", "offline: the spec's local.outbound is off", False),
    ):
        spec = spec_of(tmp_path, local + "\n")
        made = netns.Network(spec)  # type: ignore[arg-type]
        try:
            assert made.make(tmp_path) is not None
            assert made.exposure is not None and made.exposure.isolated
            assert (made.exposure.outbound, made.exposure.warn) == (words, warned)
            assert made.exposure.to_json()["outbound"] == words
            assert netns.Network(spec).probe() == made.exposure  # type: ignore[arg-type]  # plan and check say the same
        finally:
            made.close()
    before = children()
    with pytest.raises(LaunchError, match="local.outbound is on, but pasta is not installed: install passt"):
        netns.Network(spec_of(tmp_path, "local: {outbound: on}\n")).make(tmp_path)  # type: ignore[arg-type]
    assert children() <= before and not list(tmp_path.glob(".heartbeats-*"))
    from orchestrator.cli.commands import network_line
    from orchestrator.launch.local import KIND

    netns._probe.cache_clear()
    line = network_line(spec_of(tmp_path), KIND)  # type: ignore[arg-type]
    first, warning = line.splitlines()
    assert first.startswith("network: TF ports reachable from this run's own network namespace only")
    assert first.endswith("outgoing: offline: install passt for outgoing network (pasta not found)")
    assert warning == (
        "warning: this run's tasks reach no network outside it "
        "(offline: install passt for outgoing network (pasta not found))"
    )
    netns._probe.cache_clear()


FAILING = (
    "#!/bin/sh\necho 'Failed to send 40 bytes to syslog'\necho \"Couldn't open tap device\" >&2\nexit 1\n"
)
SILENT = "#!/bin/sh\nexec sleep 60\n"


@pytest.mark.parametrize(
    ("stack", "words"),
    [
        (FAILING, "offline: pasta could not connect the namespace: Couldn't open tap device"),
        (SILENT, "offline: pasta did not connect the namespace in 1 s: it said nothing"),
    ],
)
def test_a_stack_that_fails_or_hangs_leaves_the_run_offline_said_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: str, words: str
) -> None:
    tool = tmp_path / "pasta"
    tool.write_text(stack)
    tool.chmod(0o700)
    monkeypatch.setattr(outbound, "find", lambda: str(tool))
    monkeypatch.setattr(outbound.start, "__defaults__", (1.0,))
    before, t0 = children(), time.monotonic()
    made = netns.Network(spec_of(tmp_path))  # type: ignore[arg-type]
    try:
        assert made.make(tmp_path) is not None
        assert made.exposure is not None and made.exposure.outbound == words and made.exposure.warn
    finally:
        made.close()
    assert time.monotonic() - t0 < 6 and children() <= before  # its guard and the tool gone
    with pytest.raises(LaunchError, match=f"local.outbound is on, but {words.removeprefix('offline: ')}"):
        netns.Network(spec_of(tmp_path, "local: {outbound: on}\n")).make(tmp_path)  # type: ignore[arg-type]
    assert children() <= before


# --- the real stack ------------------------------------------------------------------------------


REACH = """
import json, socket, sys
address, port, *loopback = sys.argv[1:]
said = {}
said["tcp"] = socket.create_connection((address, int(port)), timeout=5).recv(10).decode()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5)
u.sendto(b"ping", (address, int(port)))
said["udp"] = u.recv(100).decode()
for p in loopback:
    try:
        said[p] = socket.create_connection(("127.0.0.1", int(p)), timeout=5).recv(10).decode()
    except OSError as exc:
        said[p] = type(exc).__name__
said["interfaces"] = sorted(n for _, n in socket.if_nameindex())
print(json.dumps(said))
"""


@needs_pasta
def test_a_task_reaches_this_machines_address_and_the_loopback_only_at_the_ports_listed(
    tmp_path: Path,
) -> None:
    address = machine_address()
    with servers(address) as outside, servers("127.0.0.1", 2) as (allowed, other):
        ports = [s.getsockname()[1] for s in (outside[0], allowed, other)]
        for local, reached in (
            ("", "ConnectionRefusedError"),
            (f"local: {{reach_host_loopback: [{ports[1]}]}}", "hello"),
        ):
            before = children()
            made = netns.Network(spec_of(tmp_path, local + "\n"))  # type: ignore[arg-type]
            try:
                assert made.make(tmp_path) is not None
                assert made.exposure is not None and made.exposure.outbound == outbound.reached(
                    made.local.reach_host_loopback
                )
                said = run_in(made, REACH, address, *map(str, ports))
            finally:
                made.close()
            assert said["tcp"] == "hello" and said["udp"] == "echo ping", said  # this machine's own address
            assert said[str(ports[1])] == reached and said[str(ports[2])] == "ConnectionRefusedError", said
            assert len(said["interfaces"]) == 2, said  # its loopback and pasta's
            assert children() <= before  # the guard and pasta gone with `close`


RESOLVE = """
import json, os, socket
print(json.dumps({"name": socket.gethostbyname("data.lab.test"), "cwd": os.getcwd(),
                  "resolv": open("/etc/resolv.conf").read()}))
"""

AS_COORDINATOR = """
import json, subprocess, sys
from pathlib import Path
from orchestrator.launch.local import netns
from orchestrator.spec.load import parse_spec
folder = Path(sys.argv[1])
spec = parse_spec("name: t\\nhosts: [{address: 127.0.0.1, tasks: {worker: 1}}]\\njob: {script: job.py}\\n",
                  file="s.yaml", base_dir=folder)
made = netns.Network(spec)
made.make(folder)
task = subprocess.run(made.enter([sys.executable, "-c", sys.argv[2]], str(folder)), pass_fds=made.fds,
                      cwd=folder, capture_output=True, text=True, timeout=60)
print(json.dumps({"task": task.stdout, "err": task.stderr, "outbound": made.exposure.outbound}), flush=True)
sys.stdin.read()  # until the test kills it
"""


@needs_pasta
@pytest.mark.skipif(
    os.geteuid() != 0, reason="a machine whose resolver is on its loopback: a mount namespace"
)
def test_names_resolve_through_a_resolver_on_this_machines_loopback_and_a_killed_coordinator_leaves_no_stack(
    tmp_path: Path,
) -> None:
    """The coordinator on a machine whose /etc/resolv.conf names 127.x.y.z (systemd-resolved's
    kind: bind-mounted in a mount namespace of the test's own); SIGKILL'd afterwards."""
    with resolver() as address:
        coordinator_on_a_machine_resolving_at(address, tmp_path)


def coordinator_on_a_machine_resolving_at(resolver: str, tmp_path: Path) -> None:
    (tmp_path / "resolv.conf").write_text(f"nameserver {resolver}\noptions timeout:2\n")
    (tmp_path / "job.py").write_text("")
    mount = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    coordinator = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            mount,
            str(tmp_path / "resolv.conf"),
            sys.executable,
            "-c",
            AS_COORDINATOR,
        ]
        + [str(tmp_path), RESOLVE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert coordinator.stdout is not None
        said = json.loads(coordinator.stdout.readline())
        task = json.loads(said["task"] or "{}")
        assert task.get("name") == "192.0.2.77", said
        assert task["cwd"] == str(tmp_path)  # entering the mount namespace kept the task's folder
        assert f"nameserver {outbound.GATEWAY}\n" in task["resolv"] and "options timeout:2" in task["resolv"]
        stack = psutil.Process(coordinator.pid).children(recursive=True)  # the guard and pasta
        assert len(stack) == 2 and any("--no-map-gw" in p.cmdline() for p in stack), stack
        coordinator.kill()  # SIGKILL: no teardown at all
        coordinator.wait(timeout=10)

        def alive() -> list[psutil.Process]:
            return [p for p in stack if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

        assert wait_until(lambda: alive() == [], 5), f"outlived their coordinator: {alive()}"
    finally:
        coordinator.kill()


@needs_pasta
def test_where_no_mount_namespace_can_be_made_the_run_stays_private_and_online(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine whose resolver is on its loopback, where the resolv.conf of the run's own cannot
    be mounted: the namespace is made without it (its TF ports private still), online."""
    monkeypatch.setattr(outbound, "resolv_conf", lambda text: "nameserver 169.254.1.1\n")
    real, asked = netns.make, []

    def make(timeout_s: float = 10.0, resolv: Path | None = None) -> netns.Namespace | str:
        asked.append(resolv)
        return "cannot give the namespace its own /etc/resolv.conf: Permission denied" if resolv else real()

    monkeypatch.setattr(netns, "make", make)
    made = netns.Network(spec_of(tmp_path))  # type: ignore[arg-type]
    try:
        assert made.make(tmp_path) is not None
        assert made.exposure is not None and made.exposure.isolated and not made.exposure.offline
        assert len(made.fds) == 2 and asked[0] is not None and asked[1:] == [None]
        # and said: names are not resolved in it, why, and the fix (the run's console, status.json)
        why = "given to it (cannot give the namespace its own /etc/resolv.conf: Permission denied)"
        assert made.exposure.unresolved is not None and made.exposure.unresolved.endswith(why)
        assert made.exposure.to_json()["names"] == f"not resolved in the run: {made.exposure.unresolved}"
        [names] = made.exposure.fallbacks()
        assert (names.what, names.where) == ("names", "this machine") and "resolv.conf" in names.fix
        assert "warning: names are not resolved in the run: " in made.exposure.said  # plan and check
    finally:
        made.close()


def test_a_machine_whose_resolver_is_reached_gets_no_word_of_names() -> None:
    """Where the run's names resolve as promised, nothing is said of them."""
    from orchestrator.launch.local.section import isolated

    exposure = isolated(outbound.reached(()))
    assert exposure.unresolved is None and exposure.fallbacks() == []
    assert exposure.to_json()["names"] is None and "names are not resolved" not in exposure.said
