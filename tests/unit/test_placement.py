"""Launch layer: the backends' placing rules (plan/placement.py), pure functions of the spec —
addresses, ports, folders, interpreter, where the heartbeats go."""

from __future__ import annotations

import textwrap
from pathlib import Path

from orchestrator.launch.local.placement import local_placements
from orchestrator.launch.ssh.placement import (
    SSH_DEFAULT_BASE_PORT,
    SSH_DEFAULT_WORKDIR,
    ssh_placements,
    ssh_ports,
    ssh_preview,
)
from orchestrator.plan.placement import Placement, job_files_root
from orchestrator.spec import ClusterSpec, parse_spec

RUN_ID = "demo-20250101-000000"

HOSTS = """
    - address: 10.0.0.1
      tasks: {worker: 2}
      base_port: 31000
      python: /opt/py/bin/python -X dev
      workdir: /srv/job
    - address: node-b.lab
      tasks: {worker: 1, chief: 1}
"""


def spec_of(tmp_path: Path, hosts: str = HOSTS, *, backend: str = "ssh", extra: str = "") -> ClusterSpec:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "train.py").write_text("")
    text = (
        f"name: demo\nbackend: {backend}\nhosts:\n"
        + textwrap.indent(textwrap.dedent(hosts).strip("\n"), "  ")
        + f"\njob:\n  script: src/train.py\n{extra}"
    )
    return parse_spec(text, file="spec.yaml", base_dir=tmp_path)


def test_ssh_ports_are_consecutive_per_host_from_its_base_port(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    # worker-0/1 on host 0 from its base_port; host 1 (chief-0, worker-2) from the default base
    assert ssh_ports(spec) == {
        "chief-0": SSH_DEFAULT_BASE_PORT,
        "worker-0": 31000,
        "worker-1": 31001,
        "worker-2": SSH_DEFAULT_BASE_PORT + 1,
    }
    assert SSH_DEFAULT_BASE_PORT == 23456


def test_ssh_ports_reserve_nothing_on_this_machine(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert ssh_ports(spec) == ssh_ports(spec)  # checked free on the hosts (`orchestrate check`), not here
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_ssh_placements_put_each_task_in_its_hosts_run_folder(tmp_path: Path) -> None:
    spec = spec_of(tmp_path)
    places = ssh_placements(
        spec,
        RUN_ID,
        workdirs={0: "/srv/job", 1: "/home/ann/.orchestrate"},
        urls={0: "http://127.0.0.1:41000", 1: "http://127.0.0.1:42000"},
    )
    assert list(places) == ["chief-0", "worker-0", "worker-1", "worker-2"]
    folder_b = f"/home/ann/.orchestrate/runs/{RUN_ID}"
    assert places["chief-0"] == Placement(
        host="node-b.lab",
        port=SSH_DEFAULT_BASE_PORT,
        run_folder=folder_b,
        python=("python3",),
        cwd=f"{folder_b}/code",
        coordinator_url="http://127.0.0.1:42000",
        host_index=1,
        code_root=f"{folder_b}/code",
        pythonpath=(f"{folder_b}/lib",),
    )
    w1 = places["worker-1"]
    folder_a = f"/srv/job/runs/{RUN_ID}"
    assert (w1.host, w1.port, w1.host_index) == ("10.0.0.1", 31001, 0)
    assert (w1.run_folder, w1.cwd, w1.code_root) == (folder_a, f"{folder_a}/code", f"{folder_a}/code")
    assert w1.pythonpath == (f"{folder_a}/lib",)
    assert w1.python == (
        "/opt/py/bin/python",
        "-X",
        "dev",
    )  # a multi-word interpreter, split as a shell would
    assert w1.coordinator_url == "http://127.0.0.1:41000"
    assert all(dict(p.env) == {} for p in places.values())


def test_ssh_preview_shows_the_folders_as_written(tmp_path: Path) -> None:
    places = ssh_preview(spec_of(tmp_path), RUN_ID)
    assert places["worker-0"].run_folder == f"/srv/job/runs/{RUN_ID}"
    assert places["worker-2"].run_folder == f"{SSH_DEFAULT_WORKDIR}/runs/{RUN_ID}"
    assert SSH_DEFAULT_WORKDIR == "~/.orchestrate"
    # heartbeats go through each host's SSH connection, on a port chosen once connected
    assert {p.coordinator_url for p in places.values()} == {"http://127.0.0.1:<port forwarded through SSH>"}
    assert ssh_ports(spec_of(tmp_path)) == {name: p.port for name, p in places.items()}


def test_ssh_preview_with_a_direct_coordinator_address(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, extra="ssh: {coordinator_address: '10.0.0.9:7000'}\n")
    places = ssh_preview(spec, RUN_ID)
    assert {p.coordinator_url for p in places.values()} == {"http://10.0.0.9:7000"}


def test_local_placements_put_every_task_on_this_machine(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, backend="local")
    ports = {"chief-0": 15001, "worker-0": 15002, "worker-1": 15003, "worker-2": 15004}
    places = local_placements(
        spec,
        ports,
        run_dir=Path("/runs/r1"),
        spec_dir=Path("/specs"),
        coordinator_url="http://127.0.0.1:9999",
        python="/usr/bin/python3.11",
    )
    assert list(places) == ["chief-0", "worker-0", "worker-1", "worker-2"]
    for name, p in places.items():
        # the hosts' addresses, interpreters and folders are the ssh backend's: not used here
        assert (p.host, p.port, p.run_folder, p.cwd) == ("127.0.0.1", ports[name], "/runs/r1", "/specs")
        assert p.python == ("/usr/bin/python3.11",)
        assert p.coordinator_url == "http://127.0.0.1:9999"
        assert (p.code_root, p.pythonpath, dict(p.env)) == (None, (), {})  # the job's files used in place
    assert [places[n].host_index for n in places] == [1, 0, 0, 1]


def test_job_files_root_is_job_files_or_the_entry_points_folder(tmp_path: Path) -> None:
    assert job_files_root(spec_of(tmp_path)) == tmp_path / "src"
    text = (
        "name: demo\nbackend: ssh\nhosts:\n  - address: 10.0.0.1\n    tasks: {worker: 1}\n"
        "job:\n  loop: src/train.py\n  files: .\ntrain: {steps: 1}\n"
    )
    spec = parse_spec(text, file="spec.yaml", base_dir=tmp_path)
    assert job_files_root(spec) == tmp_path
