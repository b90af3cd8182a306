"""The heartbeat thread and the progress buffer behind `worker.report()`.

Reporting a step only appends to a list under a lock; a daemon thread posts one heartbeat per
interval carrying every point since the last one. A task whose coordinator stays unreachable for
ORCHESTRATE_COORDINATOR_TIMEOUT_S (or which the coordinator tells it is stale) kills its own
process group: no orphan keeps a GPU after its coordinator is gone.
"""

from __future__ import annotations

import dataclasses
import http.client
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from worker import wire
from worker.task.metrics import MetricNames, number
from worker.task.process import kill_group_but_me, user_frame
from worker.task.tensorboard import Scalars
from worker.wire.dial import dial

log = logging.getLogger("worker")


@dataclass(frozen=True)
class ReporterConfig:
    task: str
    attempt: int
    url: str
    token: str
    interval_s: float
    coordinator_timeout_s: float

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> ReporterConfig | None:
        """None when the task does not run under a coordinator (plain `python script.py`)."""
        if wire.ENV_COORDINATOR not in env:
            return None
        return cls(
            task=env.get(wire.ENV_TASK, "task-0"),
            attempt=int(env.get(wire.ENV_ATTEMPT, "0")),
            url=env[wire.ENV_COORDINATOR],
            token=env.get(wire.ENV_TOKEN, ""),
            interval_s=float(env.get(wire.ENV_HEARTBEAT_INTERVAL_S, "1.0")),
            coordinator_timeout_s=float(env.get(wire.ENV_COORDINATOR_TIMEOUT_S, "30")),
        )


class Reporter:
    def __init__(self, config: ReporterConfig | None):
        self._config = config
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._points: list[dict[str, Any]] = []
        self._points_from = 0  # how many points this process reported before self._points[0]
        self._names = MetricNames()  # which reported names the coordinator takes
        self._step: int | None = None
        self._total_steps: int | None = None
        self._examples_per_step: int | None = None
        self._metrics: dict[str, float] = {}
        self._busy: str | None = None
        self._scalars: Scalars | None = None  # mode 1: the points as TensorBoard scalars too
        self._connecting = False
        self._ready = False
        self._done = False
        self._error: wire.TaskError | None = None
        self._seq = 0
        self._posted = 0  # heartbeats the coordinator accepted
        self._restored: wire.Restored | None = None
        self._folders: dict[str, str] = {}  # the job's own checkpoint folders (worker/task/checkpoints.py)
        # (connecting, ready, done, error, restored, folders): a change is sent at once
        self._phase_sent: tuple[object, ...] | None = None
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # first call primes the counter
        self._sock: socket.socket | None = None  # kept alive between heartbeats
        self._thread: threading.Thread | None = None

    # --- called from the user's code (cheap, never touches the network) ---

    def report(self, step: int | None = None, **metrics: Any) -> None:
        """A progress point: one line in metrics.jsonl, and the task's latest step and values."""
        self._take(step, metrics, point=True)

    def progress(self, step: int | None = None, **metrics: Any) -> None:
        """The task's latest step and values (live view, status.json), without a metrics.jsonl line."""
        self._take(step, metrics, point=False)

    def _take(self, step: int | None, metrics: dict[str, Any], point: bool) -> None:
        numbers = {k: number(v) for k, v in metrics.items()}
        values = {k: v for k, v in numbers.items() if v is not None}
        if any(k not in self._metrics for k in values):
            values = self._names.admit(values, self._metrics)
        with self._lock:
            first_step = self._step is None
            if step is None:
                step = (self._step or 0) + 1
            self._step = int(step)
            self._metrics.update(values)
            if point:
                self._points.append({"time": time.time(), "step": self._step, **values})
                if self._scalars is not None:
                    self._scalars.add({"step": self._step, **values})
            first = not self._ready or first_step  # the process's first step: said at once
            self._ready = True
        if first:
            self._wake.set()

    def write_tensorboard(self, folder: Path) -> None:
        """Write every reported point as TensorBoard scalars into `folder` too (a mode-1 job)."""
        self._scalars = Scalars(folder)

    def set_busy(self, what: str | None) -> None:
        """What the task does between training steps (validating, saving, …), or None when it
        trains again: the coordinator does not take the standing step for a stall meanwhile."""
        with self._lock:
            self._busy = what

    @property
    def busy(self) -> str | None:
        return self._busy

    @property
    def step(self) -> int | None:
        """The latest step reported."""
        return self._step

    def set_total_steps(self, total: int | None, examples_per_step: int | None = None) -> None:
        with self._lock:
            self._total_steps = total
            if examples_per_step is not None:
                self._examples_per_step = int(examples_per_step)

    def mark_connecting(self, wait_s: float = 2.0) -> None:
        """The task is about to create its strategy. Waits (briefly) until the coordinator has heard
        it: a MultiWorkerMirroredStrategy constructor holds the GIL while it waits for its peers
        (measured), so no heartbeat leaves this process until every peer has joined."""
        with self._lock:
            if self._connecting:
                return
            self._connecting = True
            sent_before = self._posted
        self._wait_posted(sent_before, wait_s)

    def mark_restored(self, restored: wire.Restored, wait_s: float = 2.0) -> None:
        """Where this attempt starts: sent at once, waited for (briefly) where final; a restore
        as it happens (not final) is not waited for, and never kept over a final one."""
        with self._lock:
            if self._restored is not None and self._restored.final and not restored.final:
                return
            self._restored = restored
            sent_before = self._posted
        if restored.final:
            self._wait_posted(sent_before, wait_s)

    def add_folder(self, path: str, by: str) -> None:
        """A folder the job checkpoints to (mode 1): told at once, in every heartbeat after."""
        with self._lock:
            if path not in self._folders and len(self._folders) < wire.MAX_FOLDERS:
                self._folders[path] = by[: wire.MAX_NAME_CHARS]
        self._wake.set()

    def _wait_posted(self, sent_before: int, wait_s: float) -> None:
        """Send a heartbeat now and wait (at most wait_s) until one after `sent_before` is taken."""
        self._wake.set()
        if self._thread is None:
            return
        deadline = time.monotonic() + wait_s
        while self._posted == sent_before and time.monotonic() < deadline:
            time.sleep(0.005)

    def mark_ready(self) -> None:
        with self._lock:
            first = not self._ready
            self._ready = True
        if first:
            self._wake.set()

    # --- lifecycle, called by the runtime ---

    def start(self) -> None:
        if self._config is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="orchestrate-heartbeat", daemon=True)
        self._thread.start()

    def finish(self, error: wire.TaskError | None = None) -> None:
        """Send the final heartbeat (done, or the error) and stop the thread."""
        with self._lock:
            self._done = error is None
            self._error = error
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # --- the heartbeat thread ---

    def _run(self) -> None:
        assert self._config is not None
        cfg = self._config
        last_ok = time.monotonic()
        while True:
            final = self._stopped.is_set()
            if self._scalars is not None:
                self._scalars.flush()
            body, sent_points, phase = self._snapshot()
            status, post_in = self._post(body, urgent=phase != self._phase_sent)
            if status == wire.OK_STATUS:
                last_ok = time.monotonic()
                sent_points.clear()
                self._posted += 1
                self._phase_sent = phase
            else:
                self._requeue(sent_points)
                if status == wire.STALE_ATTEMPT_STATUS:
                    self._die("the coordinator has moved on from this attempt")
                if status in _REFUSED:
                    self._die(f"the coordinator refuses this task's heartbeats: {_REFUSED[status]}")
                if time.monotonic() - last_ok > cfg.coordinator_timeout_s:
                    self._die(f"no coordinator reachable at {cfg.url} for {cfg.coordinator_timeout_s:g} s")
            if final and (status != wire.OK_STATUS or not self._points):
                return  # the last word said (and every point with it, a heartbeat's worth at a time)
            # A host's relay names when to post next, so that its tasks' heartbeats land just before
            # one of its flushes (one request per host and interval); kept near one interval.
            wait_s = (
                cfg.interval_s
                if post_in is None
                else min(1.5 * cfg.interval_s, max(0.5 * cfg.interval_s, post_in))
            )
            self._wake.wait(wait_s)
            self._wake.clear()

    def _snapshot(self) -> tuple[bytes, list[dict[str, Any]], tuple[object, ...]]:
        assert self._config is not None
        # Syscalls and the stack walk happen outside the lock that report() takes on every step.
        try:
            rss = self._proc.memory_info().rss
            cpu = self._proc.cpu_percent(None)
        except psutil.Error:
            rss, cpu = 0, 0.0
        where = user_frame()
        with self._lock:
            points, self._points = self._points[: wire.MAX_POINTS], self._points[wire.MAX_POINTS :]
            points_from = self._points_from
            self._points_from += len(points)
            self._seq += 1
            hb = wire.Heartbeat(
                task=self._config.task,
                attempt=self._config.attempt,
                seq=self._seq,
                sent_at=time.time(),
                pid=os.getpid(),
                rss_bytes=rss,
                cpu_percent=cpu,
                connecting=self._connecting,
                ready=self._ready,
                step=self._step,
                total_steps=self._total_steps,
                examples_per_step=self._examples_per_step,
                metrics=dict(self._metrics),
                points=points,
                done=self._done,
                error=self._error,
                user_frame=where,
                busy=self._busy,
                restored=self._restored,
                points_from=points_from,
                folders=dict(self._folders),
                dropped=self._names.dropped,
            )
        # a phase change (the first step too: a restart's timeline ends there) goes on at once
        phase = (hb.connecting, hb.ready, hb.step is None, hb.done, hb.error, hb.restored, len(hb.folders))
        body = hb.to_bytes()
        while len(body) > wire.MAX_HEARTBEAT_BYTES and hb.points:  # many points of many values
            keep = len(hb.points) // 2
            self._requeue(hb.points[keep:])
            hb = dataclasses.replace(hb, points=hb.points[:keep])
            body = hb.to_bytes()
        return body, hb.points, phase

    def _requeue(self, points: list[dict[str, Any]]) -> None:
        """Points not taken go first again (with their numbers: a resend's are recognised)."""
        if points:
            with self._lock:
                self._points[:0] = points
                self._points_from -= len(points)

    def _post(self, body: bytes, urgent: bool) -> tuple[int | None, float | None]:
        """POST one heartbeat: its HTTP status (None when nobody could be reached), and when to post
        the next one if a relay said so. `urgent` (the task's phase changed): a relay forwards it
        at once, not at its next flush. Head and body go in one write (http.client sends them
        apart: two segments, two wake-ups of the coordinator per heartbeat)."""
        assert self._config is not None
        unix = self._config.url.startswith(wire.UNIX_SCHEME)
        url = urllib.parse.urlsplit("http://localhost" if unix else self._config.url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        request = (
            f"POST {wire.HEARTBEAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\n{wire.TOKEN_HEADER}: {self._config.token}\r\n"
            + (f"{wire.FLUSH_HEADER}: 1\r\n" if urgent else "")
            + f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        for fresh in (self._sock is None, True):  # a kept-alive connection the server closed: once more
            try:
                if self._sock is None:
                    timeout = max(1.0, min(5.0, self._config.interval_s * 2))
                    self._sock = dial(self._config.url, timeout)
                self._sock.sendall(request)
                resp = http.client.HTTPResponse(self._sock)
                resp.begin()
                resp.read()
                if resp.will_close:
                    self._close()
                post_in = resp.getheader(wire.POST_IN_HEADER)
                return resp.status, float(post_in) if post_in else None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self._close()
                stale = isinstance(
                    exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
                )
                if fresh or not stale:
                    return None, None
        return None, None

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _die(self, why: str) -> None:
        print(f"[orchestrate] {why}; this task exits now", file=sys.stderr, flush=True)
        # The task leads its own process group (the launcher starts it in a new session): the
        # helper processes the user's script started go first, then this one, with a code of its
        # own, so the coordinator's summary says why rather than "killed by SIGKILL".
        if os.getpgrp() == os.getpid():
            kill_group_but_me()
        os._exit(wire.EXIT_NO_COORDINATOR)


#: Answers that no retry changes: the task stops (its credential, or its process, is not the task's).
_REFUSED = {
    wire.BAD_TOKEN_STATUS: "its credential is not valid",
    wire.FORBIDDEN_STATUS: "its credential is for another task",
    wire.CONFLICT_STATUS: "another process speaks for this task",
}
