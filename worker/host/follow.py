"""The shim's copy of a task's log to its stdout (the SSH channel), live. Standard
library only: the shim loads this file from its cache (worker/host/shim.py)."""

from __future__ import annotations

import os
import threading
import time


class Follower(threading.Thread):
    """Copies what the task appends to its log file to stdout (the SSH channel), live."""

    def __init__(self, path: str, offset: int):
        super().__init__(daemon=True)
        self._path, self._offset = path, offset
        self._done = threading.Event()
        self._broken = False

    def run(self) -> None:
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            while True:
                finishing = self._done.is_set()
                data = f.read(65536)
                if data and not self._broken:
                    try:
                        os.write(1, data)
                    except OSError:
                        self._broken = True  # the connection is gone; the log file still has it all
                elif not data:
                    if finishing:
                        return
                    time.sleep(0.1)

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=10.0)
