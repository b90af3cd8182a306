# ruff: noqa: E501 - captured output lines are as long as TensorFlow printed them
"""CLI output layer (orchestrator/record/quiet.py): TensorFlow's start-up noise and a traceback's frames
are left off the console (lines captured from TF 2.21 on this machine), the rest passes."""

from __future__ import annotations

from orchestrator.record.quiet import ConsoleFilter, collapse_redraws, noise

# what every task printed here before its first line of its own (TF_CPP_MIN_LOG_LEVEL=2 included)
TF_STARTUP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796150547.581546   29018 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1796150547.716715   29018 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1796150553.026238   29018 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
2026-12-01 12:00:00.123456: I tensorflow/core/util/port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results.
I0000 00:00:1796150560.1   29280 grpc_server_lib.cc:477] Started server with target: grpc://localhost:23456
""".splitlines()

KEPT = [
    "num_replicas_in_sync=2",
    "W0000 00:00:1796150560.1   29280 coordination_service_agent.cc:1] Coordination agent has shut down",
    "E0000 00:00:1796150560.1   29280 grpc_server_lib.cc:1] Could not start gRPC server",
    "Epoch 1/3",
    "INFO:tensorflow:Collective all_reduce: 1 all_reduces",  # Python logging: the user's to silence
]


def test_tensorflow_startup_lines_are_noise_and_its_warnings_and_errors_are_not() -> None:
    assert [line for line in TF_STARTUP if not noise(line)] == []
    assert [line for line in KEPT if noise(line)] == []


def test_the_console_shows_a_tracebacks_first_and_last_lines_and_counts_what_it_held() -> None:
    console = ConsoleFilter()
    shown = []
    lines = TF_STARTUP + [
        "Traceback (most recent call last):",
        '  File "/job.py", line 3, in <module>',
        "    train()",
        '  File "/job.py", line 2, in train',
        "    raise ValueError('bad batch')",
        "ValueError: bad batch",
        "after",
    ]
    for line in lines:
        shown += [f"[w0] {s}" for s in console("w0", line)]
    assert shown == [
        "[w0] Traceback (most recent call last):",
        "[w0]   … (4 lines of traceback in the log)",
        "[w0] ValueError: bad batch",
        "[w0] after",
    ]
    assert console.hidden == len(TF_STARTUP) + 4


def test_tracebacks_of_two_tasks_interleaved_are_told_apart() -> None:
    console = ConsoleFilter()
    assert console("a", "Traceback (most recent call last):") == ["Traceback (most recent call last):"]
    assert console("b", "plain line of b") == ["plain line of b"]
    assert console("a", '  File "x.py", line 1') == []
    assert console("b", "  indented line of b") == ["  indented line of b"]
    assert console("a", "KeyError: 'x'") == ["  … (1 lines of traceback in the log)", "KeyError: 'x'"]


def test_a_keras_progress_bar_redrawn_in_place_shows_its_last_state() -> None:
    bar = "1/3 [=====>....] - loss: 0.9" + "\b" * 27 + "\r2/3 [=========>..] - loss: 0.5" + "\b" * 30
    bar += "\r3/3 [==============] - 1s 10ms/step - loss: 0.3"
    assert collapse_redraws(bar) == "3/3 [==============] - 1s 10ms/step - loss: 0.3"
    assert ConsoleFilter()("w0", bar) == ["3/3 [==============] - 1s 10ms/step - loss: 0.3"]
    assert collapse_redraws("plain") == "plain"
