"""ParameterServerStrategy (asynchronous training) in the built-in loop.

- ps and worker tasks run `tf.distribute.Server(...).join()` (`python -m worker server`): they hold
  variables (ps) or run what the chief schedules (worker) and report liveness until stopped.
- The chief runs the loop with `ClusterCoordinator`: per-worker datasets (the user's make_dataset,
  repeated: workers pull batches as they go), one `schedule()` per step, `join()` at every report
  and checkpoint. A worker that dies and comes back on the same address is picked up again by the
  coordinator (TensorFlow re-runs its lost steps); a ps that dies fails the chief (whole-job
  restart, resumed from the chief's last checkpoint).

One step is one global batch applied by one worker; `train.steps` counts them (epochs do not apply
to asynchronous training).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from worker import wire
from worker.task.checkpoints import fingerprint
from worker.task.runtime import reporter
from worker.task.training import (
    build_optimizer,
    checkpoint_write_dir,
    replica_step,
    user_loss,
    user_optimizer,
    write_final_marker,
)

REPORT_EVERY = 10  # steps between join()s that report progress (each join waits for stragglers)


def serve() -> None:
    """A ps or worker task: start this task's TF server and serve until stopped."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        raise SystemExit(f"`worker server` is for ps and worker tasks, not {resolver.task_type!r}")
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    reporter().mark_ready()
    print(f"[orchestrate] {resolver.task_type} {resolver.task_id} serving at {server.target}", flush=True)
    # Not server.join(): it blocks in C++, where Python's SIGTERM handler never gets to run (a stop
    # would wait out the whole grace period). The server serves from its own threads meanwhile.
    while True:
        time.sleep(1.0)


class PsTrainer:
    """The chief of a ParameterServerStrategy job (built-in loop)."""

    def __init__(self, config: Any, user: ModuleType):
        import tensorflow as tf

        self.tf, self.config = tf, config
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        self.strategy = tf.distribute.ParameterServerStrategy(resolver)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        workers = len(resolver.cluster_spec().as_dict().get("worker", []))
        print(
            f"[orchestrate] ParameterServerStrategy: {workers} worker(s), steps scheduled by the chief",
            flush=True,
        )
        self.write_dir = checkpoint_write_dir(config.checkpoint_dir, True, "chief", 0)
        with self.strategy.scope():
            self.model = user.build_model()
            self.optimizer = user_optimizer(tf, user)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.per_example_loss = user_loss(tf, user)
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(self.write_dir), max_to_keep=3)
        # Built now, as the built-in loop does: a restore fills the optimizer's slots at once,
        # not in the first step, and the restore the chief reports is all of it.
        with self.strategy.scope():
            build_optimizer(self.optimizer, self.model)
        latest = tf.train.latest_checkpoint(str(config.checkpoint_dir))
        if latest:
            self.checkpoint.restore(latest)
            print(f"[orchestrate] resumed from {latest} at step {int(self.step.numpy())}", flush=True)
        # The job's state is the chief's alone (nothing to compare): the checkpoint's own
        # fingerprint, not its variables' (reading those back from the ps tasks costs a model's
        # size in RPCs).
        reporter().mark_restored(
            wire.Restored(
                step=int(self.step.numpy()),
                fingerprint=fingerprint(latest) if latest else wire.RESTORED_NOTHING,
                source=latest,
            )
        )
        gbs = config.global_batch_size

        def dataset_fn() -> Any:
            return self.strategy.distribute_datasets_from_function(
                lambda ctx: user.make_dataset(ctx, gbs).repeat()
            )

        self.iterator = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        self.step_fn = tf.function(self._step_fn)
        self._stop = False

    def _step_fn(self, iterator: Any) -> Any:
        tf = self.tf
        step = replica_step(
            tf, self.model, self.optimizer, self.per_example_loss, self.config.global_batch_size
        )
        per_replica = self.strategy.run(step, args=next(iterator))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def train(self) -> None:
        rep = reporter()
        total = self.config.steps
        rep.set_total_steps(total)
        # SIGTERM (the coordinator's stop): finish the steps in flight, save, exit 42 (restartable).
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        step = int(self.step.numpy())
        while step < total:
            every = self.config.checkpoint_every
            chunk = min(REPORT_EVERY, total - step, every - step % every)
            last = None
            for _ in range(chunk):
                last = self.coordinator.schedule(self.step_fn, args=(self.iterator,))
            self.coordinator.join()
            step += chunk
            self.step.assign(step)
            loss = float(last.fetch()) if last is not None else float("nan")
            rep.report(step, loss=loss)
            if step % self.config.checkpoint_every == 0 or step >= total:
                self.manager.save(checkpoint_number=step)
                print(f"[orchestrate] step {step}/{total}: loss {loss:.4f}, checkpoint saved", flush=True)
            if self._stop:
                latest = self.manager.latest_checkpoint
                if latest is None or not latest.endswith(f"-{step}"):
                    self.manager.save(checkpoint_number=step)
                print("[orchestrate] stop requested: checkpoint saved, exiting", flush=True)
                raise SystemExit(wire.EXIT_PREEMPTED)
        write_final_marker(self.config.checkpoint_dir, step)
        if self.config.run_dir is not None:
            path = Path(self.config.run_dir) / "model" / "model.keras"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.model.save(str(path))
            print(f"[orchestrate] saved the trained model to {path}", flush=True)
