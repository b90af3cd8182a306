"""Host side of `environment:` (docs/environment.md): the job's Python environment on a host, built
once from wheels the coordinator sent (they lie in its file cache, `WORKDIR/cache/<sha256>`).

Run with the interpreter that makes it, as `PYTHON -S -c SOURCE MODE WORKDIR KEY` (standard
library only), a manifest on stdin (one JSON line: {"wheels": [{"file", "sha256", "size"}],
"uv": {…}, "keep": N}):
- ready: {"target", "ready", "python", "missing": [sha256…], "folder": its folder's id}; a ready
  environment's last use is stamped.
- build: one JSON line per step ({"step": …}), the last the answer ({"ready": true, "python", …}
  or {"missing": […]}). Stdin's end (the coordinator gone) stops it; the part built is removed.

`envs/KEY/` holds complete environments only: built in `envs/.part-KEY-*` (uv: a relocatable
venv, exactly the manifest's wheels, no index, no resolution), renamed into place with their
marker (`.orchestrate-env`) inside. One build per KEY at a time (`envs/.KEY.lock`); old ones
removed beyond `keep`, never one a task holds (`hold`, the worker at start: a shared lock on its
marker), nor one asked for within GRACE_S.
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
ENV_ENVIRONMENT = "ORCHESTRATE_ENVIRONMENT"  # a task's environment folder, as its placement says
GRACE_S = 600.0  # an environment asked for this recently is never removed (a run about to start in it)


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


def _missing(workdir: str, manifest: dict[str, Any]) -> list[str]:
    cache = os.path.join(workdir, "cache")
    have = set(os.listdir(cache)) if os.path.isdir(cache) else set()
    return sorted({w["sha256"] for w in [*manifest.get("wheels", []), manifest["uv"]]} - have)


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
    print(json.dumps(fields), flush=True)


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


def unpack_uv(workdir: str, wheel: dict[str, Any]) -> str:
    """uv's binary, unpacked once from its wheel in the cache."""
    tools = _own_dir(os.path.join(workdir, "tools"))
    path = os.path.join(tools, f"uv-{wheel['sha256']}")
    if os.path.isfile(path):
        return path
    for name in os.listdir(tools):  # an unpacking cut short (an hour is ample for 40 MB)
        with contextlib.suppress(OSError):
            if name.startswith(".uv-") and os.stat(os.path.join(tools, name)).st_mtime < time.time() - 3600:
                os.unlink(os.path.join(tools, name))
    part = os.path.join(tools, f".uv-{secrets.token_hex(4)}")
    with zipfile.ZipFile(os.path.join(workdir, "cache", wheel["sha256"])) as z:
        member = next((n for n in z.namelist() if n.endswith(".data/scripts/uv")), None)
        if member is None:
            raise SystemExit(f"{wheel['file']} holds no uv binary")
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
    lock = _lock(os.path.join(root, f".{key}.lock"), fcntl.LOCK_EX)  # another run's build of it: ours
    assert lock is not None
    final = os.path.join(root, key)
    python = os.path.join(final, "bin", "python")
    wheels = manifest["wheels"]
    if os.path.isfile(os.path.join(final, MARKER)):
        return {"ready": True, "python": python, "packages": len(wheels), "seconds": 0.0, "built": False}
    _sweep(root, key)
    lifeline = _Lifeline()
    nonce = secrets.token_hex(4)
    part = os.path.join(root, f".part-{key}-{nonce}")
    try:
        uv = unpack_uv(workdir, manifest["uv"])
        _say(step="venv")
        lifeline.run([uv, "venv", "--quiet", "--relocatable", "--python", sys.executable, part], "uv venv")
        _say(step="install", packages=len(wheels))
        with _locked(os.path.join(root, ".uv-cache.lock"), fcntl.LOCK_SH):  # no clean-up meanwhile
            if missing := _missing(workdir, manifest):  # cleaned up since the look above
                raise _Missing(missing)
            files = [_named(workdir, w) for w in wheels]
            argv = install_argv(uv, os.path.join(workdir, "uv-cache"), f"{part}/bin/python")
            lifeline.run([*argv, *files], "uv pip install")
        with open(os.path.join(part, MARKER), "x", encoding="utf-8") as f:
            json.dump({"key": key, "base": sys.executable, "built": time.time(), **manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(part, final)
    except BaseException as exc:
        shutil.rmtree(part, ignore_errors=True)
        if isinstance(exc, _Missing):
            return {"missing": exc.args[0]}
        raise
    removed = _prune(workdir, root, keep=int(manifest.get("keep", 3)), current=key)
    out = {"ready": True, "python": python, "packages": len(wheels), "built": True, "removed": removed}
    return {**out, "seconds": round(time.monotonic() - started, 3)}


def install_argv(uv: str, cache: str, python: str) -> list[str]:
    """uv installing wheels (the files follow) into the environment of `python`, from them alone,
    their bytecode compiled as pip does (uv's default leaves it to each first import: where tasks
    run with PYTHONDONTWRITEBYTECODE=1, as in many images, every task and standby start would
    compile TensorFlow's modules again; elsewhere each host's first start pays it and writes into
    the environment: scripts/bench/environment.py `imports`)."""
    return [
        uv,
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--compile-bytecode",
        "--cache-dir",
        cache,
        "--python",
        python,
    ]


class _Missing(Exception):
    """Wheels removed by a clean-up since the build looked: the coordinator sends them again."""


def _named(workdir: str, wheel: dict[str, Any]) -> str:
    """The wheel under its own name (uv reads its name and tags there), at a path that never
    changes: uv keeps what it unpacked by the wheel's path, so a later environment with the same
    wheel links its files from uv's cache instead of unpacking it again."""
    folder = _own_dir(os.path.join(_own_dir(os.path.join(workdir, "wheels")), wheel["sha256"]))
    path = os.path.join(folder, os.path.basename(wheel["file"]))
    if not os.path.isfile(path):
        part = f"{path}.{secrets.token_hex(4)}"
        _link(os.path.join(workdir, "cache", wheel["sha256"]), part)
        os.replace(part, path)
    return path


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copyfile(source, target)


def _sweep(root: str, mine: str) -> None:
    """What builds cut short left (nobody holds their key's lock: nobody builds them; `mine`'s
    lock is this build's own) and removals' trash."""
    for name in os.listdir(root):
        kind, _, rest = name[1:].partition("-")
        if not name.startswith(".") or kind not in ("part", "trash"):
            continue
        key = rest.rsplit("-", 1)[0]
        if kind == "trash" or key == mine:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            continue
        fd = _lock(os.path.join(root, f".{key}.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            continue  # that build is going on
        try:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        finally:
            os.close(fd)


def _lock(path: str, how: int) -> int | None:
    """An flock on the file at `path` (made where missing); None where LOCK_NB finds it held. A
    clean-up may remove the file meanwhile: the lock is then taken again on the one there now, so
    two holders of "the" lock are never on different files."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, how)
        except OSError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _prune(workdir: str, root: str, *, keep: int, current: str) -> list[str]:
    """Environments beyond the newest `keep` (by last use) that no task holds and no run asked for
    in the last GRACE_S, removed; with them their wheels no kept environment names, and uv's cache
    (rebuilt as needed). One clean-up at a time (another going on: this one is skipped); a
    failure here never fails the build that came before it."""
    guard = _lock(os.path.join(root, ".prune.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if guard is None:
        return []
    try:
        found = []
        for name in os.listdir(root):
            with contextlib.suppress(OSError):
                if not name.startswith("."):
                    found.append((name == current, os.stat(os.path.join(root, name, MARKER)).st_mtime, name))
        found.sort(reverse=True)
        recent = time.time() - GRACE_S
        kept = [n for _, _, n in found[:keep]] + [n for _, t, n in found[keep:] if t > recent]
        removed, freed = [], set()
        for name in [n for _, _, n in found[keep:] if n not in kept]:
            wheels = _wheels_of(root, name)
            if _remove(root, name):
                removed.append(name)
                freed |= wheels
        if removed:
            _forget(workdir, root, kept, freed)
        return removed
    except (OSError, ValueError):
        return []
    finally:
        os.close(guard)


def _remove(root: str, name: str) -> bool:
    """One environment moved to the trash and removed, unless a task holds it."""
    marker = os.path.join(root, name, MARKER)
    fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a task in it holds it shared
    except OSError:
        os.close(fd)
        return False
    trash = os.path.join(root, f".trash-{name}-{secrets.token_hex(4)}")
    try:
        os.rename(os.path.join(root, name), trash)
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    lock = _lock(os.path.join(root, f".{name}.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if lock is not None:  # nobody builds it again now: its lock file goes too (holders re-check)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, f".{name}.lock"))
        os.close(lock)
    return True


def _wheels_of(root: str, name: str) -> set[str]:
    """The wheels an environment was built from (its marker's manifest)."""
    try:
        with open(os.path.join(root, name, MARKER), encoding="utf-8") as f:
            return {str(w["sha256"]) for w in json.load(f).get("wheels", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _forget(workdir: str, root: str, kept: list[str], freed: set[str]) -> None:
    """The wheels only removed environments named, and uv's cache; only while no build installs
    (builds hold `.uv-cache.lock` shared from their last look at the cache to the end)."""
    guard = _lock(os.path.join(root, ".uv-cache.lock"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    if guard is None:
        return  # a later clean-up takes them
    for digest in freed.difference(*(_wheels_of(root, name) for name in kept)):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(workdir, "cache", digest))
        shutil.rmtree(os.path.join(workdir, "wheels", digest), ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "uv-cache"), ignore_errors=True)
    os.close(guard)


@contextlib.contextmanager
def _locked(path: str, how: int) -> Any:
    fd = _lock(path, how)
    if fd is None:
        raise BlockingIOError(f"{path} is held")
    try:
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
