"""EventSubscriber worker ids that are not equal to themselves."""

import math

import numpy as np
import pytest

from kvslots.errors import InvalidArgumentError
from kvslots.events.subscriber import EventSubscriber


class _EqRaises:
    def __hash__(self):
        return 1

    def __eq__(self, other):
        raise RuntimeError("no")


@pytest.mark.parametrize("wid", [float("nan"), np.float64("nan"), complex(math.nan, 0)])
def test_a_worker_id_unequal_to_itself_is_refused(wid):
    """add_publisher(float('nan'), ...) twice added two publishers (NaN != NaN), and
    remove_publisher(float('nan')) found neither: their sockets stayed until stop(). Now an
    InvalidArgumentError, nothing added; other ids work as before."""
    s = EventSubscriber(lambda *a: None)
    try:
        for _ in range(2):
            with pytest.raises(InvalidArgumentError, match="not equal to itself"):
                s.add_publisher(wid, "tcp://127.0.0.1:1")
        assert s.publishers() == []
        assert s.add_publisher(1.5, "tcp://127.0.0.1:1") and s.publishers() == [1.5]
        assert s.remove_publisher(1.5) and s.publishers() == []
    finally:
        s.stop()



def test_a_worker_id_whose_eq_raises_is_still_taken():
    """A key found by identity only (its __eq__ raises) is kept as before (test_events_zmq)."""
    s = EventSubscriber(lambda *a: None)
    try:
        wid = _EqRaises()
        assert s.add_publisher(wid, "tcp://127.0.0.1:1") and s.publishers() == [wid]
        assert s.remove_publisher(wid) and s.publishers() == []
    finally:
        s.stop()
