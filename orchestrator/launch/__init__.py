"""Launch layer: start, poll and stop the processes of a plan (local subprocesses; SSH later)."""
