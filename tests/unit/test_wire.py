"""The copies of worker/wire/__init__.py's values in the files that run alone on a host (shim.py, relay.py,
http1.py: standard library only, so they cannot import wire) are equal to wire's."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from worker import wire
from worker.host import relay, shim
from worker.wire import failure, http1

STATUSES = {
    wire.OK_STATUS,
    wire.BAD_REQUEST_STATUS,
    wire.BAD_TOKEN_STATUS,
    wire.FORBIDDEN_STATUS,
    wire.NOT_FOUND_STATUS,
    wire.CONFLICT_STATUS,
    wire.STALE_ATTEMPT_STATUS,
}


@pytest.mark.parametrize(
    ("copy", "original"),
    [
        (shim._RUN_ID_ENV, wire.ENV_RUN_ID),
        (shim._MAX_ERROR_FILE_BYTES, failure.MAX_BYTES),
        (relay.HEARTBEAT_PATH, wire.HEARTBEAT_PATH),
        (relay.BATCH_PATH, wire.BATCH_PATH),
        (relay.OK_STATUS, wire.OK_STATUS),
        (relay.BAD_REQUEST_STATUS, wire.BAD_REQUEST_STATUS),
        (relay.NOT_FOUND_STATUS, wire.NOT_FOUND_STATUS),
        (relay.FORBIDDEN_STATUS, wire.FORBIDDEN_STATUS),
        (relay.MAX_HEARTBEAT_BYTES, wire.MAX_HEARTBEAT_BYTES),
        (relay.MAX_BATCH_BYTES, wire.MAX_BATCH_BYTES),
        (http1.OK_STATUS, wire.OK_STATUS),
        (http1.BAD_REQUEST_STATUS, wire.BAD_REQUEST_STATUS),
        (http1.BAD_TOKEN_STATUS, wire.BAD_TOKEN_STATUS),
        (http1.NOT_FOUND_STATUS, wire.NOT_FOUND_STATUS),
    ],
)
def test_copied_values_equal_wires(copy, original):
    assert (copy.decode() if isinstance(copy, bytes) else copy) == original


@pytest.mark.parametrize(
    ("copy", "original"),
    [
        (relay.TOKEN_HEADER, wire.TOKEN_HEADER),  # sent on the relay's batches
        (relay.FLUSH_HEADER, wire.FLUSH_HEADER),
        (relay.POST_IN_HEADER, wire.POST_IN_HEADER),
        (http1.TOKEN_HEADER, wire.TOKEN_HEADER),
    ],
)
def test_copied_header_names_equal_wires(copy, original):
    assert copy.decode().lower() == original.lower()  # HTTP header names ignore case


@pytest.mark.parametrize("received", [relay.FLUSH_HEADER, http1.TOKEN_HEADER])
def test_header_names_looked_up_in_a_request_are_lower_case(received):
    # looked up among the names parse_head gives, which it lower-cases
    request = f"POST / HTTP/1.1\r\n{wire.TOKEN_HEADER}: t\r\n{wire.FLUSH_HEADER}: 1".encode()
    assert received in http1.parse_head(request)[2]


def test_every_status_either_side_answers_has_a_reason():
    answered = STATUSES | {relay.UNREACHABLE_STATUS, http1.TOO_LARGE_STATUS, http1.BUSY_STATUS}
    assert answered <= set(http1.REASONS)


def test_exit_codes_are_distinct_and_not_the_shells():
    codes = {wire.EXIT_NO_COORDINATOR, wire.EXIT_PREEMPTED}
    assert len(codes) == 2 and all(0 < code < 126 and code != 1 for code in codes)


@pytest.mark.parametrize(
    "text, shown",
    [
        ("loss", "loss"),
        ("損失 📉 👨‍👩‍👧", "損失 📉 👨‍👩‍👧"),  # any script, emoji, joiners: as they are
        ("bad\ud800name", "bad\\ud800name"),  # a lone surrogate: no encoder writes it
        ("rev\u202eesrever", "rev\\u202eesrever"),  # a bidi override: it would reorder its neighbours
        ("a\u2066b\u2069c\u200fd", "a\\u2066b\\u2069c\\u200fd"),
        ("clear\x1b[2J", "clear\\x1b[2J"),  # a terminal acts on escapes
        ("line\nbreak\ttab\r", "line\\nbreak\\ttab\\r"),
        ("c1\x85\x9b", "c1\\x85\\x9b"),
        ("para\u2029", "para\\u2029"),
    ],
)
def test_safe_text_escapes_what_no_view_shows_as_it_is(text, shown):
    assert wire.safe_text(text) == shown
    assert wire.safe_text(shown) == shown  # escaped once: applying the rule again changes nothing
    shown.encode("utf-8")


def test_a_message_keeps_its_lines_and_tabs():
    assert wire.safe_text("Traceback:\n\tline\r\x1b\u202e", lines=True) == "Traceback:\n\tline\\r\\x1b\\u202e"


def test_non_finite_numbers_are_strict_json_strings_and_read_back():
    doc = {"loss": math.nan, "up": math.inf, "down": -math.inf, "ok": 0.5, "nested": [{"v": math.nan}]}
    text = wire.dumps(doc)
    assert json.loads(text) == {
        "loss": "NaN",
        "up": "Infinity",
        "down": "-Infinity",
        "ok": 0.5,
        "nested": [{"v": "NaN"}],
    }
    assert wire.dumps({"ok": 1.5}) == json.dumps({"ok": 1.5})  # nothing changes for finite numbers
    assert math.isnan(wire.number("NaN")) and wire.number("Infinity") == math.inf
    assert wire.number("-Infinity") == -math.inf and wire.number(2) == 2.0
    assert wire.number("nan") is None and wire.number(True) is None and wire.number([1]) is None


def test_the_coordinator_takes_a_heartbeats_names_and_values_by_the_one_rule():
    raw = {
        "task": "worker-0",
        "attempt": 0,
        "seq": 1,
        "sent_at": 0,
        "pid": 1,
        "metrics": {"bad\ud800name": "NaN", "loss": 0.5, "x\u202e": "-Infinity"},
        "points": [{"step": 3, "bad\ud800name": "Infinity"}, {"step": 4, "loss": 1}],
        "busy": "saving\x1b[2J",
        "user_frame": "job.py:3 in \u202eevil",
        "error": {"type": "Boom\ud800", "message": "line 1\nline\u202e 2", "traceback": "tb\r\n"},
    }
    hb = wire.Heartbeat.from_bytes(json.dumps(raw).encode())
    assert set(hb.metrics) == {"bad\\ud800name", "loss", "x\\u202e"}
    assert math.isnan(hb.metrics["bad\\ud800name"]) and hb.metrics["x\\u202e"] == -math.inf
    assert hb.points == [{"step": 3, "bad\\ud800name": math.inf}, {"step": 4, "loss": 1}]
    assert hb.busy == "saving\\x1b[2J" and hb.user_frame == "job.py:3 in \\u202eevil"
    assert hb.error == wire.TaskError("Boom\\ud800", "line 1\nline\\u202e 2", "tb\\r\n")
    for bad in ({"a": [1]}, {"a": "nan"}, {"a": None}, {"a": True}, {"a": {"b": 1}}):
        with pytest.raises(ValueError):
            wire.Heartbeat.from_dict({**raw, "metrics": bad})
        with pytest.raises(ValueError):
            wire.Heartbeat.from_dict({**raw, "points": [{"step": 1, **bad}]})
    # the worker sends strict JSON too (NaN as "NaN"), which the coordinator reads back as NaN
    sent = wire.Heartbeat(task="w", attempt=0, seq=1, sent_at=0, pid=1, metrics={"loss": math.nan}).to_bytes()
    assert b"NaN" not in sent.replace(b'"NaN"', b"") and math.isnan(
        wire.Heartbeat.from_bytes(sent).metrics["loss"]
    )


def test_huge_values_are_bounded_and_shown_truthfully():
    raw = {
        "task": "w",
        "attempt": 0,
        "seq": 1,
        "sent_at": 0,
        "pid": 1,
        "step": 10**30,
        "rss_bytes": -(10**30),
    }
    hb = wire.Heartbeat.from_dict({**raw, "metrics": {"big": 10**400, "small": -(10**400)}})
    assert hb.metrics == {"big": math.inf, "small": -math.inf}  # past a float's range: ±inf
    assert hb.step == 2**63 - 1 and hb.rss_bytes == -(2**63 - 1)  # what every reader can hold
    assert wire.number(10**400) == math.inf
    point = wire.Heartbeat.from_dict({**raw, "points": [{"step": 10**400, "big": 10**400, "ok": 2}]}).points[
        0
    ]
    assert point == {"step": 2**63 - 1, "big": math.inf, "ok": 2}


def test_the_folders_a_task_tells_are_bounded_absolute_and_shown_safely():
    base = {"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 0.0, "pid": 1}
    told = wire.Heartbeat.from_dict({**base, "folders": {"/tmp/back\u202eup": "tf.train.CheckpointManager"}})
    assert told.folders == {"/tmp/back\\u202eup": "tf.train.CheckpointManager"}
    bad = [
        {"ckpts": "x"},  # relative: on which host's which folder?
        {"/a": 3},
        {"/" + "a" * wire.MAX_PATH_CHARS: "x"},
        {f"/c{i}": "x" for i in range(wire.MAX_FOLDERS + 1)},
    ]
    for folders in bad:
        with pytest.raises(ValueError, match="folders"):
            wire.Heartbeat.from_dict({**base, "folders": folders})
    with pytest.raises(ValueError, match="folders"):
        wire.Heartbeat.from_dict({**base, "folders": ["/a"]})


def test_the_count_of_dropped_metric_names_is_checked_and_shown_safely():
    base = {"task": "worker-0", "attempt": 0, "seq": 1, "sent_at": 0.0, "pid": 1}
    told = wire.Heartbeat.from_dict(
        {
            **base,
            "dropped": {"count": 2937, "first": "loss\u202e_64" + "x" * 500, "why": "over 64 metric names"},
        }
    )
    assert told.dropped == wire.Dropped(2937, "loss\\u202e_64" + "x" * 92, "over 64 metric names")
    sent = dataclasses.replace(told, dropped=wire.Dropped(5, "loss_64", "over 64 metric names"))
    assert wire.Heartbeat.from_bytes(sent.to_bytes()) == sent  # as the reporter sends it
    for dropped in (
        {"count": -1, "first": "a", "why": "b"},
        {"count": 0, "first": "a", "why": "b"},
        {"count": 2**64, "first": "a", "why": "b"},
        {"count": 1.5, "first": "a", "why": "b"},
        {"count": True, "first": "a", "why": "b"},
        {"count": 1, "first": None, "why": "b"},
        {"count": 1, "first": "a"},
        ["loss"],
    ):
        with pytest.raises(ValueError):
            wire.Heartbeat.from_dict({**base, "dropped": dropped})
