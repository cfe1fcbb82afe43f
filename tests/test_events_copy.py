"""pickle / copy.copy / copy.deepcopy of the package's Python objects that hold live state: the
event publisher and subscriber (ZMQ sockets, a thread), their wake-up pipe (two file
descriptors) and the reference slot manager (the model of the extension's SlotManager, which
refuses). copy.copy gave a second object sharing the first one's sockets, thread and lists;
pickle and deepcopy failed with a builtin TypeError on a lock. Now each is NotCopyableError
(errors.NoCopy, the one rule), naming the class, and the object works on."""

import copy
import pickle

import pytest

from kvslots.errors import KVSlotsError, NotCopyableError
from kvslots.events._wakeup import WakePipe
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber
from kvslots.slots.reference import ReferenceSlotManager

_COPIES = (pickle.dumps, lambda o: pickle.dumps(o, protocol=0), copy.copy, copy.deepcopy,
           lambda o: copy.deepcopy({"k": [o]}))


def _publisher():
    p = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")

    def use():
        p.publish(b"\x93\x00\x90\x00")
        return p.flush(5)  # still sends: True each time

    return p, use, p.shutdown


def _subscriber():
    s = EventSubscriber(lambda *a: None)
    s.add_publisher("w", "tcp://127.0.0.1:1")
    return s, lambda: (s.publishers(), s.next_seq("w")), s.stop


def _pipe():
    w = WakePipe()

    def use():
        w.wake()
        w.drain()
        return w.fileno()

    return w, use, w.close


def _reference():
    m = ReferenceSlotManager(16, 4)
    m.create("a", [1, 2, 3, 4, 5])
    return m, lambda: (m.num_free, m.slot_info("a")), lambda: None


@pytest.mark.parametrize("make", [_publisher, _subscriber, _pipe, _reference])
def test_live_python_objects_refuse_copies(make):
    obj, use, close = make()
    try:
        before = use()
        for call in _COPIES:
            with pytest.raises(NotCopyableError, match=rf"cannot pickle or copy kvslots\..*\.{type(obj).__name__}: .") as e:
                call(obj)
            assert isinstance(e.value, KVSlotsError) and isinstance(e.value, TypeError)
            assert use() == before
    finally:
        close()


def test_reference_model_copy_no_longer_shares_its_pool():
    """copy.copy(ReferenceSlotManager) succeeded and the copy shared the original's free list:
    a request made on the copy took the original's blocks (the original's counts moved)."""
    m = ReferenceSlotManager(16, 4)
    with pytest.raises(NotCopyableError):
        c = copy.copy(m)
        c.create("x", list(range(12)))
    assert m.num_free == 16 and len(m) == 0
