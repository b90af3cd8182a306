"""The warm room: a task's next attempt, ready before it is needed (docs/architecture.md §6) — the
standby that imports TensorFlow ahead (standby.py), the keeper that forks each handover's task
(keeper.py) and the spare forked ahead of it (spare.py).

It may import the task room (a fork becomes a task), the host room and the wire; never the
coordinator."""
