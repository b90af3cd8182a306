"""A local run is private and online at once (issue 37): the real `orchestrate up` on a machine
whose resolver is on its loopback (systemd-resolved's kind: its /etc/resolv.conf bind-mounted in a
mount namespace of the test's own), under the defaults: the job downloads a file from an HTTP
server on this machine's own address and resolves a name; this machine's loopback is out of its
reach but for the ports the spec lists; without pasta the run says it is offline before the job
fails, and the hint after it says what to install. (Nobody reaching the TF ports with outbound on:
tests/e2e/test_private_network.py; a coordinator's SIGKILL: tests/e2e/test_local_jobs.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from orchestrator.launch.local import outbound
from tests import seccomp
from tests.conftest import Job, run_processes, wait_until
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
    `no_pasta` (a machine without passt: /usr/bin/pasta not executable), under a seccomp `rule`
    (tests/seccomp.py) where given."""

    def __init__(
        self,
        root: Path,
        spec_extra: str,
        env: dict[str, str],
        no_pasta: bool = False,
        rule: str | None = None,
        script: str = FETCH,
    ):
        super().__init__(root, script, spec_extra, workers=1)
        self.extra_env, self.no_pasta, self.rule = env, no_pasta, rule
        (root / "resolv.conf").write_text(f"nameserver {env['RESOLVER']}\noptions timeout:2 attempts:1\n")

    def command(self) -> list[str]:
        hide = f"mount --bind /dev/null {outbound.find()} && " if self.no_pasta else ""
        machine = f'mount --bind "$0" /etc/resolv.conf && {hide}exec "$@"'
        refuses = [sys.executable, seccomp.__file__, self.rule, "--"] if self.rule else []
        return [
            "unshare",
            "--mount",
            "sh",
            "-c",
            machine,
            str(self.root / "resolv.conf"),
            *refuses,
            *super().command(),
        ]

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


def test_where_the_run_gets_no_resolv_conf_of_its_own_names_are_said_unresolved_with_the_fix(
    tmp_path, machine
):
    """The machine's resolver on its loopback, and the kernel refusing a mount namespace (a
    container's seccomp profile, for real): the run stays private and online, says once, before the
    job fails, that names are not resolved in it and why, lists it in status.json, and the hint
    after the failure names the fix."""
    if not seccomp.SUPPORTED:
        pytest.skip("the seccomp filter of tests/seccomp.py is x86_64's")
    job = MachineJob(tmp_path, "", machine, rule="no-mount-namespace")
    res = job.up(timeout_s=120)
    assert res.returncode == 1, res.stdout + res.stderr
    said = (
        f"orchestrate: names are not resolved in this run's network namespace: this machine's resolver "
        f"({machine['RESOLVER']}) is on its loopback, out of the run's reach, and the run's own "
        "/etc/resolv.conf could not be given to it (unshare(CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS) refused: "
        "Operation not permitted) (hint: name a resolver off the loopback in /etc/resolv.conf"
    )
    assert res.stdout.count(said) == 1, res.stdout
    assert res.stdout.index(said) < res.stdout.index("Temporary failure in name resolution"), res.stdout
    assert (
        "hint: the tasks run in a network namespace of the run's own, where names are not resolved"
        in res.stdout
    )
    status = job.status()
    network = status["network"]
    assert network["isolated"] is True and network["outbound"].startswith("pasta: TCP, UDP"), network
    assert network["names"].startswith("not resolved in the run: this machine's resolver"), network
    assert [(d["what"], d["where"]) for d in status["degraded"]] == [("names", "this machine")]
    assert run_processes(job.run_id) == []


WAITS = """
import hashlib, json, os, time, urllib.request
from pathlib import Path
import worker
folder = Path(os.environ["GO_DIR"])
for turn in ("1", "2", "3"):
    worker.report(step=int(turn))
    deadline = time.monotonic() + 60
    while not (folder / f"go{turn}").exists():
        assert time.monotonic() < deadline, f"no go{turn} in 60 s"
        time.sleep(0.05)
    try:
        got = hashlib.sha256(urllib.request.urlopen(os.environ["DATA_URL"], timeout=5).read()).hexdigest()
    except OSError as exc:
        got = type(exc).__name__
    (folder / f"done{turn}").write_text(got)
worker.report(step=4)
"""


def test_pasta_killed_mid_run_is_started_again_and_once_it_cannot_be_the_run_says_it_is_offline(
    tmp_path, machine
):
    """pasta SIGKILLed while the job runs: started again, said, and the job downloads again; then
    pasta hidden (`passt` uninstalled, as it were) and killed: the run says it is offline from that
    moment, with the time, in the console, status.json (`network.outbound`, `degraded`) and its
    events; the job's next download fails."""
    go = tmp_path / "go"
    go.mkdir()
    job = MachineJob(tmp_path, "", {**machine, "GO_DIR": str(go)}, script=WAITS)
    proc = job.start()
    try:
        coordinator = psutil.Process(proc.pid)

        def pasta() -> psutil.Process | None:  # this run's: its coordinator's guard's child
            for p in coordinator.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "--no-map-gw" in p.cmdline() and "--no-map-gw" in p.parent().cmdline():
                        return p if p.status() != psutil.STATUS_ZOMBIE else None
            return None

        def turn(n: str) -> str:
            (go / f"go{n}").touch()
            assert wait_until(lambda: (go / f"done{n}").exists(), 60), n
            return (go / f"done{n}").read_text()

        assert wait_until(lambda: pasta() is not None and job.task("worker-0").get("state") == "RUNNING", 60)
        assert turn("1") == hashlib.sha256(DATA).hexdigest()
        first = pasta()
        first.kill()
        assert wait_until(lambda: pasta() not in (None, first), 30), job.events()[-3:]
        assert turn("2") == hashlib.sha256(DATA).hexdigest()  # online again
        # pasta no more on this machine (its mount namespace, as the coordinator sees it), and killed
        hide = [
            "nsenter",
            f"--mount=/proc/{proc.pid}/ns/mnt",
            "mount",
            "--bind",
            "/dev/null",
            outbound.find(),
        ]
        subprocess.run(hide, check=True, timeout=10)
        pasta().kill()
        assert wait_until(lambda: job.status().get("degraded"), 30), job.events()[-3:]
        assert turn("3") in ("URLError", "TimeoutError", "OSError"), "reached the network offline"
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    again = re.search(
        r"orchestrate: pasta, this run's outgoing network, ended at \d\d:\d\d:\d\d UTC \(killed by SIGKILL\) "
        r"and was started again \(1 of 3\): connections open then were cut",
        out,
    )
    assert again, out
    offline = re.search(
        r"orchestrate: this run's tasks reach no network outside it since (\d\d:\d\d:\d\d) UTC: pasta "
        r"ended \(killed by SIGKILL\); pasta could not connect the namespace: cannot start pasta: "
        r"Permission denied: \S+ \(hint: pasta.log",
        out,
    )
    assert offline and out.count("reach no network outside it since") == 2, out  # as it came; the summary
    status = job.status()
    assert status["network"]["outbound"].startswith(f"offline since {offline.group(1)} UTC"), status[
        "network"
    ]
    assert [(d["what"], d["since"][11:19]) for d in status["degraded"]] == [("outbound", offline.group(1))]
    kinds = [e["kind"] for e in job.events() if e["kind"] == "degraded"]
    assert kinds == ["degraded", "degraded"]  # started again; offline
    assert (
        f"degraded: this run's tasks reach no network outside it since {offline.group(1)}" in out
    )  # summary
    assert run_processes(job.run_id) == []
