"""The job's own checkpoint folders and restores, as the worker runtime sees them
(worker/task/checkpoints.py).
The hooks on TensorFlow's and Keras's classes run for real in tests/e2e (a job's BackupAndRestore,
ModelCheckpoint and CheckpointManager); here the rules."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from worker import wire
from worker.task import checkpoints


class Told:
    def __init__(self, tmp_path: Path, known: str | None = None):
        self.folders: list[tuple[str, str]] = []
        self.first: list[wire.Restored] = []
        self.said: list[wire.Restored] = []  # as each restore happened
        self.watch = checkpoints.Watch(
            lambda p, by: self.folders.append((p, by)),
            self.first.append,
            cwd=str(tmp_path / "job"),
            known=known,
            on_restore=self.said.append,
        )


def test_folders_are_told_once_each_resolved_against_the_working_folder(tmp_path: Path) -> None:
    t = Told(tmp_path)
    t.watch.wrote("ckpts/weights-{epoch}.h5", "tf_keras.callbacks.ModelCheckpoint")
    t.watch.wrote(b"/tmp/backup/chief/ckpt-1", "tf.train.Checkpoint")
    t.watch.wrote(Path("/tmp/backup/chief"), "tf.train.CheckpointManager", is_file=False)
    t.watch.wrote(tmp_path / "job" / "ckpts" / "weights-2.h5", "tf_keras.callbacks.ModelCheckpoint")
    assert t.folders == [
        (str(tmp_path / "job" / "ckpts"), "tf_keras.callbacks.ModelCheckpoint"),
        ("/tmp/backup/chief", "tf.train.Checkpoint"),
    ]


def test_temporary_copies_and_folders_that_hold_more_than_checkpoints_are_not_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = Told(tmp_path, known=str(tmp_path / "run" / "checkpoints"))
    caplog.set_level(logging.DEBUG, logger="worker")
    t.watch.wrote("/tmp/backup/workertemp_1", "tf.train.CheckpointManager", is_file=False)
    t.watch.wrote("/tmp/workertemp_1/ckpt/ckpt-2", "tf.train.Checkpoint")
    t.watch.wrote("weights.h5", "tf_keras.callbacks.ModelCheckpoint")  # the working folder itself
    t.watch.wrote("/tmp/model.h5", "tf_keras.callbacks.ModelCheckpoint")
    t.watch.wrote("gs://bucket/ckpt/ckpt-1", "tf.train.Checkpoint")
    t.watch.wrote(tmp_path / "run" / "checkpoints" / "backup", "x", is_file=False)  # kept already
    t.watch.wrote(12, "x")  # a symbolic tensor or anything else: no path
    assert t.folders == []
    said = caplog.text
    assert "workertemp_1 (tf.train.CheckpointManager) is a worker's temporary copy" in said  # (debug)
    assert "/tmp (tf_keras.callbacks.ModelCheckpoint) is not a folder of checkpoints alone" in said
    assert "not a folder on this host's disk" in said and "run/checkpoints" not in said


def test_at_most_max_folders_are_told(tmp_path: Path) -> None:
    t = Told(tmp_path)
    for i in range(wire.MAX_FOLDERS + 5):
        t.watch.wrote(f"/data/c{i}", "tf.train.CheckpointManager", is_file=False)
    assert len(t.folders) == wire.MAX_FOLDERS


class Variable:
    def __init__(self, value: int):
        self.value = value

    def numpy(self) -> int:
        return self.value


class Checkpoint:
    """What a tf.train.Checkpoint offers here: its tracked values as attributes."""

    def __init__(self, **values: object):
        self.__dict__.update(values)


def test_the_first_step_reports_the_last_restore_before_it_or_nothing(tmp_path: Path) -> None:
    t = Told(tmp_path)
    t.watch.first_step()
    t.watch.first_step()  # once per process
    assert t.first == [wire.Restored(step=0, fingerprint=checkpoints.NOTHING, source=None)]

    t = Told(tmp_path)
    prefix = tmp_path / "backup" / "chief" / "ckpt-3"
    prefix.parent.mkdir(parents=True)
    (prefix.parent / "ckpt-3.index").write_bytes(b"index bytes")
    keras = Checkpoint(ckpt_saved_epoch=Variable(1), ckpt_saved_batch=Variable(30))
    t.watch.restored(str(prefix), keras, "tf.train.Checkpoint")
    t.watch.first_step()
    t.watch.restored(str(prefix), keras, "tf.train.Checkpoint")  # after the first step: not a start
    digest = hashlib.sha256(b"index bytes").hexdigest()[:16]
    assert t.first == [
        wire.Restored(step=0, fingerprint=digest, source=str(prefix), epoch=1, step_in_epoch=30)
    ]
    assert t.folders == [(str(prefix.parent), "tf.train.Checkpoint")]  # it restores from there: the job's


def test_each_restore_is_said_as_it_happens_not_final_and_a_search_that_found_nothing_too(
    tmp_path: Path,
) -> None:
    """Keras's fit runs collectives between BackupAndRestore's restore and the first step (issue
    40): what each task restored, or that it looked and found nothing, is said before them."""
    t = Told(tmp_path)
    t.watch.found_nothing()  # restore_or_initialize in an empty /tmp/backup/chief
    assert t.said == [wire.Restored(step=0, fingerprint=checkpoints.NOTHING, source=None, final=False)]
    prefix = tmp_path / "backup" / "chief" / "ckpt-3"
    prefix.parent.mkdir(parents=True)
    (prefix.parent / "ckpt-3.index").write_bytes(b"index bytes")
    t.watch.restored(
        str(prefix), Checkpoint(ckpt_saved_epoch=Variable(0), ckpt_saved_batch=Variable(30)), "k"
    )
    t.watch.found_nothing()  # a later empty search does not undo a restore
    assert len(t.said) == 2 and t.said[1].source == str(prefix) and not t.said[1].final
    assert t.said[1].step_in_epoch == 30
    t.watch.first_step()
    assert t.first[0].final and t.first[0].source == str(prefix)  # the final one, at the first step
    t.watch.found_nothing()
    assert len(t.said) == 2  # nothing said after the first step


def test_a_restores_position_by_the_custom_loop_tutorials_names(tmp_path: Path) -> None:
    t = Told(tmp_path)
    loop = Checkpoint(epoch=Variable(2), step_in_epoch=Variable(7), step=Variable(57), model=object())
    t.watch.restored(str(tmp_path / "ckpt" / "ckpt-5"), loop, "tf.train.Checkpoint")
    t.watch.first_step()
    (r,) = t.first
    assert (r.step, r.epoch, r.step_in_epoch) == (57, 2, 7)
    # a file that cannot be read is named by its path: two tasks compare equal only on one path
    assert r.fingerprint.startswith("path:")


def test_a_hook_that_fails_never_fails_the_job(caplog: pytest.LogCaptureFixture) -> None:
    class Saver:
        def save(self, path: str) -> str:
            return path + "-1"

    def broken(*_: object) -> None:
        raise RuntimeError("watching broke")

    checkpoints._after(Saver, "save", broken)
    checkpoints._after(Saver, "save", broken)  # hooked once only
    assert Saver().save("/c/ckpt") == "/c/ckpt-1"
    assert getattr(Saver.save, "_orchestrate_hook", False)
