"""Turn this process into one lab host's sshd (tests/lab.py, NetnsLab; standard library only).

Run as `nsenter --net=/run/netns/NS -- unshare --mount --uts --propagation private --
PYTHON -I -S tests/lab_host.py PLAN_JSON`: already in the host's own network, mount and UTS
namespaces, it

1. reads every file sshd will need (the files in the plan) and opens a descriptor on every folder
   to keep (the lab's shared folder, the Python install), before anything is hidden;
2. sets the host's name;
3. mounts an empty private tmpfs over each private folder (/tmp, /var/tmp, the host's home, the
   lab's scratch path...), parents first, and binds each kept folder back at its own path (through
   its descriptor: `/proc/self/fd/N`), read-only where the plan says so;
4. drops the lab's other network namespaces' names (/run/netns/*) from its view, so this host does
   not keep them alive;
5. writes the sshd files into its private space and execs `sshd -D` (this process's pid becomes
   sshd's pid; it logs to stderr, which the lab points at a file outside).

PLAN_JSON: {"hostname": str, "private": [[path, mode]], "keep": [[path, read_only]],
"files": [[source, target, mode]], "folders": [[path, mode]], "exec": [argv...]}.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 0x2

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source!r} on {target}: {os.strerror(err)}")


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


def main(plan: dict) -> None:
    # 1. everything from the outside, while it is still in view
    files = []
    for source, target, mode in plan["files"]:
        with open(source, "rb") as f:
            files.append((target, mode, f.read()))
    kept = []
    for path, read_only in plan["keep"]:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        kept.append((path, fd, read_only))

    # 2. a name of its own
    socket.sethostname(plan["hostname"])

    # 3. private folders, then the kept ones back on top; parents before children
    steps = [(path, "tmpfs", mode) for path, mode in plan["private"]]
    steps += [(path, "bind", (fd, read_only)) for path, fd, read_only in kept]
    for path, kind, arg in sorted(steps, key=lambda s: _depth(s[0])):
        os.makedirs(path, exist_ok=True)
        if kind == "tmpfs":
            _mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=%o" % arg)
        else:
            fd, read_only = arg
            _mount(b"/proc/self/fd/%d" % fd, path, None, MS_BIND | MS_REC, None)
            if read_only:
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    for _, fd, _ in kept:
        os.close(fd)

    # 4. the names of the other hosts' network namespaces stay outside
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted(points, key=_depth, reverse=True):
        if point.startswith("/run/netns/"):
            _libc.umount2(os.fsencode(point), MNT_DETACH)

    # 5. sshd's files in the private space, then sshd itself
    for path, mode in plan["folders"]:
        os.makedirs(path, mode=mode, exist_ok=True)
        os.chmod(path, mode)
    for target, mode, data in files:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(target, mode)
    os.chdir("/")
    argv = plan["exec"]
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
