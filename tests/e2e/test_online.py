"""A local run is private and online at once (issue 37): the real `orchestrate up` on a machine
whose resolver is on its loopback (systemd-resolved's kind: its /etc/resolv.conf bind-mounted in a
mount namespace of the test's own), under the defaults: the job downloads a file from an HTTP
server on this machine's own address and resolves a name; this machine's loopback is out of its
reach but for the ports the spec lists; without pasta the run says it is offline before the job
fails, and the hint after it says what to install. (Nobody reaching the TF ports with outbound on:
tests/e2e/test_private_network.py; a coordinator's SIGKILL: tests/e2e/test_local_jobs.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.launch.local import outbound
from tests.conftest import Job, run_processes
from tests.machine_services import machine_address, resolver, servers

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or outbound.find() is None or not shutil.which("unshare"),
        reason="needs root (a machine of the test's own: its resolv.conf) and pasta (Debian's passt)",
    ),
]

DATA = os.urandom(1 << 20)  # what the job downloads: 1 MiB

FETCH = """
import hashlib, json, os, socket, urllib.request
import worker
said = {"sha": hashlib.sha256(urllib.request.urlopen(os.environ["DATA_URL"], timeout=10).read()).hexdigest()}
said["name"] = socket.gethostbyname("data.lab.test")
for port in os.environ["LOOPBACK_PORTS"].split(","):
    try:
        said[port] = socket.create_connection(("127.0.0.1", int(port)), timeout=5).recv(5).decode()
    except OSError as exc:
        said[port] = type(exc).__name__
print("SAID " + json.dumps(said), flush=True)
worker.report(step=1)
"""


class MachineJob(Job):
    """The coordinator on a machine whose resolver is `resolver` (127.x.y.z), pasta hidden where
    `no_pasta` (a machine without passt: /usr/bin/pasta not executable)."""

    def __init__(self, root: Path, spec_extra: str, env: dict[str, str], no_pasta: bool = False):
        super().__init__(root, FETCH, spec_extra, workers=1)
        self.extra_env, self.no_pasta = env, no_pasta
        (root / "resolv.conf").write_text(f"nameserver {env['RESOLVER']}\noptions timeout:2 attempts:1\n")

    def command(self) -> list[str]:
        hide = f"mount --bind /dev/null {outbound.find()} && " if self.no_pasta else ""
        machine = f'mount --bind "$0" /etc/resolv.conf && {hide}exec "$@"'
        return ["unshare", "--mount", "sh", "-c", machine, str(self.root / "resolv.conf"), *super().command()]

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra_env}


@pytest.fixture(scope="module")
def machine() -> Iterator[dict[str, str]]:
    """An HTTP server on this machine's own address, a resolver on its loopback, two services on
    its loopback: what the jobs below reach for."""

    class Serve(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA)

        def log_message(self, *args: object) -> None:
            pass

    address = machine_address()
    http = ThreadingHTTPServer((address, 0), Serve)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with resolver() as dns, servers("127.0.0.1", 2) as loopback:
            ports = [str(s.getsockname()[1]) for s in loopback]
            yield {
                "DATA_URL": f"http://{address}:{http.server_address[1]}/data.bin",
                "RESOLVER": dns,
                "LOOPBACK_PORTS": ",".join(ports),
            }
    finally:
        http.shutdown()
        http.server_close()


def said(out: str) -> dict[str, str]:
    line = next(x for x in out.splitlines() if "SAID " in x)
    return json.loads(line.split("SAID ", 1)[1])


def test_under_the_defaults_a_job_downloads_from_this_machine_and_resolves_names(tmp_path, machine):
    job = MachineJob(tmp_path, "", machine)
    try:
        res = job.up(timeout_s=120)
    finally:
        for left in run_processes(job.run_id):
            left.kill()
    assert res.returncode == 0, res.stdout + res.stderr
    got = said(res.stdout)
    assert got["sha"] == hashlib.sha256(DATA).hexdigest() and got["name"] == "192.0.2.77", got
    allowed, other = machine["LOOPBACK_PORTS"].split(",")
    assert got[allowed] == got[other] == "ConnectionRefusedError", got  # this machine's loopback: none
    network = job.status()["network"]
    assert network["isolated"] is True and network["outbound"].startswith("pasta: TCP, UDP"), network
    assert "offline" not in res.stdout and "open to every user" not in res.stdout


def test_the_loopback_is_reached_at_the_ports_the_spec_lists_alone(tmp_path, machine):
    allowed, other = machine["LOOPBACK_PORTS"].split(",")
    job = MachineJob(tmp_path, f"local: {{reach_host_loopback: [{allowed}]}}\n", machine)
    res = job.up(timeout_s=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = said(res.stdout)
    assert got[allowed] == "hello" and got[other] == "ConnectionRefusedError", got
    assert job.status()["network"]["outbound"].endswith(f"its loopback: ports {allowed}")


def test_without_pasta_the_run_says_it_is_offline_before_the_job_fails(tmp_path, machine):
    job = MachineJob(tmp_path, "", machine, no_pasta=True)
    res = job.up(timeout_s=120)
    assert res.returncode == 1, res.stdout + res.stderr
    offline = "offline: install passt for outgoing network (pasta not found)"
    first = res.stdout.index(f"orchestrate: this run's tasks reach no network outside it ({offline})")
    assert first < res.stdout.index("Network is unreachable"), res.stdout  # said before the job fails
    assert "hint: the tasks run in a network namespace of the run's own, " + offline in res.stdout
    assert "install passt (`apt install passt`" in res.stdout
    assert job.status()["network"]["outbound"] == offline
    assert run_processes(job.run_id) == []
