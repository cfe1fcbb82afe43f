"""The Rust prefix index (kvslots._core.PrefixIndex) against a brute-force oracle, through the
same msgpack payloads vLLM publishes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from indexer_support import Oracle, engine_hashes, rust_lookup

from kvslots._core import PrefixIndex
from kvslots.errors import EventDecodeError, InvalidArgumentError, UnknownWorkerError
from kvslots.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

BS = 2
WORKERS = ("a", "b", "c")


def payload(events) -> bytes:
    return encode_batch(KVEventBatch(1.0, list(events), 0))


# Prompts share prefixes (a few base prompts, sometimes with a different last block), so that
# workers hold overlapping chains and queries hit.
token_block = st.lists(st.integers(0, 2), min_size=BS, max_size=BS)
BASE = [[[0, 0], [0, 1], [1, 1], [2, 2]], [[0, 0], [0, 1], [2, 0], [1, 1]], [[1, 2], [0, 0], [0, 0], [1, 0]]]


@st.composite
def prompt(draw):
    base = draw(st.sampled_from(BASE))
    n = draw(st.integers(1, len(base)))
    blocks = [list(b) for b in base[:n]]
    if draw(st.booleans()):
        blocks[-1] = draw(token_block)
    return blocks


step = st.fixed_dictionaries({
    "worker": st.sampled_from(WORKERS),
    "kind": st.sampled_from(["store", "store", "store", "tail", "remove", "clear", "placeholder", "dup"]),
    "blocks": prompt(),
    "medium": st.sampled_from([None, None, "GPU", "CPU", "STORAGE"]),
    "lora": st.sampled_from([None, None, 7]),
    "pick": st.integers(0, 3),
    "collide": st.booleans(),
})


def build_event(s, seeds):
    tokens = [t for b in s["blocks"] for t in b]
    hs = engine_hashes(seeds[s["worker"]] + (s["lora"] or 0), tokens, BS)
    if s["collide"] and s["kind"] == "store":
        hs = [h % 5 for h in hs]  # a tiny hash space: the same hash reused for other content
    n = len(hs)
    if s["kind"] in ("store", "dup"):
        return [BlockStored(hs, None, tokens, BS, s["lora"], s["medium"], None)] * (2 if s["kind"] == "dup" else 1)
    if s["kind"] == "tail":  # chained to a parent that may or may not be known (orphan)
        k = min(s["pick"], n - 1)
        parent = hs[k - 1] if k else engine_hashes(99, tokens, BS)[0]
        return [BlockStored(hs[k:], parent, tokens[k * BS :], BS, s["lora"], s["medium"], None)]
    if s["kind"] == "remove":
        return [BlockRemoved(hs[min(s["pick"], n - 1) :], s["medium"])] * (1 + s["pick"] % 2)
    if s["kind"] == "placeholder":
        return [BlockStored(hs, None, [], 0, None, s["medium"], None)]
    return [AllBlocksCleared()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=25), queries=st.lists(prompt(), min_size=1, max_size=6),
       capacity=st.sampled_from([None, 10**6]))
def test_scores_equal_brute_force_oracle(steps, queries, capacity):
    ix = PrefixIndex(capacity=capacity, tier_weights={"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5})
    oracle = Oracle()
    seeds = {w: i * 1000 for i, w in enumerate(WORKERS)}
    for w in WORKERS:
        ix.add_worker(w)
        oracle.add_worker(w)
    for s in steps:
        events = build_event(s, seeds)
        ix.apply(s["worker"], payload(events))
        oracle.apply(s["worker"], events)
        assert ix.check_invariants() is None
    for q in queries:
        tokens = [t for b in q for t in b]
        for lora in (None, 7):
            assert rust_lookup(ix, tokens, BS, lora) == oracle.lookup(tokens, BS, lora)


def test_lookup_inputs_and_errors():
    ix = PrefixIndex()
    ix.add_worker("w")
    toks = list(range(32))
    hs = engine_hashes(1, toks, 16)
    ix.apply("w", payload([BlockStored(hs, None, toks, 16, None, None, None)]))
    want = [("w", 2, [2, 0, 0], 2.0)]
    assert ix.lookup(toks, 16) == want
    assert ix.lookup(np.array(toks, dtype=np.uint32), 16) == want
    assert ix.lookup(np.array(toks, dtype=np.int64), 16) == want
    assert ix.lookup(tuple(toks), 16) == want
    with pytest.raises(InvalidArgumentError, match="token_ids\\[3\\]"):
        ix.lookup([0, 1, 2, -1] + toks, 16)
    with pytest.raises(InvalidArgumentError):
        ix.lookup(["x"] * 16, 16)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        ix.lookup(toks, 0)
    # Every token is checked before the walk: a refused lookup changes no counter and no
    # recency, wherever the bad token is.
    before = (ix.stats(), ix.dump())
    for bad in ([99] * 16 + ["junk"], toks + [-1], toks + [2**32], toks + [True], toks + [1.0]):
        with pytest.raises(InvalidArgumentError):
            ix.lookup(bad, 16)
    assert (ix.stats(), ix.dump()) == before


def test_apply_errors_change_nothing():
    ix = PrefixIndex()
    ix.add_worker("w")
    toks = list(range(16))
    good = payload([BlockStored(engine_hashes(1, toks, 16), None, toks, 16, None, None, None)])
    ix.apply("w", good)
    for bad in (b"", b"\xc1", good[:-3], msgspec.msgpack.encode({"not": "a batch"}), b"\x93" + b"\x00" * 2):
        with pytest.raises(EventDecodeError):
            ix.apply("w", bad)
    with pytest.raises(UnknownWorkerError):
        ix.apply("nobody", good)
    with pytest.raises(InvalidArgumentError, match="tier"):
        ix.apply("w", good, "HBM")
    assert ix.stats()["entries"] == 1
    # Deeply nested junk in an ignored field is refused, not a stack overflow.
    deep = b"\x91" * 100_000
    evil = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": []}]])
    with pytest.raises(EventDecodeError):
        ix.apply("w", evil[:-1] + b"\x82\xa1x" + deep)


def test_bytes_hashes_and_capacity():
    ix = PrefixIndex(capacity=3)
    ix.add_worker("w")
    toks = list(range(64))
    hs = [i.to_bytes(32, "big") for i in range(1, 5)]
    st_ = ix.apply("w", payload([BlockStored(hs, None, toks, 16, None, "CPU", None)]))
    assert (st_.stored_blocks, ix.stats()["entries"], ix.stats()["evictions"]) == (4, 3, 1)
    assert ix.lookup(toks, 16) == [("w", 3, [0, 3, 0], pytest.approx(2.4))]
    # vLLM's int form of a bytes hash is its low 64 bits, big-endian: removal by int works.
    st_ = ix.apply("w", payload([BlockRemoved([1], "CPU")]))
    assert st_.removed_blocks == 1 and ix.lookup(toks, 16) == []
