"""ConnectorPlanner.build reads a decoding request's computed count only when it may have filled
a block (bounded by the step's largest scheduled count): the stores it plans must be exactly those
of reading every request every step."""

from __future__ import annotations

import random
import types

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from kvslots import KVSlotsError
from kvslots._core import ConnectorPlanner

from planner_support import BS, Req


def _output(reqs, sched, nb):
    ids = [r.request_id for r in reqs]
    cached = CachedRequestData(req_ids=ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                               new_block_ids=nb, num_computed_tokens=[r.num_computed_tokens for r in reqs],
                               num_output_tokens=[0] * len(reqs))
    return types.SimpleNamespace(num_scheduled_tokens=dict(zip(ids, sched)), preempted_req_ids=set(),
                                 scheduled_new_reqs=[], scheduled_cached_reqs=cached)


@pytest.mark.parametrize("seed,jump", [(0, 0.0), (1, 0.01), (2, 0.05), (3, 0.3)])
def test_stores_are_planned_in_the_first_step_a_block_is_verified(seed, jump):
    rng = random.Random(seed)
    p = ConnectorPlanner(BS, 10_000, False, expected_workers=1, max_decode_tokens=4)
    reqs = [Req(i, rng) for i in range(12)]
    for r in reqs:
        p.track(r)
    first = types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in reqs}, preempted_req_ids=set(),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=(list(r.blocks),),
                                                  num_computed_tokens=0) for r in reqs],
        scheduled_cached_reqs=CachedRequestData.make_empty())
    p.build(first)
    stored = {r.request_id: 0 for r in reqs}  # blocks stored so far
    owner = {b: (r.request_id, j) for r in reqs for j, b in enumerate(r.blocks)}
    for step in range(60):
        # This step's scheduled counts: 1 + drafts, now and then a long jump (a chunk).
        sched = [rng.choice((1, 2, 3, 4)) if rng.random() > jump else 11 for _ in reqs]
        nb = []
        for r in reqs:
            new = []
            while r.num_computed_tokens + 12 > len(r.blocks) * BS:
                b = r.blocks[-1] + 1
                r.blocks.append(b)
                owner[b] = (r.request_id, len(r.blocks) - 1)
                new.append(b)
            nb.append((new,) if new else None)
        _, dev, _, _ = p.build(_output(reqs, sched, nb))
        got = sorted(owner[b] for b in dev)
        want = sorted((r.request_id, j) for r in reqs
                      for j in range(stored[r.request_id], r.num_computed_tokens // BS))
        assert got == want, f"step {step}"
        for r in reqs:
            stored[r.request_id] = max(stored[r.request_id], r.num_computed_tokens // BS)
        if dev:
            p.complete(p.step, 1, None, 0)
        # The forward: each request verifies at most what it was scheduled.
        for r, s in zip(reqs, sched):
            a = rng.randrange(1, s + 1)
            r._all_token_ids.extend(rng.randrange(1, 1000) for _ in range(a))
            r.num_computed_tokens += a
            while len(r.block_hashes) < r.num_computed_tokens // BS:
                r.block_hashes.append(rng.getrandbits(63))
    assert sum(stored.values()) > 50


def test_drain_events_msgpack_empties_the_queue_and_hostile_scheduled_counts():
    rng = random.Random(0)
    p = ConnectorPlanner(BS, 100, False)
    r = Req(0, rng)
    p.track(r)
    assert p.drain_events_msgpack(0.0) == p.events_msgpack(0.0)
    p.clear()  # queues AllBlocksCleared
    payload = p.events_msgpack(1.0)
    assert p.num_pending_events() == 1
    # Bad arguments: a typed error, and the queue is still there.
    for args in [("x",), (None,), (1.0, "\udcff"), (1.0, "CPU", 2**80), (1.0, 7), (1.0, "CPU", "0")]:
        with pytest.raises(KVSlotsError):
            p.drain_events_msgpack(*args)
        assert p.num_pending_events() == 1
    assert p.drain_events_msgpack(1.0) == payload and p.num_pending_events() == 0
    assert p.discard_registered() == 0  # no disk tier: nothing recorded, nothing to drop
    so = _output([r], ["x"], [None])
    with pytest.raises(KVSlotsError):
        p.build(so)
    so = _output([r], [-3], [None])
    with pytest.raises(KVSlotsError):
        p.build(so)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_request_ids_found_by_position_stay_exact_under_reorder_finish_and_new_id_objects(seed):
    """build finds a cached request by the index it had last step (checked against the id object
    it holds): the blocks vLLM adds must land on the right request whatever the list does."""
    rng = random.Random(seed)
    p = ConnectorPlanner(BS, 1000, False, expected_workers=1, max_decode_tokens=4)
    live: dict[str, Req] = {}
    table: dict[str, list[int]] = {}
    next_id, next_block = 0, 10**6

    def admit():
        nonlocal next_id
        r = Req(next_id, rng)
        next_id += 1
        p.track(r)
        p.build(types.SimpleNamespace(
            num_scheduled_tokens={r.request_id: 1}, preempted_req_ids=set(),
            scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=(list(r.blocks),),
                                                      num_computed_tokens=0)],
            scheduled_cached_reqs=CachedRequestData.make_empty()))
        live[r.request_id], table[r.request_id] = r, list(r.blocks)

    for _ in range(8):
        admit()
    order = list(live)
    for step in range(80):
        ev = rng.random()
        if ev < 0.15 and len(order) > 2:  # one finishes; a new one takes its place in the list
            i = rng.randrange(len(order))
            rid = order[i]
            p.finish(live.pop(rid), table.pop(rid))
            admit()
            order[i] = next(reversed(live))
        elif ev < 0.3:
            rng.shuffle(order)
        elif ev < 0.4:  # equal ids, new string objects (vLLM may rebuild the list's strings)
            order = ["".join(list(rid)) for rid in order]
        ids = list(order)
        nb = []
        for rid in ids:
            if rng.random() < 0.4:
                new = [next_block, next_block + 1][: rng.randrange(1, 3)]
                next_block += len(new)
                table[rid].extend(new)
                nb.append((new,))
            else:
                nb.append(None)
        reqs = [live[r] for r in ids]
        so = _output(reqs, [1] * len(reqs), nb)
        so.scheduled_cached_reqs.req_ids = ids  # these exact string objects
        p.build(so)
        for rid in live:
            assert p.device_blocks(rid) == table[rid], (step, rid)
