"""Scheduler mode's KV cache manager against vLLM's ``KVCacheManager``, call by call.

The same random programs of manager calls (admissions with prefix hits, connector tokens and
delayed caching, decode steps with drafts and rollbacks, frees, deferred frees, resets, stats)
go to both managers, over the very same ``Request`` objects: every answer must match (hit
lengths, whether an allocation fits, how many blocks it adds, usage, KV events field by field,
prefix-cache stats, cached-token estimates), and the hits must land on the blocks that vLLM's
land on (block ids differ, the mapping between them must be a bijection). Plus: the
configurations scheduler mode refuses, the result objects, and bad arguments.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import hypothesis.strategies as st  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvslots._core import KVBlocks  # noqa: E402
from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError  # noqa: E402
from kvslots.vllm.scheduler import KVSlotsKVCacheManager, SchedulerModeError  # noqa: E402

BS = 16
EXAMPLES = int(os.environ.get("KVSLOTS_SCHED_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BS, sha256)


def kcc(num_blocks: int, spec=None, groups: int = 1) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{g}"], spec) for g in range(groups)])


def managers(num_blocks: int, *, use_eagle: bool, events: bool = True, caching: bool = True,
             watermark: float = 0.0, **kw):
    args = dict(kv_cache_config=kcc(num_blocks), max_model_len=4096, scheduler_block_size=BS,
                hash_block_size=BS, enable_caching=caching, use_eagle=use_eagle, log_stats=True,
                enable_kv_cache_events=events, watermark=watermark)
    args.update(kw)
    return KVCacheManager(**args), KVSlotsKVCacheManager(**args)


def request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=10_000), pooling_params=None,
                   block_hasher=_HASHER)


class Pair:
    """vLLM's manager and kvslots', driven together."""

    def __init__(self, v, k):
        self.v, self.k = v, k
        self.vk: dict[int, int] = {}  # vLLM block id -> kvslots block id

    def same(self, name, *args, **kw):
        a = getattr(self.v, name)(*args, **kw)
        b = getattr(self.k, name)(*args, **kw)
        assert a == b, f"{name}: vLLM {a!r}, kvslots {b!r}"
        return a

    def check_tables(self, rid: str, hits: int = 0) -> None:
        (tv,) = self.v.get_block_ids(rid)
        (tk,) = self.k.get_block_ids(rid)
        assert len(tv) == len(tk), f"{rid}: {len(tv)} blocks vs {len(tk)}"
        for i, (a, b) in enumerate(zip(tv, tk)):
            if i < hits:
                assert self.vk.get(a) == b, f"{rid}: hit {i} on vLLM block {a} -> {self.vk.get(a)}, kvslots {b}"
            else:
                self.vk[a] = b

    def events(self) -> None:
        ev = self.v.take_events()
        ek = self.k.take_events()
        assert ek == ev, f"events differ:\n vLLM    {ev}\n kvslots {ek}"


def run_program(seed: int, *, use_eagle: bool, num_blocks: int, k: int, watermark: float = 0.0) -> Pair:
    rng = random.Random(seed)
    p = Pair(*managers(num_blocks, use_eagle=use_eagle, watermark=watermark))
    prefixes = [[rng.randrange(1, 5000) for _ in range(rng.randrange(8, 100))] for _ in range(3)]
    live: dict[str, Request] = {}
    delayed: list[Request] = []
    parked: list[tuple[list, list]] = []
    n = 0
    for _ in range(rng.randrange(20, 120)):
        op = rng.random()
        if op < 0.3 or not live:
            n += 1
            pre = prefixes[rng.randrange(3)] if rng.random() < 0.7 else []
            req = request(f"r{n}", pre + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 60))])
            if rng.random() < 0.1:
                req.skip_reading_prefix_cache = True
            bv, hv, _ = p.v.get_computed_blocks(req)
            bk, hk, _ = p.k.get_computed_blocks(req)
            assert hk == hv, f"hit {hk} vs {hv}"
            assert bk.get_block_ids() == ([p.vk[b] for b in bv.get_block_ids()[0]],)
            ext = 0
            if rng.random() < 0.25:
                ext = rng.randrange(0, max(1, (req.num_tokens - 1 - hv) // BS)) * BS
            delay = ext > 0 and rng.random() < 0.5
            new = req.num_tokens - hv - ext
            kw = dict(num_new_computed_tokens=hv, num_lookahead_tokens=0 if delay else k,
                      num_external_computed_tokens=ext, delay_cache_blocks=delay,
                      full_sequence_must_fit=rng.random() < 0.2, has_scheduled_reqs=bool(live),
                      reserved_blocks=rng.choice([0, 0, 0, 2]))
            rv = p.v.allocate_slots(req, 0 if delay else new, new_computed_blocks=bv, **kw)
            rk = p.k.allocate_slots(req, 0 if delay else new, new_computed_blocks=bk, **kw)
            assert (rv is None) == (rk is None), f"fit: vLLM {rv is not None}, kvslots {rk is not None}"
            if rv is None:
                p.check_tables(req.request_id)
                continue
            assert len(rk.get_block_ids()[0]) == len(rv.get_block_ids()[0])
            p.check_tables(req.request_id, hits=hv // BS)
            p.k.record_prefix_cache_stats(req, hv)
            p.v.record_prefix_cache_stats(req, hv)
            req.status = RequestStatus.RUNNING
            if delay:
                req.num_computed_tokens = hv + ext
                delayed.append(req)
            else:
                req.num_computed_tokens = hv + ext + new
                live[req.request_id] = req
        elif op < 0.7:
            req = live[rng.choice(sorted(live))]
            # A decode step verified: accept some drafts, reject the rest, add the bonus token.
            accepted = rng.randrange(0, k + 1)
            req.append_output_token_ids([rng.randrange(1, 5000) for _ in range(accepted + 1)])
            req.num_computed_tokens = min(req.num_computed_tokens + accepted, req.num_tokens - 1)
            old = len(p.v.get_block_ids(req.request_id)[0])
            rv = p.v.allocate_slots(req, 1 + k, num_lookahead_tokens=k)
            rk = p.k.allocate_slots(req, 1 + k, num_lookahead_tokens=k)
            assert (rv is None) == (rk is None)
            if rv is None:
                # Preempt it, as the scheduler would.
                p.v.free(req)
                p.k.free(req)
                del live[req.request_id]
                continue
            assert len(rk.get_block_ids()[0]) == len(rv.get_block_ids()[0])
            p.check_tables(req.request_id, hits=old)
            req.num_computed_tokens += 1 + k
        elif op < 0.8 and delayed:
            req = delayed.pop(rng.randrange(len(delayed)))
            p.v.cache_blocks(req, req.num_computed_tokens)
            p.k.cache_blocks(req, req.num_computed_tokens)
            live[req.request_id] = req
        elif op < 0.9:
            req = live.pop(rng.choice(sorted(live)))
            p.same("estimate_cached_tokens", req)
            if rng.random() < 0.3:
                parked.append((p.v.pop_blocks_for_free(req), p.k.pop_blocks_for_free(req)))
            else:
                p.v.free(req)
                p.k.free(req)
        elif op < 0.95 and parked:
            bv, bk = parked.pop(0)
            assert len(bv) == len(bk)
            p.v.block_pool.free_blocks(reversed(bv))
            p.k.block_pool.free_blocks(reversed(bk))
        else:
            if not live and not delayed and not parked and rng.random() < 0.5:
                p.same("reset_prefix_cache")
                p.vk.clear()
        assert p.k.usage == p.v.usage
        assert p.k.block_pool.get_num_free_blocks() == p.v.block_pool.get_num_free_blocks()
        p.events()
        p.k.check(list(live.values()))
    sv, sk = p.v.make_prefix_cache_stats(), p.k.make_prefix_cache_stats()
    assert (sk.requests, sk.queries, sk.hits) == (sv.requests, sv.queries, sv.hits)
    for req in list(live.values()) + delayed:
        p.v.free(req)
        p.k.free(req)
    for bv, bk in parked:
        p.v.block_pool.free_blocks(reversed(bv))
        p.k.block_pool.free_blocks(reversed(bk))
    p.events()
    assert p.k.num_held_blocks() == 1 and p.k.num_free_blocks() == num_blocks - 1, "the pool is whole"
    p.k.check()
    return p


@SETTINGS
@given(seed=st.integers(0, 2**32), use_eagle=st.booleans(), num_blocks=st.integers(8, 120),
       k=st.sampled_from([0, 1, 3]), watermark=st.sampled_from([0.0, 0.0, 0.05]))
def test_manager_calls_answer_like_vllms(seed, use_eagle, num_blocks, k, watermark):
    run_program(seed, use_eagle=use_eagle, num_blocks=num_blocks, k=k, watermark=watermark)


def test_eagle_drops_the_last_hit_block_and_never_the_whole_prompt():
    for use_eagle in (False, True):
        p = Pair(*managers(64, use_eagle=use_eagle))
        a = request("a", list(range(1, 65)))  # 4 full blocks
        for m in (p.v, p.k):
            m.allocate_slots(a, 64)
        b = request("b", list(range(1, 65)))  # same prompt: at most 63 tokens can hit
        (_, hv, _), (_, hk, _) = p.v.get_computed_blocks(b), p.k.get_computed_blocks(b)
        assert hv == hk == (2 if use_eagle else 3) * BS


def test_kv_events_fields_lora_and_full_report_mode():
    from vllm.lora.request import LoRARequest

    p = Pair(*managers(64, use_eagle=False))
    params = SamplingParams(max_tokens=100, extra_args={"kv_cache_report_mode": "full"})
    lora = LoRARequest("adapter", 7, "/nowhere")
    reqs = [Request(request_id=f"r{i}", prompt_token_ids=list(range(1, 50)), sampling_params=params,
                    pooling_params=None, block_hasher=_HASHER, lora_request=lora, cache_salt="salt",
                    session_id="s") for i in range(2)]
    for r in reqs:
        bv, hv, _ = p.v.get_computed_blocks(r)
        bk, hk, _ = p.k.get_computed_blocks(r)
        p.v.allocate_slots(r, 49 - hv, hv, bv)
        p.k.allocate_slots(r, 49 - hk, hk, bk)
        p.events()
    assert hk == 48


def test_reset_only_when_nothing_is_held_and_deferred_frees():
    p = Pair(*managers(16, use_eagle=False))
    r = request("r", list(range(1, 40)))
    for m in (p.v, p.k):
        m.allocate_slots(r, 39)
    assert p.same("reset_prefix_cache") is False
    bv, bk = p.v.pop_blocks_for_free(r), p.k.pop_blocks_for_free(r)
    assert p.same("reset_prefix_cache") is False
    p.v.block_pool.free_blocks(reversed(bv))
    p.k.block_pool.free_blocks(reversed(bk))
    assert p.same("reset_prefix_cache") is True
    p.events()
    with pytest.raises(InvalidArgumentError):
        p.k.block_pool.free_blocks(bk)  # not popped any more


def test_zeroing_and_num_blocks_to_allocate():
    p = Pair(*managers(32, use_eagle=False))
    r = request("r", list(range(1, 40)))
    for m in (p.v, p.k):
        m.allocate_slots(r, 39, num_lookahead_tokens=3)
        assert m.coordinator.get_num_blocks_to_allocate(
            request_id="r", num_tokens=100, new_computed_blocks=m.empty_kv_cache_blocks.blocks
            if m is p.v else (), num_encoder_tokens=0, total_computed_tokens=39,
            num_local_computed_tokens=39, num_tokens_main_model=100) == 7 - 3
    assert p.k.take_new_block_ids() == []  # zeroing is off for a uniform-precision cache


@pytest.mark.parametrize("config, feature", [
    (dict(kv_cache_config=kcc(8, groups=2)), "2 KV cache groups"),
    (dict(kv_cache_config=kcc(8, SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=2,
                                                    dtype=torch.float32, sliding_window=64))),
     "SlidingWindowSpec"),
    (dict(kv_cache_config=kcc(8, CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2,
                                                     dtype=torch.float32))), "encoder KV caches"),
    (dict(hash_block_size=8), "hash_block_size 8"),
    (dict(dcp_world_size=2), "context parallelism"),
    (dict(metrics_collector=object()), "--kv-cache-metrics"),
])
def test_unsupported_configurations_stop_the_engine_naming_the_feature(config, feature):
    args = dict(kv_cache_config=kcc(8), max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
    args.update(config)
    with pytest.raises(SchedulerModeError) as e:
        KVSlotsKVCacheManager(**args)
    assert feature in str(e.value) and "--slot-manager vllm" in str(e.value)
    assert isinstance(e.value, KVSlotsError)


def test_mla_is_full_attention():
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    m = KVSlotsKVCacheManager(kv_cache_config=kcc(8, spec), max_model_len=256, scheduler_block_size=BS,
                              hash_block_size=BS)
    assert m.num_free_blocks() == 7


def test_kvblocks_answers_like_kvcacheblocks():
    b = KVBlocks([5, 6, 7])
    assert b.get_block_ids() == ([5, 6, 7],)
    assert b.get_block_ids(allow_none=True) == ([5, 6, 7],)
    assert b.get_block_ids(group_ids=[0]) == ([5, 6, 7],)
    assert b.get_block_ids(group_ids=[]) == ()
    assert KVBlocks().get_block_ids(allow_none=True) is None
    assert KVBlocks().get_block_ids() == ([],)
    assert (b + KVBlocks([8])).get_block_ids() == ([5, 6, 7, 8],)
    assert b.new_empty().num_blocks == 0 and b.num_blocks == 3
    with pytest.raises(InvalidArgumentError):
        b.get_block_ids(group_ids=[1])


class _Req:
    def __init__(self, rid, **kw):
        self.request_id = rid
        self.num_computed_tokens = 0
        self._all_token_ids = list(range(1, 40))
        self.block_hashes = [bytes([i]) * 32 for i in range(2)]
        self.status = RequestStatus.WAITING
        self.__dict__.update(kw)


_junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                  st.text(max_size=3), st.binary(max_size=40), st.lists(st.integers(-3, 3), max_size=3))


@SETTINGS
@given(data=st.data())
def test_any_arguments_are_typed_errors_and_change_nothing(data):
    m = KVSlotsKVCacheManager(kv_cache_config=kcc(12), max_model_len=256, scheduler_block_size=BS,
                              hash_block_size=BS)
    good = _Req("ok")
    m.allocate_slots(good, 20, num_lookahead_tokens=2)
    before = (m.num_free_blocks(), m.block_ids("ok"), m.num_registered_blocks())
    req = _Req(data.draw(st.one_of(st.just("x"), _junk)),
               num_computed_tokens=data.draw(st.one_of(st.just(0), _junk)),
               block_hashes=data.draw(st.one_of(st.just([b"a" * 32] * 3), st.lists(_junk, max_size=3), _junk)),
               _all_token_ids=data.draw(st.one_of(st.just(list(range(9))), _junk)))
    calls = [
        lambda: m.allocate_slots(req, data.draw(_junk), num_lookahead_tokens=data.draw(_junk)),
        lambda: m.allocate_slots(good, 4, num_new_computed_tokens=data.draw(_junk),
                                 new_computed_blocks=data.draw(st.one_of(_junk, st.just(KVBlocks([1]))))),
        lambda: m.cache_blocks(req, data.draw(_junk)),
        lambda: m.computed_blocks(req, data.draw(_junk), data.draw(_junk)),
        lambda: m.get_blocks(data.draw(_junk)),
        lambda: m.get_block_ids(data.draw(_junk)),
        lambda: m.release_blocks(data.draw(_junk)),
        lambda: m.evict_blocks(data.draw(st.lists(st.integers(12, 2**40), min_size=1, max_size=3))),
        lambda: m.num_blocks_to_allocate(data.draw(_junk), data.draw(_junk)),
        lambda: m.registered_hash(data.draw(_junk)),
        lambda: m.refcount(data.draw(_junk)),
        lambda: m.record_blocks_for_zeroing("ok", data.draw(_junk)),
        lambda: m.finish_step(data.draw(_junk), data.draw(_junk)),
    ]
    call = data.draw(st.sampled_from(calls))
    try:
        call()
    except KVSlotsError:
        after = (m.num_free_blocks(), m.block_ids("ok"), m.num_registered_blocks())
        assert after == before, "a refused call changed the manager"
    assert m.check_invariants() is None
    m.free(good)
    m.free(req) if isinstance(req.request_id, str) else None
    assert m.check_invariants() is None


def test_argument_types_are_named():
    m = KVSlotsKVCacheManager(kv_cache_config=kcc(12), max_model_len=256, scheduler_block_size=BS,
                              hash_block_size=BS)
    with pytest.raises(ArgumentTypeError, match="num_new_tokens"):
        m.allocate_slots(_Req("a"), 1.5)
    with pytest.raises(ArgumentTypeError, match="new_computed_blocks"):
        m.allocate_slots(_Req("a"), 4, num_new_computed_tokens=16, new_computed_blocks=[1])
    with pytest.raises(InvalidArgumentError, match="num_new_tokens must be greater than 0"):
        m.allocate_slots(_Req("a"), 0)
    with pytest.raises(InvalidArgumentError, match="block_hashes"):
        m.allocate_slots(_Req("a", block_hashes=[None]), 20)
    assert m.check_invariants() is None and "a" not in m


class _SlottedReq:
    """A request that takes no new attribute: allocate_slots finds its table by name only."""

    __slots__ = ("request_id", "num_computed_tokens", "_all_token_ids", "block_hashes", "status")

    def __init__(self, rid):
        self.request_id = rid
        self.num_computed_tokens = 0
        self._all_token_ids = []
        self.block_hashes = []
        self.status = RequestStatus.RUNNING


def _extend(req, tokens):
    """Appends verified tokens and rehashes the request's full blocks (stand-in hashes)."""
    req._all_token_ids.extend(tokens)
    full = req._all_token_ids
    req.block_hashes = [bytes(str(full[:(i + 1) * BS]), "ascii")[-32:] for i in range(len(full) // BS)]


@pytest.mark.parametrize("seed", range(4))
def test_the_slot_noted_on_a_request_never_changes_an_answer(seed):
    """allocate_slots notes a request's slot on the object and skips the lookup by name next
    time: with stale notes (freed by id, slot reused), forged and junk notes and a second object
    under the same id mixed in, every table equals the one found by name alone."""
    rng = random.Random(seed)
    mgrs = [KVSlotsKVCacheManager(kv_cache_config=kcc(400), max_model_len=4096, scheduler_block_size=BS,
                                  hash_block_size=BS, use_eagle=True) for _ in range(2)]
    noted: dict[str, list] = {}
    names = [f"r{i}" for i in range(8)]

    for _ in range(300):
        rid = rng.choice(names)
        if rid not in noted:
            noted[rid] = [_Req(rid, _all_token_ids=[]), _SlottedReq(rid)]
            n = rng.randrange(1, 40)
            prompt = [rng.randrange(1, 50) for _ in range(n)]
            for r in noted[rid]:
                _extend(r, prompt)
            answers = [m.allocate_slots(r, n, num_lookahead_tokens=3) for m, r in zip(mgrs, noted[rid])]
            assert [a is None for a in answers] == [answers[0] is None] * 2
            if answers[0] is None:
                del noted[rid]
            continue
        op = rng.random()
        pair = noted[rid]
        if op < 0.6:  # a decode step: accepted drafts, then allocate with the lookahead
            acc = rng.randrange(0, 4)
            toks = [rng.randrange(1, 50) for _ in range(acc + 1)]
            for r in pair:
                r.num_computed_tokens = len(r._all_token_ids)
                _extend(r, toks)
            answers = [m.allocate_slots(r, 1 + 3, num_lookahead_tokens=3) for m, r in zip(mgrs, pair)]
            assert [a is None for a in answers] == [answers[0] is None] * 2
        elif op < 0.7:  # freed by object
            for m, r in zip(mgrs, pair):
                m.free(r)
            del noted[rid]
        elif op < 0.8:  # freed by id: the note goes stale
            for m in mgrs:
                m.free_request(rid)
            for r in pair:
                r.num_computed_tokens = 0
            if rng.random() < 0.2:
                pair[0].__dict__.pop("_kvslots_slot", None)
            del noted[rid]
            if rng.random() < 0.5:  # the stale object comes back under its name
                noted[rid] = pair
                answers = [m.allocate_slots(r, len(r._all_token_ids), num_lookahead_tokens=3)
                           for m, r in zip(mgrs, pair)]
                if answers[0] is None:
                    del noted[rid]
        elif op < 0.9:  # a forged or junk note
            other = noted[rng.choice(list(noted))][0]
            pair[0]._kvslots_slot = rng.choice([getattr(other, "_kvslots_slot", 0), -1, 2**70, "x", None,
                                                True, 1.0, 10**6])
        else:  # another object with the same id, holding the same state
            twin = _Req(rid, _all_token_ids=list(pair[0]._all_token_ids),
                        num_computed_tokens=pair[0].num_computed_tokens, block_hashes=list(pair[0].block_hashes))
            noted[rid] = [twin, pair[1]]
        for name in names:
            assert mgrs[0].block_ids(name) == mgrs[1].block_ids(name), name
        assert mgrs[0].num_free_blocks() == mgrs[1].num_free_blocks()
    for m in mgrs:
        assert m.check_invariants() is None
    assert any(isinstance(getattr(p[0], "_kvslots_slot", None), int) for p in noted.values()) or not noted


@SETTINGS
@given(data=st.data())
def test_a_noted_request_answers_and_fails_as_one_found_by_name(data):
    """The running request's call (a noted slot, vLLM's per-step arguments) takes a path that
    never reads the request's name: with any arguments and request fields it gives the answer,
    or the same error (naming the request), as the same call on an object found by name only,
    and a refused call changes nothing."""
    watermark = data.draw(st.sampled_from([0.0, 0.25]))
    # A pool small enough that the watermark (2 of 10 blocks) decides some fits.
    mgrs = [KVSlotsKVCacheManager(kv_cache_config=kcc(10), max_model_len=256, scheduler_block_size=BS,
                                  hash_block_size=BS, use_eagle=True, watermark=watermark) for _ in range(2)]
    reqs = [_Req("r", _all_token_ids=list(range(1, 21)), status=RequestStatus.RUNNING), _SlottedReq("r")]
    _extend(reqs[1], list(range(1, 21)))
    reqs[0].block_hashes = list(reqs[1].block_hashes)
    for m, r in zip(mgrs, reqs):
        assert m.allocate_slots(r, 20, num_lookahead_tokens=3) is not None
    assert isinstance(reqs[0]._kvslots_slot, int)

    def mostly(valid):  # junk a quarter of the time (one_of would flatten _junk's branches)
        return data.draw(valid if data.draw(st.integers(0, 3)) else _junk)

    fields = {
        "num_computed_tokens": mostly(st.integers(0, 40)),
        "_all_token_ids": mostly(st.just(list(range(1, 25)))),
        "block_hashes": mostly(st.one_of(st.just([b"a" * 32, b"b" * 32]), st.lists(_junk, max_size=3))),
        "status": data.draw(st.sampled_from([RequestStatus.RUNNING, RequestStatus.PREEMPTED, "junk"])),
    }
    for r in reqs:
        for k, v in fields.items():
            setattr(r, k, v)
    args = (mostly(st.integers(0, 140)),)
    kw = {"num_lookahead_tokens": mostly(st.integers(0, 8))}
    if data.draw(st.booleans()):
        kw["has_scheduled_reqs"] = mostly(st.booleans())
    before = [(m.num_free_blocks(), m.block_ids("r"), m.num_registered_blocks()) for m in mgrs]
    outcomes = []
    for m, r in zip(mgrs, reqs):
        try:
            got = m.allocate_slots(r, *args, **kw)
            outcomes.append(("ok", None if got is None else len(got.get_block_ids()[0])))
        except KVSlotsError as e:
            outcomes.append((type(e).__name__, str(e)))
            assert (m.num_free_blocks(), m.block_ids("r"), m.num_registered_blocks()) == before[0]
    assert outcomes[0] == outcomes[1]
    assert mgrs[0].block_ids("r") == mgrs[1].block_ids("r")
    assert mgrs[0].num_registered_blocks() == mgrs[1].num_registered_blocks()
    for m in mgrs:
        assert m.check_invariants() is None


@pytest.mark.parametrize("new", [4, 2**62, 2**63 - 1, 2**64 - 1])
@pytest.mark.parametrize("lookahead", [3, 2**63 - 1, 2**64 - 1])
@pytest.mark.parametrize("reserved", [None, 0, 2**64 - 1])
def test_huge_counts_answer_as_vllms_manager(new, lookahead, reserved):
    """Counts near 2**64 (sums past usize) are capped at max_model_len, as Python's ints are in
    vLLM's manager: the same fit and the same number of new blocks, never a wrapped sum."""
    answers = []
    for m in managers(300, use_eagle=True, max_model_len=256):
        kw = {} if reserved is None else {"reserved_blocks": reserved}
        got = m.allocate_slots(request("a", list(range(1, 40))), new, num_lookahead_tokens=lookahead, **kw)
        answers.append(None if got is None else len(got.get_block_ids()[0]))
    assert answers[0] == answers[1]


def test_importing_kvslots_vllm_does_not_import_vllm():
    code = ("import sys, kvslots.vllm as v; assert 'vllm' not in sys.modules, 'vllm imported'; "
            "assert 'KVSlotsScheduler' in v.__all__; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
