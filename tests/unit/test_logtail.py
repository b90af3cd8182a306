"""orchestrator/record/logtail.py: following the tasks' log files as they appear and grow."""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.record.logtail import LogTailer, tail_lines


def test_log_tailer_follows_files_that_appear_and_grow(tmp_path):
    from orchestrator.record.logtail import LogTailer

    lines: list[tuple[str, str]] = []
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("before the start\n")  # what was there already is not replayed
    tailer = LogTailer({"a": a, "b": b}, lambda task, line: lines.append((task, line)), interval_s=0.02)
    tailer.start()
    with open(a, "a") as f:
        f.write("one\ntw")
    b.write_text("b appears\n")  # created after the tailer started
    time.sleep(0.2)
    with open(a, "a") as f:
        f.write("o\n")
    time.sleep(0.2)
    tailer.stop()
    assert [x for x in lines if x[0] == "a"] == [("a", "one"), ("a", "two")]
    assert ("b", "b appears") in lines


def test_a_second_stop_reads_nothing_again(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("one\ntwo\n")
    seen: list[str] = []
    tailer = LogTailer({"w": log}, lambda task, line: seen.append(line), from_start=True)
    tailer.stop()
    tailer.stop()
    tailer.poll()
    assert seen == ["one", "two"]


def test_a_tail_ends_lines_at_newlines_only(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    bar = "".join(f"{i}/20 [{'=' * i}]\r" for i in range(1, 21)) + "20/20 [done]"
    log.write_text(f"old\n===== orchestrate: attempt 1 =====\nEpoch 1\n{bar}\r\nnext\x0cpage\u2028x\n")
    assert tail_lines(log, 10) == ["Epoch 1", bar, "next\x0cpage\u2028x"]  # one line per line written
    assert tail_lines(log, 0) == [] and tail_lines(log, 1) == ["next\x0cpage\u2028x"]
    big = tmp_path / "big.log"
    big.write_text("x" * 300_000 + "\nlast\n")  # the tail begins part way through a line: left off
    assert tail_lines(big, 5) == ["last"]
    # a bar redrawn for long on one line (no newline until its epoch ends), longer than a tail reads
    long = "".join(f"{i}/99999 [{'=' * 30}]\r" for i in range(1, 12_000))
    big.write_text(f"Epoch 1\n{long}")
    assert len(long) > 256 * 1024 and tail_lines(big, 5)[-1].endswith("11999/99999 [" + "=" * 30 + "]")
