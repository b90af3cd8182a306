"""Launch layer, local backend: the folder of a run's heartbeat socket (a Unix socket: a path
crosses network namespaces, an abstract name would not), private, where its path fits, and the
folders of coordinators killed before removed."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

#: sun_path holds 108 bytes with its terminating NUL.
_SUN_PATH_MAX = 107


def socket_folder(run_dir: Path) -> Path:
    """A new private (0700) folder for the run's heartbeat socket: in the run directory where the
    socket's path fits a Unix socket address, else in the user's runtime folder or the temp one
    (OSError where none fits). Folders left there by coordinators killed before are removed."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    for base in (run_dir.resolve(), Path(runtime), Path(tempfile.gettempdir()), Path("/tmp")):
        if not base.is_absolute() or not base.is_dir():
            continue
        if len(os.fsencode(base)) + len("/.heartbeats-XXXXXXXX/hb") <= _SUN_PATH_MAX:
            _sweep(base, in_run=base == run_dir.resolve())
            return Path(tempfile.mkdtemp(prefix=".heartbeats-", dir=base))
    raise OSError(f"no folder whose path leaves room for a Unix socket ({_SUN_PATH_MAX} bytes)")


def _sweep(base: Path, in_run: bool) -> None:
    """Our socket folders in `base` whose coordinator is gone: in the run directory, any (the run's
    lock is this coordinator's); elsewhere, those whose socket no longer answers (another run's
    coordinator, alive, keeps its own)."""
    for stale in base.glob(".heartbeats-*"):
        with contextlib.suppress(OSError):
            st = os.lstat(stale)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if not in_run:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.settimeout(1.0)  # a live one's backlog full: a wait, then kept
                    try:
                        probe.connect(str(stale / "hb"))
                        continue  # a live coordinator's
                    except ConnectionRefusedError:
                        pass  # its coordinator is gone
            shutil.rmtree(stale)
