"""Scheduler mode's deferred lookahead (``defer_lookahead=True``): a request allocated twice in
one step keeps one deferred entry, the latest allocation's, which its reservation matches."""

from __future__ import annotations

from kvslots import _core


class Req:
    def __init__(self, rid: str, n: int) -> None:
        self.request_id = rid
        self.num_tokens = n
        self.num_computed_tokens = 0
        self.block_hashes = [bytes([i + 1]) * 32 for i in range(n // 4)]
        self._all_token_ids = list(range(n))


def test_a_second_allocation_in_a_step_replaces_the_first_deferred_one():
    """Both allocations were queued: finish_step materialised the first (using up the request's
    reservation, 2 blocks of 3) and then raised CapacityExceededError for the second ('1 > 0')
    with the blocks already taken and every reservation released. Now the latest allocation's
    lookahead (8 + 12 tokens: 5 blocks) is materialised, and the step finishes."""
    m = _core.DeviceKVManager(64, 4, max_model_len=1024, defer_lookahead=True)
    r = Req("a", 6)
    assert m.allocate_slots(r, 6, num_lookahead_tokens=8).get_block_ids() == ([1, 2],)
    r.num_computed_tokens = 6
    assert m.allocate_slots(r, 1, num_lookahead_tokens=12).get_block_ids() == ([],)
    assert m.num_deferred() == 1
    assert m.num_reserved_blocks() == 3
    assert m.finish_step(0, {"a"}) == [("a", [3, 4, 5])]
    assert m.block_ids("a") == [1, 2, 3, 4, 5]
    assert (m.num_deferred(), m.num_reserved_blocks(), m.num_free_blocks()) == (0, 0, 58)
    assert m.check_invariants() is None


def test_a_smaller_second_lookahead_is_the_one_materialised():
    m = _core.DeviceKVManager(64, 4, max_model_len=1024, defer_lookahead=True)
    r = Req("a", 6)
    m.allocate_slots(r, 6, num_lookahead_tokens=12)
    r.num_computed_tokens = 6
    m.allocate_slots(r, 1, num_lookahead_tokens=2)
    assert m.finish_step(0, {"a"}) == [("a", [3])]
    assert m.block_ids("a") == [1, 2, 3]
    assert m.num_reserved_blocks() == 0
    assert m.check_invariants() is None
