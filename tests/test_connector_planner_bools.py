"""ConnectorPlanner reads vLLM's integer fields as every integer argument of the bindings is read
(kvslots._core's one conversion): a bool is refused, as it is where the bindings take an int
(Python's ``isinstance(True, int)`` read it as 0/1 before), with a kvslots error and the planner
unchanged."""

from __future__ import annotations

import random
import types

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from kvslots import KVSlotsError
from kvslots._core import ConnectorPlanner

from planner_support import BS, Req


def _first(reqs):
    return types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in reqs}, preempted_req_ids=set(),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=(r.blocks[:-1],),
                                                  num_computed_tokens=0) for r in reqs],
        scheduled_cached_reqs=CachedRequestData.make_empty())


def _snapshot(p: ConnectorPlanner, rids):
    return (p.step, p.num_tracked, p.stats(), p.host_stats(), p.has_pending_work(), p.num_pending_events(),
            sorted(p.registered_hashes()), {r: p.device_blocks(r) for r in rids}, p.check_invariants())


def _planner():
    p = ConnectorPlanner(BS, 64, False, expected_workers=1, max_decode_tokens=4)
    p.events_wanted = True  # the stores read the token ids
    return p


def _request(n=4 * BS + 1):
    return Req(0, random.Random(7), n)


def _track_then_build(p, r):
    p.track(r)
    p.build(_first([r]))


@pytest.mark.parametrize("case", ["num_prompt_tokens", "lora_int_id"])
def test_a_bool_in_a_new_request_is_refused(case):
    p, r = _planner(), _request()
    before = _snapshot(p, [r.request_id])
    if case == "lora_int_id":
        r.lora_request = types.SimpleNamespace(lora_int_id=True, lora_name="a")
    else:
        r.num_prompt_tokens = True
    with pytest.raises(KVSlotsError, match="bool"):
        p.track(r)
    assert _snapshot(p, [r.request_id]) == before


def _running():
    """A planner with one request prefilled and running (its blocks stored)."""
    p, r = _planner(), _request()
    _track_then_build(p, r)
    p.complete(p.step, 1, None, 0)
    return p, r


def _cached(r, nb, computed, sched=1):
    return types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: sched}, preempted_req_ids=set(), scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.request_id], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
            new_block_ids=nb, num_computed_tokens=computed, num_output_tokens=[0]))


@pytest.mark.parametrize("case", ["num_scheduled_tokens", "num_computed_tokens", "new_block_ids",
                                  "a token id", "a block hash"])
def test_a_bool_in_a_step_is_refused(case):
    p, r = _running()
    before = _snapshot(p, [r.request_id])
    nc = r.num_computed_tokens
    if case == "a token id":
        r._all_token_ids[1] = True
    if case == "a block hash":
        r.block_hashes[0] = True
    out = {
        "num_scheduled_tokens": lambda: _cached(r, [([9001],)], [nc], sched=True),
        "num_computed_tokens": lambda: _cached(r, [([9001],)], [True]),
        "new_block_ids": lambda: _cached(r, [([True],)], [nc]),
    }.get(case, lambda: _cached(r, [([9001],)], [nc]))()
    with pytest.raises(KVSlotsError, match="bool|int"):
        p.build(out)
    assert _snapshot(p, [r.request_id]) == before
    # The control: the same step with ints is planned.
    q, r2 = _running()
    q.build(_cached(r2, [([9001],)], [nc]))
    assert q.device_blocks(r2.request_id)[-1] == 9001
