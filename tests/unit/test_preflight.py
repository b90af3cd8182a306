"""Launch layer, ssh preflight (orchestrator/launch/ssh/preflight.py): what `orchestrate check` says of
each host, from the facts its probe gathered. No SSH here: the reports are built by hand."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.launch.ssh.hosts import Host
from orchestrator.launch.ssh.preflight import (
    MIN_DISK_BYTES,
    HostReport,
    problems,
    table_rows,
    warnings,
)
from orchestrator.spec import parse_spec

CONNECTED: Any = object()  # stands for an open fabric.Connection: the table only asks whether there is one
GIB = 1024**3


def host(index: int = 0, address: str = "10.0.0.1", ssh_port: int = 22, python: str = "python3") -> Host:
    return Host(index, address, ssh_port, None, None, tuple(python.split()))


def facts(**over: Any) -> dict[str, Any]:
    good: dict[str, Any] = {
        "hostname": "lab1",
        "python": "3.11.7",
        "tensorflow": "2.21.0",
        "psutil": "6.1.0",
        "gpus": None,
        "workdir": "/home/me/.orchestrate",
        "workdir_error": None,
        "disk_free_bytes": 50 * GIB,
        "ports": {"23456": True, "23457": True},
        "missing": [],
    }
    return {**good, **over}


def report(index: int = 0, *, address: str | None = None, **kw: Any) -> HostReport:
    fields: dict[str, Any] = {"conn": CONNECTED, "facts": facts()}
    fields.update(kw)
    return HostReport(
        host(index, address or f"10.0.0.{index + 1}"),
        {23456: f"worker-{2 * index}", 23457: f"worker-{2 * index + 1}"},
        **fields,
    )


# --- one host's own problems ----------------------------------------------------------------------


def test_a_good_host_has_no_problems() -> None:
    r = report()
    assert r.own_problems == []
    assert problems([r]) == []
    assert warnings([r]) == []


def test_an_unreachable_host_has_only_that_problem() -> None:
    r = HostReport(host(), {23456: "worker-0"}, error="hosts[0] 10.0.0.1: connection timed out")
    assert r.own_problems == ["hosts[0] 10.0.0.1: connection timed out"]


def test_old_python() -> None:
    r = HostReport(
        host(1, "10.0.0.2", python="/opt/py39/bin/python -u"),
        {23456: "worker-0"},
        facts=facts(python="3.9.18"),
    )
    assert r.own_problems == [
        "hosts[1] 10.0.0.2: /opt/py39/bin/python -u is Python 3.9.18; "
        "the worker needs 3.10+ (hosts[1].python)"
    ]


@pytest.mark.parametrize("version", ["3.10.0", "3.12.1", "4.0.0"])
def test_new_enough_python(version: str) -> None:
    assert report(facts=facts(python=version)).own_problems == []


def test_no_tensorflow() -> None:
    [problem] = report(facts=facts(tensorflow=None)).own_problems
    assert problem == (
        "hosts[0] 10.0.0.1: TensorFlow is not installed for python3 (install it, or set hosts[0].python)"
    )


def test_no_psutil() -> None:
    [problem] = report(facts=facts(psutil=None)).own_problems
    assert problem == "hosts[0] 10.0.0.1: psutil is not installed for python3 (the worker runtime needs it)"


def test_nvidia_smi_error() -> None:
    gpus: dict[str, Any] = {"names": [], "driver": None, "cuda": None, "error": "NVIDIA-SMI has failed"}
    [problem] = report(facts=facts(gpus=gpus)).own_problems
    assert problem == "hosts[0] 10.0.0.1: nvidia-smi failed: NVIDIA-SMI has failed (the GPUs cannot be used)"


def test_gpus_without_error_are_fine() -> None:
    gpus = {"names": ["H100", "H100"], "driver": "550.1", "cuda": "12.4", "error": None}
    assert report(facts=facts(gpus=gpus)).own_problems == []


def test_workdir_error_names_the_key_and_skips_the_disk_check() -> None:
    f = facts(workdir="/data/orch", workdir_error="Permission denied", disk_free_bytes=0)
    r = report(2, facts=f)
    assert r.own_problems == [
        "hosts[2] 10.0.0.3: work folder /data/orch: Permission denied (hosts[2].workdir)"
    ]


def test_low_disk() -> None:
    [problem] = report(facts=facts(disk_free_bytes=100 * 1024**2)).own_problems
    assert problem == "hosts[0] 10.0.0.1: only 100.0 MiB free under /home/me/.orchestrate"


def test_just_enough_disk() -> None:
    assert report(facts=facts(disk_free_bytes=MIN_DISK_BYTES)).own_problems == []
    assert len(report(facts=facts(disk_free_bytes=MIN_DISK_BYTES - 1)).own_problems) == 1


def test_busy_port_names_its_task_and_the_hosts_base_port() -> None:
    r = report(1, facts=facts(ports={"23456": True, "23457": False}))
    assert r.own_problems == [
        "hosts[1] 10.0.0.2: port 23457 (worker-3) is in use there; set hosts[1].base_port to a free range"
    ]


def test_unreachable_peer() -> None:
    r = report(peers={"10.0.0.2:23456": None, "10.0.0.2:23457": "Connection refused"})
    assert r.own_problems == [
        "hosts[0] 10.0.0.1: cannot reach 10.0.0.2:23457: Connection refused (a firewall between the hosts?)"
    ]


def test_shared_folder_problems_are_the_hosts_problems() -> None:
    r = report(shared=["hosts[0] 10.0.0.1: /ckpt is not shared: …"])
    assert r.own_problems == ["hosts[0] 10.0.0.1: /ckpt is not shared: …"]


def test_several_problems_of_one_host_are_all_listed_in_order() -> None:
    r = report(facts=facts(python="3.8.10", tensorflow=None, psutil=None, ports={"23456": False}))
    assert [p.split(": ", 1)[1].split(" ")[0] for p in r.own_problems] == [
        "python3",
        "TensorFlow",
        "psutil",
        "port",
    ]


def test_a_non_default_ssh_port_is_in_the_label() -> None:
    r = HostReport(Host(0, "lab", 2222, None, None, ("python3",)), {}, facts=facts(psutil=None))
    assert r.own_problems[0].startswith("hosts[0] lab:2222: ")


# --- across hosts ---------------------------------------------------------------------------------


def test_problems_gather_every_hosts_problems() -> None:
    bad0 = report(0, facts=facts(psutil=None))
    good = report(1)
    bad2 = report(2, error="hosts[2] 10.0.0.3: authentication failed")
    got = problems([bad0, good, bad2])
    assert len(got) == 2
    assert got[0].startswith("hosts[0] 10.0.0.1: psutil")
    assert got[1] == "hosts[2] 10.0.0.3: authentication failed"


def test_a_tensorflow_minor_mismatch_is_a_problem_not_a_warning() -> None:
    reports = [report(0, facts=facts(tensorflow="2.21.0")), report(1, facts=facts(tensorflow="2.20.1"))]
    assert problems(reports) == [
        "TensorFlow versions differ across hosts (hosts[0] 10.0.0.1 2.21.0, hosts[1] 10.0.0.2 2.20.1); "
        "one cluster needs one version"
    ]
    assert warnings(reports) == []


def test_a_tensorflow_patch_mismatch_is_a_warning() -> None:
    reports = [report(0, facts=facts(tensorflow="2.21.0")), report(1, facts=facts(tensorflow="2.21.1"))]
    assert problems(reports) == []
    assert warnings(reports) == [
        "tensorflow versions differ across hosts: hosts[0] 10.0.0.1 2.21.0, hosts[1] 10.0.0.2 2.21.1"
    ]


def test_a_python_version_mismatch_is_a_warning() -> None:
    reports = [report(0, facts=facts(python="3.11.7")), report(1, facts=facts(python="3.12.3"))]
    assert problems(reports) == []
    assert warnings(reports) == [
        "python versions differ across hosts: hosts[0] 10.0.0.1 3.11.7, hosts[1] 10.0.0.2 3.12.3"
    ]


def test_a_host_without_tensorflow_is_not_a_version_mismatch() -> None:
    reports = [report(0), report(1, facts=facts(tensorflow=None)), report(2, error="down")]
    got = problems(reports)
    assert len(got) == 2  # its own "not installed", and the unreachable host
    assert not any("differ" in p for p in got)
    assert warnings(reports) == []


# --- the check table ------------------------------------------------------------------------------

COLUMNS = ["host", "ssh", "python", "tensorflow", "gpus", "disk free", "ports", "peers", "shared"]


def test_table_row_of_a_good_host() -> None:
    [row] = table_rows([report(peers={"10.0.0.2:23456": None, "10.0.0.2:23457": None})])
    assert list(row) == COLUMNS
    assert row == {
        "host": "hosts[0] 10.0.0.1",
        "ssh": "ok",
        "python": "3.11.7",
        "tensorflow": "2.21.0",
        "gpus": "none",
        "disk free": "50.0 GiB",
        "ports": "2 free",
        "peers": "2 ok",
        "shared": "ok",
    }


def test_table_row_of_an_unreachable_host() -> None:
    [row] = table_rows([HostReport(host(), {23456: "worker-0"}, error="timed out")])
    assert row == {
        "host": "hosts[0] 10.0.0.1",
        "ssh": "FAILED",
        "python": "-",
        "tensorflow": "-",
        "gpus": "-",
        "disk free": "-",
        "ports": "-",
        "peers": "-",
        "shared": "-",
    }


def test_table_row_of_a_host_with_problems() -> None:
    gpus: dict[str, Any] = {"names": [], "driver": None, "cuda": None, "error": "failed"}
    r = report(
        facts=facts(tensorflow=None, gpus=gpus, ports={"23456": False, "23457": True}, disk_free_bytes=512),
        peers={"10.0.0.2:23456": "refused", "10.0.0.2:23457": None},
        shared=["hosts[0] 10.0.0.1: /ckpt is not shared"],
    )
    [row] = table_rows([r])
    assert row["tensorflow"] == "MISSING"
    assert row["gpus"] == "nvidia-smi failed"
    assert row["ports"] == "busy: 23456"
    assert row["disk free"] == "512 B"
    assert row["peers"] == "1 unreachable"
    assert row["shared"] == "NOT SHARED"


@pytest.mark.parametrize(
    ("gpus", "cell"),
    [
        (None, "none"),
        ({"names": ["A100"], "driver": "550", "cuda": "12.4", "error": None}, "1 (CUDA 12.4)"),
        ({"names": ["A100", "A100"], "driver": "550", "cuda": None, "error": None}, "2"),
    ],
)
def test_gpu_cell(gpus: dict[str, Any] | None, cell: str) -> None:
    assert table_rows([report(facts=facts(gpus=gpus))])[0]["gpus"] == cell


def test_shared_column_per_host() -> None:
    rows = table_rows(
        [
            report(0),
            report(1, shared=["hosts[1] 10.0.0.2: cannot write in /ckpt (train.checkpoint_dir): denied"]),
            report(2, error="down"),
        ]
    )
    assert [r["shared"] for r in rows] == ["ok", "NOT SHARED", "-"]


def test_the_shared_column_is_empty_when_the_spec_declares_no_shared_folder() -> None:
    [row] = table_rows([report()], shared_declared=False)
    assert row["shared"] == "-"


@pytest.mark.parametrize(
    ("restart", "available", "cell"),
    [
        ("", 10 * GIB, "2 × 750 MiB"),
        ("", 2 * GIB, "off: low memory (2.0 GiB available)"),
        ("restart: {standby: on}\n", 2 * GIB, "2 × 750 MiB"),
        ("restart: {standby: off}\n", 10 * GIB, "off"),
    ],
)
def test_the_check_table_says_what_warm_standbys_each_host_would_keep(
    tmp_path, restart, available, cell
) -> None:
    (tmp_path / "job.py").write_text("")
    text = (
        "name: t\nbackend: ssh\nhosts:\n  - {address: 10.0.0.1, tasks: {worker: 2}}\n"
        f"job: {{script: job.py}}\n{restart}"
    )
    spec = parse_spec(text, file="s.yaml", base_dir=tmp_path)
    memory = {"available": available, "total": 16 * GIB}
    [row] = table_rows([report(facts=facts(memory=memory))], spec=spec)
    assert row["standbys"] == cell


def test_a_spare_that_answers_as_another_hosts_machine_is_a_problem() -> None:
    spare = HostReport(
        Host(2, "lab1.local", 22, None, None, ("python3",), spare=True), {}, CONNECTED, facts=facts()
    )
    other = HostReport(
        Host(1, "10.0.0.9", 22, None, None, ("python3",), spare=True),
        {},
        CONNECTED,
        facts=facts(hostname="lab9"),
    )
    got = problems([spare, report(0), other])
    assert got == [
        "hosts[2] lab1.local: this spare is the same machine as hosts[0] 10.0.0.1 (both answer as lab1): "
        "losing one would lose both; a spare must be another machine"
    ]
    assert [row["host"] for row in table_rows([report(0), other])] == [
        "hosts[0] 10.0.0.1",
        "hosts[1] 10.0.0.9 (spare)",
    ]
