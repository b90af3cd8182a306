"""Host side of `environment:` (orchestrator/environment/): the job's Python environment on a host,
built once from wheels the coordinator sent, reused by every later run.

The coordinator runs this file with the interpreter that makes the environment, as `PYTHON -S -c
SOURCE MODE WORKDIR KEY` (standard library only; nothing installed there first). Each mode reads
a manifest, one JSON line on stdin: {"wheels": [{"file", "sha256", "size"}], "uv": {"file",
"sha256"}, "keep": N}. The wheels lie in the host's file cache, `WORKDIR/cache/<sha256>` (the same
cache as the job's files; the coordinator sends what it lacks).

- ready WORKDIR KEY   {"target": …, "ready": bool, "python": …, "missing": [sha256…]}: whether
                      `WORKDIR/envs/KEY` is complete, the interpreter's wheel tags (`target`), and
                      which files the cache lacks. A ready environment's last use is stamped.
- build WORKDIR KEY   builds it; one JSON line per step on stdout ({"step": …}), the last one the
                      answer ({"ready": true, "python": …, "packages": N, "seconds": S} or
                      {"missing": [...]}, files removed meanwhile). Stdin stays open while the
                      coordinator waits: its end (the coordinator stopped, died or lost the
                      host) stops the build, and the part built is removed.

Layout under WORKDIR: `envs/KEY/` complete environments only: each is built in `envs/.part-KEY-*`
(uv's relocatable venv, then `uv pip install` of exactly the manifest's wheels, no index, no
dependency resolution) and renamed into place with its marker (`.orchestrate-env`, the manifest)
inside, so a build cut short, a full disk or a killed coordinator leave nothing a later run uses.
One build per KEY at a time (`envs/.KEY.lock`). `tools/uv-<sha256>`: uv, unpacked from its wheel.
`uv-cache/`: uv's cache (its files hard-linked into the environments: a changed requirement
builds a new environment in about a second).

Beyond the newest `keep` environments (by last use), older ones are removed after a build, but
never one a task uses: each task holds a shared lock on its environment's marker while it lives
(`hold`, called by the worker at start); removal takes it exclusively, without waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from typing import Any

MARKER = ".orchestrate-env"
_HELD: list[int] = []  # the descriptor of this process's environment's marker (hold)


def target() -> dict[str, Any]:
    """What decides which wheels this interpreter installs (orchestrator/environment/target.py)."""
    glibc = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        name, _, ver = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        glibc = ver if name == "glibc" else None
    major, minor = sys.version_info[:2]
    return {
        "implementation": sys.implementation.name,
        "version": f"{major}.{minor}",
        "abi": f"cp{major}{minor}{'t' if sysconfig.get_config_var('Py_GIL_DISABLED') else ''}",
        "platform": sysconfig.get_platform(),
        "glibc": glibc,
        "executable": sys.executable,
    }


def hold() -> None:
    """Keep this process's environment (`environment:`'s, where it runs in one) from removal while
    it lives: a shared lock on its marker. Elsewhere nothing happens."""
    path = os.path.join(sys.prefix, MARKER)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal that had begun (it moves the folder away)
    if not os.path.exists(path):
        raise SystemExit(
            f"this task's environment {sys.prefix} was removed as it started; start the run again"
        )
    _HELD.append(fd)


def _own_dir(path: str) -> str:
    """A folder of ours (made 0700 where missing); never a symlink or another user's."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SystemExit(f"{path} is not a folder of this user's; remove it or choose another work folder")
    return path


def _manifest() -> dict[str, Any]:
    line = sys.stdin.readline().strip()
    return json.loads(line) if line else {}


def _wanted(manifest: dict[str, Any]) -> list[str]:
    return [w["sha256"] for w in manifest.get("wheels", [])] + [manifest["uv"]["sha256"]]


def _missing(workdir: str, manifest: dict[str, Any]) -> list[str]:
    cache = os.path.join(workdir, "cache")
    have = set(os.listdir(cache)) if os.path.isdir(cache) else set()
    return sorted(set(_wanted(manifest)) - have)


def ready(workdir: str, key: str) -> dict[str, Any]:
    manifest = _manifest()
    workdir = os.path.abspath(os.path.expanduser(workdir))
    env = os.path.join(workdir, "envs", key)
    out: dict[str, Any] = {"target": target(), "python": os.path.join(env, "bin", "python")}
    out["folder"] = _folder_id(_own_dir(os.path.join(_own_dir(workdir), "envs")))
    marker = os.path.join(env, MARKER)
    if key != "-" and os.path.isfile(marker) and not os.path.islink(marker):
        with contextlib.suppress(OSError):
            os.utime(marker)  # its last use: removal keeps the newest
        return {**out, "ready": True, "missing": []}
    return {**out, "ready": False, "missing": _missing(workdir, manifest) if manifest else []}


def _folder_id(root: str) -> str:
    """The environments folder's own id: hosts that share it (an NFS home, a cluster's shared
    work folder) report the same one, and the coordinator builds there once."""
    path = os.path.join(root, ".id")
    if not os.path.isfile(path):
        part = os.path.join(root, f".id-{secrets.token_hex(4)}")
        with open(part, "x", encoding="utf-8") as f:
            f.write(secrets.token_hex(16))
        with contextlib.suppress(FileExistsError):
            os.link(part, path)  # the first host's id stays: a link never replaces
        os.unlink(part)
    with open(path, encoding="utf-8") as f:
        return f.read(64)


def _say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class _Lifeline:
    """Stdin's end stops the build: the running uv is killed, the caller removes the part."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:  # the descriptor itself: stdin's buffer has a lock that exiting would wait on
            try:
                if not os.read(0, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        self.gone.set()
        child = self.child
        if child is not None:
            with contextlib.suppress(OSError):
                child.kill()

    def run(self, argv: list[str], what: str) -> None:
        if self.gone.is_set():
            raise SystemExit("the coordinator went away; build stopped")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_", "VIRTUAL_ENV"))}
        env.update(UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never", UV_OFFLINE="1", UV_NO_PROGRESS="1")
        self.child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        out = self.child.communicate()[0].decode(errors="replace")
        if self.gone.is_set():
            raise SystemExit("the coordinator went away; build stopped")
        if self.child.returncode != 0:
            raise SystemExit(f"{what} failed (exit {self.child.returncode}): {out.strip()[-1500:]}")


def _uv(workdir: str, wheel: dict[str, str]) -> str:
    """uv's binary, unpacked once from its wheel in the cache."""
    tools = _own_dir(os.path.join(workdir, "tools"))
    path = os.path.join(tools, f"uv-{wheel['sha256']}")
    if os.path.isfile(path):
        return path
    part = os.path.join(tools, f".uv-{secrets.token_hex(4)}")
    with zipfile.ZipFile(os.path.join(workdir, "cache", wheel["sha256"])) as z:
        member = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
        with z.open(member) as src, open(part, "xb") as dst:
            shutil.copyfileobj(src, dst)
    os.chmod(part, 0o700)
    os.replace(part, path)
    return path


def build(workdir: str, key: str) -> dict[str, Any]:
    manifest = _manifest()
    started = time.monotonic()
    workdir = os.path.abspath(os.path.expanduser(workdir))
    _own_dir(workdir)
    root = _own_dir(os.path.join(workdir, "envs"))
    lock = os.open(
        os.path.join(root, f".{key}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    fcntl.flock(lock, fcntl.LOCK_EX)  # another run building the same one: its result is ours
    final = os.path.join(root, key)
    python = os.path.join(final, "bin", "python")
    wheels = manifest["wheels"]
    if os.path.isfile(os.path.join(final, MARKER)):
        return {"ready": True, "python": python, "packages": len(wheels), "seconds": 0.0, "built": False}
    missing = _missing(workdir, manifest)
    if missing:  # removed since `ready` (another run's clean-up): the coordinator sends them again
        return {"missing": missing}
    _sweep(root)
    lifeline = _Lifeline()
    nonce = secrets.token_hex(4)
    part, links = (os.path.join(root, f".{kind}-{key}-{nonce}") for kind in ("part", "wheels"))
    try:
        uv = _uv(workdir, manifest["uv"])
        _say(step="venv")
        lifeline.run([uv, "venv", "--quiet", "--relocatable", "--python", sys.executable, part], "uv venv")
        os.mkdir(links, 0o700)
        for w in wheels:  # uv reads a wheel's name and tags from its file name
            _link(
                os.path.join(workdir, "cache", w["sha256"]), os.path.join(links, os.path.basename(w["file"]))
            )
        _say(step="install", packages=len(wheels))
        cache = os.path.join(workdir, "uv-cache")
        files = [os.path.join(links, os.path.basename(w["file"])) for w in wheels]
        argv = [uv, "pip", "install", "--quiet", "--no-index", "--no-deps", "--cache-dir", cache]
        with _locked(os.path.join(root, ".uv-cache.lock"), fcntl.LOCK_SH):  # not cleared meanwhile
            lifeline.run([*argv, "--python", os.path.join(part, "bin", "python"), *files], "uv pip install")
        with open(os.path.join(part, MARKER), "x", encoding="utf-8") as f:
            json.dump({"key": key, "base": sys.executable, "built": time.time(), **manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(part, final)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(links, ignore_errors=True)
    removed = _prune(workdir, root, keep=int(manifest.get("keep", 3)), current=key)
    seconds = round(time.monotonic() - started, 3)
    return {
        "ready": True,
        "python": python,
        "packages": len(wheels),
        "seconds": seconds,
        "built": True,
        "removed": removed,
    }


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copyfile(source, target)


def _sweep(root: str) -> None:
    """What builds cut short left (their lock is free: nobody builds them) and removals' trash."""
    for name in os.listdir(root):
        kind, _, rest = name[1:].partition("-")
        if not name.startswith(".") or kind not in ("part", "wheels", "trash"):
            continue
        key = rest.rsplit("-", 1)[0]
        lock_path = os.path.join(root, f".{key}.lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = None
        try:
            if fd is not None and kind != "trash":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: that build is going on
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:
            continue
        finally:
            if fd is not None:
                os.close(fd)


def _prune(workdir: str, root: str, *, keep: int, current: str) -> list[str]:
    """Environments beyond the newest `keep` (by last use) that no task holds, removed; with them
    their wheels no kept environment names, and uv's cache (rebuilt as needed)."""
    found = []
    for name in os.listdir(root):
        marker = os.path.join(root, name, MARKER)
        if name.startswith(".") or not os.path.isfile(marker):
            continue
        found.append((name == current, os.stat(marker).st_mtime, name))
    found.sort(reverse=True)
    kept, removed, freed = [n for _, _, n in found[:keep]], [], set[str]()
    for _, _, name in found[keep:]:
        marker = os.path.join(root, name, MARKER)
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a task in it holds it shared
        except OSError:
            os.close(fd)
            kept.append(name)
            continue
        try:
            with open(marker, encoding="utf-8") as f:
                freed.update(w["sha256"] for w in json.load(f).get("wheels", []))
            trash = os.path.join(root, f".trash-{name}-{secrets.token_hex(4)}")
            os.rename(os.path.join(root, name), trash)
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, f".{name}.lock"))
        removed.append(name)
    if removed:
        for name in kept:
            with open(os.path.join(root, name, MARKER), encoding="utf-8") as f:
                freed.difference_update(w["sha256"] for w in json.load(f).get("wheels", []))
        for digest in freed:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(workdir, "cache", digest))
        with (
            contextlib.suppress(OSError),
            _locked(os.path.join(root, ".uv-cache.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB),
        ):
            shutil.rmtree(os.path.join(workdir, "uv-cache"), ignore_errors=True)  # no build uses it now
    return removed


@contextlib.contextmanager
def _locked(path: str, how: int) -> Any:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    modes = {"ready": ready, "build": build}
    if len(argv) != 3 or argv[0] not in modes:
        sys.stderr.write("usage: environment.py ready|build WORKDIR KEY\n")
        return 2
    _say(**modes[argv[0]](argv[1], argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
