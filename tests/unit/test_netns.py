"""A local run's private network namespace (orchestrator/launch/local/netns.py), with real
namespaces made by unshare, real processes entered by nsenter and real sockets: what a task inside
can and cannot reach, the heartbeat socket, and every way one cannot be made said in the kernel's
words (a real refusal: user.max_user_namespaces=0 inside a user namespace of the test's own,
which limits nothing outside it)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from orchestrator.errors import LaunchError
from orchestrator.health.server import HeartbeatServer
from orchestrator.health.store import HealthStore
from orchestrator.launch.local import netns, outbound, section
from orchestrator.launch.local.backend import LocalBackend
from orchestrator.spec.load import parse_spec
from tests.unit.conftest import unit_credentials
from worker import wire
from worker.wire.dial import dial

REPO = Path(__file__).resolve().parents[2]

INSIDE = """
import json, os, socket, sys
port = int(sys.argv[1])
listeners = []
for family, anywhere in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((anywhere, port)); s.listen(); listeners.append(s)
socket.create_connection(("127.0.0.1", port), timeout=5).close()  # its own loopback works
with open(sys.argv[2], "w") as f:
    f.write("made inside")
print(json.dumps({"uid": os.getuid(), "ifaces": [n for _, n in socket.if_nameindex()],
                  "net": os.readlink("/proc/self/ns/net"),
                  "shm": os.access("/dev/shm", os.W_OK)}), flush=True)
sys.stdin.read()  # listening until the test is done
"""


def spec_of(tmp_path: Path, local: str = "") -> object:
    (tmp_path / "job.py").write_text("")
    text = "name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\njob: {script: job.py}\n" + local
    return parse_spec(text, file="s.yaml", base_dir=tmp_path)


def children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


@pytest.fixture
def namespace() -> Iterator[netns.Namespace]:
    made = netns.make()
    assert isinstance(made, netns.Namespace), made
    yield made
    made.close()


def run_in(
    made: netns.Namespace, code: str, *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Python `code` run to its end inside the namespace, as a task is started there."""
    return subprocess.run(
        made.enter([sys.executable, "-c", code, *args]),
        pass_fds=made.fds,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_task_inside_has_its_loopback_alone_and_its_ports_are_out_of_reach(tmp_path: Path) -> None:
    before = children()
    made = netns.make()
    assert isinstance(made, netns.Namespace), made
    port = 20000
    try:
        inside = subprocess.Popen(
            made.enter([sys.executable, "-c", INSIDE, str(port), str(tmp_path / "file")]),
            pass_fds=made.fds,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert inside.stdout is not None and inside.stdin is not None
        seen = json.loads(inside.stdout.readline())
        assert seen["ifaces"] == ["lo"] and seen["uid"] == os.getuid() and seen["shm"]
        assert seen["net"] != os.readlink("/proc/self/ns/net")
        assert inside.pid == psutil.Process(inside.pid).pid and psutil.Process(inside.pid).name() != "nsenter"
        # listening on every address of its namespace, on none of this machine's
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family) as s, pytest.raises(ConnectionRefusedError):
                s.settimeout(5)
                s.connect((address, port))
        assert (tmp_path / "file").read_text() == "made inside"  # the same disk, owned as before
        assert (tmp_path / "file").stat().st_uid == os.getuid()
        inside.stdin.close()
        assert inside.wait(timeout=10) == 0
    finally:
        made.close()
    assert children() <= before  # the holder is gone: the descriptors held it


def test_a_namespace_gone_with_its_descriptors_leaves_no_process(tmp_path: Path) -> None:
    before = children()
    made = netns.make()
    assert isinstance(made, netns.Namespace), made
    assert children() <= before  # made, and its holder already gone
    network = os.readlink(f"/proc/self/fd/{made.fds[1]}")
    assert network.startswith("net:[") and network != os.readlink("/proc/self/ns/net")
    made.close()
    made.close()  # twice is harmless
    assert made.fds == (-1, -1)


def test_the_kernels_refusal_is_said_in_its_words(tmp_path: Path) -> None:
    """user.max_user_namespaces=0 set in a user namespace of this test's own: the kernel refuses
    every namespace below it, as on a machine configured so (nothing outside it is limited)."""
    probe = "from orchestrator.launch.local import netns; print(netns.make())"
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{probe}'"
    out = subprocess.run(
        ["unshare", "--user", "--map-current-user", "sh", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    said = out.stdout.strip()
    assert said.startswith("unshare(CLONE_NEWUSER|CLONE_NEWNET) refused: No space left on device"), said
    assert said.endswith(": user.max_user_namespaces=0 on this machine"), said


def test_a_missing_tool_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nsenter there
    assert netns.make() == "nsenter (util-linux) not found on PATH"


def test_the_spec_decides_and_on_refuses_to_run_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    backend = LocalBackend(spec_of(tmp_path), run_dir, tmp_path)  # type: ignore[arg-type]
    try:
        where, port = backend.listen()
        assert where.startswith(wire.UNIX_SCHEME) and port == 0
        folder = Path(where.removeprefix(wire.UNIX_SCHEME)).parent
        assert folder.parent == run_dir.resolve() and stat.S_IMODE(folder.stat().st_mode) == 0o700
        exposure = backend.exposure()
        assert exposure is not None and exposure.isolated
        assert "own network namespace" in exposure.reachable_from
    finally:
        backend.close()
    assert not folder.exists()

    off = LocalBackend(spec_of(tmp_path, "local: {isolate_network: off}\n"), run_dir, tmp_path)  # type: ignore[arg-type]
    assert off.listen() == ("127.0.0.1", 0)
    exposure = off.exposure()
    assert exposure is not None and not exposure.isolated and "isolate_network is off" in exposure.why
    off.close()

    monkeypatch.setenv("PATH", str(tmp_path))  # no namespace can be made
    auto = LocalBackend(spec_of(tmp_path), run_dir, tmp_path)  # type: ignore[arg-type]
    assert auto.listen() == ("127.0.0.1", 0)
    exposure = auto.exposure()
    assert exposure is not None and not exposure.isolated
    assert exposure.reachable_from == section.OPEN and "not found on PATH" in exposure.why
    auto.close()
    on = LocalBackend(spec_of(tmp_path, "local: {isolate_network: on}\n"), run_dir, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="local.isolate_network is on, but no private network namespace"):
        on.listen()
    on.close()


def test_a_long_run_directory_gets_its_socket_in_a_private_folder_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(deep))  # a temp folder as long: the next one that fits
    tempfile.tempdir = None  # read TMPDIR again
    try:
        folder = netns.socket_folder(deep)
    finally:
        tempfile.tempdir = None
    try:
        assert len(os.fsencode(folder / "hb")) <= 107 and folder.parent == Path("/tmp")
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
        # elsewhere, a folder is another run's until its socket no longer answers
        live = HeartbeatServer(HealthStore(time.monotonic), unit_credentials(), host=f"unix:{folder / 'hb'}")
        dead = Path(tempfile.mkdtemp(prefix=".heartbeats-", dir="/tmp"))
        with socket.socket(socket.AF_UNIX) as gone:
            gone.bind(str(dead / "hb"))  # bound, never listening: as a killed coordinator's
        try:
            again = netns.socket_folder(deep)
            assert folder.exists() and not dead.exists()
            again.rmdir()
        finally:
            live.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(dead, ignore_errors=True)


def test_no_folder_for_the_socket_runs_on_the_hosts_network_under_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(run_dir: Path) -> Path:
        raise OSError("no folder whose path leaves room for a Unix socket (107 bytes)")

    monkeypatch.setattr(netns, "socket_folder", no_room)
    auto = netns.Network(spec_of(tmp_path))  # type: ignore[arg-type]
    assert auto.make(tmp_path) is None and auto.namespace is None
    assert (
        auto.exposure is not None
        and auto.exposure.warn
        and "no folder for the heartbeat socket" in auto.exposure.why
    )
    on = netns.Network(spec_of(tmp_path, "local: {isolate_network: on}\n"))  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="no folder for the heartbeat socket"):
        on.make(tmp_path)
    off = netns.Network(spec_of(tmp_path, "local: {isolate_network: off}\n"))  # type: ignore[arg-type]
    assert off.make(tmp_path) is None and off.exposure is not None and not off.exposure.warn


def test_heartbeats_over_the_unix_socket(tmp_path: Path) -> None:
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    store = HealthStore(time.monotonic)
    store.reset(0, ["worker-0"])
    credentials = unit_credentials()
    server = HeartbeatServer(store, credentials, host=f"unix:{folder / 'hb'}").start()
    try:
        assert server.url == f"unix:{folder / 'hb'}" and server.port == 0
        assert stat.S_IMODE((folder / "hb").stat().st_mode) == 0o600
        body = wire.Heartbeat(task="worker-0", attempt=0, seq=1, sent_at=1.0, pid=7, step=5).to_bytes()
        for token, wanted in ((None, 401), (credentials.task_token("worker-0", 0), 200)):
            sock = dial(server.url, 5.0)
            head = (
                f"POST {wire.HEARTBEAT_PATH} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n"
            )
            head += f"{wire.TOKEN_HEADER}: {token}\r\n" if token else ""
            sock.sendall((head + "\r\n").encode() + body)
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            assert resp.status == wanted
            sock.close()
        assert store.snapshot()["worker-0"].step == 5
    finally:
        server.close()
    assert not (folder / "hb").exists()


def test_plan_and_check_say_where_the_ports_are_reachable(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\nhosts: [{address: 127.0.0.1, tasks: {worker: 2}}]\njob: {script: job.py}\n")
    orchestrate = [sys.executable, "-m", "orchestrator"]
    plan = subprocess.run(
        [*orchestrate, "plan", str(spec)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert "network: TF ports reachable from this run's own network namespace only" in plan.stdout
    assert '"worker": ["127.0.0.1:20000", "127.0.0.1:20001"]' in plan.stdout
    check = subprocess.run(
        [*orchestrate, "check", str(spec)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert "network: TF ports reachable from this run's own network namespace only" in check.stdout
    if outbound.find():  # the stack a local run would use
        online = "; outgoing: pasta: TCP, UDP and ping to wherever this machine reaches; its loopback: none"
        assert online in check.stdout and online in plan.stdout and "warning" not in check.stdout
    ssh = tmp_path / "ssh.yaml"
    ssh.write_text(
        spec.read_text().replace("127.0.0.1", "10.255.255.1").replace("name: t", "name: t\nbackend: ssh")
    )
    plan = subprocess.run(
        [*orchestrate, "plan", str(ssh)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (
        "warning: TF ports reachable from every address of 10.255.255.1, by whoever can reach them"
        in plan.stdout
    )
    assert "private network" in plan.stdout
    off = tmp_path / "off.yaml"
    off.write_text(spec.read_text() + "local: {isolate_network: off}\n")
    plan = subprocess.run(
        [*orchestrate, "plan", str(off)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert (
        "warning: TF ports reachable from every address of this machine, by every user of it" in plan.stdout
    )


def test_the_socket_folder_of_a_coordinator_killed_before_goes(tmp_path: Path) -> None:
    """A resumed run's directory: the folder its killed coordinator left is removed (the run's
    lock is the new coordinator's), a folder not ours or not a folder is left alone."""
    old = tmp_path / ".heartbeats-old"
    old.mkdir(mode=0o700)
    (old / "hb").write_text("")
    (tmp_path / ".heartbeats-file").write_text("not a folder")
    folder = netns.socket_folder(tmp_path)
    assert not old.exists() and folder.is_dir() and (tmp_path / ".heartbeats-file").exists()


REACH_OUT = """
import json, socket, traceback, urllib.request
said = []
for reach in (lambda: urllib.request.urlopen("http://example.com/", timeout=5),
              lambda: socket.create_connection(("192.0.2.1", 80), timeout=5)):
    try:
        reach()
        said.append(None)
    except Exception as exc:
        said.append([type(exc).__name__, str(exc), traceback.format_exc()])
print(json.dumps(said))
"""


def test_a_task_that_reaches_outside_gets_a_hint_the_same_on_the_hosts_network_does_not(
    tmp_path: Path, namespace: netns.Namespace
) -> None:
    """What a download says in the namespace (run there for real), and the hint that follows."""
    from orchestrator.cli.hints import network_hint
    from orchestrator.launch.local.placement import local_placements
    from orchestrator.plan.launch_plan import make_plan
    from orchestrator.states import FailureKind
    from orchestrator.supervise.policy import Failure
    from worker.wire import TaskError

    said = json.loads(run_in(namespace, REACH_OUT, timeout=60).stdout)
    assert None not in said, said  # nothing outside is reached
    spec = spec_of(tmp_path)
    for url, hinted in (("unix:/run/x/hb", True), ("http://127.0.0.1:1", False)):
        places = local_placements(
            spec,
            {"worker-0": 1, "worker-1": 2},
            run_dir=tmp_path,
            spec_dir=tmp_path,
            coordinator_url=url,
            python="p",
        )
        plan = make_plan(spec, "t-1", places)  # type: ignore[arg-type]
        for name, message, trace in said:
            failure = Failure(
                ("worker-0",),
                FailureKind.EXCEPTION,
                0,
                f"raised {name}",
                error=TaskError(name, message, trace),
            )
            offline = {"outbound": "offline: install passt for outgoing network (pasta not found)"}
            hint = network_hint(failure, plan, offline)
            assert (hint is not None) == hinted, (message, hint)
            assert hint is None or ("isolate_network: off" in hint and "install passt (`apt" in hint)
            online = {"outbound": "pasta: TCP, UDP and ping to wherever this machine reaches; …"}
            assert network_hint(failure, plan, online) is None  # the network itself is down
        refused = TaskError(
            "URLError", "<urlopen error [Errno 111] Connection refused>", 'urlopen("http://127.0.0.1:5000/x")'
        )
        failure = Failure(("worker-0",), FailureKind.EXCEPTION, 0, "raised URLError", error=refused)
        hint = network_hint(failure, plan, {"outbound": "pasta: …"})
        assert (hint is not None) == hinted and (hint is None or "reach_host_loopback: [PORT]" in hint), hint
    print([m for _, m, _ in said])


@pytest.mark.parametrize(
    ("holder", "wanted"),
    [
        ("import time; print('something else', flush=True); time.sleep(60)", "something else"),  # then hangs
        ("import time; time.sleep(60)", "no answer from the namespace's holder in 1 s"),  # says nothing
        ("import sys; sys.exit(3)", "the holder exited 3"),
        (
            "print('unshare(CLONE_NEWUSER|CLONE_NEWNET) refused: Operation not permitted')",
            "unshare(CLONE_NEWUSER",
        ),
    ],
)
def test_a_holder_that_cannot_make_it_is_said_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch, holder: str, wanted: str
) -> None:
    monkeypatch.setattr(netns, "_HOLDER", holder)
    before = children()
    t0 = time.monotonic()
    said = netns.make(timeout_s=1.0)
    assert isinstance(said, str) and said.startswith(wanted), said
    assert time.monotonic() - t0 < 5
    assert children() <= before  # nothing of it left


SHARED = """
import os, socket, sys
from multiprocessing import shared_memory
name, abstract = sys.argv[1], sys.argv[2]
if sys.argv[3] == "make":
    block = shared_memory.SharedMemory(name=name, create=True, size=16)  # /dev/shm, as NCCL's and CUDA IPC's
    block.buf[:5] = b"inner"
    server = socket.socket(socket.AF_UNIX)
    server.bind("\\0" + abstract)  # an abstract socket (NCCL's proxy): per network namespace
    server.listen()
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.sendall(b"peer")
    sys.stdin.read()
    block.close(); block.unlink()
else:
    client = socket.socket(socket.AF_UNIX)
    client.connect("\\0" + abstract)
    devices = open("/dev/null", "rb").read(), len(open("/dev/zero", "rb").read(8))
    print(client.recv(4).decode(), *devices, flush=True)
"""


def test_tasks_of_a_run_share_shared_memory_with_the_host_and_abstract_sockets_among_themselves(
    namespace: netns.Namespace,
) -> None:
    """What NCCL and CUDA IPC between a machine's tasks use: /dev/shm (not network-namespaced: the
    host sees it too), abstract Unix sockets (network-namespaced: every task of the run shares
    them, the host does not), device nodes (opened as before)."""
    from multiprocessing import shared_memory

    name, abstract = f"orchestrate-{os.getpid()}", f"orchestrate-test-{os.getpid()}"
    maker = subprocess.Popen(
        namespace.enter([sys.executable, "-c", SHARED, name, abstract, "make"]),
        pass_fds=namespace.fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert maker.stdout is not None and maker.stdout.readline().strip() == "ready"
        block = shared_memory.SharedMemory(name=name)
        assert bytes(block.buf[:5]) == b"inner"
        block.close()
        with socket.socket(socket.AF_UNIX) as outside, pytest.raises(ConnectionRefusedError):
            outside.connect("\0" + abstract)  # the host's namespace has no such socket
        peer = run_in(namespace, SHARED, name, abstract, "use")
        assert peer.stdout.strip() == "peer b'' 8", peer.stderr
    finally:
        assert maker.stdin is not None
        maker.stdin.close()
        maker.wait(timeout=10)
    nvidia = Path("/dev/nvidiactl")
    if nvidia.exists():  # a GPU machine: its device nodes open inside as outside
        opened = run_in(namespace, f"open({str(nvidia)!r}, 'rb').close()")
        assert opened.returncode == 0, opened.stderr
