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
