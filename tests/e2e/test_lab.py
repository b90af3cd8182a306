"""The SSH test lab itself (tests/lab.py): as root, its hosts are as separate as real machines, seen
over real SSH (the OpenSSH client, nothing of ours): a disk and a hostname of their own, one shared
folder, and the same Python everywhere."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from tests.lab import NetnsLab, can_netns, why_no_lab

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or ""),
    pytest.mark.skipif(not can_netns(), reason="separate hosts need namespaces (root, ip, nsenter)"),
    pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client (openssh-client)"),
]

# Run on a host with its python: writes host's name into each path (if asked), says what it sees.
LOOK = """
import json, os, socket, sys
paths, write = json.loads(sys.argv[1]), sys.argv[2] == "write"
for p in paths if write else []:
    with open(os.path.expanduser(p), "w") as f:
        f.write(socket.gethostname())
seen = {}
for p in paths:
    try:
        seen[p] = open(os.path.expanduser(p)).read()
    except OSError:
        seen[p] = None
print(json.dumps({"hostname": socket.gethostname(), "prefix": sys.prefix, "seen": seen}))
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = NetnsLab(tmp_path_factory.mktemp("lab"), 2)
    yield lab
    lab.close()


def on_host(lab: NetnsLab, i: int, paths: list[str], write: bool = False) -> dict:
    h = lab.hosts[i]
    command = shlex.join([sys.executable, "-c", LOOK, json.dumps(paths), "write" if write else "look"])
    ssh = [
        "ssh",
        "-i",
        str(lab.client_key),
        "-o",
        f"UserKnownHostsFile={lab.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "ConnectTimeout=5",
        "-p",
        str(h.ssh_port),
        f"root@{h.address}",
        command,
    ]
    res = subprocess.run(ssh, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_hosts_have_their_own_disk_and_name_and_share_one_folder(lab):
    name = f"lab-{secrets.token_hex(4)}"
    own = [f"/tmp/{name}", f"/var/tmp/{name}", str(lab.scratch / name), f"~/{name}"]
    shared = str(lab.shared / name)
    written = on_host(lab, 0, [*own, shared], write=True)
    assert written["hostname"] == "h0"
    assert all(v == "h0" for v in written["seen"].values()), written

    other = on_host(lab, 1, [*own, shared, str(lab.hosts[0].home / name)])
    assert other["hostname"] == "h1" != socket.gethostname()
    assert other["seen"][shared] == "h0"  # the shared folder is one
    assert all(other["seen"][p] is None for p in own), other  # host 0's files are on host 0 only
    assert other["seen"][str(lab.hosts[0].home / name)] is None
    # the same Python on each host: a lab's shared install
    assert written["prefix"] == other["prefix"] == sys.prefix

    # outside: only the shared file; host 0's own files through its path()
    h0, h1 = lab.hosts[0], lab.hosts[1]
    assert (lab.shared / name).read_text() == "h0"
    home_file = h0.home / name
    for path in [f"/tmp/{name}", f"/var/tmp/{name}", str(lab.scratch / name), str(home_file)]:
        assert not os.path.exists(path), path
        assert h0.path(path).read_text() == "h0"
        assert not h1.path(path).exists()
    assert h1.path(lab.shared / name).read_text() == "h0"

    # a command run "on" a host gets its name and its disk
    res = subprocess.run(
        [*h1.exec_prefix(), "cat", "/proc/sys/kernel/hostname"], capture_output=True, text=True
    )
    assert res.stdout.strip() == "h1"
    res = subprocess.run([*h0.exec_prefix(), "cat", f"/tmp/{name}"], capture_output=True, text=True)
    assert res.stdout == "h0"
    # nothing else of this machine's private folders shows on a host (pytest's folders live in /tmp)
    if str(lab.root.resolve()).startswith("/tmp/"):
        assert not h0.path(lab.known_hosts).exists() and not h0.path(lab.client_key).exists()
