"""orchestrator/launch/exchange.py: the run's state between hosts that share no disk, decided once
for every backend — here over hosts that are folders of this machine (each its own "disk"),
moved with the same `folders.py` modes the hosts run: real files, no host, no root."""

from __future__ import annotations

import dataclasses
import posixpath
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launch.exchange import StateExchange
from orchestrator.launch.job_folders import same_place
from orchestrator.launch.local.placement import local_placements
from orchestrator.launch.transfer import STAGING_PREFIX, Folders, Transfer, commit_here, differing, local_tree
from orchestrator.plan.launch_plan import LaunchPlan, make_plan
from orchestrator.spec.load import parse_spec
from tests.conftest import wait_until
from worker.host import folders as worker_folders


class Disks(Folders):
    """Host i's absolute path p is `root/hi/p`: as separate a disk as a folder can be."""

    def __init__(self, root: Path):
        self.root = root
        self.calls: list[tuple[str, int, str]] = []
        self.down: set[int] = set()
        self.lost_hosts: list[int] = []

        self.common: set[str] = set()  # folders every host sees (an NFS mount)

    def at(self, host: int, path: str) -> Path:
        if any(path == c or path.startswith(c + "/") for c in self.common):
            return self.root / "common" / path.lstrip("/")
        return self.root / f"h{host}" / path.lstrip("/")

    def shared(self, host: int, action: str, folder: str, nonce: str) -> bool:
        self._reach(host, "shared", folder)
        answer = worker_folders.shared(action, str(self.at(host, folder)), nonce)
        return not answer["error"] and (action != "read" or nonce in answer["seen"])

    def label(self, host: int) -> str:
        return f"h{host}"

    def pull(self, host: int, remote: str, local: Path, *, mirror: bool) -> Transfer:
        self._reach(host, "pull", remote)
        return _copy(self.at(host, remote), local, mirror)

    def push(self, host: int, local: Path, remote: str, ours: dict[str, Any]) -> Transfer:
        self._reach(host, "push", remote)
        return _copy(local, self.at(host, remote), True, ours)

    def lost(self, host: int) -> None:
        self.lost_hosts.append(host)

    def stamp(self, host: int, remote: str) -> str | None:
        self._reach(host, "stamp", remote)
        answer = worker_folders.stamp(str(self.at(host, remote)))
        return str(answer["stamp"]) if answer["exists"] else None

    def _reach(self, host: int, what: str, path: str) -> None:
        self.calls.append((what, host, path))
        if host in self.down:
            raise LaunchError(f"h{host}: no route to host")


def _copy(source: Path, target: Path, mirror: bool, ours: dict[str, Any] | None = None) -> Transfer:
    theirs = ours or local_tree(source)
    if not theirs["exists"]:
        return Transfer(0, 0, 0, 0.0, exists=False)
    mine = local_tree(target)
    todo = differing(theirs["files"], mine["files"])
    staging = target / f"{STAGING_PREFIX}test"
    staging.mkdir(parents=True)
    for rel in todo:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, staging / rel)
    keep = sorted(theirs["files"]) if mirror else sorted(set(theirs["files"]) | set(mine["files"]))
    done = commit_here(target, staging, keep)
    return Transfer(len(todo), sum(theirs["files"][r][0] for r in todo), int(done["removed"]), 0.0)


def plan_of(tmp_path: Path, tasks: str) -> LaunchPlan:
    (tmp_path / "job.py").write_text("")
    spec = parse_spec(f"name: t\nhosts:\n{tasks}job: {{script: job.py}}\n", file="s.yaml", base_dir=tmp_path)
    ports = {
        f"{r}-{i}": 20000 + n for n, (r, i) in enumerate([("worker", 0), ("worker", 1), ("evaluator", 0)])
    }
    places = local_placements(
        spec,
        ports,
        run_dir=Path("/runs/r1"),
        spec_dir=tmp_path,
        coordinator_url="http://x:1",
        python="python",
    )
    return make_plan(spec, "t-1", places)


TWO_HOSTS = "  - {address: 10.0.0.1, tasks: {worker: 1}}\n  - {address: 10.0.0.2, tasks: {worker: 1}}\n"
CKPT = "/runs/r1/checkpoints"


def checkpoint(disks: Disks, host: int, step: int) -> None:
    folder = disks.at(host, CKPT)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ckpt-{step}.data-00000-of-00001").write_bytes(bytes(step) * 100)
    (folder / f"ckpt-{step}.index").write_text(f"index {step}")
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{step}"\n')


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_the_owners_checkpoint_goes_home_and_to_every_reader_only_what_differs(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=60)
    checkpoint(disks, 0, 20)
    assert exchange.before_attempt(plan, 0) == []  # the first attempt restores nothing
    notes = exchange.before_attempt(plan, 1)
    assert notes[0].startswith(f"checkpoints of worker-0 copied from h0 to {home}/checkpoints: 3 file(s)")
    assert notes[1].startswith(f"→ h1 {CKPT}: 3 file(s)")
    assert files(disks.at(1, CKPT)) == files(disks.at(0, CKPT)) == files(home / "checkpoints")
    assert exchange.before_attempt(plan, 2)[1:] == [f"→ h1 {CKPT}: already the same"]
    checkpoint(disks, 0, 40)  # a newer one (its data, its index, the `checkpoint` file) travels
    (disks.at(1, CKPT) / "stray").write_text("x")  # and what the owner does not have goes
    notes = exchange.before_attempt(plan, 3)
    assert ": 3 file(s)" in notes[0] and ": 3 file(s)" in notes[1] and ", 1 removed" in notes[1]
    assert files(disks.at(1, CKPT)) == files(disks.at(0, CKPT))


def test_the_owners_state_brought_home_during_the_stop_is_what_the_next_attempt_hands_out(
    tmp_path: Path,
) -> None:
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=60)
    checkpoint(disks, 0, 20)
    exchange.bring_early(plan)  # the owner has exited: its folder will not change again
    exchange.bring_early(plan)  # told twice: one copy
    assert wait_until(lambda: files(home / "checkpoints") == files(disks.at(0, CKPT)), 10)
    pulls = [c for c in disks.calls if c[0] == "pull"]
    assert len(pulls) == 1
    notes = exchange.before_attempt(plan, 1)
    assert [c for c in disks.calls if c[0] == "pull"] == pulls  # not pulled again
    assert (
        notes[0].startswith("checkpoints of worker-0 copied from h0") and "(as soon as the owner" in notes[0]
    )
    assert files(disks.at(1, CKPT)) == files(disks.at(0, CKPT))
    # an early copy that failed (its host away a moment) is made again before the attempt
    checkpoint(disks, 0, 40)
    disks.down.add(0)
    exchange.bring_early(plan)
    assert exchange.early_copy() is None and disks.lost_hosts == [0]
    disks.down.clear()
    exchange.before_attempt(plan, 2)
    assert "ckpt-40.index" in files(disks.at(1, CKPT))
    # a copy begun for a restart that does not come: the results wait for it, never race it
    checkpoint(disks, 0, 60)
    exchange.bring_early(plan)
    exchange.bring_home(plan)
    assert files(home / "checkpoints") == files(disks.at(0, CKPT)) and exchange.early_copy() is None


def test_an_owner_that_lost_its_folder_gets_homes_copy_back(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=60)
    checkpoint(disks, 0, 20)
    exchange.before_attempt(plan, 1)
    shutil.rmtree(disks.at(0, CKPT))  # its host was cleaned (a --resume days later)
    notes = exchange.before_attempt(plan, 2)
    assert notes[0] == f"worker-0 (h0) has no checkpoint folder; using the copy in {home}/checkpoints"
    assert files(disks.at(0, CKPT)) == files(home / "checkpoints") != {}


def test_a_host_that_cannot_be_reached_fails_the_copy_and_is_said_lost(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=60)
    checkpoint(disks, 0, 20)
    disks.down.add(1)
    with pytest.raises(
        LaunchError, match=r"copying the checkpoint to the hosts failed on 1 of 1 hosts:\n  h1"
    ):
        exchange.before_attempt(plan, 1)
    assert disks.lost_hosts == [1]
    assert exchange.fetch(plan, reachable=False) == [
        "worker-0 (h0) is out of reach: the last checkpoints brought home are used"
    ]


def test_an_evaluator_on_another_host_follows_each_new_checkpoint(tmp_path: Path) -> None:
    plan = plan_of(
        tmp_path,
        "  - {address: 10.0.0.1, tasks: {worker: 2}}\n  - {address: 10.0.0.2, tasks: {evaluator: 1}}\n",
    )
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=0.05)
    exchange.before_attempt(plan, 0)
    try:
        checkpoint(disks, 0, 10)
        assert wait_until(lambda: files(disks.at(1, CKPT)) == files(disks.at(0, CKPT)), 10)
        checkpoint(disks, 0, 20)
        assert wait_until(lambda: "ckpt-20.index" in files(disks.at(1, CKPT)), 10)
    finally:
        exchange.stop_following(timeout_s=10)
    assert not any(call[1] == 0 and call[0] == "push" for call in disks.calls)  # the owner's own: never


def test_the_results_come_home_and_a_host_away_is_said_not_raised(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    checkpoint(disks, 0, 20)
    (disks.at(0, "/runs/r1/model")).mkdir(parents=True)
    (disks.at(0, "/runs/r1/model") / "model.keras").write_text("weights")
    (disks.at(0, "/runs/r1/tensorboard")).mkdir(parents=True)
    (disks.at(0, "/runs/r1/tensorboard") / "events").write_text("scalars")
    lines = StateExchange(disks, home, every_s=60).bring_home(plan)
    assert sorted(line.split(":")[0] for line in lines) == [
        "checkpoints/ from worker-0 (h0)",
        "model/ from worker-0 (h0)",
        "tensorboard/ from worker-0 (h0)",
    ]
    assert (home / "model" / "model.keras").read_text() == "weights"
    disks.down.add(0)
    said = StateExchange(disks, home, every_s=60).bring_home(plan)
    assert said and all(line.startswith("could not bring /runs/r1/") for line in said)


def with_job_folders(plan: LaunchPlan, *folders: str) -> LaunchPlan:
    assert plan.state is not None
    return dataclasses.replace(plan, state=dataclasses.replace(plan.state, job_folders=folders))


def test_the_jobs_own_folders_are_made_the_owners_on_every_host_at_the_same_place(tmp_path: Path) -> None:
    """The tutorial's BackupAndRestore('/tmp/backup') and a relative ModelCheckpoint folder: each
    host has its own; before an attempt every reader gets the owner's (issue 24)."""
    plan = plan_of(tmp_path, TWO_HOSTS)
    owner, reader = plan.task("worker-0"), plan.task("worker-1")
    relative = posixpath.join(owner.cwd, "ckpts")
    plan = with_job_folders(plan, "/tmp/backup", relative)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=60)
    backup = disks.at(0, "/tmp/backup/chief")
    backup.mkdir(parents=True)
    (backup / "ckpt-3.index").write_text("index 3")
    (backup / "ckpt-3.data-00000-of-00001").write_bytes(b"\1" * 300)
    (backup / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
    weights = disks.at(0, relative)
    weights.mkdir(parents=True)
    (weights / "w-1.weights.h5").write_bytes(b"\2" * 50)
    stale = disks.at(1, "/tmp/backup/chief")  # worker-1's own disk: an older backup, a temp copy
    stale.mkdir(parents=True)
    (stale / "ckpt-1.index").write_text("index 1")
    (disks.at(1, "/tmp/backup") / "workertemp_1").mkdir()
    assert exchange.before_attempt(plan, 0) == []  # nothing restores on a first attempt

    def own(attempt: int, plan: LaunchPlan = plan) -> list[str]:  # the notes on the job's own folders
        return [n for n in exchange.before_attempt(plan, attempt) if not n.startswith(("checkpoints ", "→"))]

    notes = own(1)
    assert notes[0].startswith("/tmp/backup of worker-0 → h1 /tmp/backup: 3 file(s)"), notes
    assert files(disks.at(1, "/tmp/backup")) == files(disks.at(0, "/tmp/backup"))  # the stale one gone
    assert files(disks.at(1, posixpath.join(reader.cwd, "ckpts"))) == files(weights)
    # again, unchanged: nothing moves (a folder every host shares: nothing written at all)
    assert [n.split(": ", 1)[1] for n in own(2)] == ["already the same"] * 2
    # a folder the owner does not have (yet) is said, not copied
    assert own(3, with_job_folders(plan, "/tmp/never")) == ["worker-0 (h0) has no /tmp/never: not copied"]


def test_a_jobs_folder_every_host_shares_is_left_as_it_is(tmp_path: Path) -> None:
    plan = with_job_folders(plan_of(tmp_path, TWO_HOSTS), "/nfs/ckpt", "/tmp/backup")
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    disks.common.add("/nfs")
    for folder in ("/nfs/ckpt", "/tmp/backup"):
        disks.at(0, folder).mkdir(parents=True)
        (disks.at(0, folder) / "ckpt-1.index").write_text("index 1")
    exchange = StateExchange(disks, home, every_s=60)
    notes = [n for n in exchange.before_attempt(plan, 1) if not n.startswith(("checkpoints ", "→"))]
    assert notes[0] == "/nfs/ckpt is on a disk every host of the job shares: left as it is"
    assert notes[1].startswith("/tmp/backup of worker-0 → h1 /tmp/backup: 1 file(s)")
    assert not any(c[0] in ("pull", "push") and c[2] == "/nfs/ckpt" for c in disks.calls)
    assert sorted(p.name for p in disks.at(0, "/nfs/ckpt").iterdir()) == ["ckpt-1.index"]  # no nonce left
    # asked once a run: the next attempt does not write there again
    asked = sum(1 for c in disks.calls if c[0] == "shared")
    exchange.before_attempt(plan, 2)
    assert sum(1 for c in disks.calls if c[0] == "shared") == asked


def test_beside_a_run_directory_every_host_sees_only_the_jobs_own_folder_moves(tmp_path: Path) -> None:
    """Issue 40: Slurm nodes on a shared file system (the run directory, proven by the backend)
    with a /tmp each of their own: the checkpoints and results under the run directory are left as
    they are; the tutorial's /tmp/backup is each node's own, and the owner's is copied."""
    plan = with_job_folders(plan_of(tmp_path, TWO_HOSTS), "/tmp/backup", "/runs/r1/mine")
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    disks.common.add("/runs/r1")
    checkpoint(disks, 0, 20)
    for folder in ("/tmp/backup/chief", "/runs/r1/mine", "/runs/r1/model"):
        disks.at(0, folder).mkdir(parents=True)
        (disks.at(0, folder) / "ckpt-1.index").write_text("index 1")
    exchange = StateExchange(disks, home, every_s=60)
    exchange.seen_everywhere("/runs/r1/")
    assert exchange.before_attempt(plan, 0) == []
    notes = exchange.before_attempt(plan, 1)
    assert notes[0] == "/runs/r1/mine is on a disk every host of the job shares: left as it is", notes
    assert notes[1].startswith("/tmp/backup of worker-0 → h1 /tmp/backup: 1 file(s)") and len(notes) == 2
    assert files(disks.at(1, "/tmp/backup")) == files(disks.at(0, "/tmp/backup"))
    moved = {c[2] for c in disks.calls if c[0] in ("pull", "push", "stamp")}
    assert moved == {"/tmp/backup"}, moved  # nothing under the run directory read or written
    assert not any(c[0] == "shared" and c[2].startswith("/runs/") for c in disks.calls)
    # at the end: the results are in the run directory already; the owner's backup, deleted as
    # Keras does once fit is done, is deleted on the other host too (a next run there starts fresh)
    shutil.rmtree(disks.at(0, "/tmp/backup/chief"))
    assert exchange.bring_home(plan) == [
        "/tmp/backup of worker-0 → h1 /tmp/backup at the end: 0 file(s), 0 B, 1 removed in 0.0 s"
    ]
    assert files(disks.at(1, "/tmp/backup")) == {}
    # an owner whose folder is gone altogether (its host cleaned): home's copy and the others stay
    (disks.at(1, "/tmp/backup") / "ckpt-2.index").write_text("index 2")
    (home / "job-checkpoints").mkdir(exist_ok=True)
    shutil.rmtree(disks.at(0, "/tmp/backup"))
    assert exchange.bring_home(plan) == []
    assert files(disks.at(1, "/tmp/backup")) == {"ckpt-2.index": b"index 2"}
    # without the backend's word, the run directory's checkpoints are copied as before
    plain = StateExchange(disks, tmp_path / "home2", every_s=60)
    assert any(n.startswith("checkpoints of worker-0 copied") for n in plain.before_attempt(plan, 1))


def test_a_folder_under_the_owners_working_folder_goes_under_each_readers() -> None:
    owner = SimpleNamespace(cwd="/home/a/.orchestrate/r1/code")
    reader = SimpleNamespace(cwd="/scratch/b/r1/code/")
    assert same_place("/home/a/.orchestrate/r1/code/ckpts", owner, reader) == "/scratch/b/r1/code/ckpts"  # type: ignore[arg-type]
    assert same_place("/tmp/backup", owner, reader) == "/tmp/backup"  # type: ignore[arg-type]
    assert same_place("/home/a/.orchestrate/r1/codex", owner, reader) == "/home/a/.orchestrate/r1/codex"  # type: ignore[arg-type]


def test_each_new_checkpoint_of_the_owner_comes_home_while_it_trains_and_a_lost_owner_is_not_asked(
    tmp_path: Path,
) -> None:
    """Issue 27: the follower copies the owner's checkpoints home as they come (only when its stamp
    changed); the owner's host lost, the next attempt (worker-1 renumbered worker-0, the owner)
    starts from home's copy, which its own folder gets."""
    plan = plan_of(tmp_path, TWO_HOSTS)
    disks, home = Disks(tmp_path / "disks"), tmp_path / "home"
    exchange = StateExchange(disks, home, every_s=0.05)
    checkpoint(disks, 0, 10)
    assert exchange.before_attempt(plan, 0) == []
    try:
        assert wait_until(lambda: (home / "checkpoints" / "ckpt-10.index").exists(), 10)
        pulls = lambda: sum(1 for c in disks.calls if c[0] == "pull")  # noqa: E731
        seen = pulls()
        assert wait_until(lambda: sum(1 for c in disks.calls if c[0] == "stamp") >= 5, 10)
        assert pulls() == seen  # nothing changed: nothing pulled
        checkpoint(disks, 0, 20)
        assert wait_until(lambda: (home / "checkpoints" / "ckpt-20.index").exists(), 10)
    finally:
        exchange.stop_following()
    assert (home / "checkpoints" / "checkpoint").read_text() == 'model_checkpoint_path: "ckpt-20"\n'
    disks.down.add(0)  # the owner's host is cut off; the job shrinks: worker-1 is worker-0 now
    asked = len(disks.calls)
    spec = parse_spec(
        f"name: t\nhosts:\n{TWO_HOSTS}job: {{script: job.py}}\n", file="s.yaml", base_dir=tmp_path
    ).laid_out({0: None})
    places = local_placements(
        spec,
        {"worker-0": 20001},
        run_dir=Path("/runs/r1"),
        spec_dir=tmp_path,
        coordinator_url="u",
        python="p",
    )
    shrunk = make_plan(spec, "t-1", places)
    assert shrunk.task("worker-0").host_index == 1 and shrunk.state is not None
    notes = exchange.before_attempt(shrunk, 1, lost={0})
    exchange.stop_following()
    assert notes[0] == "worker-0 (h0) is out of reach: the last checkpoints brought home are used"
    assert notes[1].startswith(f"→ h1 {CKPT}: 5 file(s)"), notes
    assert [c for c in disks.calls[asked:] if c[1] == 0] == []  # the lost host was not asked
    assert files(disks.at(1, CKPT)) == files(home / "checkpoints")
