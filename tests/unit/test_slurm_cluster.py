"""The slurm backend's pure parts: its spec keys, the Slurm command lines it builds, what it reads
back from Slurm's output, and how it checks a request against the cluster (Slurm's answers given
as text; everything that talks to a real slurmctld is in tests/e2e/test_slurm.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import LaunchError, SpecError
from orchestrator.launch.slurm import allocation
from orchestrator.launch.slurm import check as slurm_check
from orchestrator.launch.slurm import cluster as slurm
from orchestrator.launch.slurm.cluster import Request, Slurm, check_cluster, route_address
from orchestrator.launch.slurm.spec import section as slurm_section
from orchestrator.spec.load import parse_spec
from orchestrator.spec.model import ClusterSpec, Role


def load(tmp_path: Path, slurm_yaml: str, extra: str = "", backend: str | None = None) -> ClusterSpec:
    (tmp_path / "job.py").write_text("")
    text = (
        textwrap.dedent(
            """\
        name: s
        backend: slurm
        slurm:
        """
        )
        + textwrap.indent(textwrap.dedent(slurm_yaml), "  ")
        + "job:\n  script: job.py\n"
        + textwrap.dedent(extra)
    )
    return parse_spec(text, file="s.yaml", base_dir=tmp_path, backend=backend)


def problems(tmp_path: Path, slurm_yaml: str, extra: str = "") -> str:
    with pytest.raises(SpecError) as err:
        load(tmp_path, slurm_yaml, extra)
    return str(err.value)


# --- spec ------------------------------------------------------------------------------------


def test_the_mapping_form_puts_the_same_tasks_on_every_node_but_the_spares(tmp_path: Path) -> None:
    spec = load(tmp_path, "nodes: 3\nspare_nodes: 1\ntasks_per_node: {worker: 2}\n")
    assert [h.tasks for h in spec.hosts] == [{Role.WORKER: 2}, {Role.WORKER: 2}]
    assert spec.role_count(Role.WORKER) == 4


def test_the_list_form_gives_each_node_its_tasks_and_keeps_the_rest_spare(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        "nodes: 3\ntasks_per_node: [{chief: 1, ps: 1}, {worker: 2}]\n",
        "strategy: parameter_server\n",
    )
    assert [h.tasks for h in spec.hosts] == [{Role.CHIEF: 1, Role.PS: 1}, {Role.WORKER: 2}]
    assert Request.of(spec) == Request(nodes=3, tasks_per_node=2, partition=None)


@pytest.mark.parametrize(
    ("slurm_yaml", "said"),
    [
        (
            "nodes: 2\ntasks_per_node: {chief: 1, worker: 1}\n",
            "s.yaml:5: slurm.tasks_per_node.chief: a cluster has at most one chief; "
            "this mapping puts one on each of 2 nodes: give a list",
        ),
        ("nodes: 1\ntasks_per_node: [{worker: 1}, {worker: 1}]\n", "lists 2 nodes, slurm.nodes allocates 1"),
        ("nodes: 2\nspare_nodes: 2\ntasks_per_node: {worker: 1}\n", "leaves no node"),
        (
            "nodes: 3\nspare_nodes: 1\ntasks_per_node: [{worker: 1}]\n",
            "spare_nodes goes with the mapping form",
        ),
        (
            "nodes: 2\ntasks_per_node: [{worker: 1}, {worker: 0}]\n",
            "slurm.tasks_per_node[1].worker: count must be at least 1",
        ),
        ("nodes: 2\ntasks_per_node: {worker: 1}\ntime: 2h\n", "slurm.time"),
        (
            'nodes: 2\ntasks_per_node: {worker: 1}\ntime: "1:30"\n',
            "slurm.time: 90 s is too short: Slurm is asked for SIGTERM 60 s before the limit",
        ),
        ("nodes: 2\ntasks_per_node: {worker: 1}\npartition: 'lab; rm'\n", "slurm.partition"),
        ("nodes: 2\ntasks_per_node: {worker: 1}\nnodez: 3\n", "nodez"),
    ],
)
def test_bad_slurm_sections_are_spec_errors_at_their_key(tmp_path: Path, slurm_yaml: str, said: str) -> None:
    assert said in problems(tmp_path, slurm_yaml)


def test_backend_slurm_needs_a_slurm_section_and_the_others_need_hosts(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("")
    with pytest.raises(SpecError, match=r"s.yaml:2: backend: backend slurm needs a slurm: section"):
        parse_spec("name: s\nbackend: slurm\njob: {script: job.py}\n", file="s.yaml", base_dir=tmp_path)
    with pytest.raises(SpecError, match=r"s.yaml:1: hosts: required key is missing"):
        parse_spec("name: s\njob: {script: job.py}\n", file="s.yaml", base_dir=tmp_path)


def test_backend_slurm_from_the_command_line_uses_the_slurm_section_over_hosts(tmp_path: Path) -> None:
    extra = "hosts:\n  - {address: 127.0.0.1, tasks: {worker: 5}}\n"
    spec = load(tmp_path, "nodes: 2\ntasks_per_node: {worker: 1}\n", extra.replace("", ""), backend="slurm")
    assert [h.tasks for h in spec.hosts] == [{Role.WORKER: 1}, {Role.WORKER: 1}]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 5400),
        ("10:30", 630),
        ("01:00:05", 3605),
        ("2-0", 172800),
        ("1-02:03", 93780),
        ("1-00:00:07", 86407),
    ],
)
def test_slurm_time_formats(tmp_path: Path, text: str, seconds: float) -> None:
    spec = load(tmp_path, f'nodes: 1\ntasks_per_node: {{worker: 1}}\ntime: "{text}"\n')
    assert slurm_section(spec).time_s() == seconds


# --- command lines ---------------------------------------------------------------------------


def test_salloc_asks_for_the_spec_and_holds_the_allocation_with_a_pipe(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        'nodes: 3\ntasks_per_node: [{worker: 2}, {worker: 1}]\npartition: lab\naccount: ml\ntime: "30"\n'
        "extra_args: [--gres=gpu:1]\n",
        "health: {stop_grace_s: 45}\n",
    )
    argv = allocation.salloc_argv(spec, "s-1-ab")
    assert argv[:5] == [
        "salloc",
        "--no-kill",
        "--nodes=3",
        "--ntasks-per-node=2",
        "--job-name=orchestrate-s-1-ab",
    ]
    assert {"--partition=lab", "--account=ml", "--time=30", "--signal=TERM@75", "--gres=gpu:1"} <= set(argv)
    assert argv[-3:-1] == ["sh", "-c"] and argv[-1].endswith(
        "exec cat >/dev/null"
    )  # lives as long as our pipe


def test_a_step_carries_no_environment_and_no_credential_on_its_command_line() -> None:
    argv = slurm.srun_argv("12", "n2", "orchestrate-r-worker-0", ("/venv/bin/python",))
    assert argv[:7] == [
        "srun",
        "--jobid=12",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n2",
        "--job-name=orchestrate-r-worker-0",
    ]
    assert argv[-3:] == ["/venv/bin/python", "-S", str(slurm.SHIM)]
    assert not any("TF_CONFIG" in a or "TOKEN" in a for a in argv)


def test_inside_an_allocation_srun_reads_no_option_of_it_from_the_environment() -> None:
    env = {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_ID": "9", "PATH": "/bin"}
    assert Slurm(5, env).env == {"SLURM_JOB_ID": "9", "PATH": "/bin"}


def test_plan_lines_name_the_allocation_or_the_surrounding_one(tmp_path: Path) -> None:
    spec = load(tmp_path, "nodes: 2\ntasks_per_node: {worker: 1}\n")
    lines = slurm_check.preview_lines(spec, "s-1", tmp_path, env={})
    assert lines[0].startswith("allocation: salloc --no-kill --nodes=2")
    assert "srun --jobid=JOB --overlap --nodes=1 --ntasks=1 --nodelist=NODE" in lines[1]
    inside = slurm_check.preview_lines(spec, "s-1", tmp_path, env={"SLURM_JOB_ID": "33"})
    assert inside[0].startswith("inside Slurm job 33") and "--jobid=33" in inside[1]


# --- reading Slurm -----------------------------------------------------------------------------


def test_scontrol_one_liners_are_read_as_fields() -> None:
    line = "PartitionName=lab AllowGroups=ALL Default=YES Nodes=n[1-3] State=UP TotalCPUs=6 TotalNodes=3"
    fields = slurm._fields(line)
    assert fields["PartitionName"] == "lab" and fields["Nodes"] == "n[1-3]" and fields["TotalNodes"] == "3"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0:50", 50), ("1:02:03", 3723), ("2-00:00:01", 172801), ("UNLIMITED", None), ("", None)],
)
def test_squeue_time_left(text: str, seconds: float | None) -> None:
    assert allocation._duration_s(text) == seconds


def test_salloc_log_gives_the_pending_job_and_its_errors_without_the_routine_lines(tmp_path: Path) -> None:
    log = tmp_path / "salloc-1.log"
    log.write_text(
        "salloc: Pending job allocation 18\nsalloc: job 18 queued and waiting for resources\n"
        "salloc: Job allocation 18 has been revoked.\nsalloc: Job aborted due to signal\n"
    )
    assert allocation._pending_job(log) == "18"
    assert allocation._salloc_errors(log) == [
        "Job allocation 18 has been revoked.",
        "Job aborted due to signal",
    ]


class Answers(Slurm):
    """Slurm's answers to `scontrol show partition|node -o`, as text (no slurmctld)."""

    def __init__(self, partitions: list[str], nodes: list[str]):
        super().__init__(5, {})
        self.answers = {"partition": partitions, "node": nodes}

    def records(self, kind: str, *names: str) -> list[dict[str, str]]:
        return [slurm._fields(line) for line in self.answers[kind]]


NODES = [f"NodeName=n{i} Arch=x86_64 CPUTot=2 NodeAddr=10.0.0.{i} State=IDLE" for i in (1, 2, 3)]


@pytest.mark.parametrize(
    ("partitions", "request_", "said"),
    [
        (
            ["PartitionName=lab Default=YES Nodes=n[1-3] State=UP TotalNodes=3"],
            Request(5, 1, None),
            "slurm.nodes asks for 5 nodes; partition lab has 3",
        ),
        (
            ["PartitionName=lab Default=YES State=UP TotalNodes=3"],
            Request(2, 1, "gpu"),
            "slurm.partition 'gpu' does not exist on this cluster (partitions: lab)",
        ),
        (
            ["PartitionName=lab Default=NO State=UP TotalNodes=3"],
            Request(2, 1, None),
            "no default partition; set slurm.partition (one of lab)",
        ),
        (
            ["PartitionName=lab Default=YES State=DOWN TotalNodes=3"],
            Request(2, 1, None),
            "partition lab is DOWN",
        ),
    ],
)
def test_a_request_the_cluster_cannot_run_is_refused_before_submitting(
    monkeypatch: pytest.MonkeyPatch, partitions: list[str], request_: Request, said: str
) -> None:
    monkeypatch.setattr(Slurm, "missing", staticmethod(lambda: []))
    with pytest.raises(LaunchError, match=said.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_cluster(Answers(partitions, NODES), request_)


def test_a_request_the_cluster_can_run_gets_its_partition_and_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Slurm, "missing", staticmethod(lambda: []))
    parts = [
        "PartitionName=cpu Default=NO State=UP TotalNodes=1",
        "PartitionName=lab Default=YES State=UP TotalNodes=3",
    ]
    name, nodes = check_cluster(Answers(parts, NODES), Request(3, 1, None))
    assert name == "lab" and [n["NodeAddr"] for n in nodes] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_without_slurms_commands_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LaunchError, match="Slurm's commands are not installed here"):
        check_cluster(Slurm(5), Request(1, 1, None))


def test_the_coordinator_address_is_this_machines_on_the_route_to_the_nodes() -> None:
    assert route_address(["127.0.0.1"]) == "127.0.0.1"
    with pytest.raises(LaunchError, match="slurm.coordinator_address"):
        route_address(["no-such-node.invalid"])


def test_a_command_that_does_not_answer_in_time_is_a_launch_error_naming_the_key() -> None:
    any_: Any = Slurm(0.2, {"PATH": "/usr/bin:/bin"})
    with pytest.raises(LaunchError, match=r"no answer within 0.2 s .*slurm.connect_timeout_s"):
        any_.run(["sleep", "5"], "waiting")


def test_slurm_workdir_must_be_absolute(tmp_path: Path) -> None:
    assert "slurm.workdir" in problems(tmp_path, "nodes: 1\ntasks_per_node: {worker: 1}\nworkdir: scratch\n")
    spec = load(tmp_path, "nodes: 1\ntasks_per_node: {worker: 1}\nworkdir: /scratch/ann\n")
    assert slurm_section(spec).workdir == "/scratch/ann"


def test_what_is_copied_to_nodes_leaves_out_hidden_files_caches_and_symlinks(tmp_path: Path) -> None:
    from orchestrator.launch.slurm.files import tree

    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "pkg" / "a.py")
    (tmp_path / "train.py").write_text("")
    assert [rel for rel, _ in tree(tmp_path)] == ["pkg/a.py", "train.py"]
