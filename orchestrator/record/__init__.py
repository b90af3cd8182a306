"""The record room: the run directory (docs/architecture.md §5) — written by the coordinator
(write.py), read back by `orchestrate status`/`logs`/`wait`/`ls` and the page (read.py), its
documented shape (schemas.py), the tasks' logs followed (logtail.py), and the record as people
read it: a status in words (progress.py), what of a task's output the console shows (quiet.py).

Every layer above may use it (the supervisor writes through it; the console and the web page read
through it); it imports only the spec, the state vocabulary (orchestrator/states.py), errors and
the wire."""
