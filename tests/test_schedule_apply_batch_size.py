"""``apply_lookahead(..., batch_size=N)`` checks N whatever the schedule: with a fixed K it was
never read, so ``batch_size="x"``, ``-1`` or ``True`` set every request's lookahead and came back
as the update's batch_size; a schedule refused them (before anything changed). Now each is a
ConfigError naming batch_size, with no lookahead changed, as lookahead_array's is."""

from __future__ import annotations

import numpy as np
import pytest

from kvslots import SlotManager
from kvslots.config.schedule import MAX_BATCH, DynamicSDSchedule, apply_lookahead
from kvslots.errors import ConfigError


def _manager():
    m = SlotManager(64, 4)
    for rid, base in (("a", 0), ("b", 100)):
        m.create(rid, list(range(base, base + 10)), lookahead=2)
        m.reserve(rid, 1)
    return m


@pytest.mark.parametrize("schedule", [3, DynamicSDSchedule.parse([[1, 1, 3], [2, 9, 1]], 3)], ids=["fixed", "schedule"])
@pytest.mark.parametrize("batch_size", ["x", -1, True, 2.0, [3], MAX_BATCH + 1, 10**30])
def test_a_bad_batch_size_is_refused_with_nothing_changed(schedule, batch_size):
    m = _manager()
    before = [m.slot_info(r) for r in ("a", "b")], m.num_free
    with pytest.raises(ConfigError) as e:
        apply_lookahead(m, ["a", "b"], schedule, batch_size=batch_size)
    assert e.value.field == "batch_size"
    assert ([m.slot_info(r) for r in ("a", "b")], m.num_free) == before


@pytest.mark.parametrize("batch_size", [0, 1, 5, np.int64(7), MAX_BATCH])
def test_a_good_batch_size_is_taken(batch_size):
    m = _manager()
    up = apply_lookahead(m, ["a", "b"], 1, batch_size=batch_size)
    assert (up.batch_size, up.k, type(up.batch_size)) == (int(batch_size), 1, int)
    assert m.slot_info("a").lookahead == m.slot_info("b").lookahead == 1
    sched = DynamicSDSchedule.parse([[1, 1, 3], [2, 9, 1]], 3)
    assert apply_lookahead(m, ["a", "b"], sched, batch_size=batch_size).k == (3 if int(batch_size) <= 1 else 1)
