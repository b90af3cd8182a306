"""Where a job keeps its own checkpoints, and what each task restored (mode 1).

A job written from TensorFlow's tutorials checkpoints to a path of its own
(`BackupAndRestore('/tmp/backup')`, `ModelCheckpoint('ckpt/…')`, `CheckpointManager(ckpt, '/tmp/ckpt')`),
not to ORCHESTRATE_CHECKPOINT_DIR. On hosts that share no disk, each host has its own such folder;
after a restart one task restores and another does not, and their collectives no longer match.

This module watches the job from inside, without importing TensorFlow or Keras (strategy_hook's
after-import hooks on their classes):
- the folders the job writes checkpoints to (and restores from) are told to the coordinator, which
  keeps the owner's copy on every host (docs/architecture.md §4);
- what the task restored before its first step (a checkpoint's path, its epoch and batch where the
  checkpoint has them, or nothing) is reported once, at the first step's tracing (the first
  `strategy.run`: Keras `fit` and the custom loops call it once they restored); the coordinator
  compares the tasks' reports. Each restore (and a `restore_or_initialize` that found nothing) is
  also told as it happens, not final: Keras's `fit` under MultiWorkerMirroredStrategy runs
  collectives between its restore and its first step, and where the tasks restored different
  states those fail first; the coordinator then explains TensorFlow's error with these.

The non-chief workers' temporary copies (`workertemp_N`: TensorFlow's and the tutorials'
`_get_temp_dir`) are recognised and not told: they are removed after each save and no one restores
them. A folder that is the task's working folder, one above it, the home folder, `/` or `/tmp`
itself is not told either (copying it would copy far more than checkpoints): said in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from worker import wire
from worker.task.strategy_hook import after_import
from worker.wire import MAX_FOLDERS, MAX_PATH_CHARS

log = logging.getLogger("worker")

#: What a restore's fingerprint reads of a checkpoint file, at most.
FINGERPRINT_BYTES = 64 * 1024 * 1024
_TEMP = re.compile(r"^workertemp_\d+$")
#: (module, class, method, what it says): the job's checkpoint writers and readers.
_TF_CHECKPOINT = "tensorflow.python.checkpoint.checkpoint"
_TF_MANAGER = "tensorflow.python.checkpoint.checkpoint_management"
_TF_STRATEGY = "tensorflow.python.distribute.distribute_lib"
_KERAS_CALLBACKS = (
    ("tf_keras.src.callbacks", "BackupAndRestore", "backup_dir", False),
    ("tf_keras.src.callbacks", "ModelCheckpoint", "filepath", True),
    ("keras.src.callbacks.backup_and_restore", "BackupAndRestore", "backup_dir", False),
    ("keras.src.callbacks.model_checkpoint", "ModelCheckpoint", "filepath", True),
)
_KERAS_MODELS = ("tf_keras.src.engine.training", "keras.src.models.model")
#: Names a checkpoint's position goes by (Keras BackupAndRestore's, the custom-loop tutorial's).
_EPOCH = ("ckpt_saved_epoch", "epoch")
_IN_EPOCH = ("ckpt_saved_batch", "step_in_epoch", "batch")
_STEP = ("step", "global_step")  # (never `save_counter`: reading it makes one)


class Watch:
    """What one task's job did with its checkpoints. `on_folder(path, by)` for each new folder;
    `on_first_step(restored)` once, as the job traces its first step."""

    def __init__(
        self,
        on_folder: Callable[[str, str], None],
        on_first_step: Callable[[wire.Restored], None],
        *,
        cwd: str | None = None,
        known: str | None = None,
        check: Callable[[Any, wire.Restored], None] | None = None,
        on_restore: Callable[[wire.Restored], None] | None = None,
    ):
        self._on_folder = on_folder
        self._on_restore = on_restore  # each restore as it happens (not final)
        self._check = check or same_start
        self._on_first_step = on_first_step
        self._cwd = os.path.abspath(cwd or os.getcwd())
        self._known = os.path.abspath(known) if known else None  # ORCHESTRATE_CHECKPOINT_DIR: kept already
        self._lock = threading.Lock()
        self.folders: dict[str, str] = {}
        self._said: set[str] = set()
        self._restored: wire.Restored | None = None
        self.stepped = False

    def wrote(self, path: object, by: str, *, is_file: bool = True) -> None:
        """The job wrote (or will write) a checkpoint at `path` (a file or prefix: its folder
        counts; `is_file` False: `path` is the folder)."""
        text = _text(path)
        if text is None:
            return
        if "://" in text:  # gs://, hdfs://: no host's own disk
            self._say(
                text, f"{text} ({by}) is not a folder on this host's disk: not kept the same on every host"
            )
            return
        folder = os.path.abspath(os.path.join(self._cwd, text))
        folder = os.path.dirname(folder) if is_file else folder
        if self._known and (folder == self._known or folder.startswith(self._known + os.sep)):
            return  # ORCHESTRATE_CHECKPOINT_DIR: kept consistent already
        if any(_TEMP.match(p) for p in folder.split(os.sep)):
            log.debug("%s (%s) is a worker's temporary copy: not kept", folder, by)
            return
        why = self._refused(folder)
        if why is not None:
            self._say(folder, f"{folder} ({by}) {why}")
            return
        with self._lock:
            if folder in self.folders:
                return
            if len(self.folders) >= MAX_FOLDERS:
                full = True
            else:
                full = False
                self.folders[folder] = by
        if full:
            self._say(
                "",
                f"the job checkpoints to over {MAX_FOLDERS} folders; the others are not kept",
            )
            return
        self._on_folder(folder, by)

    def restored(self, path: object, checkpoint: object | None, by: str) -> None:
        """The job restored `path` (before its first step: where this attempt starts from)."""
        text = _text(path)
        if text is None or self.stepped:
            return
        source = os.path.abspath(os.path.join(self._cwd, text))
        epoch, in_epoch, step = (_position(checkpoint, names) for names in (_EPOCH, _IN_EPOCH, _STEP))
        self._restored = wire.Restored(
            step=step or 0,
            fingerprint=fingerprint(source),
            source=source,
            epoch=epoch or 0,
            step_in_epoch=in_epoch or 0,
        )
        self.wrote(source, by)  # the folder it restores from is the job's too
        if self._on_restore is not None:
            self._on_restore(dataclasses.replace(self._restored, final=False))

    def found_nothing(self) -> None:
        """The job looked for a checkpoint to restore (`restore_or_initialize`) and found none."""
        if self._on_restore is not None and self._restored is None and not self.stepped:
            self._on_restore(wire.Restored(step=0, fingerprint=NOTHING, source=None, final=False))

    def first_step(self, strategy: object = None) -> None:
        """The job traces its first step: what it restored is reported, then compared with the
        other workers' over the strategy's own collectives (RestoreMismatch when they differ)."""
        with self._lock:
            if self.stepped:
                return
            self.stepped = True
        restored = self._restored or wire.Restored(step=0, fingerprint=NOTHING, source=None)
        self._on_first_step(restored)
        if strategy is not None:
            self._check(strategy, restored)

    def _refused(self, folder: str) -> str | None:
        if len(folder) > MAX_PATH_CHARS:
            return "is too long a path: not kept"
        home = os.path.expanduser("~")
        if (
            folder in ("/", "/tmp", home)
            or self._cwd == folder
            or self._cwd.startswith(folder.rstrip(os.sep) + os.sep)
        ):
            return (
                "is not a folder of checkpoints alone: orchestrate does not copy it between hosts "
                "(write the checkpoints into a folder of their own)"
            )
        return None

    def _say(self, key: str, line: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        log.warning("%s", line)  # in the task's log: these checkpoints are not kept the same


NOTHING = wire.RESTORED_NOTHING
#: The strategies whose workers train one model together (MultiWorkerMirroredStrategy's names).
_SYNCHRONOUS = ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")


class RestoreMismatch(RuntimeError):
    """The workers of one attempt restored different states: trained together, they would
    average the gradients of different models."""


def same_start(strategy: Any, mine: wire.Restored) -> None:
    """Every worker of a MultiWorkerMirroredStrategy job compares what it restored with the
    others' over the strategy's own collectives, before its first step (as the built-in loop
    does): any difference stops every worker. Lifted out of a step being traced (init_scope)."""
    if not type(strategy).__name__.startswith(_SYNCHRONOUS):
        return
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    if len(cluster.get("chief", [])) + len(cluster.get("worker", [])) < 2:
        return
    import tensorflow as tf  # loaded already: the job's strategy is running

    which = int(hashlib.sha256(mine.fingerprint.encode()).hexdigest()[:15], 16)
    row = [which, mine.step, mine.epoch, mine.step_in_epoch]
    with tf.init_scope():
        gathered = strategy.gather(strategy.run(lambda: tf.constant([row], dtype=tf.int64)), axis=0)
        rows = gathered.numpy().tolist()
    if len({tuple(r) for r in rows}) > 1:
        raise RestoreMismatch(
            f"the workers restored different states (this one: {mine.source or 'nothing'}), so trained "
            "together they would average the gradients of different models; not training on"
        )


def fingerprint(source: str) -> str:
    """Which checkpoint: SHA-256 (16 hex) of its index file (a TF checkpoint's prefix) or of the
    file itself (Keras weights), the first FINGERPRINT_BYTES; its path where neither can be read."""
    for candidate in (source + ".index", source):
        try:
            with open(candidate, "rb") as f:
                digest = hashlib.sha256(f.read(FINGERPRINT_BYTES))
        except OSError:
            continue
        return digest.hexdigest()[:16]
    return "path:" + hashlib.sha256(source.encode(errors="replace")).hexdigest()[:11]


def install(watch: Watch) -> None:
    """Hook the job's checkpoint writers and readers, and its first step, as their modules load."""
    after_import(_TF_CHECKPOINT, functools.partial(_patch_checkpoint, watch))
    after_import(_TF_MANAGER, functools.partial(_patch_manager, watch))
    after_import(_TF_STRATEGY, functools.partial(_patch_strategy, watch))
    for module, cls, attribute, is_file in _KERAS_CALLBACKS:
        after_import(module, functools.partial(_patch_callback, watch, cls, attribute, is_file))
    for module in _KERAS_MODELS:
        after_import(module, functools.partial(_patch_model, watch))


def _patch_checkpoint(watch: Watch, module: ModuleType) -> None:
    cls = getattr(module, "Checkpoint", None)
    _after(
        cls,
        "_write",
        lambda ckpt, args, kw, result: watch.wrote(
            result or _arg(args, kw, "file_prefix"), "tf.train.Checkpoint"
        ),
    )
    for name in ("read", "restore"):
        _after(
            cls,
            name,
            lambda ckpt, args, kw, result: watch.restored(
                _arg(args, kw, "save_path"), ckpt, "tf.train.Checkpoint"
            ),
        )


def _patch_manager(watch: Watch, module: ModuleType) -> None:
    cls = getattr(module, "CheckpointManager", None)
    _after(
        cls,
        "__init__",
        lambda m, args, kw, result: watch.wrote(
            getattr(m, "directory", None), "tf.train.CheckpointManager", is_file=False
        ),
    )
    # Keras's BackupAndRestore restores through it: None, no checkpoint there (a restore is seen
    # by Checkpoint.restore)
    _after(cls, "restore_or_initialize", lambda m, a, kw, result: None if result else watch.found_nothing())


def _patch_strategy(watch: Watch, module: ModuleType) -> None:
    _after(
        getattr(module, "StrategyBase", None),
        "run",
        lambda strategy, *_: watch.first_step(strategy),
        before=True,
    )


def _patch_callback(watch: Watch, name: str, attribute: str, is_file: bool, module: ModuleType) -> None:
    by = f"{module.__name__.split('.')[0]}.callbacks.{name}"
    _after(
        getattr(module, name, None),
        "__init__",
        lambda cb, *_: watch.wrote(getattr(cb, attribute, None), by, is_file=is_file),
    )


def _patch_model(watch: Watch, module: ModuleType) -> None:
    by = f"{module.__name__.split('.')[0]}.Model.load_weights"
    _after(
        getattr(module, "Model", None),
        "load_weights",
        lambda m, args, kw, result: watch.restored(_arg(args, kw, "filepath"), None, by),
    )


def _after(
    cls: Any,
    name: str,
    then: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None],
    *,
    before: bool = False,
) -> None:
    """Wrap `cls.name` so that `then(self, args, kwargs, result)` runs after it (`before`: first).
    What `then` raises is logged, never the job's."""
    original = getattr(cls, name, None) if cls is not None else None
    if original is None or getattr(original, "_orchestrate_hook", False):
        if cls is not None and original is None:
            log.warning("%s.%s changed shape: cannot watch the job's checkpoints there", cls.__name__, name)
        return

    def call_then(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        try:
            then(self, args, kwargs, result)
        except RestoreMismatch:
            raise  # the one thing watching says to the job: it must not train on
        except Exception as exc:  # noqa: BLE001 - watching never breaks the job
            log.debug("watching %s.%s: %s", cls.__name__, name, exc)

    @functools.wraps(original)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before:
            call_then(self, args, kwargs, None)
        result = original(self, *args, **kwargs)
        if not before:
            call_then(self, args, kwargs, result)
        return result

    hooked._orchestrate_hook = True  # type: ignore[attr-defined]
    setattr(cls, name, hooked)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    return args[0] if args else kwargs.get(name)


def _text(path: object) -> str | None:
    """A path as text (str, bytes, os.PathLike, an eager string tensor); None for anything else."""
    if hasattr(path, "numpy"):
        try:
            path = path.numpy()
        except Exception:  # noqa: BLE001 - a symbolic tensor: no path to tell
            return None
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    return path if isinstance(path, str) and path and "\0" not in path else None


def _position(checkpoint: object | None, names: tuple[str, ...]) -> int | None:
    """A restored checkpoint's number by one of `names` (a variable or an int), if it has one."""
    if checkpoint is None:
        return None
    for name in names:
        value = getattr(checkpoint, name, None)
        if value is None:
            continue
        try:
            number = int(value.numpy() if hasattr(value, "numpy") else value)
        except (TypeError, ValueError, OverflowError):
            continue
        return number
    return None
