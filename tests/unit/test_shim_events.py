"""What the ssh and slurm backends read from a task's shim on its stderr."""

from __future__ import annotations

import json

from orchestrator.launch.api import ProcessInfo
from orchestrator.launch.shim_events import ShimEvents


def test_started_then_exit_are_read_and_other_text_is_kept_for_a_reason() -> None:
    events = ShimEvents()
    events.feed("bash: python3: not found")
    events.feed(json.dumps({"event": "started", "pid": 7, "pgid": 7, "create_time": 1.5, "step": "12.3"}))
    assert events.wait_started(1.0, closed="gone") is None
    assert events.info == ProcessInfo(7, 7, 1.5) and events.step == "12.3"
    assert not events.ended.is_set()
    events.feed(json.dumps({"event": "exit", "code": -9}))
    assert events.exit_code == -9 and events.ended.is_set()
    assert events.messages == ["bash: python3: not found"]


def test_a_start_that_never_came_says_why() -> None:
    events = ShimEvents()
    assert events.wait_started(0.1, closed="gone") == "no answer within 0.1 s"
    events.close()
    assert events.wait_started(5.0, closed="its step ended") == "its step ended"  # at once
    events.feed(json.dumps({"event": "error", "message": "cannot start /x/python: No such file"}))
    assert events.wait_started(5.0, closed="gone") == "cannot start /x/python: No such file"


def test_only_the_latest_lines_are_kept_each_cut_to_size() -> None:
    events = ShimEvents()
    for i in range(100):
        events.feed(f"line {i} " + "x" * 1000)
    assert len(events.messages) == 20 and events.messages[-1].startswith("line 99 ")
    assert all(len(m) == 500 for m in events.messages)
