"""Plan layer: make_plan, a pure function of the spec and the backend's placements
(launch/placement.py places the tasks; test_placement.py tests that)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch.placement import Placement, local_placements, ssh_placements, ssh_preview
from orchestrator.plan import LaunchPlan, make_plan
from orchestrator.spec import ClusterSpec, Role, parse_spec
from orchestrator.spec.model import Backend
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
    return local_places(spec) if spec.backend is Backend.LOCAL else ssh_preview(spec, RUN_ID)


def plan_of(spec: ClusterSpec) -> LaunchPlan:
    return make_plan(spec, RUN_ID, places_of(spec))


def tf_config(plan: LaunchPlan, name: str) -> dict[str, Any]:
    return json.loads(plan.task(name).env["TF_CONFIG"])


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
def test_tf_config(tmp_path: Path, strategy: str, hosts: str, cluster: dict, tasks: list) -> None:
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
    plan = make_plan(spec, ports={s.name: 30000 + i for i, s in enumerate(slots)}, run=RUN)
    assert dict(plan.cluster) == {
        "chief": ["10.0.0.2:30000"],
        "worker": ["10.0.0.1:30001", "10.0.0.1:30002", "10.0.0.2:30003", "10.0.0.3:30004"],
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
    assert all(t.argv[0] == RUN.python and t.cwd == str(RUN.spec_dir) for t in plan.tasks)


def test_ssh_backend_uses_host_addresses(tmp_path: Path) -> None:
    plan = plan_of(spec_of(tmp_path, TWO_HOSTS, backend="ssh"))
    assert [(t.name, t.host, t.address) for t in plan.tasks] == [
        ("worker-0", "10.0.0.1", "10.0.0.1:20000"),
        ("worker-1", "10.0.0.1", "10.0.0.1:20001"),
        ("worker-2", "node-b.lab", "node-b.lab:20002"),
    ]
    assert plan.cluster["worker"] == ["10.0.0.1:20000", "10.0.0.1:20001", "node-b.lab:20002"]
    # remote tasks use the host's interpreter; they run in the run's folder under the host's workdir
    assert [(t.argv[0], t.cwd) for t in plan.tasks] == [
        ("/opt/py/bin/python", "/srv/job/runs/demo-20250101-000000/code"),
        ("/opt/py/bin/python", "/srv/job/runs/demo-20250101-000000/code"),
        ("python3", "~/.orchestrate/runs/demo-20250101-000000/code"),
    ]
    assert [t.host_index for t in plan.tasks] == [0, 0, 1]


def test_ssh_backend_paths_point_into_the_copied_files(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("")
    spec = spec_of(
        tmp_path,
        TWO_HOSTS,
        backend="ssh",
        job="script: src/train.py\n  files: .\n  env: {PYTHONPATH: /opt/mine}",
    )
    hosts = {
        0: HostContext("/home/ann/.orchestrate", "http://127.0.0.1:41000"),
        1: HostContext("/scratch/o", "http://127.0.0.1:42000"),
    }
    plan = plan_of(spec, run=dataclasses.replace(RUN, hosts=hosts))
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
    hosts = {0: HostContext("/home/ann/.o", "http://x:1"), 1: HostContext("/scratch/o", "http://x:2")}
    plan = plan_of(spec, run=dataclasses.replace(RUN, hosts=hosts))
    dirs = {t.name: t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in plan.tasks}
    assert dirs["worker-0"] == "/home/ann/.o/runs/demo-20250101-000000/checkpoints"
    assert dirs["worker-2"] == "/scratch/o/runs/demo-20250101-000000/checkpoints"
    # not declared shared: worker-0's is the truth, copied to every other training task's host
    assert plan.state is not None and not plan.state.shared
    assert (plan.state.owner, plan.state.readers) == ("worker-0", ("worker-0", "worker-1", "worker-2"))
    local = plan_of(spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}"))
    assert {t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in local.tasks} == {f"{RUN.run_dir}/checkpoints"}


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


def test_ports_come_from_the_ports_mapping(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}")
    plan = make_plan(spec, ports={"worker-0": 41001, "worker-1": 40007}, run=RUN)
    assert [(t.name, t.port) for t in plan.tasks] == [("worker-0", 41001), ("worker-1", 40007)]
    assert plan.cluster["worker"] == ["127.0.0.1:41001", "127.0.0.1:40007"]


def test_missing_port_is_an_error(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {worker: 2}")
    with pytest.raises(ValueError, match="worker-1"):
        make_plan(spec, ports={"worker-0": 20000}, run=RUN)


def test_make_plan_is_pure(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, "- address: 127.0.0.1\n  tasks: {chief: 1, worker: 2}")
    before = spec.model_dump()
    assert plan_of(spec) == plan_of(spec)
    assert spec.model_dump() == before


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
        assert env["ORCHESTRATE_RUN_ID"] == RUN.run_id
        assert env["ORCHESTRATE_TASK"] == t.name
        assert env["ORCHESTRATE_COORDINATOR"] == RUN.coordinator_url
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
            RUN.python,
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
        RUN.python,
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
    assert argv[argv.index("--checkpoint-dir") + 1] == str(RUN.run_dir / "checkpoints")


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
    assert again["name"] == "demo" and again["run_id"] == RUN.run_id
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
