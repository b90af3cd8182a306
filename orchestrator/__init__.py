"""tf-orchestrate coordinator: spec -> plan -> launch -> supervise -> run record.

This package never imports TensorFlow: the CLI must start fast, and the coordinator machine
may not even have it installed.
"""

__version__ = "0.1.0"
