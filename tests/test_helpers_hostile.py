"""Wrong types and out-of-range values given to the public helpers this stop added (the host
rule, the speculative-config field check, the body shape check, the connection cap, the events
ports a serve plan binds, the replay reply's topic): a kvslots error naming the argument, never a
builtin AttributeError or TypeError, and a refused call changes nothing."""

from __future__ import annotations

import math

import pytest

from kvslots.config.speculative import check_vllm_fields
from kvslots.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from kvslots.events.protocol import host_problem, parse_replay_reply
from kvslots.indexer.fds import ConnectionCap
from kvslots.indexer.httpguard import json_shape_error
from kvslots.serve.events import bound_tcp_addresses

_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000"}


@pytest.mark.parametrize("call, error", [
    (lambda: host_problem(5), ArgumentTypeError),
    (lambda: host_problem(None), ArgumentTypeError),
    (lambda: host_problem(b"host"), ArgumentTypeError),
    (lambda: check_vllm_fields(5), ArgumentTypeError),
    (lambda: check_vllm_fields([("method", "eagle")]), ArgumentTypeError),
    (lambda: json_shape_error("[]", 1, 1), ArgumentTypeError),
    (lambda: json_shape_error(None, 1, 1), ArgumentTypeError),
    (lambda: json_shape_error(b"[]", -1, 1), InvalidArgumentError),
    (lambda: json_shape_error(b"[]", math.nan, 1), ArgumentTypeError),
    (lambda: json_shape_error(b"[]", 1, "2"), ArgumentTypeError),
    (lambda: json_shape_error(b"[]", 1, 1, True), ArgumentTypeError),
    (lambda: ConnectionCap("x"), ConfigError),
    (lambda: ConnectionCap(0), ConfigError),
    (lambda: ConnectionCap(2**70), ConfigError),
    (lambda: ConnectionCap(None, -1), InvalidArgumentError),
    (lambda: ConnectionCap(None, 1.5), ArgumentTypeError),
    (lambda: bound_tcp_addresses(_EVENTS, "2"), ArgumentTypeError),
    (lambda: bound_tcp_addresses(_EVENTS, 0), InvalidArgumentError),
    (lambda: bound_tcp_addresses(_EVENTS, math.inf), ArgumentTypeError),
    (lambda: bound_tcp_addresses([("endpoint", "tcp://*:6000")], 1), ArgumentTypeError),
    (lambda: parse_replay_reply([b"", b"t", bytes(8), b"x"], 5), ArgumentTypeError),
    (lambda: parse_replay_reply([b"", b"t", bytes(8), b"x"], "t"), ArgumentTypeError),
])
def test_a_wrong_argument_is_a_kvslots_error(call, error):
    with pytest.raises(error):
        call()


def test_a_refused_worker_count_leaves_the_cap_as_it_was():
    cap = ConnectionCap(None, 2)
    before = cap.value
    for bad in (-1, "3", 2.0, None, True):
        with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
            cap.set_workers(bad)
        assert cap.value == before
    cap.set_workers(2)
    assert cap.value == before


def test_the_helpers_still_take_what_they_took():
    assert host_problem("127.0.0.1") is None and host_problem("a b") is not None
    assert json_shape_error(bytearray(b"[[], []]"), 2, None) is not None
    assert json_shape_error(b"[1, 2]", 1, 1, 2) is None
    assert bound_tcp_addresses(_EVENTS, 2) == [("0.0.0.0", 6000), ("0.0.0.0", 6001)]
    assert bound_tcp_addresses(None, 1) == []
    assert parse_replay_reply([b"", b"topic", (7).to_bytes(8, "big"), b"x"], b"top") == (7, b"x")
    assert parse_replay_reply([b"", b"other", (7).to_bytes(8, "big"), b"x"], b"top") is None
    assert ConnectionCap(5).value == 5
