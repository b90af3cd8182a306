"""worker/wire/failure.py: the error file a task writes as it dies, and what the coordinator takes of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from worker.wire import TaskError, failure


def test_written_whole_and_private_and_read_back(tmp_path: Path) -> None:
    target = failure.path(str(tmp_path), "worker-1", 3)
    assert target == f"{tmp_path}/errors/worker-1.3.json"
    error = TaskError("KeyError", "'label'", "Traceback (most recent call last):\n  …\nKeyError: 'label'")
    assert failure.write(target, error, 41)
    assert os.stat(target).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(target)).st_mode & 0o077 == 0
    assert failure.read(target) == failure.Written(error, 41)
    assert [p.name for p in Path(target).parent.iterdir()] == ["worker-1.3.json"]  # no temporary left


def test_any_text_fits_the_bound_and_is_shown_safely(tmp_path: Path) -> None:
    emoji = "💥" * 20_000  # 12 bytes each once escaped
    error = TaskError("Bad\x1b[2JError", emoji + "\u202e", "x\n" * 100_000)
    data = failure.document(error, None)
    assert len(data) <= failure.MAX_BYTES
    written = failure.parse(data)
    assert written is not None and written.step is None
    assert written.error.type == "Bad\\x1b[2JError"  # a terminal's escape is written, not obeyed
    assert written.error.message.startswith("💥💥") and written.error.traceback.endswith("x\n")


def test_what_is_not_such_a_document_is_nothing(tmp_path: Path) -> None:
    for data in (b"", b"not json", b"[]", b'{"type": 3}', b'{"type": "", "message": "", "traceback": ""}'):
        assert failure.parse(data) is None
    assert failure.parse(b"x" * (failure.MAX_BYTES + 1)) is None
    odd = failure.parse(json.dumps({"type": "E", "message": "m", "traceback": "", "step": -1}).encode())
    assert odd is not None and odd.step is None  # a step that is not one is left out


def test_no_symlink_is_followed_and_only_a_file_is_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"type": "E", "message": "someone else's", "traceback": ""}))
    (tmp_path / "errors").mkdir()
    link = tmp_path / "errors" / "worker-0.0.json"
    link.symlink_to(secret)
    assert failure.read(str(link)) is None
    os.mkfifo(tmp_path / "errors" / "worker-1.0.json")
    assert failure.read(str(tmp_path / "errors" / "worker-1.0.json")) is None  # never blocks
    assert failure.read(str(tmp_path / "missing.json")) is None


def test_a_folder_that_cannot_be_written_is_said_false(tmp_path: Path) -> None:
    (tmp_path / "errors").write_text("a file where the folder goes")
    assert not failure.write(failure.path(str(tmp_path), "w", 0), TaskError("E", "m", ""), 1)
