"""Which environment variables TensorFlow reads when it is imported, and which only later.

A warm standby (issue 25) imports TensorFlow before its attempt exists: a variable read at import
must be in the standby's environment from the start (it is: a standby gets exactly its task's
environment), and a variable that changes per attempt must be read only later (TF_CONFIG must be).

For each variable, three fresh processes run the same observation after `import tensorflow`:
with the variable unset, set before the import, and set after it (in os.environ, before the
observation). Read at import: "before" differs from "unset" and "after" does not. Read later:
"after" equals "before". Prints a Markdown table; `--json FILE` writes the rows.

    .venv/bin/python scripts/bench/env_at_import.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# One observation per variable: Python run after `import tensorflow as tf` (and after the variable
# was set, for "after"); it prints the value compared. `stderr`: the observation is the number of
# lines TensorFlow's C++ writes from then on.
PROBE = r"""
import os, sys
var, value, when, observe = sys.argv[1:5]
if when == "before":
    os.environ[var] = value
import tensorflow as tf
if when == "after":
    os.environ[var] = value
print("@@after-import", file=sys.stderr, flush=True)
if observe in ("log", "threads"):
    x = tf.random.normal([64, 64])
    float(tf.reduce_sum(tf.linalg.matmul(x, x)))
    if observe == "threads":
        print("R", "threads", len(os.listdir("/proc/self/task")))
elif observe == "onednn":
    from tensorflow.python.util import _pywrap_util_port
    print("R", "oneDNN on", _pywrap_util_port.IsMklEnabled())
elif observe == "tf.keras":
    print("R", tf.keras.Model.__module__.split(".")[0])
elif observe == "keras":
    import keras
    print("R", "backend", keras.backend.backend())
elif observe == "tf_config":
    print("R", tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec().as_dict())
elif observe == "server":
    tf.distribute.Server(tf.train.ClusterSpec({"worker": ["127.0.0.1:0"]}), job_name="worker", task_index=0)
elif observe == "gpus":
    print("R", "GPUs", len(tf.config.list_physical_devices("GPU")))
elif observe == "hash":
    print("R", "hash randomization", sys.flags.hash_randomization)
"""

TF_CONFIG = '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}'

# (variable, value, observation, base environment of all three runs, what is observed)
CASES = [
    ("PYTHONHASHSEED", "0", "hash", {}, "sys.flags.hash_randomization"),
    ("TF_CPP_MIN_LOG_LEVEL", "3", "log", {"TF_CPP_MAX_VLOG_LEVEL": "1"}, "C++ log lines after the import"),
    ("TF_CPP_MAX_VLOG_LEVEL", "1", "log", {}, "C++ log lines after the import"),
    ("TF_ENABLE_ONEDNN_OPTS", "0", "onednn", {}, "oneDNN custom operations on"),
    ("TF_USE_LEGACY_KERAS", "1", "tf.keras", {}, "the package tf.keras is"),
    ("KERAS_BACKEND", "jax", "keras", {}, "Keras 3's backend"),
    ("TF_NUM_INTRAOP_THREADS", "9", "threads", {}, "threads after the first op"),
    ("TF_NUM_INTEROP_THREADS", "9", "threads", {}, "threads after the first op"),
    ("ONEDNN_VERBOSE", "1", "log", {}, "C++ log lines after the import"),
    ("GRPC_VERBOSITY", "DEBUG", "server", {}, "log lines when a gRPC server starts"),
    ("TF_CONFIG", TF_CONFIG, "tf_config", {}, "the cluster TFConfigClusterResolver reads"),
    ("CUDA_VISIBLE_DEVICES", "0", "gpus", {}, "GPUs listed"),
]


def observe(var: str, value: str, when: str, how: str, base: dict[str, str]) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != var}
    env.update(base)
    if var.startswith("PYTHON") and when == "before":  # the interpreter's own: given at its start
        env[var], when = value, "unset"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, var, value, when, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.split("@@after-import", 1)[-1].splitlines() + out.stdout.splitlines()
    said = [line[2:] for line in out.stdout.splitlines() if line.startswith("R ")]
    if out.returncode != 0:
        return f"fails (exit {out.returncode})"
    return " ".join(said) if said else f"{sum(1 for line in lines if line.strip())} lines"


def verdict(var: str, unset: str, before: str, after: str) -> str:
    if var.startswith("PYTHON") and after == unset != before:
        return "at interpreter start (set before it starts)"
    if before == unset:
        return "no effect seen here"
    if after == before:
        return "later (after the import)"
    return "at import" if after == unset else "partly at import"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = []
    start = time.monotonic()
    for var, value, how, base, what in CASES:
        seen = {when: observe(var, value, when, how, base) for when in ("unset", "before", "after")}
        rows.append({"variable": var, "value": value, "observed": what, **seen, "read": verdict(var, **seen)})
    print("| variable (value tried) | observed | unset | set before import | set after import | read |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        value = r["value"] if len(r["value"]) < 12 else "a one-worker cluster"
        print(
            f"| {r['variable']}={value} | {r['observed']} | {r['unset']} | {r['before']} | "
            f"{r['after']} | {r['read']} |"
        )
    print(f"\n({len(rows) * 3} processes, {time.monotonic() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
