"""The bindings' one integer conversion reads an exact int that fits an i64 with one C call
(PyLong_AsLongLong) before any type check; under abi3 the 128-bit read (a Python ``>>`` call per
int) made a planner step with vLLM's new block ids as lists 2-2.7x slower than before a040af3.
Here: the rules the fast path must keep (a bool refused, a value out of range, an int subclass
read by its value, an int past 64 bits). Its speed is a benchmark's to show, not a timed test's
(5f84888's message has the figures)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
from vllm.v1.core.sched.output import CachedRequestData

from kvslots import ArgumentTypeError, InvalidArgumentError, KVSlotsError
from kvslots._core import ConnectorPlanner

from planner_support import Req

N, NB = 8, 512


def _step(new_block_ids, n=N):
    """A planner after a first step, and a function running a cached step giving each request
    `new_block_ids(i)` as its new blocks."""
    p = ConnectorPlanner(4, 1 << 16, False, expected_workers=1, max_decode_tokens=4)
    rs = [Req(i, random.Random(i), 9) for i in range(n)]
    for r in rs:
        p.track(r)
    p.build(types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in rs}, preempted_req_ids=set(),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=(r.blocks[:-1],),
                                                  num_computed_tokens=0) for r in rs],
        scheduled_cached_reqs=CachedRequestData.make_empty()))
    p.complete(p.step, 1, None, 0)
    out = types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: 1 for r in rs}, preempted_req_ids=set(), scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.request_id for r in rs], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
            new_block_ids=[(new_block_ids(i),) for i in range(n)],
            num_computed_tokens=[r.num_computed_tokens for r in rs], num_output_tokens=[0] * n))

    def step():
        p.build(out)
        p.complete(p.step, 1, None, 0)
    return p, rs, step


def _ids(i):
    return [k * 10**5 + i for k in range(1, NB + 1)]


class Odd(int):
    def __rshift__(self, other):  # must never be called: the value is read, not this
        return 0


@pytest.mark.parametrize("bad, err, msg", [
    (True, ArgumentTypeError, "bool"),
    (-1, InvalidArgumentError, ">= 0"),
    (2**32, InvalidArgumentError, "out of range"),
    (2**63, InvalidArgumentError, "out of range"),
    (2**70, InvalidArgumentError, "out of range"),
    (1.0, ArgumentTypeError, "must be an int"),
])
def test_a_bad_new_block_id_is_refused_and_changes_nothing(bad, err, msg):
    p, rs, step = _step(lambda i: [5000 + i, bad] if i == 3 else [5000 + i], n=4)
    before = (p.step, p.stats(), {r.request_id: p.device_blocks(r.request_id) for r in rs})
    with pytest.raises(err, match=msg):
        step()
    assert (p.step, p.stats(), {r.request_id: p.device_blocks(r.request_id) for r in rs}) == before


def test_int_subclass_and_numpy_ids_are_read_by_value():
    p, rs, step = _step(lambda i: [Odd(7000 + i), np.int64(8000 + i), 9000 + i], n=2)
    step()
    for i, r in enumerate(rs):
        assert p.device_blocks(r.request_id)[-3:] == [7000 + i, 8000 + i, 9000 + i]


@pytest.mark.parametrize("v", [2**63 - 1, 2**63, 2**64 - 1, -1, 2**64, -2**63])
def test_u64_arguments_past_i64(v):
    # block_hash's parent is a u64: past an i64 the wide path reads it, exactly.
    from kvslots._core import block_hash
    if 0 <= v < 2**64:
        assert block_hash(v, [1]) == block_hash(Odd(v), [1]) == block_hash(np.uint64(v), [1])
        assert block_hash(v, [1]) != block_hash(v ^ 1, [1])
    else:
        with pytest.raises(InvalidArgumentError, match="parent"):
            block_hash(v, [1])
