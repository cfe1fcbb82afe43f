"""vLLM 0.33's lookahead block hashes: ``BlockStored.lookahead_token_ids`` in the codec, and the
prefix index scoring lookahead-hashed blocks as the engine would hit them.

An EAGLE engine of vLLM 0.33 without a KV connector hashes each block together with the
``L`` tokens after it, and only a request that goes on with those tokens hits the block. The
index must not count such a block for a prompt that diverges right after it, or that ends at it.
The tests that need vLLM 0.33's own classes run where it is installed (``.venv-033``).
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from indexer_support import engine_hashes

from kvslots._core import PrefixIndex
from kvslots.events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

BS = 4


def payload(events) -> bytes:
    return encode_batch(KVEventBatch(1.0, list(events), 0))


def eagle_store(seed: int, tokens: list[int], la: int, *, cls=BlockStored, **kw) -> BlockStored:
    """What a 0.33 EAGLE engine publishes for the full blocks of `tokens` that have `la` tokens
    after them: each block's hash covers those tokens too (any chain works for the index; this
    one mixes them in, as the engine's does)."""
    n = (len(tokens) - la) // BS
    hs, h = [], seed
    for i in range(n):
        h = hash((h, tuple(tokens[i * BS:(i + 1) * BS + la]))) & (2**64 - 1)
        hs.append(h)
    return cls(block_hashes=hs, parent_block_hash=None, token_ids=tokens[: n * BS], block_size=BS,
               lora_id=None, medium="GPU", lora_name=None,
               lookahead_token_ids=[tokens[(i + 1) * BS:(i + 1) * BS + la] for i in range(n)], **kw)


def new_index(*workers: str) -> PrefixIndex:
    ix = PrefixIndex()
    for w in workers:
        ix.add_worker(w)
    return ix


def blocks_of(ix: PrefixIndex, tokens: list[int]) -> dict[str, int]:
    return {w: b for w, b, _t, _s in ix.lookup(tokens, BS)}


# ---------------------------------------------------------------- codec


def test_codec_reads_and_writes_lookahead_token_ids():
    ev = BlockStored([1, 2], None, list(range(8)), BS, None, "GPU", None, lookahead_token_ids=[[4], [8]])
    raw = payload([ev])
    (back,) = decode_batch(raw).events
    assert back == ev and back.lookahead_token_ids == [[4], [8]]
    assert b"lookahead_token_ids" in raw


def test_without_lookahead_the_bytes_are_vllm_032s():
    ev = BlockStored([1, 2], 7, list(range(8)), BS, None, "GPU", None)
    raw = payload([ev])
    assert b"lookahead_token_ids" not in raw
    # [ts, [event], rank]: the event map right after the float and the one-element array.
    header = raw[raw.index(b"\x91") + 1]
    assert header == 0x80 | 8, "0.32 layout: a fixmap of the 7 required fields and the tag"
    assert decode_batch(raw).events == [ev]
    with_la = payload([msgspec.structs.replace(ev, lookahead_token_ids=[[8], [9]])])
    assert with_la[with_la.index(b"\x91") + 1] == 0xDE, "0.33 layout: map16"


# ---------------------------------------------------------------- index


def test_lookahead_block_counts_only_for_a_prompt_that_goes_on_with_its_tokens():
    ix = new_index("eagle")
    seq = [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 40]
    ix.apply("eagle", payload([eagle_store(1, seq, 1)]))  # 3 blocks, each with the token after it
    assert blocks_of(ix, seq) == {"eagle": 3}
    assert blocks_of(ix, seq + [41, 42]) == {"eagle": 3}
    # Ends at the third block: the engine has no lookahead token to hash it with.
    assert blocks_of(ix, seq[:12]) == {"eagle": 2}
    # Diverges right after the second block: its hash covered token 30, this prompt has 99.
    assert blocks_of(ix, seq[:8] + [99, 31, 32, 33, 40]) == {"eagle": 1}
    # Diverges right after the first block.
    assert blocks_of(ix, seq[:4] + [77]) == {}


def test_plain_and_lookahead_workers_side_by_side():
    ix = new_index("eagle", "plain")
    seq = list(range(100, 114))
    ev = eagle_store(1, seq, 2)
    assert len(ev.block_hashes) == 3
    ix.apply("eagle", payload([ev]))
    hs = engine_hashes(5, seq, BS)
    ix.apply("plain", payload([BlockStored(hs, None, seq[:12], BS, None, "GPU", None)]))
    assert blocks_of(ix, seq) == {"eagle": 3, "plain": 3}
    assert blocks_of(ix, seq[:13]) == {"eagle": 2, "plain": 3}  # eagle's 3rd block needs 2 tokens after it
    assert blocks_of(ix, seq[:12] + [113, 0]) == {"eagle": 2, "plain": 3}
    assert blocks_of(ix, seq[:4] + [0] * 10) == {"plain": 1}


def test_lookahead_blocks_are_removed_by_their_engine_hash():
    ix = new_index("eagle")
    seq = list(range(13))
    ev = eagle_store(3, seq, 1)
    ix.apply("eagle", payload([ev]))
    ix.apply("eagle", payload([BlockRemoved(ev.block_hashes[1:], "GPU")]))
    assert blocks_of(ix, seq) == {"eagle": 1}


def test_chained_lookahead_events_resolve_their_parent():
    ix = new_index("eagle")
    seq = list(range(50, 63))
    full = eagle_store(9, seq, 1)
    first = BlockStored(full.block_hashes[:1], None, seq[:4], BS, None, "GPU", None,
                        lookahead_token_ids=full.lookahead_token_ids[:1])
    rest = BlockStored(full.block_hashes[1:], full.block_hashes[0], seq[4:12], BS, None, "GPU", None,
                       lookahead_token_ids=full.lookahead_token_ids[1:])
    ix.apply("eagle", payload([first]))
    ix.apply("eagle", payload([rest]))
    assert blocks_of(ix, seq) == {"eagle": 3}


@pytest.mark.parametrize("bad", [
    [[1]],                      # fewer lists than blocks
    [[1], [2], [3], [4]],       # more
    [[1], list(range(65)), [3]],  # longer than the index tracks
])
def test_malformed_lookahead_is_skipped_and_counted(bad):
    ix = new_index("w")
    ev = BlockStored([1, 2, 3], None, list(range(12)), BS, None, "GPU", None, lookahead_token_ids=bad)
    st_ = ix.apply("w", payload([ev]))
    assert st_.invalid_events == 1 and st_.stored_blocks == 0
    assert len(ix) == 0


def test_lookahead_token_ids_of_the_wrong_type_is_an_invalid_event():
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                         "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None,
                                         "medium": "GPU", "lora_name": None,
                                         "lookahead_token_ids": [["x"]]}], 0])
    ix = new_index("w")
    st_ = ix.apply("w", raw)
    assert st_.invalid_events == 1 and len(ix) == 0


# An oracle: a worker holds block i of a prompt iff it stored the prompt's tokens up to the end of
# block i together with the L tokens after it (L = 0 for a plain worker).
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(st.integers(0, 2), min_size=4, max_size=17)),
                min_size=1, max_size=6),
       st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=17), min_size=1, max_size=5))
def test_lookahead_scoring_matches_an_oracle(stores, queries):
    la = {"a": 1, "b": 0}
    ix = new_index("a", "b")
    held: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set()}
    for w, seq in stores:
        if la[w]:
            ev = eagle_store(1, seq, la[w])
        else:
            ev = BlockStored(engine_hashes(2, seq, BS), None, seq[: len(seq) // BS * BS], BS, None, "GPU", None)
        if not ev.block_hashes:
            continue
        ix.apply(w, payload([ev]))
        for i in range(len(ev.block_hashes)):
            held[w].add(tuple(seq[: (i + 1) * BS + la[w]]))
    for q in queries:
        want = {}
        for w in ("a", "b"):
            k = 0
            while (k + 1) * BS + la[w] <= len(q) and tuple(q[: (k + 1) * BS + la[w]]) in held[w]:
                k += 1
            if k:
                want[w] = k
        assert blocks_of(ix, q) == want, (q, held)


# ---------------------------------------------------------------- vLLM 0.33's own classes


def _vke033():
    try:
        from vllm.distributed import kv_events as vke
    except ImportError as exc:
        pytest.skip(f"vLLM is not importable here: {exc!r}")
    if "lookahead_token_ids" not in vke.BlockStored.__struct_fields__:
        pytest.skip("vLLM 0.32 here: its BlockStored has no lookahead_token_ids (the 0.33 env runs this)")
    return vke


def test_eagle_stream_of_vllm_033_structs_is_scored_with_lookahead():
    vke = _vke033()
    seq = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9, 9, 9, 0]
    ev = eagle_store(4, seq, 1, cls=vke.BlockStored, group_idx=0)
    raw = msgspec.msgpack.encode(vke.KVEventBatch(ts=2.0, events=[ev], data_parallel_rank=0))
    assert raw[raw.index(b"\x91") + 1] == 0xDE  # 0.33 writes map16
    ix = new_index("eagle")
    st_ = ix.apply("eagle", raw)
    assert st_.stored_blocks == 3 and st_.invalid_events == 0
    assert blocks_of(ix, seq) == {"eagle": 3}
    assert blocks_of(ix, seq[:12]) == {"eagle": 2}
    assert blocks_of(ix, seq[:8] + [0, 9, 9, 9, 0]) == {"eagle": 1}
    # Both ways through the codecs: ours decodes theirs, theirs decodes ours, values equal.
    (ours,) = decode_batch(raw).events
    assert ours.lookahead_token_ids == ev.lookahead_token_ids == [[1], [9], [0]]
    back = msgspec.msgpack.Decoder(vke.KVEventBatch).decode(payload([ours]))
    assert back.events[0] == ev


def test_vllm_033_block_pool_events_are_scored_with_lookahead():
    """The events vLLM 0.33's own block pool emits with num_hash_lookahead_tokens=1."""
    vke = _vke033()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BS,
                     enable_kv_cache_events=True, num_hash_lookahead_tokens=1)
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    hasher = get_request_block_hasher(BS, sha256, num_hash_lookahead_tokens=1)
    req = Request("r", prompt_token_ids=seq, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, block_hasher=hasher)
    assert len(req.block_hashes) == 3
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request=req, blocks=blocks, num_cached_blocks=0, num_full_blocks=3,
                           block_size=BS, kv_cache_group_id=0)
    events = pool.take_events()
    assert [type(e) for e in events] == [vke.BlockStored]
    assert events[0].lookahead_token_ids == [[5], [5], [9]]
    raw = msgspec.msgpack.encode(vke.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))
    ix = new_index("eagle")
    ix.apply("eagle", raw)
    assert blocks_of(ix, seq) == {"eagle": 3}
    assert blocks_of(ix, seq[:12]) == {"eagle": 2}
    assert blocks_of(ix, seq[:8] + [7, 3, 5, 8]) == {"eagle": 1}
