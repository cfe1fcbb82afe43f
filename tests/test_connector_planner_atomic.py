"""ConnectorPlanner.build is atomic: whatever Python code the scheduler output's items run while
they are read (an ``__index__``, ``__eq__`` or ``__hash__`` that raises, or that mutates the very
lists being read), a failed build raises a kvslots error and leaves the planner exactly as it was;
a later good build plans what it would have planned had the failed one never been called."""

from __future__ import annotations

import random
import types

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from kvslots import KVSlotsError
from kvslots._core import ConnectorPlanner

from planner_support import BS, Req


def _cached(ids, nb, computed, resumed=()):
    return CachedRequestData(req_ids=ids, resumed_req_ids=set(resumed), new_token_ids=[], all_token_ids={},
                             new_block_ids=nb, num_computed_tokens=computed, num_output_tokens=[0] * len(ids))


def _output(reqs, nb, preempted=(), new=(), sched=None, resumed=()):
    ids = [r.request_id for r in reqs]
    sched = sched if sched is not None else {i: 1 for i in ids}
    return types.SimpleNamespace(
        num_scheduled_tokens=sched, preempted_req_ids=set(preempted), scheduled_new_reqs=list(new),
        scheduled_cached_reqs=_cached(ids, nb, [r.num_computed_tokens for r in reqs], resumed))


def _snapshot(p: ConnectorPlanner, rids):
    return (p.step, p.num_tracked, p.stats(), p.host_stats(), p.has_pending_work(), p.num_pending_events(),
            p.num_held, p.num_cached, p.num_storing, sorted(p.registered_hashes()),
            {r: p.device_blocks(r) for r in rids}, p.check_invariants())


def _setup(seed: int):
    """Two twin planners, each with 3 requests prefilled and running: one gets the hostile
    builds, the other never sees them."""
    rng = random.Random(seed)
    reqs = [Req(i, rng, 4 * BS + 1) for i in range(3)]
    twins = [ConnectorPlanner(BS, 64, False, expected_workers=1, max_decode_tokens=4) for _ in range(2)]
    first = types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in reqs}, preempted_req_ids=set(),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=(r.blocks[:-1],),
                                                  num_computed_tokens=0) for r in reqs],
        scheduled_cached_reqs=CachedRequestData.make_empty())
    for p in twins:
        for r in reqs:
            p.track(r)
        p.build(first)
        p.complete(p.step, 1, None, 0)
    return twins, reqs


class Boom(Exception):
    pass


class Hostile:
    """An int-like whose ``__index__`` runs ``action`` (then returns ``value``)."""

    def __init__(self, value: int, action):
        self.value, self.action = value, action

    def __index__(self):
        self.action()
        return self.value


def _raise():
    raise Boom("hostile __index__")


class HostileStr(str):
    """A request id whose ``__eq__``/``__hash__`` raise once armed (a str subclass, so the planner
    finds it by value)."""

    armed = False

    def __hash__(self):
        if HostileStr.armed:
            raise Boom("hostile __hash__")
        return str.__hash__(self)

    def __eq__(self, other):
        if HostileStr.armed:
            raise Boom("hostile __eq__")
        return str.__eq__(self, other)


def _good_step(reqs):
    """Every request gets a new block; the first's 4th block is verified (a store)."""
    return [([r.blocks[-1]],) for r in reqs]


def _cases(reqs):
    """(name, hostile scheduler output) pairs, each failing only after an earlier request of
    the same step would have changed the planner."""
    good = _good_step(reqs)
    out = []
    # 1. The last request's new block id raises: the first two were appended already.
    nb = list(good)
    nb[2] = ([Hostile(reqs[2].blocks[-1], _raise)],)
    out.append(("index raises", _output(reqs, nb)))
    # 2. The last request's new block id empties the lists being read (then is a fine int).
    so = _output(reqs, list(good))
    cached = so.scheduled_cached_reqs

    def clear():
        cached.req_ids.clear()
        cached.new_block_ids.clear()
        cached.num_computed_tokens.clear()

    so.scheduled_cached_reqs.new_block_ids[2] = ([Hostile(reqs[2].blocks[-1], clear)],)
    out.append(("index mutates the lists", so))
    # 3. A store candidate whose block hash raises: the candidates before it were stored.
    for r in reqs:
        r.num_computed_tokens += BS  # a block filled: every request is a candidate
    out.append(("block hash raises", _output(reqs, list(good))))
    # 4. The same request listed twice.
    so = _output(reqs + [reqs[0]], list(good) + [None])
    out.append(("listed twice", so))
    # 5. A computed count that is not an int (a builtin TypeError inside).
    so = _output(reqs, list(good))
    so.scheduled_cached_reqs.num_computed_tokens[2] = "x"
    out.append(("computed count not an int", so))
    # 6. A resumed-set lookup whose __eq__ raises for the last request.
    hs = HostileStr(reqs[2].request_id)
    so = _output(reqs, list(good), resumed=[hs])
    so.scheduled_cached_reqs.req_ids[2] = hs
    out.append(("resumed __eq__ raises", so))
    for r in reqs:
        r.num_computed_tokens -= BS
    return out


@pytest.mark.parametrize("case", range(6))
def test_failed_build_leaves_the_planner_unchanged(case):
    (p, twin), reqs = _setup(case)
    rids = [r.request_id for r in reqs]
    name, so = _cases(reqs)[case]
    if name == "block hash raises":
        for r in reqs:
            r.num_computed_tokens += BS
        saved = reqs[2].block_hashes
        reqs[2].block_hashes = saved[:-1] + [object()]  # neither bytes nor int
    before = _snapshot(p, rids)
    HostileStr.armed = True
    try:
        with pytest.raises(KVSlotsError):
            p.build(so)
    finally:
        HostileStr.armed = False
    assert _snapshot(p, rids) == before, name
    if name == "block hash raises":
        reqs[2].block_hashes = saved
        for r in reqs:
            r.num_computed_tokens -= BS
    # The failed build had no effect: the next steps plan exactly what the twin's do.
    for step in range(3):
        for r in reqs:
            r.num_computed_tokens += BS
        nb = _good_step(reqs) if step == 0 else [None] * len(reqs)
        a = p.build(_output(reqs, nb))
        b = twin.build(_output(reqs, nb))
        assert a == b, (name, step)
        assert _snapshot(p, rids) == _snapshot(twin, rids), (name, step)
        for q in (p, twin):
            q.complete(q.step, 1, None, 0)


def test_builtin_errors_from_the_output_are_kvslots_errors_with_their_cause():
    (p, _), reqs = _setup(9)
    so = _output(reqs, _good_step(reqs))
    so.scheduled_cached_reqs.num_computed_tokens[1] = "x"
    with pytest.raises(KVSlotsError) as ei:
        p.build(so)
    # Read as every integer of the bindings is: the kvslots error itself, naming the field.
    assert isinstance(ei.value, TypeError) and "num_computed_tokens must be an int" in str(ei.value)
    nb = list(_good_step(reqs))
    nb[0] = ([Hostile(1, _raise)],)
    with pytest.raises(KVSlotsError) as ei:
        p.build(_output(reqs, nb))
    assert isinstance(ei.value.__cause__, Boom)


def test_preempted_and_resumed_in_one_step_matches_the_sequential_rules():
    """vLLM lists a request preempted between two schedule() calls (its preempted_req_ids
    accumulate) and resumed by the next one in the same output: read before anything changes,
    the step must plan what applying preemption then mirroring does."""
    (p, _), reqs = _setup(5)
    r = reqs[0]
    r.num_computed_tokens += BS
    p.build(_output(reqs, [None] * 3))
    p.complete(p.step, 1, None, 0)
    # Preempted (its blocks freed) and resumed with a new block table, in one output.
    r.blocks = [9000 + j for j in range(len(r.blocks))]
    so = _output(reqs, [(r.blocks,), None, None], preempted=[r.request_id], resumed=[r.request_id])
    p.build(so)
    assert p.device_blocks(r.request_id) == r.blocks
    assert p.check_invariants() is None


@pytest.mark.parametrize("bad", [3, [], "r0", None, types.SimpleNamespace(request_id=7),
                                 types.SimpleNamespace(request_id="z", num_prompt_tokens="x", lora_request=None)])
def test_request_taking_calls_raise_kvslots_errors_for_what_is_not_a_request(bad):
    (p, _), reqs = _setup(11)
    rids = [r.request_id for r in reqs]
    before = _snapshot(p, rids)
    for call in (lambda: p.track(bad), lambda: p.lookup(bad, 0), lambda: p.after_alloc(bad, [1, 2], 4)):
        with pytest.raises(KVSlotsError):
            call()
        assert _snapshot(p, rids) == before
    try:  # an id the planner does not track: nothing to finish
        assert p.finish(bad, [1, 2]) is False
    except KVSlotsError:
        pass
    assert _snapshot(p, rids) == before


class _RaisingHashes(Req):
    """A request whose ``block_hashes`` cannot be read."""

    @property
    def block_hashes(self):
        raise Boom("block_hashes")

    @block_hashes.setter
    def block_hashes(self, v):
        pass


def test_failed_lookup_or_after_alloc_does_not_track_the_request():
    """lookup tracked the request before reading its block hashes and tokens, and after_alloc
    tracked it before planning the load: a lookup whose request raised, or an after_alloc the
    planner refused, left a new request tracked (``num_tracked`` one higher, its id known) and
    a re-tracked one reset. Now both change nothing when they fail, and succeed as before."""
    (p, twin), reqs = _setup(21)
    rng = random.Random(21)
    rids = [r.request_id for r in reqs] + ["new", "hashes"]
    before = _snapshot(p, rids)
    bad = _RaisingHashes(7, rng, 4 * BS + 1)
    bad.request_id = "new"
    with pytest.raises(KVSlotsError) as e:
        p.lookup(bad, 0)
    assert isinstance(e.value.__cause__, Boom)
    assert _snapshot(p, rids) == before
    junk = Req(8, rng, 4 * BS + 1)
    junk.request_id = "hashes"
    junk.block_hashes = [1, 2, object(), 4]  # the third cannot be a hash
    with pytest.raises(KVSlotsError):
        p.lookup(junk, 0)
    assert _snapshot(p, rids) == before
    new = Req(9, rng, 4 * BS + 1)
    new.request_id = "new"
    with pytest.raises(KVSlotsError, match="external blocks asked"):
        p.after_alloc(new, new.blocks, 2 * BS)  # no lookup: nothing hit
    assert _snapshot(p, rids) == before
    # A known id under a new object (a new request reusing it) is not reset by a failed call.
    again = Req(0, rng, 4 * BS + 1)
    again.request_id = reqs[0].request_id
    with pytest.raises(KVSlotsError, match="external blocks asked"):
        p.after_alloc(again, again.blocks, 2 * BS)
    assert _snapshot(p, rids) == before
    # The same calls that succeed still track.
    assert p.lookup(new, 0) == 0
    p.after_alloc(new, new.blocks, 0)
    assert p.num_tracked == len(reqs) + 1 and p.device_blocks("new") == []
    assert p.check_invariants() is None


def test_failed_finish_leaves_the_request_tracked():
    """finish forgot the request even when reading it failed (a block_hashes that raises, a
    computed count that is not an int), then raised: the error came
    with the request gone. Now a failed finish changes nothing; a good one forgets it."""
    (p, _), reqs = _setup(22)
    rids = [r.request_id for r in reqs]
    r = reqs[0]
    r.num_computed_tokens += BS  # a block to store at finish
    before = _snapshot(p, rids)
    saved = r.block_hashes
    r.block_hashes = saved[:-1] + [object()]
    with pytest.raises(KVSlotsError):
        p.finish(r, r.blocks)
    assert _snapshot(p, rids) == before
    r.block_hashes = saved
    r.num_computed_tokens, nc = "x", r.num_computed_tokens
    with pytest.raises(KVSlotsError):
        p.finish(r, r.blocks)
    assert _snapshot(p, rids) == before
    r.num_computed_tokens = nc
    assert p.finish(r, r.blocks) is True
    assert p.num_tracked == len(reqs) - 1 and p.device_blocks(r.request_id) is None
    assert p.check_invariants() is None


def test_expected_workers_setter_refuses_zero_like_the_constructor():
    """ConnectorPlanner(..., expected_workers=0) is refused, but the setter silently took 0 as
    1: the call succeeded with another value than given. Now the same InvalidArgumentError."""
    p = ConnectorPlanner(BS, 8, False, expected_workers=2)
    with pytest.raises(KVSlotsError, match="expected_workers must be at least 1"):
        ConnectorPlanner(BS, 8, False, expected_workers=0)
    with pytest.raises(KVSlotsError, match="expected_workers must be at least 1"):
        p.expected_workers = 0
    assert p.expected_workers == 2
    p.expected_workers = 3
    assert p.expected_workers == 3
