"""The P/D control channel (kvslots.vllm.pd.control) fed hostile arguments and handlers, without
vLLM or Mooncake: every bad argument is a kvslots error before a socket exists or a byte is sent,
a negative timeout never waits forever, and the serving thread outlives a reply it cannot
encode."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, TransferError
from kvslots.vllm.pd.control import MAX_REQUEST_BYTES, ControlServer, control_call


@pytest.fixture
def server():
    srv = ControlServer("127.0.0.1", 0, lambda msg: {"echo": msg.get("op")})
    yield srv
    srv.close()


@pytest.mark.parametrize("kwargs, exc", [
    ({"timeout_s": float("nan")}, InvalidArgumentError), ({"timeout_s": float("inf")}, InvalidArgumentError),
    ({"timeout_s": None}, ArgumentTypeError), ({"timeout_s": "1"}, ArgumentTypeError),
    ({"timeout_s": 1e300}, InvalidArgumentError), ({"timeout_s": 0}, InvalidArgumentError),
    ({"timeout_s": 1, "retries": -5}, InvalidArgumentError), ({"timeout_s": 1, "retries": 1.5}, ArgumentTypeError),
    ({"timeout_s": 1, "retries": "x"}, ArgumentTypeError), ({"timeout_s": 1, "retries": 10**9}, InvalidArgumentError),
    ({"timeout_s": 1, "msg": None}, ArgumentTypeError), ({"timeout_s": 1, "msg": [1]}, ArgumentTypeError),
    # What reaches the peer comes from its hand-off (kv_transfer_params): a TransferError, what
    # the connector's pull handles as a failed peer.
    ({"timeout_s": 1, "msg": {"op": "\udc80"}}, TransferError),
    ({"timeout_s": 1, "msg": {"op": object()}}, TransferError),
    ({"timeout_s": 1, "msg": {"op": "x" * MAX_REQUEST_BYTES}}, TransferError),
    ({"timeout_s": 1, "host": "\udc80"}, TransferError), ({"timeout_s": 1, "host": "a\0b"}, TransferError),
    ({"timeout_s": 1, "host": ""}, TransferError), ({"timeout_s": 1, "host": 5}, TransferError),
    ({"timeout_s": 1, "port": -1}, TransferError), ({"timeout_s": 1, "port": 70000}, TransferError),
    ({"timeout_s": 1, "port": 2**70}, TransferError), ({"timeout_s": 1, "port": "80"}, TransferError),
    ({"timeout_s": 1, "port": None}, TransferError), ({"timeout_s": 1, "port": True}, TransferError),
])
def test_control_call_refuses_bad_arguments_before_sending(server, kwargs, exc):
    # Before: a builtin ValueError, OverflowError, TypeError, AttributeError or
    # UnicodeEncodeError; an oversized request waited out every try unanswered.
    call = {"host": "127.0.0.1", "port": server.port, "msg": {"op": "x"}, **kwargs}
    start = time.monotonic()
    with pytest.raises(exc) as e:
        control_call(call.pop("host"), call.pop("port"), call.pop("msg"), **call)
    assert time.monotonic() - start < 5  # refused, not waited out
    if exc is TransferError:
        assert e.value.kind == "peer"
    assert control_call("127.0.0.1", server.port, {"op": "ok"}, timeout_s=10) == {"echo": "ok"}


def test_a_negative_timeout_does_not_wait_forever():
    # ZMQ's poll reads a negative timeout as "no timeout": against a peer that never answers the
    # call never returned.
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            control_call("127.0.0.1", port, {"op": "hello"}, timeout_s=-1, retries=0)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - what it raised is the point
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(30)
    sock.close()
    assert not t.is_alive(), "control_call(timeout_s=-1) is still waiting"
    assert isinstance(outcome[0], InvalidArgumentError), outcome


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("host, port, handler, exc", [
    ("\udc80", 0, dict, InvalidArgumentError), ("a\0", 0, dict, InvalidArgumentError),
    (5, 0, dict, ArgumentTypeError), ("127.0.0.1", -1, dict, InvalidArgumentError),
    ("127.0.0.1", 2**70, dict, InvalidArgumentError), ("127.0.0.1", "x", dict, ArgumentTypeError),
    ("127.0.0.1", True, dict, ArgumentTypeError), ("127.0.0.1", 0, None, ArgumentTypeError),
])
def test_control_server_refuses_bad_arguments_and_leaks_no_socket(host, port, handler, exc):
    # A lone surrogate in host was a UnicodeEncodeError that left the ZMQ socket open (a leaked
    # descriptor per call); port -1 and 2**70 were "bound" and reported as the port.
    ControlServer("127.0.0.1", 0, dict).close()  # the ZMQ context's own descriptors, once
    before = _open_fds()
    threads = threading.active_count()
    for _ in range(20):
        with pytest.raises(exc):
            ControlServer(host, port, handler)
    # A leak is one descriptor (and no thread) per call: 20 here. Other tests' background threads
    # may close descriptors or end meanwhile, so the counts may only go down.
    assert _open_fds() < before + 10
    assert threading.active_count() <= threads


def test_the_server_thread_outlives_a_reply_it_cannot_encode():
    # The reply was encoded outside the handler's try: a reply msgpack cannot encode ended the
    # serving thread, and every later request went unanswered (timeouts).
    replies = iter([{1j: 2}, {"ok": True}])
    srv = ControlServer("127.0.0.1", 0, lambda msg: next(replies))
    try:
        with pytest.raises(TransferError, match="complex") as e:
            control_call("127.0.0.1", srv.port, {"op": "x"}, timeout_s=10, retries=0)
        assert e.value.kind == "peer"
        assert control_call("127.0.0.1", srv.port, {"op": "x"}, timeout_s=10, retries=0) == {"ok": True}
        assert srv._thread.is_alive()
    finally:
        srv.close()
    assert not srv._thread.is_alive()


def test_a_hand_off_that_cannot_reach_its_peer_fails_the_pull_not_the_request():
    # A hand-off (kv_transfer_params, JSON through the proxy) may carry a lone surrogate in its
    # host or request id. The ack's control_call raised UnicodeEncodeError, which the pull's
    # ack handler (TransferError only) let escape: the request never reached finished_recving
    # and waited in vLLM for good. Now a TransferError: the pull fails and vLLM recomputes.
    pytest.importorskip("vllm", reason="the connector's package imports vLLM")
    from kvslots.vllm.connector.pd import PDWorker, RecvSpec
    from ports import free_port

    port = free_port()  # nothing listens: the hellos time out
    w = PDWorker(engine_id="C", host="127.0.0.1", port=0, block_size=16, model="m", timeout_s=5,
                 producer=False, consumer=True, control_timeout_s=0.5)
    try:
        reqs = set()
        for i, (host, req) in enumerate([("\udc80", "r"), ("127.0.0.1", "\udc80"), ("a\0b", "r")]):
            spec = RecvSpec(req_id=f"req{i}", remote_req_id=req, remote_engine_id="P", remote_host=host,
                            remote_port=port, remote_block_ids=[0], local_block_ids=[0])
            w._pull(spec)
            reqs.add(spec.req_id)
        _, done, failed = w.take_finished()
        assert done == reqs and failed == reqs
    finally:
        w.close()
