"""An event publisher or subscriber used in a forked child (vLLM forks its worker processes):
its thread did not survive the fork, and libzmq's sockets and context are not usable there."""


import pytest

from kvslots.errors import InvalidStateError
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber
from process_support import in_child

BATCH = b"\x93\x00\x90\x00"  # an empty KVEventBatch



@pytest.fixture
def pair():
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", max_queue_size=2)
    got = []
    sub = EventSubscriber(lambda w, seq, batch: got.append(seq))
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, wait=5)
    yield pub, sub, got
    sub.stop()
    pub.shutdown()


def test_publish_in_a_forked_child_is_refused(pair):
    """publish() in the child queued batches no thread would send, and blocked for ever once
    the queue (2 here) was full; flush() said all was sent. Now InvalidStateError at once."""
    pub, _, _ = pair

    def body():
        for _ in range(3):
            pub.publish(BATCH)
        return "published"

    assert in_child(body)[0] == "InvalidStateError"
    assert in_child(lambda: pub.flush(1))[0] == "InvalidStateError"
    assert in_child(lambda: pub.shutdown() or "shut down") == "shut down"  # the child's copy only


def test_poll_once_in_a_forked_child_is_refused_and_the_parent_goes_on(pair):
    """poll_once() in the child hung in libzmq (past its 200 ms timeout), reading the parent's
    ZMQ wake-up descriptors as it did (the parent then missed a batch). Now InvalidStateError
    at once, and add_publisher, remove_publisher and start() likewise; stop() in the child
    leaves the parent's subscriber working."""
    pub, sub, got = pair
    assert in_child(lambda: sub.poll_once(200))[0] == "InvalidStateError"
    for call in (lambda: sub.add_publisher("v", pub.endpoint), lambda: sub.remove_publisher("w"), sub.start):
        out = in_child(call)
        assert out[0] == "InvalidStateError" and "fork" in out[1], out
    assert in_child(lambda: sub.stop() or "stopped") == "stopped"
    pub.publish(BATCH)
    assert pub.flush(5)
    for _ in range(50):
        sub.poll_once(100)
        if got:
            break
    assert got == [0] and sub.publishers() == ["w"]
