"""The Slurm test lab itself (tests/slurm_lab.py): a real slurmctld and three real slurmds, each node
with its own network and hostname, driven from this machine through the stock Slurm clients."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_until
from tests.slurm_lab import SlurmLab, why_no_slurm

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(why_no_slurm() is not None, reason=why_no_slurm() or ""),
]

KILL_WAIT_S = 5  # slurm.conf's KillWait

# Run as two tasks on two nodes: task 0 listens on its node's address and sends its hostname to
# whoever connects; task 1 finds task 0's node by name (the lab's hosts file) and connects.
PAIR = """
import os, socket, sys, time
port, first = int(sys.argv[1]), sys.argv[2]
me = socket.gethostname()
if os.environ["SLURM_PROCID"] == "0":
    srv = socket.create_server((socket.gethostbyname(me), port))
    srv.settimeout(20)
    conn, peer = srv.accept()
    conn.sendall(me.encode())
    conn.close()
    print(f"server {me} {socket.gethostbyname(me)} peer {peer[0]}", flush=True)
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((socket.gethostbyname(first), port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    print(f"client {me} {socket.gethostbyname(me)} got {conn.recv(100).decode()}", flush=True)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    with SlurmLab(shared=[tmp_path_factory.getbasetemp()]) as lab:
        lab.wait_ready(timeout_s=30)
        yield lab


def sleepers(lab: SlurmLab, marker: str) -> list[int]:
    """The processes in any node's namespaces whose command line is `sleep MARKER`."""
    found = []
    for node in lab.nodes:
        for pid in lab.node_pids(node.name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", marker.encode()]:
                found.append(pid)
    return found


def test_srun_runs_on_two_different_nodes(lab: SlurmLab) -> None:
    res = lab.run(["srun", "-N2", "hostname"], timeout_s=30)
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    assert len(names) == 2 and len(set(names)) == 2, res.stdout
    assert set(names) <= {n.name for n in lab.nodes}


def test_each_node_has_its_own_tmp_and_sees_the_shared_folders(lab: SlurmLab, tmp_path: Path) -> None:
    """A real cluster's layout (issue 40): /tmp is each node's own; the run directory's file system,
    the lab's folder and this repository are seen by every node at the same path."""
    mine = f"/tmp/orchestrate-lab-{lab.tag}-{tmp_path.name}"
    (tmp_path / "flag").write_text("shared")

    def on(node: str, script: str) -> subprocess.CompletedProcess[str]:
        return lab.run(["srun", "-N1", "-w", node, "sh", "-c", script], timeout_s=30)

    wrote = on("n1", f"echo n1 > {mine} && cat {mine} {tmp_path / 'flag'} && test -r {lab.conf}")
    assert wrote.returncode == 0 and wrote.stdout.split() == ["n1", "shared"], wrote.stderr
    other = on("n2", f"cat {tmp_path / 'flag'} {REPO / 'pyproject.toml'} >/dev/null && ls {mine}")
    assert other.returncode != 0 and f"cannot access '{mine}': No such file" in other.stderr, (
        other.stdout,
        other.stderr,
    )
    assert not Path(mine).exists()  # nor this machine's
    assert on("n1", f"rm {mine}").returncode == 0


def test_nodes_reach_each_other_over_tcp(lab: SlurmLab) -> None:
    port = 23000 + int(lab.tag, 16) % 1000
    res = lab.run(
        [
            "srun",
            "-N2",
            "-n2",
            "-w",
            "n1,n2",
            "--kill-on-bad-exit=1",
            sys.executable,
            "-c",
            PAIR,
            str(port),
            "n1",
        ],
        timeout_s=40,
    )
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line.split() for line in res.stdout.splitlines()}
    n1, n2 = lab.node("n1"), lab.node("n2")
    # the server ran on n1 at its own address and was reached from n2's address (not loopback)
    assert lines["server"] == ["server", "n1", n1.address, "peer", n2.address], res.stdout
    assert lines["client"] == ["client", "n2", n2.address, "got", "n1"], res.stdout


def test_scancel_ends_a_batch_job_on_its_node(lab: SlurmLab) -> None:
    marker = str(300 + int(lab.tag, 16) % 600)  # `sleep N` that no one else runs here
    res = lab.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"sleep {marker}"], timeout_s=20)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]

    def state() -> str:
        return str(lab.run(["squeue", "-h", "-j", job, "-o", "%T"], timeout_s=10).stdout).strip()

    assert wait_until(lambda: state() == "RUNNING" and sleepers(lab, marker), 20), state()
    lab.run(["scancel", job], timeout_s=10, check=True)
    started = time.monotonic()
    assert wait_until(lambda: not lab.run(["squeue", "-h"], timeout_s=10).stdout.strip(), KILL_WAIT_S + 5)
    assert wait_until(lambda: not sleepers(lab, marker), KILL_WAIT_S + 5 - (time.monotonic() - started)), (
        sleepers(lab, marker)
    )


def test_a_cut_node_stops_responding_and_rejoins(lab: SlurmLab) -> None:
    """`cut` takes a node off the network for Slurm too (slurmctld marks it not responding, `*`,
    within ~10-18 s); `restore` + `rejoin` bring it back to idle."""
    lab.cut("n3")
    try:
        assert wait_until(lambda: lab.node_states().get("n3", "").endswith("*"), 30, interval_s=0.5), (
            lab.node_states()
        )
    finally:
        lab.restore("n3")
    lab.rejoin("n3", timeout_s=30)
    res = lab.run(["srun", "-N3", "hostname"], timeout_s=30)
    assert sorted(res.stdout.split()) == ["n1", "n2", "n3"], res.stderr


def test_close_leaves_nothing_behind() -> None:
    """A lab closed with a job still running: its daemons, the job's processes, namespaces, links and
    folder are all gone when close() returns."""
    lab = SlurmLab()
    try:
        lab.wait_ready(timeout_s=30)
        marker = str(300 + int(lab.tag, 16) % 600 + 1)
        res = lab.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"sleep {marker}"], timeout_s=20)
        assert res.returncode == 0, res.stderr
        assert wait_until(lambda: sleepers(lab, marker), 20)
        pids = [pid for node in lab.nodes for pid in lab.node_pids(node.name)]
        assert lab.leftovers()  # it was all there
    finally:
        lab.close()
    assert lab.leftovers() == []
    assert [pid for pid in pids if _running(pid)] == []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
