"""worker/host/probe.py, run as the ssh backend runs it (`python -c SOURCE MODE …`), on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROBE = (Path(__file__).resolve().parents[2] / "worker" / "host" / "probe.py").read_text()

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


def test_node_chooses_free_ports_and_avoids_one_another_runs_shim_holds(tmp_path: Path) -> None:
    from worker.host import shim

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
    from worker.host import shim

    (tmp_path / "ports").mkdir(mode=0o777)
    os.chmod(tmp_path / "ports", 0o777)  # not private: someone else could swap the lock files
    try:
        shim._lock_port(str(tmp_path / "ports" / "n1-1.lock"))
    except OSError as exc:
        assert "not a private folder" in str(exc)
    else:
        raise AssertionError("a shared lock folder was used")
