"""Small jobs run on a lab host with its own Python (ssh and slurm backends).

The coordinator runs this file on each host as `PYTHON -c SOURCE MODE ARGS…` (nothing needs to
be installed there first). Standard library only; each mode prints one JSON object on stdout.
A state folder's modes (tree, commit, pack, unpack, shared) are worker/host/folders.py's.

- facts WORKDIR PORT…     Python, TensorFlow and psutil versions, GPUs, home, the work folder
                          (made absolute, created, writable?), its free disk, which TF ports are
                          free, and which of the files named on stdin (JSON list of SHA-256) its
                          cache (WORKDIR/cache) lacks.
- stacks                  whether py-spy can read a task here: tried on a child Python.
- listen PORT…            bind each port, print which bound, then accept and drop connections
                          until stdin closes (peers test that they can reach this host).
- connect TIMEOUT ADDR…   try a TCP connection to each host:port.
- mesh PORT WAIT_S ADDR:PORT…   as `node 0`, and while listening on PORT for WAIT_S seconds, try
                          a connection to each peer (one task per node of a Slurm step).
- node COUNT LOCK [PORT…] a Slurm node (one probe step per node): its facts as `facts` gives them,
                          which of the given TF ports are still free, COUNT more free ports (below
                          the ephemeral range, at random), and which of the files named on stdin
                          (JSON {path: expected text}) it sees with that content (a shared filesystem).
                          LOCK ("-" for none): the path of a port's lock with `{port}` in it; a
                          port whose lock another run's shim holds is not free (port_locked).

"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any


def facts(workdir: str, *ports: str) -> dict[str, Any]:
    wanted = json.loads(sys.stdin.read() or "[]")
    out: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "tensorflow": version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
        "psutil": version("psutil"),
        "home": os.path.expanduser("~"),
        "gpus": _gpus(),
        "memory": _memory(),
        "page_copy": page_copy(),  # why a standby's spare cannot copy its pages here, if so
    }
    path = os.path.abspath(os.path.expanduser(workdir))
    out["workdir"] = path
    try:
        os.makedirs(path, exist_ok=True)
        out["workdir_error"] = None if os.access(path, os.W_OK) else "not writable"
    except OSError as exc:
        out["workdir_error"] = str(exc)
    probe = path
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    usage = shutil.disk_usage(probe)
    out["disk_free_bytes"] = usage.free
    out["ports"] = {p: port_free(int(p)) for p in ports}
    cache = os.path.join(path, "cache")
    have = set(os.listdir(cache)) if os.path.isdir(cache) else set()
    out["missing"] = sorted(set(wanted) - have)
    return out


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def page_copy() -> str | None:
    """Why a warm standby's spares cannot copy their pages ahead of a handover here (None: they
    can): a kernel before Linux 5.14 (RHEL 8's 4.18: no MADV_POPULATE_WRITE), /proc/self/pagemap
    not readable. A task handed over then copies its pages as it first writes them, its first step
    slower than a cold task's (worker/warm/spare.py). `orchestrate check` says it per host, a
    standby as it is ready (wire.STANDBY_NO_PAGE_COPY), the run once per host."""
    try:
        if populating_madvise() is None:
            kernel = f"this kernel ({os.uname().release})"
            return f"{kernel} refuses madvise(MADV_POPULATE_WRITE): Linux 5.14 and later have it"
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            pagemap.read(8)
    except OSError as exc:
        return f"/proc/self/pagemap cannot be read: {exc.strerror or exc}"
    except Exception as exc:  # noqa: BLE001 - said, never fatal: the standby serves without the copy
        return f"{type(exc).__name__}: {exc}"
    return None


def populating_madvise() -> Any | None:
    """libc's madvise, typed, where this kernel knows MADV_POPULATE_WRITE (tried on a page of our
    own); None where it does not (EINVAL)."""
    import ctypes
    import mmap

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        if madvise(address, mmap.PAGESIZE, MADV_POPULATE_WRITE) == 0 or ctypes.get_errno() != errno.EINVAL:
            return madvise
        return None
    finally:
        with contextlib.suppress(BufferError):
            page.close()


def _memory() -> dict[str, int] | None:
    """This host's memory, bytes: what is available (what a warm standby would take) and in all."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return {"available": kib["MemAvailable"] * 1024, "total": kib["MemTotal"] * 1024}
    except (OSError, KeyError, ValueError, IndexError):
        return None


def version(*names: str) -> str | None:
    """A distribution's version from its .dist-info folder (importlib.metadata costs ~70 ms here)."""
    wanted = {n.replace("-", "_").lower() for n in names}
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for name in listing:
            if not name.endswith(".dist-info"):
                continue
            dist, _, rest = name[: -len(".dist-info")].partition("-")
            if dist.replace("-", "_").lower() in wanted and rest:
                return rest
    return None


def _gpus() -> dict[str, Any] | None:
    """GPU names, driver and CUDA version from nvidia-smi; None when the host has no NVIDIA driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"names": [], "driver": None, "cuda": None, "error": str(exc)}
    rows = [[c.strip() for c in line.split(",")] for line in listing.stdout.splitlines() if line.strip()]
    cuda = None
    for part in banner.stdout.split("|"):
        if "CUDA Version:" in part:
            cuda = part.split("CUDA Version:", 1)[1].split()[0]
    error = (listing.stderr or listing.stdout).strip()[-200:] if listing.returncode != 0 else None
    return {
        "names": [r[0] for r in rows] if listing.returncode == 0 else [],
        "driver": rows[0][1] if rows and len(rows[0]) > 1 else None,
        "cuda": cuda,
        "error": error,
    }


def port_free(port: int) -> bool:
    # TensorFlow's gRPC server binds every interface; test the same way.
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue
            return False
    return True


def port_locked(template: str, port: int) -> bool:
    """True while another process holds the port's lock (a task of another run on this node)."""
    if template == "-":
        return False
    try:
        fd = os.open(template.replace("{port}", str(port)), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: nobody has held it here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def node(count: str, lock: str = "-", *ports: str) -> dict[str, Any]:
    wanted = json.loads(sys.stdin.read() or "{}")
    seen = {}
    for path, text in wanted.items():
        try:
            with open(path, encoding="utf-8") as f:
                seen[path] = f.read(4096) == text
        except (OSError, ValueError):
            seen[path] = False
    high = 32768  # the kernel's ephemeral range starts here unless it says otherwise
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/sys/net/ipv4/ip_local_port_range") as f,
    ):
        high = int(f.read().split()[0])
    high = max(16000, high)
    chosen: list[int] = []
    rng = random.SystemRandom()
    taken = {int(p) for p in ports}
    for _ in range(500 + 100 * int(count)):
        if len(chosen) >= int(count):
            break
        port = rng.randrange(15000, high)  # as the local backend's ports (orchestrator/launch/local/ports.py)
        if port not in taken and port not in chosen and port_free(port) and not port_locked(lock, port):
            chosen.append(port)
    return {
        "hostname": socket.gethostname(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "tensorflow": version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"),
        "gpus": _gpus(),
        "ports": {p: port_free(int(p)) and not port_locked(lock, int(p)) for p in ports},
        "free": chosen,
        "seen": seen,
    }


def mesh(port: str, wait_s: str, *peers: str) -> dict[str, Any]:
    out = node("0", "-")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", int(port)))
        server.listen(64)
        server.settimeout(0.2)
    except OSError as exc:
        out["listen_error"] = str(exc)
    end = time.monotonic() + float(wait_s)

    def accept() -> None:
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                server.accept()[0].close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    time.sleep(min(1.0, float(wait_s) / 3))  # the peers' tasks start about together
    reached = {}
    for peer in peers:
        host, _, p = peer.rpartition(":")
        try:
            with socket.create_connection((host, int(p)), timeout=max(0.5, end - time.monotonic() - 0.5)):
                reached[peer] = True
        except OSError:
            reached[peer] = False
    t.join()
    server.close()
    out["reached"] = reached
    out["stacks"] = stacks()
    return out


#: A process py-spy is tried on: it lets its parent (this probe) read it, as the task's runtime
#: lets the shim or the coordinator (worker/host/stacks.py), then waits for its stdin to close.
_READ_ME = (
    "import ctypes, os, sys\n"
    "try:\n    ctypes.CDLL(None).prctl(0x59616D61, os.getppid(), 0, 0, 0)\nexcept Exception:\n    pass\n"
    "print('ready', flush=True)\nsys.stdin.read()\n"
)


def stacks() -> dict[str, Any]:
    """Whether a hung task's native stacks can be read here (`orchestrate check`): py-spy, found
    as the shim finds it, tried on a child Python; else why not."""
    scope = None
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/yama/ptrace_scope") as f:
        scope = int(f.read())
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    py_spy = beside if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if py_spy is None:
        return {"native": False, "why": "py-spy not installed", "ptrace_scope": scope}
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", _READ_ME], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
        res = subprocess.run(
            [py_spy, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=10
        )
        said = res.stderr.split("Stack backtrace:")[0].strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        res, said = None, [str(exc)]
    finally:
        child.kill()
        child.wait()
    if res is not None and res.returncode == 0:
        return {"native": True, "why": None, "ptrace_scope": scope, "py_spy": py_spy}
    why = said[-1] if said else "py-spy failed"
    if "ermission" in why or "not permitted" in why:
        why = f"ptrace refused: kernel.yama.ptrace_scope={scope}" if scope else f"ptrace refused ({why})"
    return {"native": False, "why": why[:300], "ptrace_scope": scope, "py_spy": py_spy}


def listen(*ports: str) -> None:
    bound: dict[str, str | None] = {}
    socks = []
    for p in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", int(p)))
            s.listen(64)
        except OSError as exc:
            s.close()
            bound[p] = str(exc)
            continue
        bound[p] = None
        socks.append(s)
        threading.Thread(target=_accept_forever, args=(s,), daemon=True).start()
    print(json.dumps(bound), flush=True)
    deadline = time.monotonic() + 120  # never outlive a forgotten check
    reader = threading.Thread(target=sys.stdin.read, daemon=True)
    reader.start()
    reader.join(timeout=max(0.0, deadline - time.monotonic()))


def _accept_forever(s: socket.socket) -> None:
    while True:
        try:
            conn, _ = s.accept()
        except OSError:
            return
        conn.close()


def connect(timeout_s: str, *targets: str) -> dict[str, str | None]:
    results: dict[str, str | None] = {}

    def one(target: str) -> None:
        host, _, port = target.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=float(timeout_s)):
                results[target] = None
        except OSError as exc:
            results[target] = str(exc) or type(exc).__name__

    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(argv: list[str]) -> int:
    mode, args = argv[0], argv[1:]
    if mode == "listen":
        listen(*args)
        return 0
    handlers: dict[str, Any] = {
        "facts": facts,
        "connect": connect,
        "node": node,
        "mesh": mesh,
        "stacks": stacks,
    }
    print(json.dumps(handlers[mode](*args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
