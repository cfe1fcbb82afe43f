"""Scheduler mode's KV cache manager against vLLM's on schedules vLLM's scheduler makes only
rarely (or a buggy caller would): a request freed twice or never allocated, freed while its
blocks load (delay_cache_blocks), preempted mid-lookahead, a prompt of exactly whole blocks,
a lookahead larger than the pool, an allocation after reset_prefix_cache, token ids past any
vocabulary. Where vLLM's manager answers, kvslots answers the same; where kvslots refuses a
call vLLM takes (a stale or foreign prefix hit, a double release of popped blocks) it raises a
kvslots error and nothing changes."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvslots.errors import InvalidArgumentError  # noqa: E402

from test_scheduler_mode_manager import managers, request  # noqa: E402


def shape(blocks):
    return None if blocks is None else [len(ids) for ids in blocks.get_block_ids()]


def admit(m, req, **kw):
    hit_blocks, hit, _ = m.get_computed_blocks(req)
    got = m.allocate_slots(req, req.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=hit_blocks,
                           **kw)
    if got is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, shape(got)


def free_twice(m):
    r = request("a", range(1, 40))
    out = admit(m, r)
    m.free(r)
    m.free(r)
    m.free(request("never", range(1, 40)))
    return out


def whole_blocks(m):
    r = request("a", range(1, 33))
    first = admit(m, r)
    m.free(r)
    return first, admit(m, request("b", range(1, 33)))


def lookahead_past_the_pool(m):
    return [admit(m, request(f"r{n}", range(1, 40)), num_lookahead_tokens=n) for n in (10_000, 2**63)]


def preempted_mid_lookahead(m):
    r = request("a", range(1, 30))
    admit(m, r, num_lookahead_tokens=4)
    r.append_output_token_ids([5, 6])
    step = shape(m.allocate_slots(r, 5, num_lookahead_tokens=4))
    r.num_computed_tokens += 2
    m.free(r)
    r.status, r.num_computed_tokens = RequestStatus.PREEMPTED, 0
    return step, admit(m, r, num_lookahead_tokens=4)


def after_reset(m):
    r = request("a", range(1, 40))
    admit(m, r)
    held = m.reset_prefix_cache()  # refused: a's blocks are held
    m.free(r)
    return held, m.reset_prefix_cache(), admit(m, request("b", range(1, 40)))


def freed_while_loading(m):
    r = request("a", range(1, 60))
    got = m.allocate_slots(r, 0, num_external_computed_tokens=32, delay_cache_blocks=True)
    r.num_computed_tokens = 32
    m.free(r)  # aborted before its load ended
    return shape(got), admit(m, request("b", range(1, 60)))


def huge_token_ids(m):
    out = []
    for i, tok in enumerate((2**31, 2**63, 2**64, -1)):
        r = request(f"a{i}", [tok] * 40)
        out.append(admit(m, r))
        r.append_output_token_ids(tok)
        out.append(shape(m.allocate_slots(r, 1)))
        m.free(r)
        out.append(admit(m, request(f"b{i}", [tok] * 40)))
    return out


@pytest.mark.parametrize("use_eagle", [False, True])
@pytest.mark.parametrize("schedule", [free_twice, whole_blocks, lookahead_past_the_pool, preempted_mid_lookahead,
                                      after_reset, freed_while_loading, huge_token_ids])
def test_odd_schedules_answer_as_vllms_manager(schedule, use_eagle):
    v, k = managers(20, use_eagle=use_eagle)
    assert schedule(k) == schedule(v)
    assert k.block_pool.get_num_free_blocks() == v.block_pool.get_num_free_blocks()
    assert k.usage == v.usage
    assert [type(e).__name__ for e in k.take_events()] == [type(e).__name__ for e in v.take_events()]
    k.check()


def stale_hit(m, how):
    r = request("a", range(1, 40))
    admit(m, r)
    m.free(r)
    late = request("b", range(1, 40))
    hit_blocks, hit, _ = m.get_computed_blocks(late)
    if how == "reset":
        assert m.reset_prefix_cache()
    else:  # another request takes the whole pool, evicting the hit
        admit(m, request("c", range(1000, 1000 + 16 * 18)))
    return late, hit_blocks, hit


@pytest.mark.parametrize("how", ["reset", "evicted"])
def test_a_prefix_hit_gone_before_its_allocation_is_refused_changing_nothing(how):
    # vLLM's manager takes the stale blocks as the request's prefix (after a reset: blocks that
    # no longer hold it); kvslots refuses, and the pool is as it was.
    _, k = managers(20, use_eagle=False)
    late, hit_blocks, hit = stale_hit(k, how)
    before = (k.block_pool.get_num_free_blocks(), k.num_held_blocks(), k.block_ids("b"))
    with pytest.raises(InvalidArgumentError, match="no longer cached"):
        k.allocate_slots(late, late.num_tokens - hit, num_new_computed_tokens=hit, new_computed_blocks=hit_blocks)
    assert (k.block_pool.get_num_free_blocks(), k.num_held_blocks(), k.block_ids("b")) == before
    k.check()


def test_blocks_popped_for_free_and_released_twice_are_refused_the_second_time():
    _, k = managers(20, use_eagle=False)
    r = request("a", range(1, 40))
    admit(k, r)
    popped = list(k.pop_blocks_for_free(r))
    k.block_pool.free_blocks(popped)
    free = k.block_pool.get_num_free_blocks()
    with pytest.raises(InvalidArgumentError, match="released"):
        k.block_pool.free_blocks(popped)
    assert k.block_pool.get_num_free_blocks() == free == 19
    k.check()
