"""The Rust encoder writes exactly the bytes msgspec writes for vLLM's event structs."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslots import InvalidArgumentError, SlotManager
from kvslots._core import encode_event_batch
from kvslots.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    from_raw,
)

U64_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
u64 = st.integers(0, 2**64 - 1) | st.sampled_from(U64_EDGES)
u32 = st.integers(0, 2**32 - 1) | st.sampled_from([x for x in U64_EDGES if x < 2**32])

stored = st.tuples(
    st.just("BlockStored"),
    st.lists(u64, max_size=20),
    st.none() | u64,
    st.lists(u32, max_size=40),
    u32,
    st.none() | u64,
)
removed = st.tuples(st.just("BlockRemoved"), st.lists(u64, max_size=20))
cleared = st.just(("AllBlocksCleared",))
raw_events = st.lists(st.one_of(stored, removed, cleared), max_size=20)
# Lengths around the fixstr/str8/str16 header boundaries (31/32, 255/256).
mediums = st.none() | st.sampled_from(["GPU", "CPU"]) | st.text(max_size=300)
ranks = st.none() | st.integers(-(2**63), 2**63 - 1)


def structs(raw: list[tuple], medium: str | None, as_bytes: bool) -> list:
    """The structs that the raw tuples stand for (the Python path: ``from_raw``)."""
    return [from_raw(ev, medium, hashes_as_bytes=as_bytes) for ev in raw]


@settings(max_examples=300, deadline=None)
@given(raw_events, st.floats(), mediums, ranks, st.booleans())
def test_rust_bytes_equal_msgspec_bytes(raw, ts, medium, rank, as_bytes):
    ours = encode_event_batch(
        raw, ts, medium=medium, data_parallel_rank=rank, hashes_as_bytes=as_bytes
    )
    theirs = encode_batch(KVEventBatch(ts, structs(raw, medium, as_bytes), rank))
    assert ours == theirs
    back = decode_batch(ours)
    assert back.events == structs(raw, medium, as_bytes)
    assert back.data_parallel_rank == rank
    assert back.ts == ts or (math.isnan(ts) and math.isnan(back.ts))


def test_nan_payload_and_sign_kept():
    for bits in (0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001):
        (ts,) = struct.unpack(">d", bits.to_bytes(8, "big"))
        assert encode_event_batch([], ts) == encode_batch(KVEventBatch(ts, []))


@pytest.mark.parametrize("n", [15, 16, 65535, 65536])
def test_long_arrays_use_the_same_headers(n):
    raw = [("BlockStored", list(range(n)), None, list(range(n)), 16, None)]
    ours = encode_event_batch(raw, 1.0, medium="CPU")
    assert ours == encode_batch(KVEventBatch(1.0, structs(raw, "CPU", False)))
    many = [("AllBlocksCleared",)] * n
    assert encode_event_batch(many, 2.0) == encode_batch(KVEventBatch(2.0, structs(many, None, False)))


def test_rank_none_is_written_as_nil():
    # EventBatch is array_like: msgspec writes all three elements even with omit_defaults.
    b = encode_event_batch([], 1.0)
    assert b == bytes.fromhex("93cb3ff000000000000090c0")
    assert msgspec.msgpack.decode(b) == [1.0, [], None]


def _workload(m: SlotManager, ops: list[tuple[int, int]]) -> None:
    """Requests over a small vocabulary, so prefixes are shared, blocks are cached and evicted."""
    live: list[str] = []
    for i, (a, b) in enumerate(ops):
        if a % 4 == 3 and live:
            m.finish(live.pop(b % len(live)))
            continue
        if a % 7 == 6:
            m.clear_cache()
            continue
        rid = f"r{i}"
        prompt = [(a * 3 + j) % 5 for j in range(2 + b % 12)]
        try:
            m.create(rid, prompt, lookahead=b % 3, lora_id=None if a % 2 else a)
            m.reserve(rid, len(prompt) - m.slot_info(rid).committed)
            m.commit(rid, prompt[m.slot_info(rid).committed :])
            live.append(rid)
        except Exception:
            if rid in m:
                m.finish(rid)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40),
    mediums,
    ranks,
    st.booleans(),
    st.floats(allow_nan=False),
)
def test_manager_events_msgpack_matches_drain_events(ops, medium, rank, as_bytes, ts):
    m = SlotManager(12, 2)
    _workload(m, ops)
    pending = m.num_pending_events()
    ours = m.events_msgpack(ts, medium, rank, as_bytes)
    assert m.num_pending_events() == pending, "events_msgpack does not drain"
    evs = m.drain_events(medium)
    if as_bytes:
        for ev in evs:
            if isinstance(ev, (BlockStored, BlockRemoved)):
                ev.block_hashes = [h.to_bytes(8, "big") for h in ev.block_hashes]
            if isinstance(ev, BlockStored) and ev.parent_block_hash is not None:
                ev.parent_block_hash = ev.parent_block_hash.to_bytes(8, "big")
    assert ours == encode_batch(KVEventBatch(ts, evs, rank))


def test_drain_events_msgpack_empties_the_queue():
    m = SlotManager(8, 2)
    m.create("a", [1, 2, 3, 4, 5])
    m.reserve("a", 5)
    m.commit("a", [1, 2, 3, 4, 5])
    assert m.num_pending_events() == 1
    payload = m.drain_events_msgpack(10.0, "CPU", 2)
    assert m.num_pending_events() == 0
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 2 and batch.ts == 10.0
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.token_ids == [1, 2, 3, 4] and ev.block_size == 2 and ev.medium == "CPU"
    assert ev.block_hashes == m.block_hashes("a")
    assert m.drain_events_msgpack(11.0) == encode_batch(KVEventBatch(11.0, []))


@pytest.mark.parametrize(
    "bad, match",
    [
        ([("BlockStored", [-1], None, [], 2, None)], "out of range"),
        ([("BlockStored", [2**64], None, [], 2, None)], "out of range"),
        ([("BlockStored", [1], None, [2**32], 2, None)], "out of range"),
        ([("BlockStored", [1], None, [], 2)], "6 items"),
        ([("BlockRemoved", [1], "x")], "2 items"),
        ([("Nope",)], "unknown event kind"),
        ([["AllBlocksCleared"]], "tuple"),
        (5, "sequence"),
    ],
)
def test_bad_raw_events_raise_typed_errors(bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        encode_event_batch(bad, 0.0)


def test_host_cache_events_msgpack_defaults_to_cpu_medium():
    from kvslots import HostCache

    host = HostCache(2, 2)
    stores = host.begin_store([11, 12])
    host.complete_store([(h, b) for _, h, b in stores], None, [1, 2, 3, 4], 5)
    host.begin_store([13])  # evicts the least recently used block: BlockRemoved
    pending = host.events_msgpack(3.0)
    raw = host.drain_raw_events()
    assert [r[0] for r in raw] == ["BlockStored", "BlockRemoved"]
    assert pending == encode_batch(KVEventBatch(3.0, [from_raw(r, "CPU") for r in raw]))
    host.begin_store([14])
    payload = host.drain_events_msgpack(4.0, data_parallel_rank=1)
    assert decode_batch(payload).data_parallel_rank == 1
    assert host.drain_events_msgpack(5.0) == encode_batch(KVEventBatch(5.0, []))
