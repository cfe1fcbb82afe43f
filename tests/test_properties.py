"""Property tests: the Rust SlotManager and the pure-Python reference run side by side under
random schedules (hypothesis stateful testing), and every invariant of DESIGN.md is checked
after every operation."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvslots
from kvslots.slots.reference import ReferenceSlotManager, block_hash

# CI runs at least 2,000 generated cases (KVSLOTS_HYPOTHESIS_EXAMPLES overrides).
EXAMPLES = int(os.environ.get("KVSLOTS_HYPOTHESIS_EXAMPLES", "2000"))

BLOCK_SIZE = 4
VOCAB = 6  # small, so different requests share blocks by chance too
SHARED_PREFIXES = [[1, 2, 3, 4, 5, 0, 1, 2], [5, 5, 5, 5, 4, 4, 4, 4, 3, 3]]


class _Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


class _OddInt(int):
    """An int subclass whose operators lie: only its value counts."""

    def __rshift__(self, n):
        return 0

    def __index__(self):
        raise ZeroDivisionError("boom")


def _mutating_list():
    """A list whose items' __index__ grow and then empty it while it is read."""
    lst: list = []

    class Grow:
        def __index__(self):
            lst.append(3)
            return 1

    class Clear:
        def __index__(self):
            lst.clear()
            return 2

    lst.extend([1, Grow(), 2, Clear(), 4])
    return lst


# Factories (each side gets fresh objects: generators are used up, lists mutated).
HOSTILE_INTS = [lambda: 0, lambda: 1, lambda: 3, lambda: -1, lambda: 2**32, lambda: 2**64, lambda: 2**64 - 1,
                lambda: True, lambda: 1.0, lambda: float("nan"), lambda: "1", lambda: None, lambda: _Index(2),
                lambda: _Index(-1), lambda: _OddInt(-1), lambda: _OddInt(2), lambda: np.int64(2), lambda: np.bool_(True)]
HOSTILE_SEQS = [lambda: [], lambda: [1, 2], lambda: [0, 1, 2, 3, 4], lambda: (1, 2), lambda: (x for x in [1, 2, 3]),
                lambda: range(3), lambda: _LyingList([4, 4]), lambda: "ab", lambda: b"\x01", lambda: [2**32],
                lambda: [-1], lambda: [True], lambda: [None], lambda: np.array([1.5]), lambda: np.array([[1]]),
                lambda: np.array([1, 2], dtype=np.uint8), lambda: np.array([3, 1], dtype=">i4"), lambda: None,
                lambda: _mutating_list(), lambda: [_OddInt(1), _OddInt(2**32)]]
HOSTILE_CALLS = {"create": "rsi", "reserve": "ri", "commit": "rs", "rollback": "ri", "set_lookahead": "ri",
                 "finish": "r", "step": "sssss", "evict": "i", "lookup": "i", "refcount": "i", "registered_hash": "i",
                 "slot_id": "r", "block_table": "r", "committed_tokens": "r", "__contains__": "r"}


def _raw(events):
    """Normalises raw events (tuples of lists) from either side for comparison."""
    return [tuple(tuple(x) if isinstance(x, list) else x for x in ev) for ev in events]


class SlotMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 48), caching=st.booleans(), limit=st.sampled_from([None, 40, 200]))
    def setup(self, num_blocks, caching, limit):
        kw = dict(enable_prefix_caching=caching, max_tokens_per_slot=limit, hash_seed=7)
        self.rust = kvslots.SlotManager(num_blocks, BLOCK_SIZE, **kw)
        self.ref = ReferenceSlotManager(num_blocks, BLOCK_SIZE, **kw)
        self.n = num_blocks
        self.counter = 0
        self.replayed: set[int] = set()  # the registry as rebuilt from the event stream

    # ---- helpers ----
    def both(self, name, *args, **kwargs):
        """Calls the same method on both; they must return the same or raise the same type."""
        results = []
        for impl in (self.rust, self.ref):
            try:
                results.append(("ok", getattr(impl, name)(*args, **kwargs)))
            except kvslots.SlotError as e:
                results.append(("err", type(e).__name__, e.request_id))
        r, p = results
        if r[0] == "ok" and p[0] == "ok":
            rv, pv = r[1], p[1]
            if name == "step":
                rv = tuple(list(map(int, a)) for a in rv)
                pv = tuple(pv)
            assert rv == pv, (name, args, rv, pv)
        else:
            assert r == p, (name, args, r, p)
        return r

    def live(self):
        return sorted(self.rust.request_ids())

    def assert_unchanged_after_error(self, outcome, before):
        if outcome[0] == "err":
            assert self.snapshot() == before, "a failing call changed the manager"

    def snapshot(self):
        m = self.rust
        slots = {r: (m.block_table(r), m.slot_info(r), m.committed_tokens(r)) for r in self.live()}
        return (slots, m.num_free, m.num_held, m.num_cached, m.registered_hashes(), m.cached_blocks(),
                m.stats(), m.num_pending_events())

    # ---- rules ----
    @rule(shared=st.integers(0, len(SHARED_PREFIXES)), tail=st.lists(st.integers(0, VOCAB - 1), max_size=14),
          k=st.integers(0, 5), match=st.booleans(), lora=st.sampled_from([None, None, 3]))
    def create(self, shared, tail, k, match, lora):
        prompt = (SHARED_PREFIXES[shared - 1] if shared else []) + tail
        rid = f"r{self.counter}"
        self.counter += 1
        self.both("create", rid, prompt, lookahead=k, match_prefix=match, lora_id=lora)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data(), new=st.integers(0, 12))
    def reserve(self, data, new):
        rid = data.draw(st.sampled_from(self.live()))
        before = self.snapshot()
        self.assert_unchanged_after_error(self.both("reserve", rid, new), before)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        pending = self.rust.slot_info(rid).pending
        n = data.draw(st.integers(0, pending + 1))  # sometimes one too many
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        before = self.snapshot()
        self.assert_unchanged_after_error(self.both("commit", rid, tokens), before)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data())
    def rollback(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        pending = self.rust.slot_info(rid).pending
        n = data.draw(st.integers(0, pending + 2))
        before = self.snapshot()
        self.assert_unchanged_after_error(self.both("rollback", rid, n), before)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data(), k=st.integers(0, 6))
    def set_lookahead(self, data, k):
        rid = data.draw(st.sampled_from(self.live()))
        self.both("set_lookahead", rid, k)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data(), use_lookahead=st.booleans())
    def step(self, data, use_lookahead):
        rids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=6, unique=True))
        ids, acc, toks, rej, new, look = [], [], [], [], [], []
        for rid in rids:
            pending = self.rust.slot_info(rid).pending
            a = data.draw(st.integers(0, pending))
            r = data.draw(st.integers(0, pending - a))
            k = data.draw(st.integers(0, 5))
            ids.append(self.rust.slot_id(rid))
            acc.append(a)
            toks += data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=a, max_size=a))
            rej.append(r)
            new.append(data.draw(st.integers(0, 1 + k)))
            look.append(k)
        before = self.snapshot()
        outcome = self.both("step", ids, acc, toks, rej, new, look if use_lookahead else None)
        self.assert_unchanged_after_error(outcome, before)

    @precondition(lambda self: len(self.rust) > 0)
    @rule(data=st.data())
    def finish(self, data):
        self.both("finish", data.draw(st.sampled_from(self.live())))

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        self.both("evict", n)

    @rule()
    def clear_cache(self):
        self.both("clear_cache")

    # ---- any arguments (wrong types, out of range, subclasses, generators, lists changing while
    # read): the same outcome on both sides, and a failed call changes nothing ----
    @rule(name=st.sampled_from(sorted(HOSTILE_CALLS)), data=st.data())
    def hostile_call(self, name, data):
        ids = [lambda r=r: r for r in self.live()[:2] + ["nope", "\ud800", b"r0", 5, f"h{self.counter}"]]
        ids += [lambda r=r: _OddStr(r) for r in self.live()[:1]]  # a fresh subclass object per side
        makers = [data.draw(st.sampled_from({"r": ids, "i": HOSTILE_INTS, "s": HOSTILE_SEQS}[kind]))
                  for kind in HOSTILE_CALLS[name]]
        self.counter += name == "create"
        before = self.snapshot()
        results = []
        for impl in (self.rust, self.ref):
            try:
                args = [mk() for mk in makers]
                kw = {"lookahead": args.pop()} if name == "create" else {}
                v = getattr(impl, name)(*args, **kw)
                results.append(("ok", tuple(list(map(int, a)) for a in v) if name == "step" else v))
            except kvslots.KVSlotsError as e:
                results.append(("err", type(e).__name__))
        assert results[0] == results[1], (name, [mk() for mk in makers], results)
        if results[0][0] == "err":
            assert self.snapshot() == before, "a failing call changed the manager"

    # ---- bad input: typed error, state unchanged, same on both sides ----
    @rule(which=st.sampled_from(["unknown", "negative", "token", "duplicate", "stale", "twice", "lengths"]))
    def bad_input(self, which):
        before = self.snapshot()
        live = self.live()
        if which == "unknown":
            out = self.both("reserve", "no-such-request", 1)
            assert out[1] == "UnknownRequestError"
        elif which == "negative" and live:
            out = self.both("rollback", live[0], -1)
            assert out[1] == "InvalidArgumentError"
        elif which == "token" and live:
            out = self.both("commit", live[0], [2**32])
            assert out[1] == "InvalidArgumentError"
        elif which == "duplicate" and live:
            out = self.both("create", live[0], [1, 2])
            assert out[1] == "DuplicateRequestError"
        elif which == "stale":
            out = self.both("step", [(5 << 32) | 999], [0], [], [0], [1])
            assert out[1] == "InvalidArgumentError"
        elif which == "twice" and live:
            sid = self.rust.slot_id(live[0])
            out = self.both("step", [sid, sid], [0, 0], [], [0, 0], [0, 0])
            assert out[1] == "InvalidArgumentError"
        elif which == "lengths" and live:
            out = self.both("step", [self.rust.slot_id(live[0])], [0, 0], [], [0], [1])
            assert out[1] == "InvalidArgumentError"
        else:
            return
        assert self.snapshot() == before

    # ---- invariants, after every step ----
    @invariant()
    def same_observable_state(self):
        r, p = self.rust, self.ref
        assert sorted(r.request_ids()) == sorted(p.request_ids())
        for rid in self.live():
            assert r.block_table(rid) == p.block_table(rid)
            ri, pi = r.slot_info(rid), p.slot_info(rid)
            assert (ri.committed, ri.pending, ri.lookahead, ri.reserved_lookahead, ri.num_blocks,
                    ri.num_immutable, ri.capacity) == tuple(pi.__dict__.values())
            assert r.committed_tokens(rid) == p.committed_tokens(rid)
            assert r.block_hashes(rid) == p.block_hashes(rid)
            assert r.slot_id(rid) == p.slot_id(rid)
        assert (r.num_free, r.num_held, r.num_cached) == (p.num_free, p.num_held, p.num_cached)
        assert r.registered_hashes() == p.registered_hashes()
        assert r.cached_blocks() == p.cached_blocks()
        assert r.stats() == p.stats()
        assert [r.refcount(b) for b in range(self.n)] == [p.refcount(b) for b in range(self.n)]

    @invariant()
    def design_invariants(self):
        m, bs = self.rust, BLOCK_SIZE
        assert m.num_free + m.num_held + m.num_cached == self.n
        holders = [0] * self.n
        for rid in self.live():
            table = m.block_table(rid)
            info = m.slot_info(rid)
            for b in table:
                holders[b] += 1
            assert info.capacity >= info.committed + info.pending + info.reserved_lookahead
            tokens = m.committed_tokens(rid)
            hashes = m.block_hashes(rid)
            assert len(hashes) == info.committed // bs
            parent = m.hash_seed
            for i, h in enumerate(hashes):
                parent = block_hash(parent, tokens[i * bs:(i + 1) * bs], self.lora_of(rid))
                assert h == parent, "immutable block hash differs from its committed tokens"
            for i, b in enumerate(table):
                if m.registered_hash(b) is not None:
                    # Registered => full of committed (verified) tokens, with that hash.
                    assert i < info.committed // bs
                    assert m.registered_hash(b) == hashes[i]
        assert [m.refcount(b) for b in range(self.n)] == holders
        for b in m.cached_blocks():
            assert m.refcount(b) == 0 and m.registered_hash(b) is not None
        assert m.check_invariants() is None, m.check_invariants()

    @invariant()
    def events_replay_to_registry(self):
        rust_events = self.rust.drain_raw_events()
        assert _raw(rust_events) == _raw(self.ref.drain_raw_events())
        for ev in rust_events:
            if ev[0] == "BlockStored":
                _, hashes, parent, tokens, bs, lora = ev
                prev = self.rust.hash_seed if parent is None else parent
                for i, h in enumerate(hashes):
                    prev = block_hash(prev, tokens[i * bs:(i + 1) * bs], lora)
                    assert prev == h, "BlockStored hash is not the hash of its tokens"
                    assert h not in self.replayed
                    self.replayed.add(h)
            elif ev[0] == "BlockRemoved":
                for h in ev[1]:
                    self.replayed.remove(h)
            else:
                self.replayed.clear()
        assert sorted(self.replayed) == self.rust.registered_hashes()

    def lora_of(self, rid):
        # The reference keeps the slot's lora id; use it to recompute hashes independently.
        return self.ref._slots[rid].lora_id


SlotMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSlotMachine = SlotMachine.TestCase


class _OddStr(str):
    def __hash__(self):
        return 12345

    def __eq__(self, other):
        return False


class _LyingList(list):
    def __iter__(self):
        return iter([1])

    def __len__(self):
        return 99


def test_reference_reads_subclassed_arguments_as_the_extension_does():
    """The extension reads a str subclass by its text and a list subclass in place; the
    reference used the subclass's own __hash__/__eq__ (UnknownRequestError where the extension
    found the request) and __iter__ (other tokens than the extension's)."""
    def run(m):
        m.create("r", [1, 2, 3])
        m.reserve("r", 4)
        out = [m.commit(_OddStr("r"), _LyingList([4, 4, 4])), m.committed_tokens("r"), m.slot_id(_OddStr("r")),
               _OddStr("r") in m]
        m.finish(_OddStr("r"))
        return out, m.request_ids(), m.stats()

    rust = run(kvslots.SlotManager(8, BLOCK_SIZE))
    assert rust == run(ReferenceSlotManager(8, BLOCK_SIZE))
    assert rust[0][1] == [4, 4, 4]
