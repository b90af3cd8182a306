"""worker/probe.py, run as the ssh backend runs it (`python -c SOURCE MODE …`), on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROBE = (Path(__file__).resolve().parents[2] / "worker" / "probe.py").read_text()

# What nvidia-smi prints on a machine with two GPUs (driver 550, CUDA 12.4), trimmed.
FAKE_NVIDIA_SMI = """#!/bin/sh
if [ "$1" = "--query-gpu=name,driver_version" ]; then
  printf 'NVIDIA H100 80GB HBM3, 550.54.15\\nNVIDIA H100 80GB HBM3, 550.54.15\\n'
else
  echo '| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |'
fi
"""


def probe(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", PROBE, *args], input=stdin, capture_output=True, text=True, env=env, check=True
    )
    return json.loads(res.stdout)


def test_facts_versions_match_importlib_metadata(tmp_path: Path) -> None:
    facts = probe("facts", str(tmp_path / "w"))
    assert facts["tensorflow"] == metadata.version("tensorflow")
    assert facts["psutil"] == metadata.version("psutil")
    assert facts["python"] == ".".join(map(str, sys.version_info[:3]))
    assert facts["workdir"] == str(tmp_path / "w") and (tmp_path / "w").is_dir()
    assert facts["workdir_error"] is None and facts["disk_free_bytes"] > 0


def test_facts_reports_gpus_and_cuda_from_nvidia_smi(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    gpus = probe("facts", str(tmp_path / "w"), env=env)["gpus"]
    assert gpus == {
        "names": ["NVIDIA H100 80GB HBM3"] * 2,
        "driver": "550.54.15",
        "cuda": "12.4",
        "error": None,
    }


def test_facts_says_which_files_the_cache_lacks_and_which_ports_are_busy(tmp_path: Path) -> None:
    import socket

    (tmp_path / "w" / "cache").mkdir(parents=True)
    (tmp_path / "w" / "cache" / "aaa").write_text("x")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        facts = probe("facts", str(tmp_path / "w"), str(port), stdin=json.dumps(["aaa", "bbb"]))
    assert facts["missing"] == ["bbb"]
    assert facts["ports"] == {str(port): False}


# --- state folders: tree and commit (checkpoints between hosts that share no disk) ---


def test_tree_lists_files_with_checksums_and_leaves_out_scratch_hidden_and_symlinks(tmp_path):
    import hashlib

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
        "ns = {'__name__': 'probe'}\n"
        f"exec(compile({PROBE!r}, 'probe.py', 'exec'), ns)\n"
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


def test_node_chooses_free_ports_and_avoids_one_another_runs_shim_holds(tmp_path: Path) -> None:
    from worker import shim

    locks = tmp_path / "locks"
    template = str(locks / "ports" / "n1-{port}.lock")
    held_port = 15000
    held = shim._lock_port(template.replace("{port}", str(held_port)))  # as a running task's shim does
    assert held is not None
    try:
        assert (locks.stat().st_mode & 0o777) == 0o700
        assert shim._lock_port(template.replace("{port}", str(held_port))) is None  # a second run's task
        seen = str(tmp_path / "seen.txt")
        Path(seen).write_text("nonce")
        answer = probe("node", "3", template, str(held_port), stdin=json.dumps({seen: "nonce", "/nope": "x"}))
        assert answer["ports"] == {str(held_port): False}  # its lock is held: not ours to take
        assert len(set(answer["free"])) == 3 and held_port not in answer["free"]
        assert all(15000 <= p < 65536 for p in answer["free"])
        assert answer["seen"] == {seen: True, "/nope": False}
    finally:
        os.close(held)
    assert probe("node", "0", template, str(held_port))["ports"] == {str(held_port): True}  # released


def test_a_port_lock_folder_another_user_could_own_is_refused(tmp_path: Path) -> None:
    from worker import shim

    (tmp_path / "ports").mkdir(mode=0o777)
    os.chmod(tmp_path / "ports", 0o777)  # not private: someone else could swap the lock files
    try:
        shim._lock_port(str(tmp_path / "ports" / "n1-1.lock"))
    except OSError as exc:
        assert "not a private folder" in str(exc)
    else:
        raise AssertionError("a shared lock folder was used")


def test_pack_and_unpack_carry_a_folder_and_replace_what_the_target_held(tmp_path: Path) -> None:
    source, target = tmp_path / "node1", tmp_path / "node2"
    (source / "checkpoints" / "sub").mkdir(parents=True)
    (source / "checkpoints" / "checkpoint").write_text("index")
    (source / "checkpoints" / "sub" / "data").write_bytes(b"\x00\x01")
    (source / "checkpoints" / ".hidden").write_text("left out")
    (target / "checkpoints").mkdir(parents=True)
    (target / "checkpoints" / "stale").write_text("an older attempt's")
    packed = subprocess.run(
        [sys.executable, "-c", PROBE, "pack", str(source), "checkpoints", "model"],
        capture_output=True,
        check=True,
    ).stdout
    res = subprocess.run(
        [sys.executable, "-c", PROBE, "unpack", str(target), "replace"],
        input=packed,
        capture_output=True,
        check=True,
    )
    assert json.loads(res.stdout) == {"moved": 2, "removed": 1}
    got = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert got == ["checkpoints/checkpoint", "checkpoints/sub/data"]
    assert (target / "checkpoints" / "sub" / "data").read_bytes() == b"\x00\x01"
    assert not list(tmp_path.glob("*.incoming-*"))


def test_unpack_refuses_a_member_outside_its_folder(tmp_path: Path) -> None:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    res = subprocess.run(
        [sys.executable, "-c", PROBE, "unpack", str(tmp_path / "in")],
        input=buffer.getvalue(),
        capture_output=True,
    )
    assert res.returncode != 0 and b"refused tar member '../escape'" in res.stderr
    assert not (tmp_path / "escape").exists()


def test_unpack_makes_the_folders_it_needs_private(tmp_path: Path) -> None:
    """A node's copy of a run under /tmp/orchestrate-<uid>: that folder also holds the shim's port
    locks, which must be the user's alone (and the job's code is nobody else's business)."""
    import io
    import tarfile

    from worker import shim

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("code/train.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    base = tmp_path / "orchestrate-0"
    folder = base / "runs" / "r1"
    subprocess.run(
        [sys.executable, "-c", PROBE, "unpack", str(folder)],
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
