"""The built-in training loop (mode 2, `job.loop`), the seed's loop done right.

The user's module defines `build_model()` (called under `strategy.scope()`),
`make_dataset(input_context, global_batch_size)` (per-replica batches, sharded by the context),
and optionally `make_loss()` (per-example loss `(labels, predictions) -> [batch]`) and
`make_optimizer()`. The loop distributes the dataset with `distribute_datasets_from_function`,
scales the loss with `tf.nn.compute_average_loss(..., global_batch_size=...)`, runs `strategy.run`
inside a `tf.function`, reduces the loss with `strategy.reduce`, checkpoints every
`checkpoint_every` steps and at the end (every worker saves: the chief into the real directory,
the others into temporary ones, or the save deadlocks), and resumes from the latest checkpoint at
the exact step and position in the epoch where it was taken.

SIGTERM (the coordinator's stop, or a preemption) goes through TF's PreemptionCheckpointHandler:
all workers agree on a step, save there, and exit with code 42.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from worker import wire
from worker.task.process import is_chief
from worker.task.ps import PsTrainer
from worker.task.runtime import reporter
from worker.task.training import (
    LoopError,
    build_optimizer,
    checkpoint_write_dir,
    load_module,
    replica_step,
    tensorboard_scalar,
    user_loss,
    user_optimizer,
    write_final_marker,
)


@dataclass(frozen=True)
class LoopConfig:
    module: Path
    strategy: str  # multi_worker_mirrored | mirrored | parameter_server
    steps: int | None
    epochs: int | None
    global_batch_size: int
    checkpoint_every: int
    checkpoint_dir: Path
    run_dir: Path | None
    cpu_replicas: int | None = None  # mirrored on a CPU-only host: this many logical CPU devices

    def finished(self, step: int, epoch: int) -> bool:
        return step >= self.steps if self.steps is not None else epoch >= (self.epochs or 0)


class RestoreMismatch(LoopError):
    """The workers of one attempt restored different states."""


def state_fingerprint(model: Any, optimizer: Any, counters: tuple[Any, ...]) -> str:
    """SHA-256 of every checkpointed variable's bytes, in a fixed order: equal on two workers
    exactly when they hold the same model, optimizer state and position."""
    digest = hashlib.sha256()
    variables = [*model.variables, *getattr(optimizer, "variables", []), *counters]
    for v in variables:
        value = v.numpy()
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:16]


def run(config: LoopConfig) -> None:
    user = load_module(config.module)
    if config.strategy == "parameter_server":
        PsTrainer(config, user).train()
        return
    _Trainer(config, user).train()


class _Trainer:
    def __init__(self, config: LoopConfig, user: ModuleType):
        import tensorflow as tf  # after the user's module loaded: its own env tweaks come first

        self.tf = tf
        self.config = config
        self.strategy = _make_strategy(tf, config.strategy, config.cpu_replicas)
        replicas = self.strategy.num_replicas_in_sync
        print(f"[orchestrate] {type(self.strategy).__name__}: num_replicas_in_sync={replicas}", flush=True)
        resolver = self.strategy.cluster_resolver
        task_type = getattr(resolver, "task_type", None)
        task_id = getattr(resolver, "task_id", 0) or 0
        has_chief = resolver is not None and "chief" in resolver.cluster_spec().as_dict()
        self.is_chief = is_chief(task_type, task_id, has_chief)
        self.write_dir = checkpoint_write_dir(config.checkpoint_dir, self.is_chief, task_type, task_id)
        with self.strategy.scope():
            self.model = user.build_model()
            self.optimizer = user_optimizer(tf, user)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.step_in_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_in_epoch")
        self.per_example_loss = user_loss(tf, user)
        checkpoint = tf.train.Checkpoint(
            model=self.model,
            optimizer=self.optimizer,
            step=self.step,
            epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
        )
        self.manager = tf.train.CheckpointManager(checkpoint, str(self.write_dir), max_to_keep=3)
        # Built now, so that a restore fills the optimizer's state at once (not on its first
        # step) and the fingerprint below covers it.
        with self.strategy.scope():
            build_optimizer(self.optimizer, self.model)
        self.restored = self._restore(checkpoint)
        reporter().mark_restored(self.restored)
        self._check_same_start(task_type, task_id)
        self.preemption = tf.distribute.experimental.PreemptionCheckpointHandler(
            resolver,
            self.manager,
            termination_config=tf.distribute.experimental.TerminationConfig(
                exit_fn=lambda: _exit_preempted(self.write_dir, self.is_chief),
                # numbered by our step (the manager's own counter would name it ckpt-<saves>)
                save_fn=lambda: self.manager.save(checkpoint_number=int(self.step.numpy())),
            ),
        )
        self.user = user
        self.dataset: Any = None  # made when an epoch starts from its first batch
        self.train_step = tf.function(self._train_step)
        self.writer = (
            tf.summary.create_file_writer(str(config.run_dir / "tensorboard"))
            if self.is_chief and config.run_dir is not None
            else None
        )

    def _restore(self, checkpoint: Any) -> wire.Restored:
        """The latest checkpoint of the run's folder restored, if there is one: where from, and
        the fingerprint of the state this task starts from."""
        latest = self.tf.train.latest_checkpoint(str(self.config.checkpoint_dir))
        if latest:
            checkpoint.restore(latest)
            print(f"[orchestrate] resumed from {latest} at step {int(self.step.numpy())}", flush=True)
        counters = (self.step, self.epoch, self.step_in_epoch)
        return wire.Restored(
            step=int(self.step.numpy()),
            fingerprint=state_fingerprint(self.model, self.optimizer, counters),
            source=latest,
            epoch=int(self.epoch.numpy()),
            step_in_epoch=int(self.step_in_epoch.numpy()),
        )

    def _check_same_start(self, task_type: str | None, task_id: int) -> None:
        """Every worker of a synchronous job must start from the same state (the chief's): one that
        restored something else (its disk lacked the checkpoint) would average its gradients with
        the others' — a different model, trained on silently. Compared over the strategy's own
        collectives before the first step; any difference stops every worker."""
        tf, mine = self.tf, self.restored
        if self.config.strategy != "multi_worker_mirrored":
            return  # one worker: its replicas share its variables
        cluster = self.strategy.cluster_resolver.cluster_spec().as_dict()
        if len(cluster.get("chief", [])) + len(cluster.get("worker", [])) < 2:
            return
        row = [
            0 if task_type == "chief" else 1,
            task_id,
            mine.step,
            mine.epoch,
            mine.step_in_epoch,
            int(mine.fingerprint[:15], 16),
        ]
        rows = (
            self.strategy.gather(self.strategy.run(lambda: tf.constant([row], dtype=tf.int64)), axis=0)
            .numpy()
            .tolist()
        )
        starts = {tuple(r[2:]) for r in rows}
        if len(starts) == 1:
            return
        seen = {}
        for r in rows:
            name = f"{'chief' if r[0] == 0 else 'worker'}-{r[1]}"
            seen[name] = f"step {r[2]} (epoch {r[3]}, batch {r[4]}), state {r[5]:015x}"
        table = "; ".join(f"{k}: {v}" for k, v in sorted(seen.items()))
        raise RestoreMismatch(
            "the workers restored different states, so they would train different models: "
            f"{table}. Their checkpoint folders differ (hosts that share no disk); not training on."
        )

    def _train_step(self, batch: Any) -> Any:
        step = replica_step(
            self.tf, self.model, self.optimizer, self.per_example_loss, self.config.global_batch_size
        )
        per_replica = self.strategy.run(step, args=batch)
        # each replica's loss is already divided by the global batch: their sum is the batch mean
        return self.strategy.reduce(self.tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def _one_step(self, batch: Any) -> float:
        loss = float(self.train_step(batch))
        # counted before PreemptionCheckpointHandler may save after this call returns
        self.step.assign_add(1)
        self.step_in_epoch.assign_add(1)
        return loss

    def train(self) -> None:
        rep = reporter()
        rep.set_total_steps(self.config.steps)
        self._rate_mark = (time.monotonic(), int(self.step.numpy()))
        try:
            while not self.config.finished(int(self.step.numpy()), int(self.epoch.numpy())):
                if self._train_epoch(rep):
                    self.epoch.assign_add(1)
                    self.step_in_epoch.assign(0)
            final = int(self.step.numpy())
            if self.manager.latest_checkpoint is None or not self.manager.latest_checkpoint.endswith(
                f"-{final}"
            ):
                self.manager.save(checkpoint_number=final)
        finally:
            if self.writer is not None:
                self.writer.close()
            if not self.is_chief:
                shutil.rmtree(self.write_dir, ignore_errors=True)
        if self.is_chief:
            write_final_marker(self.config.checkpoint_dir, final)
        if self.is_chief and self.config.run_dir is not None:
            path = self.config.run_dir / "model" / "model.keras"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.model.save(str(path))
            print(f"[orchestrate] saved the trained model to {path}", flush=True)

    def _train_epoch(self, rep: Any) -> bool:
        """Train until the epoch's data ends (True) or the run's steps are done (False)."""
        skipped = int(self.step_in_epoch.numpy())
        if skipped:  # resumed mid-epoch: at the same batch
            iterator = self._resumed_at(skipped)
        else:
            if self.dataset is None:
                self.dataset = self._distributed(0)
            iterator = iter(self.dataset)
        trained = 0
        while not self.config.finished(int(self.step.numpy()), int(self.epoch.numpy())):
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                if trained == 0 and skipped == 0:
                    raise LoopError("make_dataset() returned an empty dataset: nothing to train on")
                return True
            loss = self.preemption.run(self._one_step, batch.get_value())
            trained += 1
            self._after_step(rep, int(self.step.numpy()), loss)
        return False

    def _distributed(self, steps: int) -> Any:
        """The job's dataset, distributed; its first `steps` steps' batches skipped by tf.data
        itself (each input pipeline gives each of its replicas a batch per step)."""
        gbs = self.config.global_batch_size

        def make(ctx: Any) -> Any:
            dataset = self.user.make_dataset(ctx, gbs)
            per_step = ctx.num_replicas_in_sync // ctx.num_input_pipelines
            return dataset.skip(steps * per_step) if steps else dataset

        return self.strategy.distribute_datasets_from_function(make)

    def _resumed_at(self, steps: int) -> Any:
        """An iterator at the batch after `steps` of the epoch. The skipped batches are still made
        (an input pipeline cannot jump), but inside tf.data, not a step at a time from Python:
        ×3–5 faster (docs/architecture.md §6); said with its time in the task's log."""
        start = time.monotonic()
        iterator = iter(self._distributed(steps))
        first = iterator.get_next_as_optional()
        more = bool(first.has_value())  # the skipping happens here
        epoch, took = int(self.epoch.numpy()), time.monotonic() - start
        said = f"{steps} batches skipped" if more else "its data ended before"
        print(f"[orchestrate] resumed at batch {steps} of epoch {epoch}: {said} in {took:.2f} s", flush=True)
        return _Pushback(first, iterator)

    def _after_step(self, rep: Any, step: int, loss: float) -> None:
        # the loss is all-reduced: the same on every worker, so one of them keeps the record
        (rep.report if self.is_chief else rep.progress)(step, loss=loss)
        if self.writer is not None and step % 10 == 0:
            now = time.monotonic()
            then, then_step = self._rate_mark
            with self.writer.as_default(step=step):
                tensorboard_scalar(self.tf, "loss", loss)
                tensorboard_scalar(self.tf, "steps_per_s", (step - then_step) / max(now - then, 1e-9))
            self._rate_mark = (now, step)
        if step % self.config.checkpoint_every == 0:
            self.manager.save(checkpoint_number=step)
            if self.is_chief:
                total = f"/{self.config.steps}" if self.config.steps else ""
                print(f"[orchestrate] step {step}{total}: loss {loss:.4f}, checkpoint saved", flush=True)


class _Pushback:
    """An iterator whose first optional batch was already taken (to time the skip)."""

    def __init__(self, first: Any, rest: Any):
        self._first, self._rest = first, rest

    def get_next_as_optional(self) -> Any:
        first, self._first = self._first, None
        return first if first is not None else self._rest.get_next_as_optional()


def _exit_preempted(write_dir: Path, is_chief: bool) -> None:
    print("[orchestrate] stop requested: checkpoint saved, exiting", flush=True)
    if not is_chief:
        shutil.rmtree(write_dir, ignore_errors=True)
    raise SystemExit(wire.EXIT_PREEMPTED)


def _make_strategy(tf: Any, name: str, cpu_replicas: int | None = None) -> Any:
    if name == "multi_worker_mirrored":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored":
        if cpu_replicas and not tf.config.list_physical_devices("GPU"):
            # No GPU: split the CPU into logical devices, one replica each (testing, trying a job).
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_replicas
            )
            devices = [d.name for d in tf.config.list_logical_devices("CPU")]
            return tf.distribute.MirroredStrategy(devices=devices)
        return tf.distribute.MirroredStrategy()  # every GPU of this host (or its CPU)
    raise LoopError(f"the built-in loop does not support strategy {name!r}")


def config_from_args(ns: Any) -> LoopConfig:
    run_dir = os.environ.get(wire.ENV_RUN_DIR)
    return LoopConfig(
        module=Path(ns.module),
        strategy=ns.strategy,
        steps=ns.steps,
        epochs=ns.epochs,
        global_batch_size=ns.global_batch_size,
        checkpoint_every=ns.checkpoint_every,
        checkpoint_dir=Path(ns.checkpoint_dir),
        run_dir=Path(run_dir) if run_dir else None,
        cpu_replicas=ns.cpu_replicas,
    )
