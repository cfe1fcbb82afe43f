"""__init__ called again on a live event publisher or subscriber."""

import threading

import pytest

from kvslots.errors import InvalidStateError
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber


def _threads(prefix):
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix))


def test_publisher_init_again_is_refused_and_leaks_nothing():
    """p.__init__(...) on a live publisher made a second thread and sockets and forgot the
    first ones: shutdown() stopped only the new thread; the old one ran on and its port stayed
    bound until the process ended. Now InvalidStateError, the publisher unchanged."""
    p = EventPublisher("tcp://127.0.0.1:0")
    ep = p.endpoint
    with pytest.raises(InvalidStateError, match="already made"):
        p.__init__("tcp://127.0.0.1:0")
    assert p.endpoint == ep
    p.publish(b"\x93\x00\x90\x00")
    assert p.flush(5)
    p.shutdown()
    assert not any(ep in name for name in _threads("kvslots-event-publisher"))


def test_subscriber_init_again_is_refused_and_leaks_nothing():
    s = EventSubscriber(lambda *a: None, thread_name="kvslots-reinit-probe")
    s.add_publisher("w", "tcp://127.0.0.1:1")
    s.start()
    with pytest.raises(InvalidStateError, match="already made"):
        s.__init__(lambda *a: None, thread_name="kvslots-reinit-probe")
    assert s.publishers() == ["w"]
    s.stop()
    assert _threads("kvslots-reinit-probe") == []
