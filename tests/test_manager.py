"""The Python API of the slot manager: the EAGLE step, prefix hits, events, and one test per
bad input showing its typed error, a message that names the request and the numbers, and an
unchanged manager."""

from __future__ import annotations

import numpy as np
import pytest

import kvslots
from kvslots import (
    CapacityExceededError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRollbackError,
    OutOfBlocksError,
    SlotError,
    SlotManager,
    UnknownRequestError,
)
from kvslots.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvslots.slots.reference import ReferenceSlotManager, block_hash


def state(m):
    ids = sorted(m.request_ids())
    return (
        {r: (m.block_table(r), m.slot_info(r), m.committed_tokens(r), m.block_hashes(r)) for r in ids},
        m.num_free, m.num_held, m.num_cached, m.registered_hashes(), m.cached_blocks(), m.stats(),
        m.num_pending_events(),
    )


@pytest.fixture
def m():
    m = SlotManager(8, 4)
    m.create("a", [1, 2, 3, 4, 5, 6], lookahead=2)
    m.reserve("a", 6)  # 6 + 2 -> 2 blocks
    m.commit("a", [1, 2, 3, 4, 5, 6])
    m.reserve("a", 3)  # 1 + K new: 6 + 3 + 2 -> 3 blocks
    return m


def test_eagle_step_commits_verified_blocks_and_keeps_rejected_tail(m):
    assert m.slot_info("a").pending == 3
    assert m.commit("a", [7, 8]) == 1  # sampled + one accepted draft fill block 1
    m.rollback("a", 1)
    info = m.slot_info("a")
    assert (info.committed, info.pending, info.num_immutable, info.num_blocks) == (8, 0, 2, 3)
    events = m.drain_events(medium="GPU")
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    second = events[1]
    assert second.token_ids == [5, 6, 7, 8] and second.medium == "GPU"
    assert second.parent_block_hash == events[0].block_hashes[0]
    assert second.block_hashes == [block_hash(events[0].block_hashes[0], [5, 6, 7, 8])]
    assert m.block_hashes("a") == events[0].block_hashes + second.block_hashes


class _QuietEncode(str):
    def encode(self, *args, **kwargs):  # hides its lone surrogate from a check that encodes it
        return b""


@pytest.mark.parametrize("medium, kind", [(5, kvslots.ArgumentTypeError), (b"GPU", kvslots.ArgumentTypeError),
                                          ("\ud800", InvalidArgumentError),
                                          (_QuietEncode("\ud800"), InvalidArgumentError)])
def test_drain_events_refuses_a_bad_medium_and_keeps_the_queue(m, medium, kind):
    """drain_events(5) put the int into every struct (which msgspec then would not encode as a
    medium), with the queue emptied; now refused as drain_events_msgpack refuses it."""
    m.commit("a", [7, 8])
    before = state(m)
    with pytest.raises(kind):
        m.drain_events(medium)
    assert state(m) == before and m.num_pending_events() == 2

    class Medium(str):
        pass

    events = m.drain_events(Medium("CPU"))
    assert [type(e.medium) for e in events] == [str, str]  # an exact str: encodable
    from kvslots.events import KVEventBatch, encode_batch

    encode_batch(KVEventBatch(0.0, events))


def test_prefix_hit_then_eviction_events():
    m = SlotManager(4, 2)
    m.create("a", [1, 2, 3, 4, 5])
    m.reserve("a", 5)
    m.commit("a", [1, 2, 3, 4, 5])
    m.finish("a")
    assert (m.num_free, m.num_cached) == (2, 2)
    assert m.create("b", [1, 2, 3, 4, 9]) == 4
    assert m.num_cached == 0 and m.refcount(m.block_table("b")[0]) == 1
    m.finish("b")
    m.drain_events()
    m.create("c", [7, 7, 7, 7, 7, 7, 7])
    m.reserve("c", 7)  # 4 blocks: 2 free + 2 evicted
    removed = [e for e in m.drain_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2
    assert m.clear_cache() == 0
    assert isinstance(m.drain_events()[-1], AllBlocksCleared)


def test_batch_step_with_numpy_matches_reference():
    rust, ref = SlotManager(64, 4), ReferenceSlotManager(64, 4)
    for impl in (rust, ref):
        for i in range(3):
            impl.create(f"r{i}", list(range(i, i + 9)), lookahead=3)
            impl.reserve(f"r{i}", 9)
    ids = np.array([rust.slot_id(f"r{i}") for i in range(3)], dtype=np.uint64)
    args = (np.array([9, 9, 9], np.uint32), np.arange(27, dtype=np.uint32) % 5,
            np.zeros(3, np.uint32), np.array([4, 4, 2], np.uint32), np.array([3, 3, 1], np.uint32))
    new, new_ids, committed = rust.step(ids, *args)
    assert new.dtype == np.uint32 and new_ids.dtype == np.uint32
    assert (list(new), list(new_ids), list(committed)) == ref.step(list(ids), *(a.tolist() for a in args))
    for i in range(3):
        assert rust.block_table(f"r{i}") == ref.block_table(f"r{i}")
    assert rust.slot_info("r2").lookahead == 1


def test_shrinking_lookahead_frees_surplus_at_once():
    m = SlotManager(16, 4)
    m.create("a", [1, 2, 3], lookahead=9)
    m.reserve("a", 3)
    assert m.num_held == 3
    assert m.set_lookahead("a", 1) == 2
    assert m.num_held == 1 and m.num_free == 15
    assert m.set_lookahead("a", 5) == 0 and m.num_held == 1  # growth waits for the next reserve
    assert m.reserve("a", 0) == 1


# ---- one test per bad input: typed error, names the request and numbers, nothing changes ----

def test_unknown_request(m):
    before = state(m)
    with pytest.raises(UnknownRequestError) as e:
        m.commit("ghost", [1])
    assert e.value.request_id == "ghost" and "ghost" in str(e.value)
    assert isinstance(e.value, KeyError) and isinstance(e.value, SlotError)
    assert state(m) == before


def test_duplicate_request(m):
    before = state(m)
    with pytest.raises(DuplicateRequestError, match='"a"'):
        m.create("a", [1, 2])
    assert state(m) == before


def test_out_of_blocks_is_atomic(m):
    before = state(m)
    with pytest.raises(OutOfBlocksError) as e:
        m.reserve("a", 100)
    err = e.value
    assert (err.request_id, err.needed, err.available, err.total) == ("a", 25, 5, 8)
    assert all(str(n) in str(err) for n in (25, 5, 8))
    assert state(m) == before


def test_batch_out_of_blocks_is_atomic(m):
    m.create("b", [9] * 5, lookahead=0)
    m.reserve("b", 5)
    before = state(m)
    ids = [m.slot_id("a"), m.slot_id("b")]
    with pytest.raises(OutOfBlocksError) as e:
        m.step(ids, [3, 5], [1, 2, 3, 9, 9, 9, 9, 9], [0, 0], [4, 40], [2, 0])
    assert e.value.request_id == "b"
    assert state(m) == before


def test_rollback_into_committed_tokens(m):
    before = state(m)
    with pytest.raises(InvalidRollbackError) as e:
        m.rollback("a", 5)
    assert (e.value.requested, e.value.pending, e.value.committed) == (5, 3, 6)
    assert "5" in str(e.value) and "3" in str(e.value)
    assert state(m) == before


def test_commit_beyond_pending(m):
    before = state(m)
    with pytest.raises(CapacityExceededError) as e:
        m.commit("a", [1, 2, 3, 4])
    assert (e.value.requested, e.value.limit) == (4, 3)
    assert state(m) == before


def test_max_tokens_per_slot():
    m = SlotManager(64, 4, max_tokens_per_slot=10)
    m.create("a", [1] * 8)
    before = state(m)
    with pytest.raises(CapacityExceededError, match="11 > 10"):
        m.reserve("a", 11)
    with pytest.raises(CapacityExceededError):
        m.create("b", [1] * 11)
    assert state(m) == before


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.reserve("a", -1),
        lambda m: m.rollback("a", -2),
        lambda m: m.set_lookahead("a", -1),
        lambda m: m.commit("a", [2**32]),
        lambda m: m.commit("a", [-1]),
        lambda m: m.commit("a", ["x"]),
        lambda m: m.commit("a", 5),
        lambda m: m.create("new", [1], lookahead=-3),
        lambda m: m.step([m.slot_id("a")], [1], [], [0], [0]),
        lambda m: m.step([m.slot_id("a")], [0, 0], [], [0], [0]),
        lambda m: m.step([m.slot_id("a"), m.slot_id("a")], [0, 0], [], [0, 0], [0, 0]),
        lambda m: m.step([12345], [0], [], [0], [0]),
        lambda m: m.evict(-1),
        lambda m: m.refcount(99),
    ],
)
def test_invalid_arguments(m, call):
    before = state(m)
    with pytest.raises(InvalidArgumentError):
        call(m)
    assert state(m) == before


def test_invalid_construction():
    with pytest.raises(InvalidArgumentError):
        SlotManager(8, 0)
    with pytest.raises(InvalidArgumentError):
        SlotManager(-1, 4)


def test_stale_slot_id_after_finish():
    m = SlotManager(8, 4)
    m.create("a", [1])
    sid = m.slot_id("a")
    m.finish("a")
    m.create("b", [1])
    assert m.slot_id("b") != sid
    with pytest.raises(InvalidArgumentError, match="live slot"):
        m.step([sid], [0], [], [0], [1])


def test_tracker_over_external_blocks():
    t = kvslots.SlotTracker(4)
    t.add("r", lookahead=2)
    assert t.blocks_needed("r", 6) == 2
    with pytest.raises(OutOfBlocksError):
        t.reserve("r", 6, [10])
    t.reserve("r", 6, [10, 11])
    assert t.commit("r", [1, 2, 3, 4, 5, 6]) == [(0, 10, block_hash(0, [1, 2, 3, 4]))]
    t.reserve("r", 3, [12])
    assert t.commit("r", [7, 8], block_hashes=[111, 222]) == [(1, 11, 222)]
    t.rollback("r", 1)
    assert t.set_lookahead("r", 0) == [12]
    assert t.finish("r") == [10, 11]


def test_metadata_per_block_is_small():
    assert SlotManager.metadata_bytes_per_block() <= 32
