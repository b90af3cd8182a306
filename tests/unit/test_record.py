"""Run record layer, write side (orchestrator/record/write.py): run ids and folders, atomic writes,
status.json's text, and RunRecord's events, metrics and status (docs/architecture.md §5)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.record import write as record
from orchestrator.record.write import (
    SCHEMA_VERSION,
    RunRecord,
    iso_time,
    new_run_dir,
    new_run_id,
    now_iso,
    status_text,
    write_json_atomic,
    write_text_atomic,
)
from tests.conftest import tmpfs_disk

ISO_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def fixed_clock(monkeypatch: pytest.MonkeyPatch, when: dt.datetime) -> None:
    """record's `datetime.now()` answers `when` (record.dt is replaced, not the datetime module)."""

    class Fixed(dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Fixed:
            return cls.fromtimestamp(when.timestamp(), tz)

    monkeypatch.setattr(record, "dt", types.SimpleNamespace(datetime=Fixed, timezone=dt.timezone))


def task(i: int, state: str = "RUNNING") -> dict[str, Any]:
    return {
        "task": f"worker-{i}",
        "role": "worker",
        "index": i,
        "state": state,
        "pid": 100 + i,
        "metrics": {},
    }


def status(tasks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {
        "name": "demo",
        "run_id": "demo-20260101-000000-0badcafe",
        "state": "RUNNING",
        "attempt": 0,
        "restarts": 0,
        "reason": 'say "hi"\nnewline ünïcode',
        "started_at": "2026-01-01T00:00:00.000Z",
        "ended_at": None,
        "tasks": tasks,
        **kw,
    }


# --- run id and folder ----------------------------------------------------------------------------


def test_run_id_format() -> None:
    run_id = new_run_id("demo-job")
    m = re.fullmatch(r"demo-job-(\d{8}-\d{6})-([0-9a-f]{8})", run_id)
    assert m, run_id
    stamp = dt.datetime.strptime(m[1], "%Y%m%d-%H%M%S")
    assert abs((dt.datetime.now() - stamp).total_seconds()) < 5


def test_run_ids_are_unique() -> None:
    ids = {new_run_id("demo") for _ in range(1000)}
    assert len(ids) == 1000


def test_new_run_dir_is_named_after_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixed_clock(monkeypatch, dt.datetime(2026, 3, 4, 5, 6, 7))
    path = new_run_dir("demo", base=tmp_path / "runs")
    assert path == tmp_path / "runs" / "demo-20260304-050607"
    assert path.is_dir()


def test_new_run_dir_picks_a_fresh_folder_when_the_first_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_clock(monkeypatch, dt.datetime(2026, 3, 4, 5, 6, 7))
    (tmp_path / "demo-20260304-050607").mkdir()
    (tmp_path / "demo-20260304-050607" / "mine").write_text("x")
    second = new_run_dir("demo", base=tmp_path)
    third = new_run_dir("demo", base=tmp_path)
    assert second == tmp_path / "demo-20260304-050607-2"
    assert third == tmp_path / "demo-20260304-050607-3"
    assert second.is_dir() and third.is_dir()
    assert (tmp_path / "demo-20260304-050607" / "mine").read_text() == "x"  # the first is untouched


# --- atomic writes --------------------------------------------------------------------------------


def test_write_text_atomic_writes_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    write_text_atomic(path, "first\n")
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_write_text_atomic_replaces_the_file_never_rewrites_it(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text("old\n")
    with open(path) as reader:  # a reader holding the old file keeps reading the old file
        old_inode = os.fstat(reader.fileno()).st_ino
        write_text_atomic(path, "new\n")
        assert reader.read() == "old\n"
    assert path.stat().st_ino != old_inode
    assert path.read_text() == "new\n"


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "status.json"
    path.write_text("old\n")

    def no_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError):
        write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n"


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "status.json"

    def no_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError):
        write_text_atomic(path, "new\n")
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    data = {"tasks": [{"name": "worker-0", "tf_config": {"task": {"type": "worker", "index": 0}}}]}
    write_json_atomic(path, data)
    assert json.loads(path.read_text()) == data
    assert path.read_text().endswith("}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


# --- status.json's text ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 3, 200])
def test_status_text_is_the_status_as_json(count: int) -> None:
    s = status([task(i) for i in range(count)])
    assert json.loads(status_text(s)) == s


@pytest.mark.parametrize("count", [1, 3, 200])
def test_status_text_has_one_line_per_task(count: int) -> None:
    text = status_text(status([task(i) for i in range(count)]))
    task_lines = [line for line in text.splitlines() if '"task": "worker-' in line]
    assert len(task_lines) == count
    for i, line in enumerate(task_lines):
        assert json.loads(line.strip().rstrip(",")) == task(i)


def test_status_text_with_no_tasks_ends_with_an_empty_list() -> None:
    text = status_text(status([]))
    assert text.endswith('  "tasks": []\n}\n')


def test_status_text_keeps_the_head_indented() -> None:
    text = status_text(status([task(0)]))
    assert text.startswith('{\n  "name": "demo",\n')
    assert text.endswith("\n  ]\n}\n")


# --- times ----------------------------------------------------------------------------------------


def test_now_iso_is_utc_with_milliseconds() -> None:
    assert ISO_MS.match(now_iso())


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (0.0, "1970-01-01T00:00:00.000Z"),
        (1.5, "1970-01-01T00:00:01.500Z"),
        (1_800_000_000.25, "2027-01-15T08:00:00.250Z"),
        (1_800_000_000.9999, "2027-01-15T08:00:00.999Z"),
    ],
)
def test_iso_time(t: float, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "_second_cache", (-1, ""))
    assert iso_time(t) == expected


def test_iso_time_milliseconds_of_a_decimal_time() -> None:
    assert iso_time(100.1) == "1970-01-01T00:01:40.100Z"
    assert iso_time(1_700_000_000.123) == "2023-11-14T22:13:20.123Z"


def test_iso_time_agrees_with_datetime() -> None:
    t = 1_767_225_600.0 + 12_345.678  # 2026-01-01 + 3h25m45.678s
    expected = dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    assert iso_time(t).startswith(expected)
    assert ISO_MS.match(iso_time(t))


def test_iso_time_formats_the_date_once_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record, "_second_cache", (-1, ""))
    calls: list[float] = []

    class Counting(dt.datetime):
        @classmethod
        def fromtimestamp(cls, t: float, tz: Any = None) -> Counting:
            calls.append(t)
            return super().fromtimestamp(t, tz)

    monkeypatch.setattr(record, "dt", types.SimpleNamespace(datetime=Counting, timezone=dt.timezone))
    assert iso_time(100.25) == "1970-01-01T00:01:40.250Z"
    assert iso_time(100.75) == "1970-01-01T00:01:40.750Z"
    assert len(calls) == 1  # the same second: the cached date part
    assert iso_time(101.5) == "1970-01-01T00:01:41.500Z"  # a new second is formatted anew
    assert iso_time(100.125) == "1970-01-01T00:01:40.125Z"  # and going back too
    assert len(calls) == 3


# --- RunRecord ------------------------------------------------------------------------------------


@pytest.fixture
def rec(tmp_path: Path) -> Iterator[RunRecord]:
    r = RunRecord(tmp_path / "run")
    yield r
    r.close()  # again: harmless


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_run_record_makes_its_folders(rec: RunRecord, tmp_path: Path) -> None:
    assert (tmp_path / "run" / "logs").is_dir()
    assert rec.log_path("worker-0.log") == tmp_path / "run" / "logs" / "worker-0.log"


def test_events_are_json_lines_with_a_time(rec: RunRecord) -> None:
    rec.event(kind="transition", old="PENDING", new="LAUNCHING", reason="attempt 0")
    rec.event(kind="unconfirmed", tasks=["worker-1"])
    got = lines(rec.dir / "events.jsonl")  # written through at once, no flush needed
    assert [e["kind"] for e in got] == ["transition", "unconfirmed"]
    assert got[0]["reason"] == "attempt 0" and got[1]["tasks"] == ["worker-1"]
    assert all(ISO_MS.match(e["time"]) for e in got)


def test_events_append_to_an_existing_record(tmp_path: Path) -> None:
    first = RunRecord(tmp_path)
    first.event(kind="a")
    first.close()
    second = RunRecord(tmp_path)  # a --resume opens the same folder again
    second.event(kind="b")
    second.close()
    assert [e["kind"] for e in lines(tmp_path / "events.jsonl")] == ["a", "b"]


def test_metrics_lines_carry_task_and_attempt_and_convert_the_time(rec: RunRecord) -> None:
    rec.metrics(
        "worker-1", 2, [{"time": 1.5, "step": 10, "loss": 0.5}, {"time": 2, "step": 11, "loss": 0.25}]
    )
    rec.flush()
    v = SCHEMA_VERSION
    assert lines(rec.dir / "metrics.jsonl") == [
        {"schema_version": v, "time": "1970-01-01T00:00:01.500Z", "task": "worker-1", "attempt": 2}
        | {"step": 10, "loss": 0.5},
        {"schema_version": v, "time": "1970-01-01T00:00:02.000Z", "task": "worker-1", "attempt": 2}
        | {"step": 11, "loss": 0.25},
    ]


def test_every_event_line_carries_the_schema_version(rec: RunRecord) -> None:
    rec.event(kind="run", reason="x")
    rec.close()
    assert lines(rec.dir / "events.jsonl")[0]["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("when", [None, "yesterday", True], ids=["missing", "text", "bool"])
def test_a_point_without_a_numeric_time_gets_the_time_it_was_written(rec: RunRecord, when: Any) -> None:
    point: dict[str, Any] = {"step": 1}
    if when is not None:
        point["time"] = when
    rec.metrics("worker-0", 0, [point])
    rec.flush()
    [line] = lines(rec.dir / "metrics.jsonl")
    assert ISO_MS.match(line["time"])
    assert line["time"] != "1970-01-01T00:00:01.000Z"
    assert line["step"] == 1 and line["task"] == "worker-0"


def test_metrics_are_batched_until_flush_and_nothing_is_lost(rec: RunRecord) -> None:
    for step in range(500):
        rec.metrics("worker-0", 0, [{"time": 1.0, "step": step}])
    rec.flush()
    assert [m["step"] for m in lines(rec.dir / "metrics.jsonl")] == list(range(500))


def test_close_flushes_and_closes_both_files(rec: RunRecord) -> None:
    rec.metrics("worker-0", 0, [{"time": 1.0, "step": 1}])
    rec.close()
    assert rec.closed
    assert len(lines(rec.dir / "metrics.jsonl")) == 1


def test_write_status_writes_only_when_changed(rec: RunRecord, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[Path] = []
    real = record.write_text_atomic

    def spy(path: Path, text: str) -> None:
        writes.append(path)
        real(path, text)

    monkeypatch.setattr(record, "write_text_atomic", spy)
    rec.write_status(status([task(0)]))
    rec.write_status(status([task(0)]))  # an equal document: not written again
    assert writes == [rec.dir / "status.json"]
    rec.write_status(status([task(0, state="SUCCEEDED")]))
    assert len(writes) == 2
    assert json.loads((rec.dir / "status.json").read_text())["tasks"][0]["state"] == "SUCCEEDED"


def test_write_status_leaves_the_file_alone_when_unchanged(rec: RunRecord) -> None:
    rec.write_status(status([task(0)]))
    path = rec.dir / "status.json"
    os.utime(path, (1_000_000, 1_000_000))
    rec.write_status(status([task(0)]))
    assert path.stat().st_mtime == 1_000_000
    rec.write_status(status([task(0)], attempt=1))
    assert path.stat().st_mtime != 1_000_000


def test_write_backend_plan_coordinator_and_spec(rec: RunRecord) -> None:
    rec.write_backend({"backend": "local"})
    rec.write_plan({"tasks": [{"name": "worker-0"}]})
    rec.write_coordinator({"pid": 1, "create_time": 2.0})
    rec.write_spec("name: demo\n")
    assert json.loads((rec.dir / "backend.json").read_text()) == {"backend": "local"}
    assert json.loads((rec.dir / "plan.json").read_text()) == {"tasks": [{"name": "worker-0"}]}
    assert json.loads((rec.dir / "coordinator.json").read_text()) == {"pid": 1, "create_time": 2.0}
    assert (rec.dir / "spec.yaml").read_text() == "name: demo\n"
    assert not [p for p in rec.dir.iterdir() if p.name.endswith(".tmp")]


# --- the record is the user's alone -------------------------------------------------------------


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_run_directory_and_its_files_are_private(tmp_path: Path) -> None:
    run_dir = record.new_run_dir("demo", base=tmp_path / "runs")
    assert _mode(run_dir) == 0o700
    rec = record.RunRecord(run_dir)
    rec.write_spec("name: demo\n")
    rec.write_plan({"tasks": []})
    rec.write_status({"state": "RUNNING", "tasks": []})
    rec.write_backend({"backend": "local"})
    rec.event(kind="run", reason="x")
    rec.metrics("worker-0", 0, [{"step": 1}])
    rec.close()
    with record.private_open(rec.log_path("worker-0.log")) as log:
        log.write(b"hello\n")
    assert _mode(run_dir / "logs") == 0o700
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) == 8 and {p: _mode(p) for p in files} == dict.fromkeys(files, 0o600)  # .lock too


def test_a_record_file_is_never_written_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    link = tmp_path / "events.jsonl"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        record.private_open(link, "a")
    assert not victim.exists()


# --- one coordinator per run directory; a disk that fills up or turns read-only (issue 13) ---


def test_a_run_directory_in_use_is_refused_naming_its_coordinator(tmp_path: Path) -> None:
    first = record.RunRecord(tmp_path / "run")
    try:
        with pytest.raises(record.RunDirBusy, match=rf"in use by a live coordinator \(pid {os.getpid()}\)"):
            record.RunRecord(tmp_path / "run")
    finally:
        first.close()
    record.RunRecord(tmp_path / "run").close()  # its coordinator gone: free again


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 1.5 MiB of its own (root only): a disk that can really fill up."""
    with tmpfs_disk(tmp_path / "disk", "1536k") as disk:
        yield disk


def fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)


def test_a_full_disk_breaks_the_record_whole_and_its_reserve_holds_the_last_words(small_disk: Path) -> None:
    rec = record.RunRecord(small_disk / "run")
    rec.event(kind="run", reason="before")
    rec.write_status({"state": "RUNNING", "tasks": []})
    fill(small_disk)  # someone else's file takes every block left
    rec.metrics("worker-0", 0, [{"step": i, "loss": 0.5} for i in range(20_000)])  # ~1.4 MB: too much
    rec.flush()
    assert rec.broken is not None and "metrics.jsonl" in rec.broken and "No space left" in rec.broken
    rec.event(kind="run", reason="x" * 100_000)  # written in the reserve's room, or not at all
    rec.write_status({"state": "FAILED", "reason": rec.broken, "tasks": []})
    rec.close()
    assert json.loads((small_disk / "run" / "status.json").read_text())["state"] == "FAILED"
    for name in ("events.jsonl", "metrics.jsonl"):  # every line whole
        text = (small_disk / "run" / name).read_text()
        assert text == "" or text.endswith("\n")
        [json.loads(line) for line in text.splitlines()]
    assert lines(small_disk / "run" / "events.jsonl")[0]["reason"] == "before"


def test_up_on_a_read_only_disk_says_so_and_starts_nothing(
    small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator import cli
    from tests.unit.test_cli import LOCAL_SPEC, spec_file

    spec = spec_file(tmp_path, LOCAL_SPEC)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code = cli.main(["up", str(spec), "--run-dir", str(small_disk / "run")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err == f"orchestrate: cannot write the run directory {small_disk / 'run'}: Read-only file system\n"


def test_up_on_a_full_disk_says_so_and_starts_nothing(
    small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator import cli
    from tests.unit.test_cli import LOCAL_SPEC, spec_file

    spec = spec_file(tmp_path, LOCAL_SPEC)
    fill(small_disk)
    code = cli.main(["up", str(spec), "--run-dir", str(small_disk / "run")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.startswith("orchestrate: cannot write the run directory ") and "No space left on device" in err
    assert "Traceback" not in err


def test_a_spec_may_share_the_run_directory_with_the_owners_group(tmp_path: Path) -> None:
    old_umask = os.umask(0o077)  # even under a strict umask
    record.share_with_group(True)
    try:
        rec = record.RunRecord(tmp_path / "run")
        rec.write_status({"state": "RUNNING", "tasks": []})
        rec.event(kind="run", reason="x")
        rec.close()
    finally:
        record.share_with_group(False)
        os.umask(old_umask)
    assert _mode(tmp_path / "run") == 0o750 and _mode(tmp_path / "run" / "logs") == 0o750
    # files: 0640 under the usual umask (022); a stricter umask still applies to them
    assert _mode(tmp_path / "run" / "events.jsonl") & 0o7 == 0


def test_up_detach_on_a_run_directory_in_use_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator import cli
    from tests.unit.test_cli import LOCAL_SPEC, spec_file

    spec = spec_file(tmp_path, LOCAL_SPEC)
    live = record.RunRecord(tmp_path / "run")  # as a live coordinator holds it
    try:
        code = cli.main(["up", str(spec), "--detach", "--run-dir", str(tmp_path / "run")])
    finally:
        live.close()
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"in use by a live coordinator (pid {os.getpid()})" in err
    assert not (tmp_path / "run" / "coordinator.log").exists()
