"""The task room: what runs inside a training task — the runtime that runs the job (runtime.py), the
built-in loop (loop.py, ps.py, evaluate.py, training.py), what the task reports (reporter.py,
keras_callback.py, tensorboard.py) and keeps (checkpoints.py), and how it meets TensorFlow
(strategy_hook.py, tf_tuning.py, stack_dump.py, process.py).

It may import TensorFlow (only inside functions: `import worker` stays light), the wire
(worker/wire/) and the host room's standard-library modules; never the warm room, never the
coordinator."""
