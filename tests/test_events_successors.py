"""Successors in the host and disk tiers' events: with the EAGLE rule every ``BlockStored`` of
medium CPU or STORAGE carries ``lookahead_token_ids`` (vLLM 0.33's field), ``[successor]`` per
block with one recorded, ``[]`` without; without the rule the field is absent and the bytes are
vLLM 0.32's.

Runs under both vLLM environments (Makefile TESTS_033): the bytes are compared with vLLM 0.33's
own encoder where it is installed (skipped, with the reason, under 0.32), and vLLM's decoder of
the running version must read them (0.32's skips the field it does not know).
"""

from __future__ import annotations

import copy
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslots import InvalidArgumentError, KVSlotsError
from kvslots._core import ConnectorPlanner, DiskIndex, HostCache, encode_event_batch
from kvslots.events import KVEventBatch, decode_batch, encode_batch, from_raw

from test_events_wire import mediums, ranks, u32, u64

NO_SUCCESSOR = 2**32 - 1
# A recorded successor is a token id below the "none" marker.
succ = st.integers(0, NO_SUCCESSOR - 1) | st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, NO_SUCCESSOR - 1])


@st.composite
def stored_with_lookahead(draw):
    hashes = draw(st.lists(u64, max_size=12))
    lookahead = [draw(st.just([]) | succ.map(lambda s: [s])) for _ in hashes]
    return ("BlockStored", hashes, draw(st.none() | u64), draw(st.lists(u32, max_size=30)), draw(u32),
            draw(st.none() | u64), lookahead)


plain_stored = st.tuples(st.just("BlockStored"), st.lists(u64, max_size=12), st.none() | u64,
                         st.lists(u32, max_size=30), u32, st.none() | u64)
events = st.lists(st.one_of(stored_with_lookahead(), plain_stored,
                            st.tuples(st.just("BlockRemoved"), st.lists(u64, max_size=12)),
                            st.just(("AllBlocksCleared",))), max_size=12)


def _vke():
    try:
        from vllm.distributed import kv_events as vke
    except ImportError as exc:
        pytest.skip(f"vLLM is not importable here: {exc!r}")
    return vke


def _vke033():
    vke = _vke()
    if "lookahead_token_ids" not in vke.BlockStored.__struct_fields__:
        reason = "vLLM 0.32 here: its BlockStored has no lookahead_token_ids (the 0.33 env compares bytes)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return vke


# ---- the codec (no vLLM needed) ----

@settings(max_examples=200, deadline=None)
@given(events, st.floats(allow_nan=False), mediums, ranks, st.booleans())
def test_rust_bytes_equal_the_codec_with_and_without_lookahead(raw, ts, medium, rank, as_bytes):
    ours = encode_event_batch(raw, ts, medium=medium, data_parallel_rank=rank, hashes_as_bytes=as_bytes)
    structs = [from_raw(ev, medium, hashes_as_bytes=as_bytes) for ev in raw]
    assert ours == encode_batch(KVEventBatch(ts, structs, rank))
    back = decode_batch(ours).events
    assert back == structs
    for ev, r in zip(back, raw):
        if r[0] == "BlockStored":
            assert ev.lookahead_token_ids == (r[6] if len(r) == 7 else None)


def test_one_event_with_lookahead_is_vllm_033s_layout_and_without_it_032s():
    ev = ("BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None)
    plain = encode_event_batch([ev], 0.0, medium="CPU")
    with_la = encode_event_batch([(*ev, [[3], []])], 0.0, medium="CPU")
    body = 1 + 9 + 1  # fixarray(3), float64, fixarray(1)
    assert plain[body] == 0x88, "fixmap of 8: vLLM 0.32's bytes"
    assert with_la[body:body + 3] == b"\xde\x00\x09", "map16 of 9: vLLM 0.33's bytes"
    assert with_la.endswith(b"\xb3lookahead_token_ids\x92\x91\x03\x90\xc0")
    assert with_la[body + 3:body + 3 + len(plain) - body - 2] == plain[body + 1:-1]
    # A None seventh item is no lookahead at all.
    assert encode_event_batch([(*ev, None)], 0.0, medium="CPU") == plain


@pytest.mark.parametrize(
    "lookahead, match",
    [
        ([[3]], "2 entries|1 entries"),
        ([[3], [], []], "entries"),
        ([[3], [4, 5]], "at most one"),
        ([[3], [NO_SUCCESSOR]], "below"),
        ([[3], [-1]], "out of range|negative|below"),
        ([[3], ["x"]], "int"),
        ([[3], 4], "list or tuple"),
        ("ab", "list or tuple"),
        (5, "list or tuple"),
    ],
)
def test_bad_lookahead_raises_typed_errors(lookahead, match):
    with pytest.raises(KVSlotsError, match=match):
        encode_event_batch([("BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, lookahead)], 0.0)
    with pytest.raises(InvalidArgumentError, match="6 items"):
        encode_event_batch([("BlockStored", [1], None, [1, 2], 2, None, [[1]], 8)], 0.0)


def test_host_cache_publishes_successors_only_when_asked_and_refuses_bad_ones():
    host = HostCache(4, 1, publish_successors=True)
    assert host.publishes_successors
    for bad in ([1], [1, 2, 3], "xy", 5, [NO_SUCCESSOR, 1], [-1, 1], [1.5, 1]):
        with pytest.raises((KVSlotsError, TypeError)):
            host.begin_store_run(1, [10, 20], None, [1, 2], successors=bad)
        assert host.num_storing == 0 and host.pending_steps == 0, "nothing changed"
    with pytest.raises(KVSlotsError):
        HostCache(4, 1, publish_successors=1)
    host.begin_store_run(1, [10, 20], None, [1, 2], successors=[7, None])
    assert host.drain_raw_events() == [], "published when the store completes, not before"
    host.complete_step(1)
    assert (host.successor(10), host.successor(20)) == (7, None)
    (ev,) = host.drain_raw_events()
    assert ev == ("BlockStored", [10, 20], None, [1, 2], 1, None, [[7], []])
    off = HostCache(4, 1)
    assert not off.publishes_successors
    off.begin_store_run(1, [10], None, [1], successors=[7])
    off.complete_step(1)
    assert off.drain_raw_events() == [("BlockStored", [10], None, [1], 1, None)]


def _promoted_planner(eagle: bool) -> ConnectorPlanner:
    """A planner whose host tier registered three blocks promoted from disk with successors."""
    p = ConnectorPlanner(2, 8, eagle)
    assert p.publishes_successors is eagle
    hashes = [11, 12, 2**64 - 1]
    got = p.begin_promote(hashes)
    p.complete_promote(hashes, [b for _, b in got], [1, 2, 3, 4, 5, 6], [300, None, 0], parent_hash=9)
    return p


def test_connector_planner_raw_and_batch_paths_carry_the_successors():
    raw = _promoted_planner(True).drain_events_raw(msgspec.Raw, "CPU")
    batch = _promoted_planner(True).drain_events_msgpack(1.0, "CPU", 0)
    (ev,) = decode_batch(batch).events
    assert ev.lookahead_token_ids == [[300], [], [0]] and ev.medium == "CPU" and ev.parent_block_hash == 9
    # The raw event's bytes are the batch's events array's element.
    assert bytes(raw[0]) in batch
    assert msgspec.msgpack.encode(KVEventBatch(1.0, raw, 0)) == batch
    # Without the EAGLE rule: vLLM 0.32's bytes, no field.
    plain = _promoted_planner(False).drain_events_msgpack(1.0, "CPU", 0)
    (ev0,) = decode_batch(plain).events
    assert ev0.lookahead_token_ids is None and b"lookahead" not in plain
    assert msgspec.structs.replace(ev, lookahead_token_ids=None) == ev0


def test_disk_index_publishes_successors_of_writes_when_asked():
    for publish in (True, False):
        idx = DiskIndex(4, 2, publish_successors=publish)
        assert idx.publishes_successors is publish
        a = idx.begin_write(5, [1, 2], successor=3, parent_hash=4)
        b = idx.begin_write(6, [3, 4], successor=None, parent_hash=5)
        idx.complete_write(a, True)
        idx.complete_write(b, True)
        evs = decode_batch(idx.events_msgpack(0.0, drain=True)).events
        assert [e.medium for e in evs] == ["STORAGE"] * 2
        assert [e.lookahead_token_ids for e in evs] == ([[[3]], [[]]] if publish else [None, None])
    with pytest.raises(KVSlotsError):
        DiskIndex(4, 2, publish_successors="yes")


# ---- vLLM's own structs ----

@settings(max_examples=150, deadline=None)
@given(events, st.floats(allow_nan=False), mediums, ranks, st.booleans())
def test_rust_bytes_with_lookahead_are_vllm_033s_bytes(raw, ts, medium, rank, as_bytes):
    vke = _vke033()
    ours = encode_event_batch(raw, ts, medium=medium, data_parallel_rank=rank, hashes_as_bytes=as_bytes)
    structs = [from_raw(ev, medium, hashes_as_bytes=as_bytes, structs=vke) for ev in raw]
    theirs = msgspec.msgpack.encode(vke.KVEventBatch(ts, structs, rank))
    if all(len(ev) == 7 for ev in raw if ev[0] == "BlockStored"):
        assert ours == theirs  # every BlockStored in 0.33's layout: byte for byte
    else:  # 0.33 gives plain BlockStored a map16 header too; ours stay 0.32's fixmap
        n_plain = sum(ev[0] == "BlockStored" and len(ev) == 6 for ev in raw)
        assert len(ours) == len(theirs) - 2 * n_plain
    assert msgspec.msgpack.decode(ours, type=vke.KVEventBatch).events == structs


def test_connector_and_disk_bytes_are_vllm_033s_encoder_bytes():
    vke = _vke033()
    payload = _promoted_planner(True).drain_events_msgpack(2.0, "CPU", 1)
    ev = vke.BlockStored([11, 12, 2**64 - 1], 9, [1, 2, 3, 4, 5, 6], 2, None, "CPU", None,
                         lookahead_token_ids=[[300], [], [0]])
    assert payload == msgspec.msgpack.encode(vke.KVEventBatch(2.0, [ev], 1))
    raw = _promoted_planner(True).drain_events_raw(msgspec.Raw, "CPU")
    assert msgspec.msgpack.encode(vke.KVEventBatch(2.0, raw, 1)) == payload
    idx = DiskIndex(2, 2, publish_successors=True)
    idx.complete_write(idx.begin_write(5, [1, 2], successor=70000, parent_hash=4), True)
    ev = vke.BlockStored([5], 4, [1, 2], 2, None, "STORAGE", None, lookahead_token_ids=[[70000]])
    assert idx.events_msgpack(3.0) == msgspec.msgpack.encode(vke.KVEventBatch(3.0, [ev]))


@settings(max_examples=100, deadline=None)
@given(events, st.floats(allow_nan=False), mediums, ranks)
def test_vllms_decoder_reads_events_with_lookahead(raw, ts, medium, rank):
    """On vLLM 0.32 msgspec skips the field its BlockStored lacks; 0.33 keeps it."""
    vke = _vke()
    has_field = "lookahead_token_ids" in vke.BlockStored.__struct_fields__
    payload = encode_event_batch(raw, ts, medium=medium, data_parallel_rank=rank)
    got = msgspec.msgpack.decode(payload, type=vke.KVEventBatch)
    assert got.ts == ts and got.data_parallel_rank == rank and len(got.events) == len(raw)
    for ev, r in zip(got.events, raw):
        assert type(ev).__name__ == r[0]
        if r[0] == "BlockStored":
            assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id,
                    ev.medium) == (r[1], r[2], r[3], r[4], r[5], medium)
            if has_field:
                assert ev.lookahead_token_ids == (r[6] if len(r) == 7 else None)


# ---- the connector on vLLM's real Scheduler ----

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    _vke()
    from kvslots._dev.tiny import build_tiny_models

    return build_tiny_models(str(tmp_path_factory.mktemp("tiny")))


def _harness(models, *, draft: bool, extra: dict, chunk: int = 256, num_blocks: int = 64):
    from vllm_harness import Harness, engine_config

    cfg = engine_config(models["target"], models["eagle"] if draft else None, k=3, num_blocks=num_blocks,
                        max_num_batched_tokens=chunk)
    cfg.kv_transfer_config.kv_connector_extra_config = dict(extra)
    h = Harness(copy.deepcopy(cfg), num_blocks=num_blocks, seed=11)
    # As with vLLM's ZMQ publisher: each event as its wire bytes (msgspec.Raw).
    h.connector._raw_events = True
    return h


def _published(h, medium: str | None = None) -> list:
    """The captured events as a vLLM ZMQ publisher sends them (msgspec writes the Raw bytes
    verbatim), read back with the codec (which knows lookahead_token_ids on any vLLM); vLLM's
    own decoder must read the same payload."""
    vke = _vke()
    payload = msgspec.msgpack.encode(vke.KVEventBatch(ts=0.0, events=h.events))
    msgspec.msgpack.decode(payload, type=vke.KVEventBatch)  # no error on 0.32 nor 0.33
    evs = decode_batch(payload).events
    return [e for e in evs if type(e).__name__ == "BlockStored" and (medium is None or e.medium == medium)]


def _lookahead_by_hash(stored) -> dict[int, list[int] | None]:
    out: dict[int, list[int] | None] = {}
    for e in stored:
        las = e.lookahead_token_ids or [None] * len(e.block_hashes)
        assert len(las) == len(e.block_hashes)
        out.update(zip(e.block_hashes, las))
    return out


def test_scheduler_cpu_events_carry_the_recorded_successors(models):
    from kvslots.events import external_block_hash
    from vllm_harness import BLOCK_SIZE, DRAFT_BASE

    # 64-token prefill chunks: blocks 1 and 3 end a partial chunk (no successor recorded).
    h = _harness(models, draft=True, extra={"host_cache_blocks": 256}, chunk=64)
    rng = random.Random(11)
    tokens = [rng.randrange(1, DRAFT_BASE) for _ in range(5 * BLOCK_SIZE + 7)]
    req = h.add("a", tokens, max_tokens=2)
    h.run_until_done()
    stored = _published(h, "CPU")
    assert stored and all(e.lookahead_token_ids is not None for e in stored)
    got = _lookahead_by_hash(stored)
    host = h.sched_side.host
    hashes = [external_block_hash(x) for x in req.block_hashes[:5]]
    assert set(hashes) <= set(got)
    # Each published successor is the one recorded (the host tier serves the last block by it).
    for x in hashes:
        s = host.successor(x)
        assert got[x] == ([] if s is None else [s])
    expected = [[] if i in (1, 3) else [tokens[(i + 1) * BLOCK_SIZE]] for i in range(5)]
    assert [got[x] for x in hashes] == expected


@pytest.mark.parametrize("draft,extra", [(True, {"eagle_block_drop": False}), (False, {})])
def test_scheduler_cpu_events_have_no_lookahead_without_the_eagle_rule(models, draft, extra):
    from vllm_harness import BLOCK_SIZE, DRAFT_BASE

    h = _harness(models, draft=draft, extra={"host_cache_blocks": 256, **extra})
    assert not h.sched_side.planner.publishes_successors
    rng = random.Random(12)
    h.add("a", [rng.randrange(1, DRAFT_BASE) for _ in range(3 * BLOCK_SIZE + 5)], max_tokens=2)
    h.run_until_done()
    stored = _published(h)
    assert stored and all(e.lookahead_token_ids is None for e in stored)
    assert not any(b"lookahead" in bytes(r) for r in h.events)


# ---- the disk tier (medium STORAGE) on vLLM's real Scheduler ----

def _spill(h, tokens: list[int]) -> list[int]:
    """Runs `tokens`, then other work that pushes its 5 full blocks from the 8-block host tier
    to disk, and waits for the writer. Returns their external hashes."""
    from kvslots.events import external_block_hash
    from vllm_harness import BLOCK_SIZE, DRAFT_BASE

    a = h.add("a", tokens, max_tokens=2)
    h.run_until_done()
    hashes = [external_block_hash(x) for x in a.block_hashes[:5]]
    rng = random.Random(13)
    h.add("push", [rng.randrange(1, DRAFT_BASE) for _ in range(10 * BLOCK_SIZE + 5)], max_tokens=2)
    h.run_until_done()
    h.workers[0]._disk_worker.store.flush()
    h.step()  # carries the writer's report to the scheduler
    disk = h.connector._disk_sched.index
    assert all(disk.contains(x) for x in hashes), "spilled to disk"
    return hashes


@pytest.mark.parametrize("draft", [True, False])
def test_disk_storage_events_carry_successors_on_write_promotion_and_restart(models, tmp_path, draft):
    from vllm_harness import BLOCK_SIZE, DRAFT_BASE

    h = _harness(models, draft=draft, extra={"host_cache_blocks": 8, "disk_path": str(tmp_path / "disk"),
                                             "disk_blocks": 64})
    disk = h.connector._disk_sched
    assert disk.index.publishes_successors is draft
    rng = random.Random(14)
    tokens = [rng.randrange(1, DRAFT_BASE) for _ in range(5 * BLOCK_SIZE + 10)]
    hashes = _spill(h, tokens)
    storage = _published(h, "STORAGE")
    assert storage
    if not draft:
        assert all(e.lookahead_token_ids is None for e in storage)
        assert all(e.lookahead_token_ids is None for e in _published(h, "CPU"))
        return
    got = _lookahead_by_hash(storage)
    expected = [[tokens[(i + 1) * BLOCK_SIZE]] for i in range(5)]
    assert [got[x] for x in hashes] == expected
    for x, la in got.items():  # every STORAGE block: the successor its record carries
        if disk.index.contains(x):
            s = disk.index.successor(x)
            assert la == ([] if s is None else [s])

    # A restart rebuilds the index from the file and publishes the same successors.
    fresh = DiskIndex(disk.index.num_slots, BLOCK_SIZE, publish_successors=True)
    restored, _, why = fresh.restore_from_file(disk.path, **h.workers[0]._disk_worker.layout.kwargs())
    assert why is None and restored == disk.index.num_stored
    again = _lookahead_by_hash(decode_batch(fresh.events_msgpack(0.0, drain=True)).events)
    assert [again[x] for x in hashes] == expected

    # A disk hit moves the blocks up: their CPU BlockStored carries the successors too.
    before = len(h.events)
    assert h.scheduler.reset_prefix_cache()
    h.add("a2", tokens, max_tokens=2)
    for _ in range(200):
        h.step()
        if not h.scheduler.has_requests():
            break
    assert not h.scheduler.has_requests()
    assert disk.stats["promoted_blocks"] == 5
    h.events[:] = h.events[before:]
    promoted = _lookahead_by_hash(_published(h, "CPU"))
    assert [promoted[x] for x in hashes] == expected
