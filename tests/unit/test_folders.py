"""worker/host/folders.py, run as the backends run it (`python -c SOURCE MODE …`), on this machine: a
state folder listed, committed, proven shared, packed and unpacked."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

FOLDERS = (Path(__file__).resolve().parents[2] / "worker" / "host" / "folders.py").read_text()


def probe(*args: str, stdin: str = "") -> dict:
    res = subprocess.run(
        [sys.executable, "-c", FOLDERS, *args], input=stdin, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout)


def test_tree_lists_files_with_checksums_and_leaves_out_scratch_hidden_and_symlinks(tmp_path):

    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "ckpt-20"\n')
    (ckpt / "sub" / "ckpt-20.data-00000-of-00001").write_bytes(b"\0" * 1000)
    (ckpt / ".worker-1").mkdir()  # a non-chief's throwaway save
    (ckpt / ".worker-1" / "ckpt-20.index").write_text("x")
    (ckpt / "workertemp_1").mkdir()  # tf-keras BackupAndRestore's
    (ckpt / "workertemp_1" / "f").write_text("x")
    secret = tmp_path / "secret"
    secret.write_text("not ours")
    (ckpt / "link").symlink_to(secret)
    (ckpt / ".incoming-1234").mkdir()  # an interrupted transfer: removed by the next look
    (ckpt / ".incoming-1234" / "half").write_text("x")
    out = probe("tree", str(ckpt))
    assert out["exists"] and out["free_bytes"] > 0
    assert out["files"] == {
        "checkpoint": [33, hashlib.sha256(b'model_checkpoint_path: "ckpt-20"\n').hexdigest()],
        "sub/ckpt-20.data-00000-of-00001": [1000, hashlib.sha256(b"\0" * 1000).hexdigest()],
    }
    assert not (ckpt / ".incoming-1234").exists() and (ckpt / ".worker-1").exists()
    assert probe("tree", str(tmp_path / "none"))["exists"] is False


def test_commit_moves_data_before_the_index_and_removes_what_the_source_no_longer_has(tmp_path):
    folder, staging = tmp_path / "ckpt", tmp_path / "ckpt" / ".incoming-ab"
    folder.mkdir()
    (folder / "ckpt-10.index").write_text("old")
    (folder / "checkpoint").write_text("ckpt-10")
    (folder / ".worker-1").mkdir()
    staging.mkdir()
    (staging / "checkpoint").write_text("ckpt-20")
    (staging / "ckpt-20.index").write_text("new")
    (staging / "nested").mkdir()
    (staging / "nested" / "final.json").write_text("{}")
    # a watcher records the order in which files appear: the index only after its data
    keep = ["checkpoint", "ckpt-20.index", "nested/final.json"]
    script = (
        "import io, json, os, sys\n"
        "order = []\n"
        "real = os.replace\n"
        "os.replace = lambda a, b: (order.append(os.path.basename(b)), real(a, b))\n"
        f"sys.stdin = io.StringIO({json.dumps(keep)!r})\n"
        "ns = {'__name__': 'folders'}\n"
        f"exec(compile({FOLDERS!r}, 'folders.py', 'exec'), ns)\n"
        f"print(json.dumps([ns['commit']({str(folder)!r}, {str(staging)!r}), order]))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    answer, order = json.loads(res.stdout)
    assert order == ["ckpt-20.index", "checkpoint", "final.json"]  # data first, index files last
    assert answer == {"moved": 3, "removed": 1}
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == keep
    assert (folder / "checkpoint").read_text() == "ckpt-20"
    assert not staging.exists() and (folder / ".worker-1").is_dir()  # others' scratch left alone


def test_shared_folder_nonces_are_written_read_and_removed(tmp_path):
    assert probe("shared", "write", str(tmp_path), "n1") == {"error": None, "seen": []}
    assert probe("shared", "read", str(tmp_path), "n1", "n2")["seen"] == ["n1"]
    assert probe("shared", "read", str(tmp_path / "elsewhere"), "n1")["seen"] == []
    assert probe("shared", "write", str(tmp_path), "n1")["error"]  # never overwrites
    assert probe("shared", "remove", str(tmp_path), "n1")["error"] is None
    assert list(tmp_path.iterdir()) == []


def test_pack_and_unpack_carry_a_folder_and_replace_what_the_target_held(tmp_path: Path) -> None:
    source, target = tmp_path / "node1", tmp_path / "node2"
    (source / "checkpoints" / "sub").mkdir(parents=True)
    (source / "checkpoints" / "checkpoint").write_text("index")
    (source / "checkpoints" / "sub" / "data").write_bytes(b"\x00\x01")
    (source / "checkpoints" / ".hidden").write_text("left out")
    (target / "checkpoints").mkdir(parents=True)
    (target / "checkpoints" / "stale").write_text("an older attempt's")
    packed = subprocess.run(
        [sys.executable, "-c", FOLDERS, "pack", str(source), "checkpoints", "model"],
        capture_output=True,
        check=True,
    ).stdout
    res = subprocess.run(
        [sys.executable, "-c", FOLDERS, "unpack", str(target), "replace"],
        input=packed,
        capture_output=True,
        check=True,
    )
    assert json.loads(res.stdout) == {"moved": 2, "removed": 1}
    got = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert got == ["checkpoints/checkpoint", "checkpoints/sub/data"]
    assert (target / "checkpoints" / "sub" / "data").read_bytes() == b"\x00\x01"
    assert not list(tmp_path.glob("*.incoming-*"))


def test_single_files_pack_and_unpack_at_the_top_of_the_folder(tmp_path: Path) -> None:
    """What only differs travels: `pack` of named files (as `tree` listed them), `unpack` of them
    into a staging folder, every one of them there (none silently left out)."""
    source = tmp_path / "node1" / "checkpoints"
    (source / "sub").mkdir(parents=True)
    (source / "checkpoint").write_text("index")
    (source / "sub" / "ckpt-40.index").write_text("data")
    (source / "other").write_text("not asked for")
    packed = subprocess.run(
        [sys.executable, "-c", FOLDERS, "pack", str(source), "checkpoint", "sub/ckpt-40.index", "gone"],
        capture_output=True,
        check=True,
    ).stdout
    staging = tmp_path / "node2" / "checkpoints" / ".incoming-ab"
    res = subprocess.run(
        [sys.executable, "-c", FOLDERS, "unpack", str(staging)], input=packed, capture_output=True, check=True
    )
    assert json.loads(res.stdout) == {"moved": 2, "removed": 0}
    got = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    assert got == ["checkpoint", "sub/ckpt-40.index"]


def test_unpack_refuses_a_member_outside_its_folder(tmp_path: Path) -> None:

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    res = subprocess.run(
        [sys.executable, "-c", FOLDERS, "unpack", str(tmp_path / "in")],
        input=buffer.getvalue(),
        capture_output=True,
    )
    assert res.returncode != 0 and b"refused tar member '../escape'" in res.stderr
    assert not (tmp_path / "escape").exists()


def test_unpack_makes_the_folders_it_needs_private(tmp_path: Path) -> None:
    """A node's copy of a run under /tmp/orchestrate-<uid>: that folder also holds the shim's port
    locks, which must be the user's alone (and the job's code is nobody else's business)."""

    from worker.host import shim

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("code/train.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    base = tmp_path / "orchestrate-0"
    folder = base / "runs" / "r1"
    subprocess.run(
        [sys.executable, "-c", FOLDERS, "unpack", str(folder)],
        input=buffer.getvalue(),
        capture_output=True,
        check=True,
    )
    for path in (base, base / "runs", folder):
        assert (path.stat().st_mode & 0o777) == 0o700, path
    assert (folder / "code" / "train.py").read_bytes() == b"ok"
    fd = shim._lock_port(str(base / "ports" / "n1-15000.lock"))  # the shim accepts the folder as ours
    assert fd is not None
    os.close(fd)


def test_a_snapshot_keeps_what_it_listed_whole_while_the_task_saves_and_removes(tmp_path: Path) -> None:
    """Issue 27: the owner's checkpoints are copied while it trains; what `tree … snapshot` lists
    stays as listed (hard links), whatever the task writes or removes meanwhile, and goes once
    packed; the folder's stamp moves with a new checkpoint, not with a snapshot."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "ckpt-10.index").write_bytes(b"i10")
    (ckpt / "ckpt-10.data-00000-of-00001").write_bytes(b"d" * 100)
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "ckpt-10"\n')
    before = probe("stamp", str(ckpt))["stamp"]
    out = probe("tree", str(ckpt), "snapshot")
    snap = ckpt / out["snapshot"]
    assert out["snapshot"].startswith(".orchestrate-snapshot-") and snap.is_dir()
    assert sorted(out["files"]) == ["checkpoint", "ckpt-10.data-00000-of-00001", "ckpt-10.index"]
    assert probe("stamp", str(ckpt))["stamp"] == before  # a hidden snapshot changes nothing
    # the task saves step 20 and removes step 10 (its manager keeps a few): the snapshot is whole
    (ckpt / "ckpt-20.index").write_bytes(b"i20")
    (ckpt / "checkpoint").unlink()
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "ckpt-20"\n')
    (ckpt / "ckpt-10.index").unlink()
    (ckpt / "ckpt-10.data-00000-of-00001").unlink()
    for rel, (size, digest) in out["files"].items():
        assert (
            hashlib.sha256((snap / rel).read_bytes()).hexdigest() == digest
            and (snap / rel).stat().st_size == size
        )
    assert probe("stamp", str(ckpt))["stamp"] != before
    packed = subprocess.run(
        [sys.executable, "-c", FOLDERS, "pack", str(snap), *out["files"]], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
        assert sorted(tar.getnames()) == sorted(out["files"])
    assert not snap.exists()  # used once: gone


def test_copy_carries_the_listed_files_through_a_shared_file_system_and_follows_no_symlink(
    tmp_path: Path,
) -> None:
    """Slurm nodes that see the run directory (issue 40): a node copies a folder's files into it,
    or from it, in place of a tar through srun's pipes."""
    source, staging = tmp_path / "ckpt", tmp_path / "run" / ".incoming-x"
    (source / "sub").mkdir(parents=True)
    (source / "ckpt-1.index").write_bytes(b"i" * 10)
    (source / "sub" / "data").write_bytes(b"d" * 3000)
    (tmp_path / "secret").write_text("not yours")
    (source / "link").symlink_to(tmp_path / "secret")
    said = probe("copy", str(source), str(staging), stdin=json.dumps(["ckpt-1.index", "sub/data"]))
    assert said == {"copied": 2, "bytes": 3010}
    assert (staging / "sub" / "data").read_bytes() == b"d" * 3000
    for bad in (["link"], ["../secret"]):
        res = subprocess.run(
            [sys.executable, "-c", FOLDERS, "copy", str(source), str(staging)],
            input=json.dumps(bad),
            capture_output=True,
            text=True,
        )
        assert res.returncode != 0 and not (staging / "link").exists(), res.stderr
    # a snapshot (tree's hard links, taken while a task saves) is used once: gone after
    snap = source / ".orchestrate-snapshot-1"
    snap.mkdir()
    (snap / "ckpt-1.index").write_bytes(b"i")
    probe("copy", str(snap), str(tmp_path / "again"), stdin=json.dumps(["ckpt-1.index"]))
    assert not snap.exists() and (tmp_path / "again" / "ckpt-1.index").exists()
