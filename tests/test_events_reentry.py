"""A subscriber's caller code run under its state lock: a ``worker_id``'s ``__hash__``,
``__eq__`` or ``__repr__`` calling the same subscriber again. That call waited for ever on the
lock its own thread held (the process hung); now it raises ConcurrentUseError, and the outer
call goes on."""

from __future__ import annotations

import threading

import pytest

from kvslots.errors import DuplicateWorkerError, KVSlotsError
from kvslots.events.subscriber import EventSubscriber


class _Worker:
    """A worker id whose hashing, comparing and repr call ``back()`` once armed."""

    def __init__(self, name):
        self.name = name
        self.back = None
        self.inner = []  # what each call back raised (its class name) or returned

    def _call_back(self):
        back, self.back = self.back, None  # not again from inside it (in_sync hashes it too)
        if back is not None:
            try:
                back()
                self.inner.append("ok")
            except KVSlotsError as e:  # UnknownWorkerError before it is added
                self.inner.append(type(e).__name__)
            finally:
                self.back = back

    def __hash__(self):
        self._call_back()
        return hash(self.name)

    def __eq__(self, other):
        self._call_back()
        return isinstance(other, _Worker) and other.name == self.name

    def __repr__(self):
        self._call_back()
        return f"_Worker({self.name!r})"


def _in_time(call):
    """call() in a daemon thread: its result or exception, or a failure if it does not return
    (it hung on the old code, holding the lock for ever)."""
    out = {}

    def run():
        try:
            out["result"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the call hung"
    if "error" in out:
        raise out["error"]
    return out["result"]


@pytest.fixture
def sub():
    s = EventSubscriber(lambda *a: None)
    yield s
    # In a thread: on the old code a hung call kept the lock that stop() takes.
    t = threading.Thread(target=s.stop, daemon=True)
    t.start()
    t.join(10)


@pytest.mark.parametrize("back", ["publishers", "in_sync"])
def test_a_worker_id_calling_the_subscriber_while_it_is_added(sub, back):
    w = _Worker("a")
    w.back = {"publishers": sub.publishers, "in_sync": lambda: sub.in_sync(w)}[back]
    assert _in_time(lambda: sub.add_publisher(w, "tcp://127.0.0.1:1")) is True
    assert "ConcurrentUseError" in w.inner
    w.back = None
    assert [p.name for p in sub.publishers()] == ["a"]  # only the outer call changed anything
    assert sub.in_sync(w) is False


def test_a_worker_id_calling_the_subscriber_while_it_is_looked_up_or_removed(sub):
    w = _Worker("a")
    sub.add_publisher(w, "tcp://127.0.0.1:1")
    w.back = sub.publishers
    assert _in_time(lambda: sub.publisher_status(w))["next_seq"] is None
    assert _in_time(lambda: sub.next_seq(w)) is None
    assert _in_time(lambda: sub.remove_publisher(w)) is True
    assert "ConcurrentUseError" in w.inner
    w.back = None
    assert sub.publishers() == []


def test_a_worker_ids_repr_calling_the_subscriber_while_it_is_refused_as_a_duplicate(sub):
    """Its repr names it in the DuplicateWorkerError, made under the lock."""
    w = _Worker("a")
    sub.add_publisher(w, "tcp://127.0.0.1:1")
    again = _Worker("a")
    again.back = sub.publishers
    with pytest.raises(DuplicateWorkerError):
        _in_time(lambda: sub.add_publisher(again, "tcp://127.0.0.1:1"))
    assert "ConcurrentUseError" in again.inner
    assert sub.publishers() == [w]
