"""The ssh backend end to end, on real sshd hosts (tests/lab.py): as root, namespaces with a network,
a disk and a hostname of their own; loopback sshd instances otherwise. Real SSH, real keys, real
TensorFlow, real signals. A host's files are read from outside through `host.path(...)`."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import CliRun, run_processes, wait_until
from tests.lab import NetnsLab, make_lab, why_no_lab

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or "")]

# Every task prints what it was given, so the test can compare it with the spec, byte for byte.
NASTY = '$(touch {marker}); echo `id` ; \'single\' "double" \\back {{"json": [1]}}'

MWMS = """
    import json, os, sys, time
    import tensorflow as tf
    import worker
    print("ENV " + json.dumps(os.environ["NASTY"]), flush=True)
    print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
    print("RUNTIME " + worker.__file__, flush=True)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)  # all-reduced across hosts
    step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
    steps = int(os.environ.get("STEPS", "20"))
    worker.set_total_steps(steps)
    for i in range(1, steps + 1):
        step()
        worker.report(step=i, value=float(v.numpy()))
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
    print("FINAL", float(v.numpy()), flush=True)
"""

# No TensorFlow: for what does not depend on it (teardown paths), faster on 2 cores.
PLAIN = """
    import time
    import worker
    for i in range(1, 100000):
        worker.report(step=i)
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = make_lab(tmp_path_factory.mktemp("lab"), 3)
    yield lab
    lab.close()


class SshJob(CliRun):
    def __init__(self, lab, root: Path, script: str, *, hosts: int = 2, spec: dict | None = None, name="s"):
        self.lab, self.root = lab, root
        self.run_dir = root / f"run-{secrets.token_hex(3)}"
        (root / "job").mkdir(parents=True, exist_ok=True)
        (root / "job" / "job.py").write_text(textwrap.dedent(script))
        self.hosts = list(range(hosts))
        data = {
            "name": name,
            "backend": "ssh",
            "hosts": [lab.host_spec(i) for i in self.hosts],
            "job": {"script": "job/job.py", "env": {"TF_CPP_MIN_LOG_LEVEL": "2"}},
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3, "stop_grace_s": 5},
            "restart": {"max_restarts": 2, "backoff_s": 0.5},
            "ssh": lab.ssh_spec(),
        }
        for key, value in (spec or {}).items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        self.spec = root / "spec.yaml"
        self.spec.write_text(yaml.safe_dump(data))

    def steps(self) -> int:
        return min((t.get("last_step") or 0 for t in self.status().get("tasks", [])), default=0)

    def host_pids(self) -> dict[int, list[str]]:
        """Processes on the job's hosts other than their sshd listener (sshd's session processes
        included): none once a run is over and its connections are closed."""
        out = {}
        for i in self.hosts:
            names = []
            for pid in self.lab.pids(i):
                line = cmdline(pid)
                if line:
                    names.append(f"{pid} {line[:80]}")
            if names:
                out[i] = names
        return out

    def hosts_empty(self, timeout_s: float = 5.0) -> bool:
        return wait_until(lambda: self.host_pids() == {}, timeout_s)


@pytest.fixture
def ssh_job(lab, tmp_path):
    made: list[SshJob] = []

    def make(script: str, **kw) -> SshJob:
        job = SshJob(lab, tmp_path / f"job{len(made)}", script, **kw)
        made.append(job)
        return job

    yield make
    for job in made:
        for proc in run_processes(job.run_id):
            proc.kill()


def test_three_hosts_train_together_and_spec_values_pass_literally(ssh_job, lab):
    marker = lab.shared / f"executed-{secrets.token_hex(3)}"  # the same path on every host and here
    nasty = NASTY.format(marker=marker)
    job = ssh_job(
        MWMS,
        hosts=3,
        spec={"job": {"script": "job/job.py", "args": [nasty, "--x=$HOME"], "env": {"NASTY": nasty}}},
    )
    res = job.up(timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    status = job.status()
    assert status["state"] == "SUCCEEDED"
    assert [t["last_step"] for t in status["tasks"]] == [20, 20, 20]
    assert len({t["host"] for t in status["tasks"]}) == 3  # one task per host
    for i, task in enumerate(("worker-0", "worker-1", "worker-2")):
        log = (job.run_dir / "logs" / f"{task}.log").read_text()
        # the log streamed back; the host keeps its own copy
        host = job.lab.hosts[i]
        remote = host.path(host.workdir / "runs" / job.run_id / "logs" / f"{task}.log")
        assert "FINAL 60.0" in log and "FINAL 60.0" in remote.read_text()  # 3 replicas x 20 steps
        assert f"ENV {json.dumps(nasty)}" in log
        assert f"ARGV {json.dumps([nasty, '--x=$HOME'])}" in log
        # the runtime copied into the run's folder ran, not the coordinator's checkout
        assert f"RUNTIME {host.workdir}/runs/{job.run_id}/lib/worker/__init__.py" in log
    assert not marker.exists()  # nothing in the spec was ever run by a shell
    assert job.hosts_empty(), job.host_pids()


def test_an_exception_whose_heartbeat_is_lost_comes_home_from_its_host(ssh_job):
    """The durable error on a remote host: the task cuts its heartbeat channel, then raises; its
    error file, on its host's disk only, comes home through its shim and names the cause."""
    from tests.e2e.test_local_jobs import CUT_THEN_RAISE

    job = ssh_job(CUT_THEN_RAISE, spec={"restart": {"max_restarts": 0}})
    res = job.up(timeout_s=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "first failure: worker-1 raised KeyError: 'label'" in res.stdout, res.stdout
    assert not (job.run_dir / "errors").exists()  # written on worker-1's host, not here
    assert job.hosts_empty(), job.host_pids()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# its name in the cache
RELAY_SHA = hashlib.sha256((REPO / "worker" / "host" / "relay.py").read_bytes()).hexdigest()


def two_tasks_on_host_0(ssh_job, lab, step_sleep_s: float) -> SshJob:
    """MWMS on 3 workers: two on host 0 (so behind its relay), one on host 1 (posting directly)."""
    env = {"STEPS": "60", "STEP_SLEEP_S": str(step_sleep_s), "NASTY": "-"}
    return ssh_job(
        MWMS,
        spec={
            "hosts": [lab.host_spec(0, tasks={"worker": 2}), lab.host_spec(1)],
            "job": {"script": "job/job.py", "env": env},
        },
    )


def test_tasks_sharing_a_host_report_through_its_relay(ssh_job, lab):
    job = two_tasks_on_host_0(ssh_job, lab, step_sleep_s=0.05)
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 5, 120), job.status()
        running = {i: " ".join(cmdline(pid) for pid in lab.pids(i)) for i in (0, 1)}
        assert RELAY_SHA in running[0], running  # host 0 (two tasks): a relay
        assert RELAY_SHA not in running[1], running  # host 1 (one task): none
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    status = job.status()
    # every task's progress arrived (through the relay for host 0's two), and the job agreed
    assert [t["last_step"] for t in status["tasks"]] == [60, 60, 60]
    assert all("FINAL 180.0" in (job.run_dir / "logs" / f"worker-{i}.log").read_text() for i in range(3))
    assert job.hosts_empty(), job.host_pids()  # the relay ended with the run


def test_a_relay_killed_mid_run_is_noticed_and_replaced(ssh_job, lab):
    job = two_tasks_on_host_0(ssh_job, lab, step_sleep_s=0.1)
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 5, 120), job.status()
        relays = [pid for pid in lab.pids(0) if RELAY_SHA in cmdline(pid)]
        assert len(relays) == 1, relays
        os.kill(relays[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "heartbeat relay ended" in out  # said when it happened
    status = job.status()
    # its tasks went silent: lost, the job restarted with a new relay, and finished
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1, status
    # the cause named is a task of the relay's host: silent, or stopped by its own guard (its
    # coordinator unreachable as long as the coordinator's timeout), whichever came first
    stopping = next(e for e in job.events() if e.get("new") == "STOPPING")
    assert stopping["reason"].startswith(("worker-0 ", "worker-1 ")), stopping
    assert "no heartbeat" in stopping["reason"] or "cut off from the coordinator" in stopping["reason"]
    assert [t["last_step"] for t in status["tasks"]] == [60, 60, 60]
    assert job.hosts_empty(), job.host_pids()


def test_unknown_host_key_is_refused_and_nothing_starts(ssh_job):
    job = ssh_job(PLAIN)
    known = Path(job.lab.known_hosts)
    keep = [
        line
        for line in known.read_text().splitlines()
        if not line.startswith(job.lab.hosts[1].known_name + " ")
    ]
    only_first = job.root / "known_hosts"
    only_first.write_text("\n".join(keep) + "\n")
    job = ssh_job(PLAIN, spec={"ssh": {"known_hosts": str(only_first)}})
    res = job.up(timeout_s=60)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "hosts[1]" in res.stderr and "host key unknown" in res.stderr and "ssh-keyscan" in res.stderr
    assert "hosts[0]" not in res.stderr  # the known host is fine, and not blamed
    assert job.hosts_empty(), job.host_pids()
    assert all(h.path(h.home).is_dir() for h in job.lab.hosts)  # each host's disk is in view
    assert not any(h.path(h.workdir / "runs" / job.run_id).exists() for h in job.lab.hosts)  # nothing copied


def test_accept_new_records_a_first_key_but_a_changed_key_is_refused(ssh_job, lab, tmp_path):
    fresh = tmp_path / "fresh_known_hosts"
    fresh.write_text("")
    job = ssh_job(PLAIN, spec={"ssh": {"known_hosts": str(fresh), "host_key_policy": "accept-new"}})
    check = [sys.executable, "-m", "orchestrator", "check", str(job.spec)]
    res = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    recorded = fresh.read_text().splitlines()
    assert set(recorded) == {f"{h.known_name} {h.host_key_pub}" for h in lab.hosts[:2]}
    # host 1's recorded key no longer matches what it presents (a reinstall, or an attack)
    h1 = lab.hosts[1].known_name + " "
    fresh.write_text(
        "\n".join(f"{h1}{lab.hosts[2].host_key_pub}" if x.startswith(h1) else x for x in recorded) + "\n"
    )
    res = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3
    assert "HOST KEY CHANGED" in res.stdout and "ssh-keygen -R" in res.stdout
    assert "hosts[1]" in res.stdout


def test_wrong_identity_gives_an_authentication_error(ssh_job, tmp_path):
    other = tmp_path / "not_authorized"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    job = ssh_job(PLAIN)
    data = yaml.safe_load(job.spec.read_text())
    data["hosts"][0]["identity_file"] = str(other)
    job.spec.write_text(yaml.safe_dump(data))
    res = job.up(timeout_s=60)
    assert res.returncode == 3
    assert "hosts[0]" in res.stderr and "authentication failed" in res.stderr and str(other) in res.stderr
    assert job.hosts_empty(), job.host_pids()


def test_unreachable_host_fails_clearly_and_leaves_nothing_on_the_others(ssh_job, lab):
    job = ssh_job(PLAIN, hosts=2, spec={"ssh": {"connect_timeout_s": 2}})
    data = yaml.safe_load(job.spec.read_text())
    dead = dict(data["hosts"][1])
    dead["address"] = (
        lab.hosts[0].address.rsplit(".", 1)[0] + ".99" if isinstance(lab, NetnsLab) else "127.0.0.99"
    )
    data["hosts"].append(dead)
    job.spec.write_text(yaml.safe_dump(data))
    started = time.monotonic()
    res = job.up(timeout_s=60)
    assert res.returncode == 3
    assert "hosts[2]" in res.stderr and ("no answer" in res.stderr or "cannot" in res.stderr), res.stderr
    assert time.monotonic() - started < 20
    assert job.hosts_empty(), job.host_pids()
    assert run_processes(job.run_id) == []


def test_hosts_that_cannot_reach_each_other_are_named_at_the_startup_deadline(ssh_job, lab):
    if not isinstance(lab, NetnsLab):
        pytest.skip("routes need the namespace lab")
    job = ssh_job(
        "import tensorflow as tf\ntf.distribute.MultiWorkerMirroredStrategy()\nprint('connected')\n",
        hosts=2,
        spec={"health": {"startup_timeout_s": 12}, "restart": {"max_restarts": 0}},
    )
    lab.blackhole(1, 0)
    try:
        res = job.up(timeout_s=120)
        check = subprocess.run(
            [sys.executable, "-m", "orchestrator", "check", str(job.spec)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        lab.blackhole(1, 0, on=False)
    assert res.returncode == 1, res.stdout[-3000:]
    target = f"{lab.hosts[0].address}:"
    reason = job.status()["reason"]
    assert "(its cluster never connected); peer probe: " in reason, reason
    assert f"hosts[1] {lab.hosts[1].address} cannot reach {target}" in reason and "(worker-0)" in reason
    assert f"cannot reach {target}" in res.stdout  # in the summary's first failure
    assert check.returncode == 3 and f"cannot reach {target}" in check.stdout  # check says the same
    assert job.hosts_empty(), job.host_pids()


def test_ctrl_c_mid_training_leaves_no_process_on_any_host(ssh_job):
    job = ssh_job(MWMS, spec={"job": {"script": "job/job.py", "env": {"NASTY": "", "STEPS": "100000"}}})
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 5, 90), job.status()
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, proc.stdout.read() if proc.stdout else ""
    grace = 5
    assert job.hosts_empty(), job.host_pids()
    assert time.monotonic() - sent < grace + 5
    assert job.status()["state"] == "INTERRUPTED"


def test_remote_tasks_exit_by_themselves_when_the_coordinator_is_killed(ssh_job):
    job = ssh_job(PLAIN)
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 5, 60), job.status()
        assert len(run_processes(job.run_id)) >= 2
        proc.kill()  # SIGKILL: no teardown from the coordinator at all
        killed = time.monotonic()
        proc.wait(timeout=10)
        assert wait_until(lambda: run_processes(job.run_id) == [], 15), run_processes(job.run_id)
        print(f"remote tasks gone {time.monotonic() - killed:.2f} s after the coordinator's SIGKILL")
        assert job.hosts_empty(), job.host_pids()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cut_off_host_is_detected_and_the_job_restarts(ssh_job, lab):
    if not isinstance(lab, NetnsLab):
        pytest.skip("cutting a host off needs network namespaces (root)")
    # heartbeats go straight to the coordinator here (its address on the lab's bridge); the host
    # cut off runs two tasks, so they report through its relay, which the cut strands too
    job = ssh_job(
        MWMS,
        spec={
            "hosts": [lab.host_spec(0), lab.host_spec(1, tasks={"worker": 2})],
            "job": {"script": "job/job.py", "env": {"NASTY": "", "STEPS": "60", "STEP_SLEEP_S": "0.1"}},
            "ssh": {"coordinator_address": lab.gateway},
        },
    )
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 5 and job.status().get("attempt") == 0, 90), job.status()
        lab.cut(1)
        cut_at = time.monotonic()
        assert wait_until(lambda: job.status().get("state") in ("STOPPING", "RESTARTING"), 15)
        detected = time.monotonic() - cut_at
        # The host stays cut off while the job is torn down: its task cannot confirm its exit.
        assert wait_until(lambda: job.status().get("state") == "RESTARTING", 30), job.status()
        lab.restore(1)
        out, _ = proc.communicate(timeout=150)
    finally:
        lab.restore(1)
        if proc.poll() is None:
            proc.kill()
    print(f"cut-off host detected after {detected:.2f} s")
    assert detected <= 3 + 1.5  # health.heartbeat_timeout_s, plus a poll or two
    assert proc.returncode == 0, out
    status = job.status()
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1
    events = job.events()
    stopping = next(e for e in events if e.get("new") == "STOPPING")
    assert stopping["reason"].startswith(("worker-1 ", "worker-2 ")), stopping  # a silent one, not their peer
    # the coordinator said it could not confirm the cut-off tasks' exit, then reconnected
    assert any("worker-1" in e.get("reason", "") and "not confirmed" in e["reason"] for e in events)
    assert [t["last_step"] for t in status["tasks"]] == [60, 60, 60]
    assert job.hosts_empty(), job.host_pids()  # the stranded relay and tasks ended by themselves


def test_down_from_another_terminal_stops_an_ssh_run_and_is_idempotent(ssh_job):
    job = ssh_job(PLAIN)
    res = subprocess.run(
        [*job.command(), "--detach"], capture_output=True, text=True, timeout=30, cwd=job.root
    )
    assert res.returncode == 0, res.stderr
    assert wait_until(lambda: job.steps() >= 3, 60), job.status()
    down = [sys.executable, "-m", "orchestrator", "down", str(job.run_dir)]
    first = subprocess.run(down, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    assert job.status()["state"] == "INTERRUPTED"
    assert wait_until(lambda: run_processes(job.run_id) == [], 10)
    assert job.hosts_empty(), job.host_pids()
    again = subprocess.run(down, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "INTERRUPTED" in again.stdout


def test_down_stops_a_task_left_behind_when_its_shim_and_the_coordinator_died(ssh_job):
    # Both safety nets gone at once: the shim (kill -9) and the coordinator (kill -9). The task's
    # own guard would stop it after heartbeat_timeout_s; `down` does it now, from the records.
    job = ssh_job(PLAIN, spec={"health": {"heartbeat_timeout_s": 30}})
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 3, 60), job.status()
        host = job.lab.hosts[0]
        pidfile = host.path(host.workdir / "runs" / job.run_id / "tasks" / "worker-0.json")
        record = json.loads(pidfile.read_text())
        os.kill(record["shim"], signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # worker-1's shim saw its channel close and stopped it; worker-0 runs on, orphaned
    assert wait_until(lambda: [p.pid for p in run_processes(job.run_id)] == [record["pid"]], 10)
    res = subprocess.run(
        [sys.executable, "-m", "orchestrator", "down", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"worker-0 stopped process group {record['pgid']}" in res.stdout
    assert wait_until(lambda: run_processes(job.run_id) == [], 5)


def test_files_travel_once_and_only_when_changed(lab, tmp_path):
    from orchestrator.launch.ssh.hosts import Host, close_all, connect, probe
    from orchestrator.launch.ssh.spec import SshSpec
    from orchestrator.launch.ssh.sync import job_files, upload

    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "job.py").write_text("print('v1')\n")
    (src / "data" / "big.bin").write_bytes(os.urandom(300_000))
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "job.cpython-311.pyc").write_bytes(b"skip me")
    h = lab.hosts[0]
    host = Host(0, h.address, h.ssh_port, None, lab.client_key, (sys.executable,))
    conn = connect(host, SshSpec(known_hosts=lab.known_hosts))
    workdir = str(tmp_path / "remote")

    def send() -> int:
        files = job_files(src)
        facts = probe(conn, host, "facts", workdir, stdin=json.dumps([f.sha256 for f in files]))
        return upload(conn, host, workdir, files, facts["missing"]).uploaded

    try:
        assert sorted(f.rel for f in job_files(src)) == ["code/data/big.bin", "code/job.py"]  # no cache files
        first, again = send(), send()
        (src / "job.py").write_text("print('v2')\n")
        changed = send()
    finally:
        close_all({0: conn})
    assert (first, again, changed) == (2, 0, 1)
    if lab.separate_disks:
        assert not Path(workdir).exists()  # host 0's disk, not this machine's
    cached = {p.name: p.read_bytes() for p in (h.path(workdir) / "cache").iterdir()}
    assert (src / "data" / "big.bin").read_bytes() in cached.values()
    assert b"print('v2')\n" in cached.values() and b"print('v1')\n" in cached.values()
    assert not any(name.startswith(".") for name in cached)  # no half-written upload left


def test_check_prints_one_table_and_fails_on_a_busy_port(ssh_job, lab):
    job = ssh_job(PLAIN, hosts=2)
    port = yaml.safe_load(job.spec.read_text())["hosts"][1].get("base_port", 23456)
    holder = subprocess.Popen(
        [
            *lab.hosts[1].exec_prefix(),
            sys.executable,
            "-c",
            # SO_REUSEADDR: earlier jobs' TF connections may linger in TIME_WAIT on this port
            "import socket, time\ns = socket.socket()\n"
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('0.0.0.0', {port})); s.listen(); time.sleep(60)",
        ],
    )
    try:
        check = [sys.executable, "-m", "orchestrator", "check", str(job.spec)]
        assert wait_until(lambda: subprocess.run(check, capture_output=True, timeout=60).returncode == 3, 10)
        res = subprocess.run(check, capture_output=True, text=True, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 3
    rows = [line for line in res.stdout.splitlines() if line.startswith("│ hosts[")]
    assert len(rows) == 2 and "busy" in rows[1] and "busy" not in rows[0]
    assert all("native" in row for row in rows), res.stdout  # py-spy read a process on each host
    assert (
        "TensorFlow" not in res.stdout.split("problem:")[0] or "2.21" in res.stdout
    )  # versions side by side
    assert (
        f"problem: hosts[1] {lab.hosts[1].address}" in res.stdout
        and f"port {port} (worker-1) is in use" in res.stdout
    )
    assert "peers" in res.stdout and "1 ok" in rows[0]  # host 0 reached the one port that listened
    res = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "all hosts ready" in res.stdout


DEADLOCK = """
    import os, threading
    import tensorflow as tf
    import worker
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(0.0)
    step = tf.function(lambda: strategy.run(lambda: v.assign_add(1.0)))
    lock = threading.Lock()
    def wait_for_lock():
        lock.acquire()
        lock.acquire()  # the planted deadlock
    for i in range(1, 1000):
        if os.environ["ORCHESTRATE_TASK"] == "worker-1" and i == 10:
            wait_for_lock()
        step()
        worker.report(step=i)
"""


def stacks_of(job, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "orchestrator", "stacks", str(job.run_dir), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=job.root)


def test_a_live_runs_stacks_are_read_on_its_hosts_and_the_run_goes_on(ssh_job):
    job = ssh_job(PLAIN)
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 3, 60), job.status()
        res = stacks_of(job, "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        docs = json.loads(res.stdout)
        assert sorted(docs) == ["worker-0", "worker-1"]
        for doc in docs.values():
            assert doc["method"] == "py-spy" and doc["host"] != "this machine", doc
            main = next(t for t in doc["threads"] if t["main"])
            assert any(f["file"].endswith("job.py") and f["function"] == "<module>" for f in main["frames"])
        steps = job.steps()
        assert wait_until(lambda: job.steps() > steps, 10)  # it went on
        assert job.status()["state"] == "RUNNING"
    finally:
        subprocess.run([sys.executable, "-m", "orchestrator", "down", str(job.run_dir)], timeout=60)
        proc.communicate(timeout=60)
    assert job.hosts_empty(), job.host_pids()


def test_a_hung_jobs_stacks_come_home_by_the_runtimes_own_dump_without_py_spy(ssh_job):
    job = ssh_job(
        DEADLOCK,
        spec={
            "job": {
                "script": "job/job.py",
                "env": {"ORCHESTRATE_PY_SPY": "none", "TF_CPP_MIN_LOG_LEVEL": "2"},
            },
            "health": {"stall_timeout_s": 4, "heartbeat_timeout_s": 60},
            "restart": {"max_restarts": 0},
        },
    )
    res = job.up(timeout_s=180)
    assert res.returncode == 1, res.stdout
    assert "first failure: worker-1" in res.stdout
    line = next(x for x in res.stdout.splitlines() if x.strip().startswith("worker-1:"))
    assert "in wait_for_lock (job.py:12)" in line and "the one the others wait for" in line, res.stdout
    doc = json.loads((job.run_dir / "stacks" / "attempt-0" / "worker-1.json").read_text())
    assert doc["method"] == "faulthandler" and doc["host"] != "this machine", doc
    assert job.hosts_empty(), job.host_pids()


def test_a_host_cut_off_during_the_capture_is_said_and_the_stop_goes_on(ssh_job, lab):
    if not isinstance(lab, NetnsLab):
        pytest.skip("cutting a host off needs network namespaces (root)")
    job = ssh_job(PLAIN, spec={"ssh": {"coordinator_address": lab.gateway}, "restart": {"max_restarts": 0}})
    proc = job.start()
    try:
        assert wait_until(lambda: job.steps() >= 3, 60), job.status()
        lab.cut(1)
        out, _ = proc.communicate(timeout=90)
    finally:
        lab.restore(1)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    doc = json.loads((job.run_dir / "stacks" / "attempt-0" / "worker-1.json").read_text())
    assert doc["state"] == "unknown" and "no answer from" in doc["notes"][0], doc
    assert doc["seconds"] < 5 + 2 + 1  # health.stacks_timeout_s, the way back, a little more
    other = json.loads((job.run_dir / "stacks" / "attempt-0" / "worker-0.json").read_text())
    assert other["method"] == "py-spy", other
    assert job.hosts_empty(15), job.host_pids()
