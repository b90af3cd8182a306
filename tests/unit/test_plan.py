"""Plan layer: make_plan, a pure function of the spec and the backend's placements
(plan/placement.py places the tasks; test_placement.py tests that)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch.local.placement import local_placements
from orchestrator.launch.ssh.placement import ssh_placements, ssh_preview
from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.plan.placement import Placement
from orchestrator.spec import ClusterSpec, Role, parse_spec
from orchestrator.spec.roles import task_slots

RUN_ID = "demo-20250101-000000"
RUN_DIR = Path("/runs/demo-20250101-000000")  # never created: planning touches no file
SPEC_DIR = Path("/specs")
COORDINATOR_URL = "http://127.0.0.1:9999"
PYTHON = "/usr/bin/python3.11"


def spec_of(
    tmp_path: Path,
    hosts: str,
    *,
    strategy: str = "multi_worker_mirrored",
    backend: str = "local",
    job: str = "script: train.py\n  args: [--lr, '0.1']\n  env: {SHARED: job, ONLY_JOB: j}",
    extra: str = "",
) -> ClusterSpec:
    (tmp_path / "train.py").write_text("")
    text = (
        f"name: demo\nstrategy: {strategy}\nbackend: {backend}\nhosts:\n"
        + textwrap.indent(textwrap.dedent(hosts).strip("\n"), "  ")
        + f"\njob:\n  {job}\n{extra}"
    )
    return parse_spec(text, file="spec.yaml", base_dir=tmp_path)


def ports_for(spec: ClusterSpec, base: int = 20000) -> dict[str, int]:
    return {s.name: base + i for i, s in enumerate(task_slots(spec))}


def local_places(spec: ClusterSpec, ports: Mapping[str, int] | None = None) -> dict[str, Placement]:
    return local_placements(
        spec,
        ports if ports is not None else ports_for(spec),
        run_dir=RUN_DIR,
        spec_dir=SPEC_DIR,
        coordinator_url=COORDINATOR_URL,
        python=PYTHON,
    )


def places_of(spec: ClusterSpec) -> dict[str, Placement]:
    """The spec's backend's placements: local ports 20000 + i in task order; ssh hosts' folders as
    written (before connecting) and their ports from base_port."""
    return local_places(spec) if spec.backend == "local" else ssh_preview(spec, RUN_ID)


def plan_of(spec: ClusterSpec) -> LaunchPlan:
    return make_plan(spec, RUN_ID, places_of(spec))


def tf_config(plan: LaunchPlan, name: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(plan.task(name).env["TF_CONFIG"])
    return config


# ---------------------------------------------------------------- TF_CONFIG per strategy


# (id, strategy, hosts yaml, expected cluster, expected [(task name, type, index, in_cluster)])
TF_CONFIG_CASES = [
    (
        "mwms-2-workers",
        "multi_worker_mirrored",
        "- address: 127.0.0.1\n  tasks: {worker: 2}",
        {"worker": ["127.0.0.1:20000", "127.0.0.1:20001"]},
        [("worker-0", "worker", 0, True), ("worker-1", "worker", 1, True)],
    ),
    (
        "mwms-chief-2-workers",
        "multi_worker_mirrored",
        "- address: 127.0.0.1\n  tasks: {worker: 2, chief: 1}",
        {"chief": ["127.0.0.1:20000"], "worker": ["127.0.0.1:20001", "127.0.0.1:20002"]},
        [("chief-0", "chief", 0, True), ("worker-0", "worker", 0, True), ("worker-1", "worker", 1, True)],
    ),
    (
        "ps-chief-2-workers-1-ps",
        "parameter_server",
        "- address: 127.0.0.1\n  tasks: {ps: 1, worker: 2, chief: 1}",
        {
            "chief": ["127.0.0.1:20000"],
            "worker": ["127.0.0.1:20001", "127.0.0.1:20002"],
            "ps": ["127.0.0.1:20003"],
        },
        [
            ("chief-0", "chief", 0, True),
            ("worker-0", "worker", 0, True),
            ("worker-1", "worker", 1, True),
            ("ps-0", "ps", 0, True),
        ],
    ),
    (
        "ps-with-evaluator",
        "parameter_server",
        "- address: 127.0.0.1\n  tasks: {evaluator: 1, ps: 1, worker: 2, chief: 1}",
        {
            "chief": ["127.0.0.1:20000"],
            "worker": ["127.0.0.1:20001", "127.0.0.1:20002"],
            "ps": ["127.0.0.1:20003"],
        },
        [
            ("chief-0", "chief", 0, True),
            ("worker-0", "worker", 0, True),
            ("worker-1", "worker", 1, True),
            ("ps-0", "ps", 0, True),
            ("evaluator-0", "evaluator", 0, False),
        ],
    ),
    (
        "mirrored-single",
        "mirrored",
        "- address: 127.0.0.1\n  tasks: {worker: 1}",
        {"worker": ["127.0.0.1:20000"]},
        [("worker-0", "worker", 0, True)],
    ),
]


@pytest.mark.parametrize(
    ("strategy", "hosts", "cluster", "tasks"),
    [c[1:] for c in TF_CONFIG_CASES],
    ids=[c[0] for c in TF_CONFIG_CASES],
)
def test_tf_config(
    tmp_path: Path, strategy: str, hosts: str, cluster: dict[str, list[str]], tasks: list[Any]
) -> None:
    plan = plan_of(spec_of(tmp_path, hosts, strategy=strategy))
    assert dict(plan.cluster) == cluster
    assert [(t.name, t.role.value, t.index, t.in_cluster) for t in plan.tasks] == tasks
    for t in plan.tasks:
        config = tf_config(plan, t.name)
        assert config == {"cluster": cluster, "task": {"type": t.role.value, "index": t.index}}
        assert t.address == f"127.0.0.1:{t.port}"
        in_cluster_lists = any(t.address in addrs for addrs in config["cluster"].values())
        assert in_cluster_lists is t.in_cluster
    assert "evaluator" not in plan.cluster


def test_evaluator_is_outside_the_cluster(tmp_path: Path) -> None:
    plan = plan_of(
        spec_of(
            tmp_path,
            "- address: 127.0.0.1\n  tasks: {chief: 1, worker: 2, ps: 1, evaluator: 1}",
            strategy="parameter_server",
        )
    )
    ev = plan.task("evaluator-0")
    assert ev.role is Role.EVALUATOR and ev.index == 0 and not ev.in_cluster
    config = tf_config(plan, "evaluator-0")
    assert config["task"] == {"type": "evaluator", "index": 0}
    assert set(config["cluster"]) == {"chief", "worker", "ps"}
    # it still has a port and an address of its own, not shared with any cluster member
    all_members = [a for addrs in plan.cluster.values() for a in addrs]
    assert ev.address not in all_members and len(set(all_members)) == len(all_members)


def test_task_numbering_across_hosts_in_host_order(tmp_path: Path) -> None:
    hosts = """
        - address: 10.0.0.1
          tasks: {worker: 2}
        - address: 10.0.0.2
          tasks: {worker: 1, chief: 1}
        - address: 10.0.0.3
          tasks: {worker: 1}
    """
    spec = spec_of(tmp_path, hosts, backend="ssh")
    slots = task_slots(spec)
    assert [(s.name, s.host_index) for s in slots] == [
        ("chief-0", 1),
        ("worker-0", 0),
        ("worker-1", 0),
        ("worker-2", 1),
        ("worker-3", 2),
    ]
    plan = plan_of(spec)  # each host's tasks on consecutive ports from the default base port
    assert dict(plan.cluster) == {
        "chief": ["10.0.0.2:23456"],
        "worker": ["10.0.0.1:23456", "10.0.0.1:23457", "10.0.0.2:23457", "10.0.0.3:23456"],
    }
    assert [(t.name, t.host) for t in plan.tasks] == [
        ("chief-0", "10.0.0.2"),
        ("worker-0", "10.0.0.1"),
        ("worker-1", "10.0.0.1"),
        ("worker-2", "10.0.0.2"),
        ("worker-3", "10.0.0.3"),
    ]


TWO_HOSTS = """
    - address: 10.0.0.1
      tasks: {worker: 2}
      python: /opt/py/bin/python
      workdir: /srv/job
    - address: node-b.lab
      tasks: {worker: 1}
"""


def test_local_backend_uses_loopback_for_every_address(tmp_path: Path) -> None:
    plan = plan_of(spec_of(tmp_path, TWO_HOSTS, backend="local"))
    assert {t.host for t in plan.tasks} == {"127.0.0.1"}
    assert all(a.startswith("127.0.0.1:") for addrs in plan.cluster.values() for a in addrs)
    assert all(t.address == f"127.0.0.1:{t.port}" for t in plan.tasks)
    # local tasks run with the coordinator's interpreter, in the spec's folder
    assert all(t.argv[0] == PYTHON and t.cwd == str(SPEC_DIR) for t in plan.tasks)
    # the local tasks import the worker runtime from where the coordinator does: nothing is added
    assert all("PYTHONPATH" not in t.env for t in plan.tasks)


def test_ssh_backend_uses_host_addresses(tmp_path: Path) -> None:
    plan = plan_of(spec_of(tmp_path, TWO_HOSTS, backend="ssh"))
    assert [(t.name, t.host, t.address) for t in plan.tasks] == [
        ("worker-0", "10.0.0.1", "10.0.0.1:23456"),
        ("worker-1", "10.0.0.1", "10.0.0.1:23457"),
        ("worker-2", "node-b.lab", "node-b.lab:23456"),
    ]
    assert plan.cluster["worker"] == ["10.0.0.1:23456", "10.0.0.1:23457", "node-b.lab:23456"]
    # remote tasks use the host's interpreter; they run in the run's folder under the host's workdir
    assert [(t.argv[0], t.cwd) for t in plan.tasks] == [
        ("/opt/py/bin/python", "/srv/job/runs/demo-20250101-000000/code"),
        ("/opt/py/bin/python", "/srv/job/runs/demo-20250101-000000/code"),
        ("python3", "~/.orchestrate/runs/demo-20250101-000000/code"),
    ]
    assert [t.host_index for t in plan.tasks] == [0, 0, 1]
    # the worker runtime copied to each host's run folder is on the path
    assert [t.env["PYTHONPATH"] for t in plan.tasks] == [
        "/srv/job/runs/demo-20250101-000000/lib",
        "/srv/job/runs/demo-20250101-000000/lib",
        "~/.orchestrate/runs/demo-20250101-000000/lib",
    ]


def test_ssh_backend_paths_point_into_the_copied_files(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("")
    spec = spec_of(
        tmp_path,
        TWO_HOSTS,
        backend="ssh",
        job="script: src/train.py\n  files: .\n  env: {PYTHONPATH: /opt/mine}",
    )
    # the absolute folders and the tunnels' URLs, as the ssh backend learns them by connecting
    places = ssh_placements(
        spec,
        RUN_ID,
        workdirs={0: "/home/ann/.orchestrate", 1: "/scratch/o"},
        urls={0: "http://127.0.0.1:41000", 1: "http://127.0.0.1:42000"},
    )
    plan = make_plan(spec, RUN_ID, places)
    w0, w2 = plan.task("worker-0"), plan.task("worker-2")
    run0 = "/home/ann/.orchestrate/runs/demo-20250101-000000"
    # job.files is the copied root: the script keeps its path inside it
    assert w0.argv[:6] == (
        "/opt/py/bin/python",
        "-m",
        "worker",
        "run",
        "--script",
        f"{run0}/code/src/train.py",
    )
    assert w0.env["ORCHESTRATE_RUN_DIR"] == run0
    assert w0.env["ORCHESTRATE_COORDINATOR"] == "http://127.0.0.1:41000"
    assert w2.env["ORCHESTRATE_COORDINATOR"] == "http://127.0.0.1:42000"
    # the copied worker runtime comes first on the path, the user's entries after it
    assert w0.env["PYTHONPATH"] == f"{run0}/lib:/opt/mine"
    assert w2.env["PYTHONPATH"] == "/scratch/o/runs/demo-20250101-000000/lib:/opt/mine"


def test_ssh_loop_checkpoints_default_to_the_hosts_run_folder(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("")
    spec = spec_of(
        tmp_path,
        "- address: 10.0.0.1\n  tasks: {worker: 1}\n  python: python3 -X dev",
        backend="ssh",
        job="loop: loop.py",
        extra="train: {steps: 10}\n",
    )
    argv = plan_of(spec).task("worker-0").argv
    assert argv[:3] == ("python3", "-X", "dev")  # a multi-word interpreter stays several words
    folder = "~/.orchestrate/runs/demo-20250101-000000"
    assert argv[argv.index("--module") + 1] == f"{folder}/code/loop.py"
    assert argv[argv.index("--checkpoint-dir") + 1] == f"{folder}/checkpoints"


def test_every_task_gets_a_checkpoint_folder_on_its_own_host(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, TWO_HOSTS, backend="ssh")
    places = ssh_placements(
        spec, RUN_ID, workdirs={0: "/home/ann/.o", 1: "/scratch/o"}, urls={0: "http://x:1", 1: "http://x:2"}
    )
    plan = make_plan(spec, RUN_ID, places)
    dirs = {t.name: t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in plan.tasks}
    assert dirs["worker-0"] == "/home/ann/.o/runs/demo-20250101-000000/checkpoints"
    assert dirs["worker-2"] == "/scratch/o/runs/demo-20250101-000000/checkpoints"
    # not declared shared: worker-0's is the truth, copied to every other training task's host
    assert plan.state is not None and not plan.state.shared
    assert (plan.state.owner, plan.state.readers) == ("worker-0", ("worker-0", "worker-1", "worker-2"))
    local = plan_of(spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}"))
    assert {t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in local.tasks} == {f"{RUN_DIR}/checkpoints"}


def test_a_declared_shared_checkpoint_folder_is_every_tasks_and_nothing_is_copied(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path, TWO_HOSTS, backend="ssh", job="script: train.py\n  checkpoint_dir: /nfs/ann/ckpt"
    )
    plan = plan_of(spec)
    assert {t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in plan.tasks} == {"/nfs/ann/ckpt"}
    assert plan.state is not None and plan.state.shared


def test_state_owner_and_readers_per_strategy(tmp_path: Path) -> None:
    ps = loop_plan(tmp_path, "parameter_server", "{chief: 1, worker: 2, ps: 1, evaluator: 1}")
    assert ps.state is not None
    # ps and workers hold no state of their own: only the chief restores, the evaluator reads
    assert (ps.state.owner, ps.state.readers) == ("chief-0", ("chief-0", "evaluator-0"))
    mwms = loop_plan(tmp_path, "multi_worker_mirrored", "{chief: 1, worker: 1, evaluator: 1}")
    assert mwms.state is not None
    assert (mwms.state.owner, mwms.state.readers) == ("chief-0", ("chief-0", "worker-0", "evaluator-0"))


def test_ports_come_from_the_placements(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}")
    plan = make_plan(spec, RUN_ID, local_places(spec, {"worker-0": 41001, "worker-1": 40007}))
    assert [(t.name, t.port) for t in plan.tasks] == [("worker-0", 41001), ("worker-1", 40007)]
    assert plan.cluster["worker"] == ["127.0.0.1:41001", "127.0.0.1:40007"]


def test_missing_placement_is_an_error(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}")
    places = local_places(spec)
    del places["worker-1"]
    with pytest.raises(ValueError, match="worker-1"):
        make_plan(spec, RUN_ID, places)


# While set, the I/O that the thread named here attempts (as audit events, and stat calls).
_WATCHED: dict[int, list[str]] = {}
_IO_EVENTS = ("open", "os.", "socket.", "subprocess.", "shutil.", "urllib.", "http.")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    seen = _WATCHED.get(threading.get_ident())
    if seen is not None and event.startswith(_IO_EVENTS):
        seen.append(f"{event}{args!r}"[:200])


sys.addaudithook(_audit)  # cannot be removed; it costs a dict look-up when nothing is watched


@contextmanager
def no_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What this thread tried to touch meanwhile: files, folders, sockets, processes."""
    seen: list[str] = []

    def watching(real: Any, name: str) -> Any:
        def call(path: Any, *a: Any, **kw: Any) -> Any:
            if threading.get_ident() in _WATCHED:
                seen.append(f"{name}({path!r})")
            return real(path, *a, **kw)

        return call

    with monkeypatch.context() as m:
        m.setattr(os, "stat", watching(os.stat, "os.stat"))  # not audited: Path.exists, os.path.isdir
        m.setattr(os, "lstat", watching(os.lstat, "os.lstat"))
        _WATCHED[threading.get_ident()] = seen
        try:
            yield seen
        finally:
            del _WATCHED[threading.get_ident()]


def test_make_plan_is_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "loop.py").write_text("")
    local = spec_of(
        tmp_path,
        "- address: 127.0.0.1\n  tasks: {chief: 1, worker: 2, evaluator: 1}\n  gpus: [0, 1]",
        job="loop: loop.py",
        extra="train: {steps: 10}\n",
    )
    remote = spec_of(tmp_path, TWO_HOSTS, backend="ssh", job="script: train.py\n  files: .")
    before = (local.model_dump(), remote.model_dump())
    # placements whose folders exist nowhere, on this machine or any other
    local_in = local_places(local)
    remote_in = ssh_placements(
        remote, RUN_ID, {0: "/nowhere/a", 1: "/nowhere/b"}, {0: "http://10.9.9.9:1", 1: "http://10.9.9.9:2"}
    )
    with no_io(monkeypatch) as touched:
        plans = [make_plan(spec, RUN_ID, places) for spec, places in [(local, local_in), (remote, remote_in)]]
        again = [make_plan(spec, RUN_ID, places) for spec, places in [(local, local_in), (remote, remote_in)]]
        as_json = [p.to_json() for p in plans]
    assert touched == []
    assert plans == again and as_json == [p.to_json() for p in again]
    assert (local.model_dump(), remote.model_dump()) == before  # neither input is changed
    assert local_in == local_places(local)
    assert not RUN_DIR.exists() and not Path("/nowhere").exists()


def test_the_no_io_watch_sees_file_access(monkeypatch: pytest.MonkeyPatch) -> None:
    # the purity test above would pass vacuously if its watch saw nothing
    with no_io(monkeypatch) as touched:
        Path("/nowhere/at/all").exists()
        with open(os.devnull, "rb"):
            pass
    assert any(t.startswith("os.stat") for t in touched) and any(t.startswith("open") for t in touched)


# ---------------------------------------------------------------- environment


def test_env_of_every_task(tmp_path: Path) -> None:
    hosts = """
        - address: 127.0.0.1
          tasks: {chief: 1, worker: 1}
          env: {SHARED: host, ONLY_HOST: h}
        - address: 127.0.0.2
          tasks: {worker: 1}
    """
    plan = plan_of(spec_of(tmp_path, hosts))
    for t in plan.tasks:
        env = t.env
        assert env["ORCHESTRATE_RUN_ID"] == RUN_ID
        assert env["ORCHESTRATE_TASK"] == t.name
        assert env["ORCHESTRATE_COORDINATOR"] == COORDINATOR_URL
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["ONLY_JOB"] == "j"
        assert (
            "ORCHESTRATE_TOKEN" not in env
        )  # the secret is never in the plan (plan.json is written to disk)
        assert "ORCHESTRATE_ATTEMPT" not in env
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    # host env wins over job env, and only on that host's tasks
    assert [(t.name, t.env["SHARED"], t.env.get("ONLY_HOST")) for t in plan.tasks] == [
        ("chief-0", "host", "h"),
        ("worker-0", "host", "h"),
        ("worker-1", "job", None),
    ]


def test_a_placements_env_reaches_its_task_under_the_orchestrators_own(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}\n  env: {SHARED: host}")
    places = local_places(spec)
    added = {"SHARED": "backend", "EXTRA": "x", "ORCHESTRATE_TASK": "not-mine"}
    places["worker-1"] = dataclasses.replace(places["worker-1"], env=added)
    plan = make_plan(spec, RUN_ID, places)
    w0, w1 = plan.task("worker-0").env, plan.task("worker-1").env
    # the backend's env wins over the spec's; the orchestrator's own variables win over both
    assert (w1["SHARED"], w1["EXTRA"], w1["ORCHESTRATE_TASK"]) == ("backend", "x", "worker-1")
    assert w0["SHARED"] == "host" and "EXTRA" not in w0


def test_launch_env_adds_attempt_and_token(tmp_path: Path) -> None:
    plan = plan_of(spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}"))
    task = plan.task("worker-1")
    before = dict(task.env)
    env = task.launch_env(attempt=2, token="s3cret")
    assert env["ORCHESTRATE_ATTEMPT"] == "2"
    assert env["ORCHESTRATE_TOKEN"] == "s3cret"
    assert {k: v for k, v in env.items() if k not in ("ORCHESTRATE_ATTEMPT", "ORCHESTRATE_TOKEN")} == before
    assert dict(task.env) == before  # the plan itself is not changed
    assert task.launch_env(attempt=0, token="t")["ORCHESTRATE_ATTEMPT"] == "0"


# (id, gpus, tasks on that host, expected CUDA_VISIBLE_DEVICES per task in order)
GPU_CASES = [
    ("2-gpus-2-tasks", [0, 1], "{worker: 2}", ["0", "1"]),
    ("4-gpus-2-tasks", [0, 1, 2, 3], "{worker: 2}", ["0,1", "2,3"]),
    ("ids-kept", [4, 6], "{worker: 2}", ["4", "6"]),
    ("4-gpus-chief-and-worker", [0, 1, 2, 3], "{chief: 1, worker: 1}", ["0,1", "2,3"]),
    ("1-gpu-1-task", [3], "{worker: 1}", ["3"]),
    ("1-gpu-shared-by-2-tasks", [0], "{worker: 2}", ["0", "0"]),
]


@pytest.mark.parametrize(
    ("gpus", "tasks", "expected"), [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES]
)
def test_cuda_visible_devices_split(tmp_path: Path, gpus: list[int], tasks: str, expected: list[str]) -> None:
    plan = plan_of(spec_of(tmp_path, f"- address: 127.0.0.1\n  tasks: {tasks}\n  gpus: {gpus}"))
    assert [t.env["CUDA_VISIBLE_DEVICES"] for t in plan.tasks] == expected


def test_cuda_visible_devices_only_on_hosts_with_gpus(tmp_path: Path) -> None:
    hosts = """
        - address: 10.0.0.1
          tasks: {worker: 2}
          gpus: [0, 1]
        - address: 10.0.0.2
          tasks: {worker: 1}
    """
    plan = plan_of(spec_of(tmp_path, hosts, backend="ssh"))
    assert [t.env.get("CUDA_VISIBLE_DEVICES") for t in plan.tasks] == ["0", "1", None]


# ---------------------------------------------------------------- command line of a task


def test_argv_script_mode(tmp_path: Path) -> None:
    plan = plan_of(spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}"))
    for t in plan.tasks:
        assert t.argv == (
            PYTHON,
            "-m",
            "worker",
            "run",
            "--script",
            str(tmp_path / "train.py"),
            "--",
            "--lr",
            "0.1",
        )


def test_argv_loop_mode(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        "- address: 127.0.0.1\n  tasks: {worker: 2}",
        job="loop: train.py",
        extra="train:\n  steps: 30\n  global_batch_size: 16\n"
        "  checkpoint_every: 10\n  checkpoint_dir: ckpt\n",
    )
    argv = plan_of(spec).task("worker-0").argv
    assert argv == (
        PYTHON,
        "-m",
        "worker",
        "loop",
        "--module",
        str(tmp_path / "train.py"),
        "--strategy",
        "multi_worker_mirrored",
        "--steps",
        "30",
        "--global-batch-size",
        "16",
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--",
    )


def test_argv_loop_mode_epochs(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        "- address: 127.0.0.1\n  tasks: {worker: 1}",
        job="loop: train.py",
        extra="train:\n  epochs: 3\n",
    )
    argv = plan_of(spec).task("worker-0").argv
    assert argv[argv.index("--epochs") + 1] == "3" and "--steps" not in argv
    # without train.checkpoint_dir, checkpoints go into the run directory
    assert argv[argv.index("--checkpoint-dir") + 1] == str(RUN_DIR / "checkpoints")


# ---------------------------------------------------------------- JSON form (plan.json)


def test_to_json_round_trips(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        "- address: 127.0.0.1\n  tasks: {chief: 1, worker: 2, ps: 1, evaluator: 1}\n  gpus: [0]",
        strategy="parameter_server",
    )
    plan = plan_of(spec)
    out = plan.to_json()
    again = json.loads(json.dumps(out))
    assert again == out
    assert again["name"] == "demo" and again["run_id"] == RUN_ID
    assert again["strategy"] == "parameter_server" and again["backend"] == "local"
    assert again["cluster"] == {k: list(v) for k, v in plan.cluster.items()}
    assert [t["name"] for t in again["tasks"]] == [t.name for t in plan.tasks]
    for t, task in zip(again["tasks"], plan.tasks, strict=True):
        assert t["role"] == task.role.value
        assert t["argv"] == list(task.argv)
        assert t["env"] == dict(task.env)
        assert t["tf_config"] == json.loads(task.env["TF_CONFIG"])
        assert t["in_cluster"] is task.in_cluster and t["port"] == task.port
    assert again["tasks"][-1]["tf_config"]["task"] == {"type": "evaluator", "index": 0}


# ---------------------------------------------------------------- commands and policy per strategy

LOOP_JOB = "loop: loop.py"
LOOP_TRAIN = "train: {steps: 100, checkpoint_every: 20}\n"


def loop_plan(tmp_path: Path, strategy: str, tasks: str, extra: str = "") -> LaunchPlan:
    (tmp_path / "loop.py").write_text("")
    spec = spec_of(
        tmp_path,
        f"- address: 127.0.0.1\n  tasks: {tasks}",
        strategy=strategy,
        job=LOOP_JOB,
        extra=LOOP_TRAIN + extra,
    )
    return plan_of(spec)


def verb(plan: LaunchPlan, name: str) -> str:
    argv = plan.task(name).argv
    return argv[argv.index("worker") + 1]


def test_parameter_server_roles_run_loop_server_and_evaluator(tmp_path: Path) -> None:
    plan = loop_plan(tmp_path, "parameter_server", "{chief: 1, worker: 2, ps: 1, evaluator: 1}")
    assert {t.name: verb(plan, t.name) for t in plan.tasks} == {
        "chief-0": "loop",
        "worker-0": "server",
        "worker-1": "server",
        "ps-0": "server",
        "evaluator-0": "evaluate",
    }
    chief = plan.task("chief-0").argv
    assert chief[chief.index("--strategy") + 1] == "parameter_server"
    ev = plan.task("evaluator-0").argv
    assert ev[ev.index("--checkpoint-dir") + 1] == chief[chief.index("--checkpoint-dir") + 1]
    # a call to a lost task fails at once instead of waiting (every task)
    assert {t.env.get("GRPC_FAIL_FAST") for t in plan.tasks} == {"use_caller"}


def test_policy_defaults_per_strategy(tmp_path: Path) -> None:
    ps = loop_plan(tmp_path, "parameter_server", "{chief: 1, worker: 2, ps: 1, evaluator: 1}").to_json()[
        "policy"
    ]
    assert ps == {
        "chief": {"decides": True, "on_failure": "restart_job", "at_end": "wait"},
        "worker": {"decides": False, "on_failure": "restart_task", "at_end": "stop"},
        "ps": {"decides": False, "on_failure": "restart_job", "at_end": "stop"},
        "evaluator": {"decides": False, "on_failure": "ignore", "at_end": "wait"},
    }
    mwms = loop_plan(tmp_path, "multi_worker_mirrored", "{worker: 2, evaluator: 1}").to_json()["policy"]
    assert mwms == {
        "worker": {"decides": True, "on_failure": "restart_job", "at_end": "wait"},
        "evaluator": {"decides": False, "on_failure": "ignore", "at_end": "wait"},
    }
    assert (
        "GRPC_FAIL_FAST"
        not in loop_plan(tmp_path, "multi_worker_mirrored", "{worker: 2}").task("worker-0").env
    )


def test_policy_from_the_spec_overrides_the_default(tmp_path: Path) -> None:
    plan = loop_plan(
        tmp_path,
        "multi_worker_mirrored",
        "{worker: 2, evaluator: 1}",
        "policy:\n  evaluator: {on_failure: restart_task, at_end: stop}\n",
    )
    assert plan.to_json()["policy"]["evaluator"] == {
        "decides": False,
        "on_failure": "restart_task",
        "at_end": "stop",
    }


def test_mirrored_cpu_replicas_reach_the_loop(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("")
    spec = spec_of(
        tmp_path,
        "- address: 127.0.0.1\n  tasks: {worker: 1}",
        strategy="mirrored",
        job=LOOP_JOB,
        extra="train: {steps: 10, cpu_replicas: 2}\n",
    )
    argv = plan_of(spec).task("worker-0").argv
    assert argv[argv.index("--cpu-replicas") + 1] == "2"


# ---------------------------------------------------------------- secrets in the environment (issue 13)


def test_secret_values_are_redacted_in_the_plans_record_but_given_to_the_task(tmp_path: Path) -> None:
    job = (
        "script: train.py\n  env: {WANDB_API_KEY: k1, DB_PASSWORD: p1, HF_TOKEN: t1, LAB_PROXY: x1, "
        "AUTHOR: me, PLAIN: v}\n  secret_env: [LAB_PROXY]"
    )
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 1}\n  env: {HOST_SECRET: h1}", job=job)
    assert spec.secret_names() == {"WANDB_API_KEY", "DB_PASSWORD", "HF_TOKEN", "LAB_PROXY", "HOST_SECRET"}
    plan = plan_of(spec)
    task = plan.task("worker-0")
    assert task.env["WANDB_API_KEY"] == "k1" and task.env["HOST_SECRET"] == "h1"  # the task gets them
    written = json.dumps(plan.to_json())
    assert not any(f'"{v}"' in written for v in ("k1", "p1", "t1", "x1", "h1"))
    env = plan.to_json()["tasks"][0]["env"]
    assert env["LAB_PROXY"] == "<redacted>" and env["AUTHOR"] == "me" and env["PLAIN"] == "v"
