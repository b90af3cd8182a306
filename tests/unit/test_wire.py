"""The copies of worker/wire.py's values in the files that run alone on a host (shim.py, relay.py,
http1.py: standard library only, so they cannot import wire) are equal to wire's."""

from __future__ import annotations

import pytest

from worker import http1, relay, shim, wire

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
