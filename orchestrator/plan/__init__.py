"""The plan room: where each task runs and how it starts — a backend's placements (placement.py),
the pure function from spec and placements to the launch plan (launch_plan.py: every task's host,
port, command and environment with TF_CONFIG), and the plan of each attempt, made again when the
backend moves tasks (planner.py).

It imports the spec, the wire and nothing else of the coordinator at run time: the backends, the
supervisor and the coordinator above it use it; it is handed what it writes to."""
