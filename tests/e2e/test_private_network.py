"""A local run's TF ports as another user of the machine would try them (issue 28): while a real
ParameterServerStrategy job trains, `nobody` connects to every TF port on every address of this
machine (IPv4 and IPv6) and to the heartbeat socket. In the run's own network namespace nothing
connects; where the kernel refuses the namespace (a real refusal: user.max_user_namespaces=0 in a
user namespace the coordinator runs in, which limits nothing outside it) the run says so and the
same attacker gets in — the proof that the attack itself works."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import psutil
import pytest

from tests.conftest import run_processes, wait_until
from tests.e2e.test_strategies import LoopJob

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one `nobody` may run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("runuser") or not SYSTEM_PYTHON,
        reason="needs root (to act as nobody) and the system's python3",
    ),
]

#: What `nobody` runs (stdlib only, the system's Python): every port on every address, then the
#: heartbeat socket; prints what connected.
ATTACK = r"""
import json, socket, sys
addresses, ports, heartbeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
connected, tried = [], 0
for address in addresses:
    for port in ports:
        for family, kind, proto, _, where in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM):
            tried += 1
            s = socket.socket(family, kind, proto)
            s.settimeout(2)
            try:
                s.connect(where)
                connected.append(f"{address}:{port}")
            except OSError:
                pass
            finally:
                s.close()
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(heartbeats)
    connected.append(heartbeats)
    said = "connected"
except OSError as exc:
    said = type(exc).__name__
print(json.dumps({"tried": tried, "connected": connected, "heartbeats": said}))
"""

TASKS = "{chief: 1, worker: 1, ps: 1}"


class RefusedJob(LoopJob):
    """The coordinator in a user namespace whose kernel limit allows no namespace below it."""

    def command(self) -> list[str]:
        limit = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
        return ["unshare", "--user", "--map-current-user", "sh", "-c", limit, "sh", *super().command()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def every_address() -> list[str]:
    """Every address of this machine's network (the host's namespace), IPv4 and IPv6."""
    found = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                found.append(a.address)
            elif a.family == socket.AF_INET6:
                found.append(
                    a.address
                    if "%" in a.address or not a.address.startswith("fe80")
                    else f"{a.address}%{name}"
                )
    return found


def attack(job: LoopJob) -> dict:
    """As nobody, while the chief trains: the job's TF ports (plan.json) on every address."""
    assert wait_until(lambda: (job.task("chief-0").get("last_step") or 0) >= 5, 180), job.status()
    plan = json.loads((job.run_dir / "plan.json").read_text())
    ports = sorted({t["port"] for t in plan["tasks"]})
    heartbeats = json.loads((job.run_dir / "coordinator.json").read_text())["heartbeat_url"]
    heartbeats = heartbeats.removeprefix("unix:")  # where isolation is off: a TCP URL, no such file
    args = [json.dumps(every_address()), json.dumps(ports), heartbeats]
    out = subprocess.run(
        ["runuser", "-u", "nobody", "--", str(SYSTEM_PYTHON), "-I", "-c", ATTACK, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    seen["ports"] = ports
    seen["listening_here"] = sorted(
        c.laddr.port
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    )
    seen["while_training"] = job.status().get("state") == "RUNNING"
    return seen


def attacked(job: LoopJob) -> tuple[dict, int, str]:
    """The job run to its end, attacked while it trains: what the attacker saw, the exit code and
    the console; nothing of the run left whatever happens."""
    proc = job.start()
    try:
        seen = attack(job)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        for left in run_processes(job.run_id):
            left.kill()
    return seen, proc.returncode, out


def test_no_other_user_reaches_a_runs_tf_ports_or_its_heartbeats(tmp_path):
    base = free_port()  # a port free here now: what connects there later would be ours
    job = LoopJob(tmp_path, "parameter_server", TASKS, steps=300)
    job.spec.write_text(
        job.spec.read_text().replace("tasks: {chief", f"base_port: {base}\n    tasks: {{chief")
    )
    seen, code, out = attacked(job)
    print(f"nobody tried {seen['tried']} address:port pairs and the heartbeat socket")
    assert seen["ports"] == [base, base + 1, base + 2]
    assert seen["tried"] >= 2 * len(seen["ports"]) and seen["connected"] == [], seen
    assert seen["heartbeats"] == "PermissionError" and seen["listening_here"] == [], seen
    assert seen["while_training"], seen
    assert code == 0, out[-3000:]
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["network"]["isolated"] is True
    assert "open to every user" not in out
    if shutil.which("pasta"):  # and the tasks online all the while: nothing published
        assert status["network"]["outbound"].startswith("pasta: TCP, UDP"), status["network"]


def test_where_the_kernel_refuses_the_run_says_so_and_goes_on(tmp_path):
    job = RefusedJob(tmp_path, "parameter_server", TASKS, steps=300)
    seen, code, out = attacked(job)
    assert code == 0, out[-3000:]
    said = (
        "orchestrate: this run's TF ports are open to every user of this machine (no private network "
        "namespace: unshare(CLONE_NEWUSER|CLONE_NEWNET) refused: No space left on device: "
        "user.max_user_namespaces=0 "
        "on this machine)"
    )
    assert out.count(said) == 1, out[-3000:]
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["network"]["isolated"] is False
    assert "user.max_user_namespaces=0" in status["network"]["why"]
    # the attack works: the same user reaches the ports of a run that could not close them
    assert seen["connected"] and set(seen["listening_here"]) == set(seen["ports"]), seen
    assert seen["while_training"], seen


def test_on_refuses_to_run_without_the_namespace(tmp_path):
    """`local: {isolate_network: on}` where the kernel refuses: exit 3 with the reason, nothing started."""
    job = RefusedJob(tmp_path, "parameter_server", TASKS, steps=10, extra="local: {isolate_network: on}\n")
    res = subprocess.run(job.command(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert (
        "local.isolate_network is on, but no private network namespace can be made here: "
        "unshare(CLONE_NEWUSER|CLONE_NEWNET) refused: No space left on device: user.max_user_namespaces=0 "
        "on this machine"
    ) in res.stderr + res.stdout
    assert "Traceback" not in res.stderr + res.stdout
    assert not (job.run_dir / "logs" / "chief-0.log").exists()
