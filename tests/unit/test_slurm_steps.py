"""The slurm backend's steps, in-process and without root: Slurm's commands replaced at the
command-runner seam (`Slurm.runner`, as submitit's tests replace its subprocess calls) — by
recorded answers of slurmctld, or by running a step's command on this machine (what srun does on
a node), so that the real `worker/host/folders.py` and `worker/host/probe.py` answer. The real cluster's
tests (tests/e2e/test_slurm.py) stay."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch.slurm.check import _judge
from orchestrator.launch.slurm.cluster import Slurm
from orchestrator.launch.slurm.files import NodeFolders
from orchestrator.launch.slurm.leftovers import SlurmLeftovers
from orchestrator.launch.slurm.nodes import NodeProbe, files_copied
from orchestrator.launch.transfer import local_tree
from orchestrator.spec.load import parse_spec

Run = subprocess.CompletedProcess[Any]


class OnThisMachine:
    """srun: the step's command run here (its options dropped, each call recorded); any other
    Slurm command: its recorded answer."""

    def __init__(self, answers: dict[str, str] | None = None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv: Sequence[str], **kw: Any) -> Run:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] == "srun":
            command = argv[next(i for i, a in enumerate(argv[1:], 1) if not a.startswith("-")) :]
            return subprocess.run(command, **kw)
        said = next((out for start, out in self.answers.items() if " ".join(argv).startswith(start)), None)
        if said is None:
            raise AssertionError(f"no recorded answer for {argv}")
        text = kw.get("text", False)
        return subprocess.CompletedProcess(argv, 0, said if text else said.encode(), "" if text else b"")


def folders(runner: OnThisMachine, nodes: dict[int, str]) -> NodeFolders:
    slurm = Slurm(30, {}, runner=runner)
    return NodeFolders(slurm, "s-1", ("python3",), 60, nodes.get, lambda: "7")


def checkpoint(folder: Path, step: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ckpt-{step}.data-00000-of-00001").write_bytes(bytes([step % 256]) * 5000)
    (folder / f"ckpt-{step}.index").write_text(f"index {step}")
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{step}"\n')


def test_a_nodes_folder_comes_home_through_steps_only_what_differs(tmp_path: Path) -> None:
    runner = OnThisMachine()
    on_node, home = tmp_path / "n1" / "checkpoints", tmp_path / "home" / "checkpoints"
    checkpoint(on_node, 20)
    got = folders(runner, {0: "n1"}).pull(0, str(on_node), home, mirror=True)
    assert (got.files, got.removed) == (3, 0) and local_tree(home)["files"] == local_tree(on_node)["files"]
    steps = [c for c in runner.calls if c[0] == "srun"]
    assert [c[c.index("-c") + 2] for c in steps] == ["tree", "pack"]  # what differs, then those files
    assert all("--nodelist=n1" in c and "--jobid=7" in c for c in steps)
    checkpoint(on_node, 40)
    again = folders(runner, {0: "n1"}).pull(0, str(on_node), home, mirror=True)
    assert again.files == 3 and sorted(p.name for p in home.iterdir())[0] == "checkpoint"
    assert folders(runner, {0: "n1"}).pull(0, str(tmp_path / "none"), home, mirror=True).exists is False


def test_homes_copy_goes_to_a_node_staged_and_committed_and_then_is_the_same(tmp_path: Path) -> None:
    runner = OnThisMachine()
    home, on_node = tmp_path / "home" / "checkpoints", tmp_path / "n2" / "checkpoints"
    checkpoint(home, 20)
    on_node.mkdir(parents=True)
    (on_node / "stale").write_text("an earlier attempt's")
    nodes = folders(runner, {1: "n2"})
    sent = nodes.push(1, home, str(on_node), local_tree(home))
    assert (sent.files, sent.removed) == (3, 1)
    assert local_tree(on_node)["files"] == local_tree(home)["files"]
    modes = [c[c.index("-c") + 2] for c in runner.calls if c[0] == "srun"]
    assert modes == ["tree", "unpack", "commit"]
    assert not [p for p in on_node.iterdir() if p.name.startswith(".incoming-")]
    assert nodes.push(1, home, str(on_node), local_tree(home)).describe() == "already the same"


def test_a_node_the_placement_no_longer_gives_is_a_launch_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no node holds the spec's node 2 now"):
        folders(OnThisMachine(), {}).pull(1, str(tmp_path), tmp_path / "home", mirror=True)


def test_the_node_probe_says_ports_and_which_nodes_see_the_run_directory(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print('the job')\n")
    spec = parse_spec(
        "name: t\nbackend: slurm\njob: {script: job.py}\nslurm: {nodes: 2, tasks_per_node: {worker: 2}}\n",
        file="s.yaml",
        base_dir=tmp_path,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    probe = NodeProbe(Slurm(30, {}, runner=OnThisMachine()), spec, "7", "s-1", ("python3",))
    answers, problems = probe.run(["n1", "n2"], run_dir, ports={"n1": [], "n2": []}, timeout_s=60)
    assert problems == [] and sorted(answers) == ["n1", "n2"]
    assert all(a["sees_run"] and not a["unseen"] and len(a["free"]) == 2 for a in answers.values())
    assert files_copied(answers, run_dir) is False  # every node sees it: used in place
    assert not list(run_dir.glob("nonce-*"))  # the nonce is taken away again
    blind = {n: {**a, "sees_run": False, "unseen": ["x"]} for n, a in answers.items()}
    assert files_copied(blind, run_dir) is True
    with pytest.raises(LaunchError, match=r"some nodes see the run directory .*, others do not \(n2\)"):
        files_copied({"n1": answers["n1"], "n2": blind["n2"]}, run_dir)


def test_down_cancels_the_runs_allocation_found_by_name_from_recorded_answers() -> None:
    runner = OnThisMachine(
        {
            "squeue -h --name orchestrate-s-1 -o %i": "41\n",
            "scancel --signal=TERM 41": "",
            "squeue -h -s -j 41 -o %i": "",
            "scancel 41": "",
        }
    )
    record = {"backend": "slurm", "run_id": "s-1", "job_id": "41", "owned": True, "connect_timeout_s": 5}
    lines = SlurmLeftovers(record, Slurm(5, {}, runner=runner)).stop(grace_s=1.0)
    assert lines == [("Slurm: cancelled job(s) 41", True)]
    assert [c[0] for c in runner.calls] == ["squeue", "scancel", "squeue", "scancel"]


def test_check_reads_each_nodes_answer_into_its_row_and_its_problems() -> None:
    rows = {
        n: {"node": n, "python": "-", "tensorflow": "-", "files": "-", "peers": "-"} for n in ("n1", "n2")
    }
    answers = [
        {"hostname": "n1", "python": "3.11.7", "executable": "/usr/bin/python3", "tensorflow": "2.21.0",
         "seen": {"/x/shim.py": True}, "reached": {"10.0.0.2:20000": True},
         "stacks": {"native": True, "why": None}},
        {"hostname": "n2", "python": "3.11.7", "executable": "/usr/bin/python3", "tensorflow": None,
         "seen": {"/x/shim.py": False}, "reached": {"10.0.0.1:20000": False},
         "stacks": {"native": False, "why": "ptrace refused: kernel.yama.ptrace_scope=3"}},
    ]  # fmt: skip
    notes: list[str] = []
    problems = _judge(answers, rows, ("python3",), notes)
    assert rows["n1"]["stacks"] == "native" and rows["n2"]["stacks"] == "Python only"
    assert notes == [
        "n2: a hung task's stacks will have its Python frames only (its runtime's own dump): ptrace "
        "refused: kernel.yama.ptrace_scope=3 (py-spy, installed beside the job's Python, reads C++ "
        "frames too)"
    ]
    assert rows["n1"]["files"] == "shared" and rows["n1"]["peers"] == "all reached"
    assert rows["n2"]["tensorflow"] == "MISSING" and rows["n2"]["files"] == "NOT SEEN"
    assert problems == [
        "n2: TensorFlow is not installed for python3 (slurm.python)",
        "n2 does not see /x/shim.py: the slurm backend needs this machine's files on a filesystem "
        "the nodes share",
        "n2 cannot reach 10.0.0.1:20000 (TF ports between nodes)",
    ]
    assert json.loads(json.dumps(rows))  # the table `orchestrate check` prints
