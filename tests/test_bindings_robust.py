"""Every public call of the extension, with arguments of every type and value: the only outcomes
are success or a kvslots exception (``KVSlotsError``) with the object's state exactly as before.
Also re-entrant arguments (``__index__`` / ``__iter__`` calling back into the same object) and
concurrent use from several threads: no builtin exception, no "Already borrowed", no deadlock,
no corruption.

``KVSLOTS_HYPOTHESIS_EXAMPLES`` sets the number of generated cases per test (default 300).
"""

from __future__ import annotations

import os
import threading

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import kvslots
from kvslots import _core
from kvslots.errors import ArgumentTypeError, ConcurrentUseError, InvalidArgumentError, KVSlotsError

EXAMPLES = int(os.environ.get("KVSLOTS_HYPOTHESIS_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


class Index:
    """An object with ``__index__`` (like a numpy integer)."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v

    def __repr__(self):
        return f"Index({self.v})"


class Raising:
    def __index__(self):
        raise ZeroDivisionError("boom")

    def __iter__(self):
        raise ZeroDivisionError("boom")


SPECIAL_INTS = [0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                2**100, -1, -(2**63), -(2**64)]


def _arrays():
    base = st.lists(st.integers(0, 40), max_size=6)
    return st.one_of(
        base.map(lambda v: np.array(v, dtype=np.int64)),
        base.map(lambda v: np.array(v, dtype=np.uint32)),
        base.map(lambda v: np.array(v, dtype=np.int8)),
        base.map(lambda v: np.array(v, dtype=np.uint64)),
        base.map(lambda v: np.array(v + v, dtype=np.int32)[::2]),  # non-contiguous
        base.map(lambda v: np.array(v, dtype=np.float64)),
        base.map(lambda v: np.array(v, dtype=bool)),
        base.map(lambda v: np.array(v, dtype=object)),
        base.map(lambda v: np.array([v, v], dtype=np.int64)),  # 2-D
        base.map(lambda v: np.array(v, dtype=">i4")),  # non-native byte order
        st.just(np.array(5)),  # 0-d
        st.just(np.array([-1, 2**40], dtype=np.int64)),
    )


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(SPECIAL_INTS),
    st.integers(-5, 50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), 1.0, -0.0, 2.0**64]),
    st.sampled_from(["a", "b", "", "x" * 300, "\ud800", "a\udfffb", "é", "GPU", "cpu"]),
    st.binary(max_size=8),
    st.sampled_from([Index(1), Index(-1), Index(2**64), Raising(), object(), np.int64(3), np.uint32(2),
                     np.float32(1.0), np.bool_(True), {"a": 1}, {1, 2}]),
)
SEQS = st.one_of(
    st.lists(st.integers(0, 40), max_size=10),
    st.lists(st.sampled_from(SPECIAL_INTS), max_size=4),
    st.lists(st.one_of(st.integers(0, 9), st.booleans(), st.floats(), st.text(max_size=2), st.none()), max_size=4),
    st.lists(st.integers(0, 9), max_size=4).map(tuple),
    st.lists(st.integers(0, 9), max_size=4).map(lambda v: (x for x in v)),
    _arrays(),
    st.sampled_from([[Index(2)], [Raising()], Raising(), "abc", b"\x01\x02", range(3), [[1, 2]]]),
)
ANY = st.one_of(SCALARS, SEQS)


def _call(obj, name, args, kwargs, snapshot, check=None):
    before = snapshot()
    try:
        getattr(obj, name)(*args, **kwargs)
    except KVSlotsError as e:
        assert not isinstance(e, ConcurrentUseError), (name, args, kwargs, e)
        after = snapshot()
        assert after == before, (name, args, kwargs, e)
    except BaseException as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{name}{args!r} {kwargs!r} raised {type(e).__name__}: {e}")
    if check is not None:
        assert check() is None, (name, args, kwargs, check())


# ---- SlotManager ----


def _manager():
    m = kvslots.SlotManager(16, 4, hash_seed=7)
    m.create("a", [1, 2, 3, 4, 5, 6], lookahead=2)
    m.reserve("a", 6)
    m.commit("a", [1, 2, 3, 4, 5])
    m.create("b", [1, 2, 3, 4, 9])
    return m


def _manager_state(m):
    ids = sorted(m.request_ids())
    per = [(r, m.slot_info(r), m.block_table(r), m.committed_tokens(r), m.block_hashes(r)) for r in ids]
    return (per, m.stats(), m.num_free, m.num_held, m.num_cached, m.cached_blocks(), m.registered_hashes(),
            m.num_pending_events(), bytes(m.events_msgpack(0.0)))


MANAGER_CALLS = {
    "create": 2, "slot_id": 1, "reserve": 2, "commit": 2, "rollback": 2, "set_lookahead": 2, "finish": 1,
    "evict": 1, "step": 5, "block_table": 1, "slot_info": 1, "committed_tokens": 1, "block_hashes": 1,
    "lookup": 1, "registered_hash": 1, "refcount": 1, "events_msgpack": 1, "__contains__": 1,
}
MANAGER_KWARGS = {
    "create": ["lookahead", "match_prefix", "lora_id"],
    "step": ["lookahead"],
    "events_msgpack": ["medium", "data_parallel_rank", "hashes_as_bytes"],
}


def _args(data, n, valid):
    return [data.draw(st.one_of(st.sampled_from(valid), ANY)) for _ in range(n)]


@SETTINGS
@given(data=st.data())
def test_slot_manager_any_arguments(data):
    m = _manager()
    valid = ["a", "b", "c", 0, 1, 2, [1, 2], [0], m.slot_id("a"), [m.slot_id("a")], 0.5]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(MANAGER_CALLS)))
        args = _args(data, MANAGER_CALLS[name], valid)
        kw = {k: data.draw(ANY) for k in MANAGER_KWARGS.get(name, []) if data.draw(st.booleans())}
        _call(m, name, args, kw, lambda: _manager_state(m), m.check_invariants)


@SETTINGS
@given(args=st.lists(ANY, min_size=2, max_size=2), kw=st.dictionaries(
    st.sampled_from(["hash_seed", "enable_prefix_caching", "max_tokens_per_slot"]), ANY))
def test_constructors_any_arguments(args, kw):
    for make in (kvslots.SlotManager, _core.SlotManager, _core.HostCache):
        try:
            make(*args, **(kw if make is not _core.HostCache else {}))
        except KVSlotsError:
            pass
    try:
        _core.SlotTracker(args[0], **({"hash_seed": kw["hash_seed"]} if "hash_seed" in kw else {}))
    except KVSlotsError:
        pass
    try:
        _core.PrefixIndex(capacity=args[0], tier_weights=args[1], hash_seed=kw.get("hash_seed", 0))
    except KVSlotsError:
        pass


# ---- SlotTracker ----

TRACKER_CALLS = {"add": 1, "blocks_needed": 2, "reserve": 3, "commit": 2, "rollback": 2, "set_lookahead": 2,
                 "finish": 1, "slot_info": 1, "block_table": 1, "block_hashes": 1}


def _tracker():
    t = _core.SlotTracker(4)
    t.add("a", lookahead=1)
    t.reserve("a", 6, [10, 11])
    t.commit("a", [1, 2, 3, 4, 5])
    return t


def _tracker_state(t):
    out = [len(t)]
    for r in ("a", "b", "c", ""):
        try:
            out.append((r, t.slot_info(r), t.block_table(r), t.block_hashes(r)))
        except KVSlotsError:
            out.append(r)
    return out


@SETTINGS
@given(data=st.data())
def test_slot_tracker_any_arguments(data):
    t = _tracker()
    valid = ["a", "b", 0, 1, 2, [1, 2], [7]]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(TRACKER_CALLS)))
        args = _args(data, TRACKER_CALLS[name], valid)
        kw = {}
        if name == "add" and data.draw(st.booleans()):
            kw = {"lookahead": data.draw(ANY), "lora_id": data.draw(ANY)}
        if name == "commit" and data.draw(st.booleans()):
            kw = {"block_hashes": data.draw(ANY)}
        _call(t, name, args, kw, lambda: _tracker_state(t), t.check_invariants)


# ---- HostCache ----

CACHE_CALLS = {"match_prefix": 1, "contains": 1, "lookup": 1, "begin_load": 2, "end_load": 1, "begin_store": 1,
               "complete_store": 3, "begin_store_run": 4, "complete_step": 2, "abort_store": 1,
               "events_msgpack": 1}


def _cache():
    c = _core.HostCache(8, 2)
    s = c.begin_store([10, 20])
    c.complete_store([(h, b) for _, h, b in s], None, [1, 2, 3, 4])
    c.begin_load("r", [10])
    c.begin_store([30])
    c.begin_store_run(5, [40, 50], 30, [1, 2, 3, 4])
    return c


def _cache_state(c):
    return (c.registered_hashes(), c.stats(), c.num_free, c.num_held, c.num_cached, c.num_storing,
            c.pending_steps, c.num_pending_events(), [c.lookup(h) for h in (10, 20, 30, 40, 50)])


@SETTINGS
@given(data=st.data())
def test_host_cache_any_arguments(data):
    c = _cache()
    blocks = sorted({c.lookup(10), c.lookup(20)})
    valid = ["r", 10, 20, 30, 5, [10], [10, 20], blocks, [blocks[0], blocks[0]], [(30, 2)], [(30, 2), (30, 2)],
             [1, 2], None]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(CACHE_CALLS)))
        args = _args(data, CACHE_CALLS[name], valid)
        _call(c, name, args, {}, lambda: _cache_state(c), c.check_invariants)


# ---- DiskIndex ----

DISK_INDEX_CALLS = {"begin_write": 2, "complete_write": 2, "match_prefix": 1, "contains": 1, "lookup": 1,
                    "successor": 1, "block_meta": 1, "held": 1, "begin_read": 1, "end_read": 1, "remove": 1,
                    "events_msgpack": 1, "drain_events_raw": 1}
DISK_INDEX_KWARGS = {"begin_write": ["successor", "parent_hash", "lora_id"],
                     "events_msgpack": ["medium", "data_parallel_rank", "hashes_as_bytes", "drain"],
                     "drain_events_raw": ["medium", "hashes_as_bytes"]}


def _disk_index():
    d = _core.DiskIndex(4, 2, publish_successors=True)
    d.complete_write(d.begin_write(11, [1, 2], 3), True)
    d.complete_write(d.begin_write(12, [3, 4], None, 11, 5), True)
    d.begin_write(13, [5, 6])
    d.begin_read([11])
    return d


def _disk_index_state(d):
    return (d.stats(), d.num_stored, d.num_writing, d.num_free, d.num_pending_events(),
            [(d.lookup(h), d.block_meta(h), d.successor(h)) for h in (11, 12, 13)], d.held([11, 12, 13]),
            bytes(d.events_msgpack(0.0)))


@SETTINGS
@given(data=st.data())
def test_disk_index_any_arguments(data):
    d = _disk_index()
    valid = [11, 12, 13, 0, 1, 2, [11], [11, 12], [11, 11], [0], [0, 0], [1, 2], True, False, bytes]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(DISK_INDEX_CALLS)))
        args = _args(data, DISK_INDEX_CALLS[name], valid)
        kw = {k: data.draw(st.one_of(st.sampled_from(valid), ANY))
              for k in DISK_INDEX_KWARGS.get(name, []) if data.draw(st.booleans())}
        _call(d, name, args, kw, lambda: _disk_index_state(d), d.check_invariants)


# ---- PrefixIndex, block_hash, encode_event_batch ----

INDEX_CALLS = {"add_worker": 1, "remove_worker": 1, "clear_worker": 1, "worker_len": 1, "apply": 2, "lookup": 2,
               "chain_keys": 2, "score_blocks": 1, "load": 2, "set_worker_eagle": 2, "worker_eagle": 1}


def _index():
    ix = _core.PrefixIndex(capacity=100)
    ix.add_worker("w")
    toks = list(range(8))
    keys = ix.chain_keys(toks, 4)
    ix.load("w", [(keys[0], keys[0], [1, 0, 0], 0)])
    return ix


def _index_state(ix):
    return (ix.workers(), [ix.worker_eagle(w) for w in ix.workers()], ix.dump(), ix.stats(), len(ix))


@SETTINGS
@given(data=st.data())
def test_prefix_index_any_arguments(data):
    ix = _index()
    payload = _core.encode_event_batch([("BlockStored", [1], None, [1, 2, 3, 4], 4, None)], 0.0)
    valid = ["w", "v", list(range(8)), 4, payload, b"\x00", [{"w": 1}], [(1, 2, [1, 0, 0], 0)], True, ["w"]]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(INDEX_CALLS)))
        args = _args(data, INDEX_CALLS[name], valid)
        kw = {}
        if name in ("lookup", "chain_keys") and data.draw(st.booleans()):
            kw = {"lora_id": data.draw(ANY), "lora_name": data.draw(ANY)}
        if name == "apply" and data.draw(st.booleans()):
            kw = {"default_tier": data.draw(ANY)}
        if name == "score_blocks" and data.draw(st.booleans()):
            kw = {"token_ids": data.draw(ANY), "block_size": data.draw(ANY), "eagle": data.draw(ANY)}
        # A lookup counts itself (stats) when it succeeds; only failures must change nothing.
        _call(ix, name, args, kw, lambda: _index_state(ix), ix.check_invariants)


@SETTINGS
@given(args=st.lists(ANY, min_size=3, max_size=3), events=st.lists(
    st.one_of(ANY, st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x", 1]),
                             ANY, ANY, ANY, ANY, ANY)), max_size=3))
def test_functions_any_arguments(args, events):
    for call in (
        lambda: _core.block_hash(args[0], args[1], args[2]),
        lambda: _core.block_hash(args[0], args[1]),
        lambda: _core.encode_event_batch(events, args[0], medium=args[1], data_parallel_rank=args[2]),
        lambda: _core.encode_event_batch(args[0], 0.0, hashes_as_bytes=args[1]),
        lambda: _core.lora_key(args[0]),
    ):
        try:
            call()
        except KVSlotsError:
            pass


@SETTINGS
@given(args=st.lists(ANY, min_size=5, max_size=5))
def test_copy_path_any_arguments(args):
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    s = _core.BlockRegion(src, block_bytes=8, num_blocks=8)
    d = _core.BlockRegion(dst, block_bytes=8, num_blocks=8)
    for call in (
        lambda: _core.copy_blocks(s, d, args[0], args[1], args[2]),
        lambda: _core.copy_blocks(args[0], d, [0], [0]),
        lambda: _core.BlockRegion(args[0], block_bytes=args[1], num_blocks=args[2], stride=args[3], offset=args[4]),
        lambda: _core.BlockRegion(src, block_bytes=args[1], num_blocks=args[2], stride=args[3], offset=args[4]),
    ):
        before = dst.copy()
        try:
            call()
        except KVSlotsError:
            assert np.array_equal(dst, before)
    from kvslots.vllm.transfer import BlockCopier

    import torch

    layer = torch.zeros(4, 2, 3)
    c = BlockCopier({"l": layer}, 4, 4)
    for call in (lambda: c.store(args[0], args[1]), lambda: c.load(args[2], args[3])):
        host = c.host.clone()
        try:
            call()
        except KVSlotsError:
            assert torch.equal(c.host, host)


# ---- specific cases ----


@pytest.mark.parametrize(
    "call, kind",
    [
        (lambda m: m.reserve("a", 2**62), kvslots.OutOfBlocksError),
        (lambda m: m.reserve("a", 2**64 - 1), kvslots.OutOfBlocksError),
        (lambda m: m.reserve("a", 2**64), InvalidArgumentError),
        (lambda m: m.reserve("a", 1.0), ArgumentTypeError),
        (lambda m: m.reserve("a", True), ArgumentTypeError),
        (lambda m: m.reserve("a", "1"), ArgumentTypeError),
        (lambda m: m.reserve(5, 1), ArgumentTypeError),
        (lambda m: m.reserve("\ud800", 1), InvalidArgumentError),
        (lambda m: m.commit("a", np.array([1.5])), ArgumentTypeError),
        (lambda m: m.commit("a", np.array([[1]])), ArgumentTypeError),
        (lambda m: m.create("z", [1], lookahead=2**64), InvalidArgumentError),
        (lambda m: m.create("z", [1], match_prefix=1), ArgumentTypeError),
        (lambda m: m.create("z", [1], lora_id=-1), InvalidArgumentError),
        (lambda m: m.lookup(2**64), InvalidArgumentError),
        (lambda m: m.refcount(2**40), InvalidArgumentError),
        (lambda m: m.events_msgpack("now"), ArgumentTypeError),
        (lambda m: m.events_msgpack(0.0, medium=b"x"), ArgumentTypeError),
        (lambda m: 5 in m, ArgumentTypeError),
    ],
)
def test_bad_scalars_are_typed_and_change_nothing(call, kind):
    m = _manager()
    before = _manager_state(m)
    with pytest.raises(kind) as e:
        call(m)
    assert isinstance(e.value, KVSlotsError)
    assert _manager_state(m) == before
    assert m.check_invariants() is None


def test_huge_lookahead_then_commit_never_panics():
    m = kvslots.SlotManager(8, 4)
    m.create("a", [1, 2, 3], lookahead=2**62)
    with pytest.raises(kvslots.OutOfBlocksError):
        m.reserve("a", 3)
    m.set_lookahead("a", 0)
    m.reserve("a", 3)
    m.commit("a", [1, 2, 3])
    assert m.check_invariants() is None
    t = _core.SlotTracker(4)
    t.add("a", lookahead=2**64 - 1)
    # The count is exact (it read 2**64-1 whatever the count): 2 new tokens + the lookahead.
    for call in (lambda: t.blocks_needed("a", 2), lambda: t.reserve("a", 2, [0])):
        with pytest.raises(kvslots.CapacityExceededError) as e:
            call()
        assert (e.value.requested, e.value.limit) == (2**64 + 1, 2**64 - 1)
        assert "(18446744073709551617 > 18446744073709551615)" in str(e.value)
    assert t.check_invariants() is None


def test_reentrant_arguments():
    m = _manager()

    class Peek:
        def __index__(self):
            m.stats()
            m.reserve("b", 1)  # a mutation from inside an argument: runs before the call borrows
            return 1

    m.reserve("a", Peek())
    assert m.check_invariants() is None

    class Finishing:
        def __iter__(self):
            m.finish("b")
            return iter([1])

    with pytest.raises(kvslots.UnknownRequestError):
        m.commit("b", Finishing())
    assert m.check_invariants() is None

    ix = _index()

    class IxPeek:
        def __index__(self):
            ix.stats()
            return 1

    def lookups():
        ix.lookup([IxPeek()] * 8, 4)
        ix.lookup(list(range(8)), IxPeek(), lora_id=IxPeek())
        ix.chain_keys(np.array([IxPeek()] * 8, dtype=object), 4)
        ix.load("w", [(IxPeek(), IxPeek(), [IxPeek(), 0, 0], IxPeek())])
        ix.score_blocks([{"w": IxPeek()}])
        ix.score_blocks([{"w": IxPeek()}], [IxPeek()] * 8, IxPeek(), ["w"])

    t = threading.Thread(target=lookups, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "re-entrant PrefixIndex call deadlocked"
    assert ix.check_invariants() is None


class OddInt(int):
    """An int subclass whose operators lie: only its value may count."""

    def __rshift__(self, n):
        return 0

    def __and__(self, n):
        return 0

    def __index__(self):
        raise ZeroDivisionError("boom")

    def __str__(self):
        return "7"

    __repr__ = __str__


def test_int_subclasses_are_read_by_their_value():
    """The abi3 build read 128-bit ints with ``>>``: OddInt(-1) was taken as 2**64-1 and
    OddInt(2**70) as 0 (success where the reference refuses), and messages showed the
    subclass's own str."""
    m = _manager()
    before = _manager_state(m)
    with pytest.raises(InvalidArgumentError, match="must be >= 0, got -1"):
        m.reserve("a", OddInt(-1))
    with pytest.raises(InvalidArgumentError, match=str(2**70)):
        m.reserve("a", OddInt(2**70))
    with pytest.raises(InvalidArgumentError, match=r"tokens\[1\] = 4294967296"):
        m.commit("a", [OddInt(1), OddInt(2**32)])
    with pytest.raises(InvalidArgumentError):
        m.set_lookahead("b", OddInt(-(2**64) + 1))
    assert _manager_state(m) == before
    m.reserve("b", OddInt(3))
    assert m.slot_info("b").pending == 3
    assert m.check_invariants() is None


def test_index_raising_callbacks_become_typed():
    m = _manager()
    with pytest.raises(ArgumentTypeError) as e:
        m.reserve("a", Raising())
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    with pytest.raises(ArgumentTypeError):
        m.commit("a", Raising())


# ---- threads ----


def _run_threads(target, n=4, seconds=30):
    errors: list[BaseException] = []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds)
        assert not t.is_alive(), "deadlock"
    assert not errors, errors


def test_step_arrays_mutated_by_another_thread():
    m = kvslots.SlotManager(64, 4)
    ids = []
    for i in range(8):
        m.create(f"r{i}", [1, 2, 3])
        m.reserve(f"r{i}", 3)
        m.commit(f"r{i}", [1, 2, 3])
        ids.append(m.slot_id(f"r{i}"))
    slots = np.array(ids, dtype=np.uint64)
    zeros = np.zeros(8, dtype=np.uint32)
    new = np.ones(8, dtype=np.uint32)
    look = np.zeros(8, dtype=np.uint32)
    stop = threading.Event()

    def scribble(_):
        rng = np.random.default_rng(0)
        while not stop.is_set():
            new[:] = rng.integers(0, 2**32, 8, dtype=np.uint32)  # ufunc loops may release the GIL
            look[:] = rng.integers(0, 2**32, 8, dtype=np.uint32)
            new[:] = 0
            look[:] = 0

    def stepper(_):
        try:
            for _ in range(2000):
                try:
                    m.step(slots, zeros, np.zeros(0, dtype=np.uint32), zeros, new, look)
                except KVSlotsError:
                    pass
                for i in range(8):
                    info = m.slot_info(f"r{i}")
                    assert info.pending < 2**40, info
                    if info.pending:
                        m.rollback(f"r{i}", info.pending)
                m.set_lookahead("r0", 0)
        finally:
            stop.set()

    _run_threads(lambda i: scribble(i) if i == 0 else stepper(i), n=2)
    assert m.check_invariants() is None


def test_shared_objects_from_many_threads():
    m = kvslots.SlotManager(256, 4)
    c = _core.HostCache(64, 2)
    t = _core.SlotTracker(4)
    ix = _core.PrefixIndex()
    ix.add_worker("w")

    def work(k):
        rng = np.random.default_rng(k)
        for j in range(300):
            rid = f"t{k}-{j % 5}"
            try:
                op = rng.integers(0, 9)
                if op == 0:
                    m.create(rid, list(rng.integers(0, 5, 9)), lookahead=1)
                elif op == 1:
                    m.reserve(rid, int(rng.integers(0, 6)))
                elif op == 2:
                    m.commit(rid, [1] * int(rng.integers(0, 3)))
                elif op == 3:
                    m.finish(rid)
                elif op == 4:
                    ids = [m.slot_id(r) for r in m.request_ids() if r.startswith(f"t{k}-")]
                    z = np.zeros(len(ids), dtype=np.uint32)
                    m.step(np.array(ids, dtype=np.uint64), z, [], z, z + 1)
                    m.drain_events_msgpack(0.0)
                elif op == 5:
                    s = c.begin_store([k * 1000 + j])
                    c.complete_store([(h, b) for _, h, b in s], None, [1, 2] * len(s))
                    c.match_prefix([k * 1000 + j])
                elif op == 6:
                    t.add(rid)
                    t.reserve(rid, 3, [1])
                    t.commit(rid, [1, 2, 3])
                    t.finish(rid)
                elif op == 7:
                    ix.apply("w", _core.encode_event_batch([("BlockStored", [k * 1000 + j], None, [1, 2], 2, None)],
                                                           0.0))
                    ix.lookup([1, 2, 3, 4], 2)
                else:
                    assert m.check_invariants() is None
                    assert c.check_invariants() is None
                    assert ix.check_invariants() is None
                    m.stats(), len(m), c.stats(), ix.stats()
            except ConcurrentUseError:
                pytest.fail("a call was refused as concurrent although every call holds the GIL")
            except KVSlotsError:
                pass

    _run_threads(work, n=4)
    assert m.check_invariants() is None
    assert c.check_invariants() is None
    assert t.check_invariants() is None
    assert ix.check_invariants() is None


def test_gc_finalizers_during_an_event_drain_find_the_object_free():
    """drain_raw_events builds its tuples holding the object's borrow; a GC run inside it ran
    finalizers, and one calling the object (or releasing the GIL to a thread that did) got
    ConcurrentUseError. The GC now waits until the list is built."""
    import gc

    def fill_manager(m):
        m.create("a", list(range(40)))
        m.reserve("a", 40)
        for i in range(40):
            m.commit("a", [i])  # one BlockStored each

    def fill_cache(c):
        for i in range(40):
            s = c.begin_store([i + 1])
            c.complete_store([(h, b) for _, h, b in s], None, [i])

    for obj, fill in ((kvslots.SlotManager(64, 1), fill_manager), (_core.HostCache(64, 1), fill_cache)):
        fill(obj)
        refused = []

        class Finalizer:
            def __init__(self):
                self.me = self  # a cycle: only the GC frees it

            def __del__(self):
                try:
                    obj.num_pending_events()
                except ConcurrentUseError as e:
                    refused.append(e)

        threshold = gc.get_threshold()
        gc.collect()
        try:
            for _ in range(50):
                Finalizer()
            gc.set_threshold(1)
            assert len(obj.drain_raw_events()) == 40
        finally:
            gc.set_threshold(*threshold)
            gc.collect()
        assert not refused, (type(obj).__name__, refused[0])
        assert gc.isenabled()


# ---- memory safety: what a region may hold, what a token read may run ----


@pytest.mark.parametrize("dtype", [object, [("a", np.int64), ("b", object)]])
def test_regions_over_python_objects_are_refused(dtype):
    dst = np.empty(8, dtype=dtype)  # its bytes are object pointers
    with pytest.raises(InvalidArgumentError, match="Python objects"):
        _core.BlockRegion(dst, block_bytes=8, num_blocks=1)


@pytest.mark.parametrize("kind", ["sparse_csr", "mkldnn"])
def test_tensors_torch_cannot_give_an_address_for_are_refused(kind):
    """A sparse CSR tensor (``is_contiguous`` raises) or an mkldnn one (``data_ptr`` raises)
    let torch's builtin RuntimeError escape from BlockRegion; now an InvalidArgumentError
    naming the memory, torch's error as its cause."""
    import torch

    if kind == "sparse_csr":
        t = torch.eye(4).to_sparse_csr()
    else:
        if not torch.backends.mkldnn.is_available():
            pytest.skip("no mkldnn")
        t = torch.zeros(8).to_mkldnn()
    with pytest.raises(InvalidArgumentError, match="memory") as e:
        _core.BlockRegion(t, block_bytes=4, num_blocks=1)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_a_tensor_over_a_read_only_mapping_is_not_a_destination(tmp_path):
    import warnings

    import torch

    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(range(64)) * 64)
    ro = np.memmap(path, dtype=np.uint8, mode="r", shape=(4096,))  # PROT_READ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        t = torch.from_numpy(ro)
    region = _core.BlockRegion(t, block_bytes=64, num_blocks=64)
    assert region.writable is False
    src = _core.BlockRegion(np.ones(64, np.uint8), block_bytes=64, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        _core.copy_blocks(src, region, [0], [0])
    assert bytes(ro[:64]) == bytes(range(64))
    out = np.zeros(64, np.uint8)  # reading from it is fine
    _core.copy_blocks(region, _core.BlockRegion(out, block_bytes=64, num_blocks=1), [1], [0])
    assert bytes(out) == bytes(range(64))
    assert _core.BlockRegion(torch.zeros(64, dtype=torch.uint8), block_bytes=64, num_blocks=1).writable


class _PlannerReq:
    def __init__(self, toks, n, bs):
        self.request_id = "r"
        self.num_prompt_tokens = self.num_tokens = self.num_computed_tokens = n
        self.num_in_flight_tokens = 0
        self.lora_request = None
        self.block_hashes = list(range(1, n // bs + 1))
        self._all_token_ids = toks


@pytest.mark.parametrize("clear", [False, True])
def test_token_items_with_index_that_frees_the_list(clear):
    """A token read never holds borrowed items across Python code: an ``__index__`` that
    empties the request's token list gives a typed error (or the values read), not freed memory."""
    bs, n = 4, 64

    class Tok:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            if clear:
                toks.clear()
                [object() for _ in range(5000)]  # reuse what was freed
            return self.v

    toks = [Tok(1)] + [Tok(7) for _ in range(n - 1)]
    p = _core.ConnectorPlanner(bs, 64, False)
    req = _PlannerReq(toks, n, bs)
    p.track(req)
    if clear:
        with pytest.raises(InvalidArgumentError, match="past the request"):
            p.finish(req, list(range(n // bs)))
    else:
        p.finish(req, list(range(n // bs)))
    assert p.check_invariants() is None


def test_slot_tracker_refuses_a_block_twice():
    t = _core.SlotTracker(4)
    t.add("a")
    with pytest.raises(InvalidArgumentError, match="block 5"):
        t.reserve("a", 8, [5, 5])
    t.reserve("a", 4, [5])
    with pytest.raises(InvalidArgumentError, match="block 5"):
        t.reserve("a", 4, [5])
    assert t.check_invariants() is None
    t.reserve("a", 4, [6])
    assert t.finish("a") == [5, 6]


@pytest.mark.parametrize(
    "call, kind",
    [
        (lambda: _core.KVBlocks([-1]), InvalidArgumentError),
        (lambda: _core.KVBlocks([2**32]), InvalidArgumentError),
        (lambda: _core.KVBlocks("ab"), ArgumentTypeError),
        (lambda: _core.KVBlocks([1.5]), ArgumentTypeError),
        (lambda: _core.KVBlocks([1]).get_block_ids(1), ArgumentTypeError),
        (lambda: _core.KVBlocks([1]).get_block_ids(group_ids=[-1]), InvalidArgumentError),
        (lambda: _core.KVBlocks([1]).get_block_ids(group_ids="0"), ArgumentTypeError),
    ],
)
def test_kv_blocks_arguments_are_typed(call, kind):
    with pytest.raises(kind):
        call()
    assert _core.KVBlocks([3, 4]).get_block_ids() == ([3, 4],)
    assert _core.KVBlocks([3]).get_block_ids(group_ids=[0]) == ([3],)


def test_disk_tier_arguments_are_typed(tmp_path):
    di = _core.DiskIndex(4, 2)
    slot = di.begin_write(11, [1, 2])
    for ok in (1, "yes", None):
        with pytest.raises(ArgumentTypeError, match="ok must be a bool"):
            di.complete_write(slot, ok)
    di.complete_write(slot, True)  # still pending after the refusals
    assert di.lookup(11) == slot

    ds = _core.DiskStore(str(tmp_path / "f.bin"), num_slots=4, block_size=2, num_layers=1,
                         bytes_per_block=8, dtype="uint8", fingerprint=1)
    ro = np.zeros((1, 8), np.uint8)
    ro.flags.writeable = False
    for call, kind in [
        (lambda: ds.submit(0, [0] * 8, 11, [1, 2]), ArgumentTypeError),
        (lambda: ds.submit(0, np.zeros(8, np.int64), 11, [1, 2]), ArgumentTypeError),
        (lambda: ds.submit(0, np.zeros((2, 4), np.uint8), 11, [1, 2]), ArgumentTypeError),
        (lambda: ds.read_into([0], [11], np.zeros((1, 8), np.float32)), ArgumentTypeError),
        (lambda: ds.read_into([0], [11], np.zeros(8, np.uint8)), ArgumentTypeError),
        (lambda: ds.read_into([0], [11], ro), InvalidArgumentError),
        (lambda: ds.read_rows([0], [11], [[0] * 8], [0]), ArgumentTypeError),
        (lambda: ds.read_rows_async([0], [11], None, [0]), ArgumentTypeError),
        (lambda: ds.wait_reads("1"), ArgumentTypeError),
        (lambda: ds.wait_reads(None), ArgumentTypeError),
        (lambda: ds.wait_reads(float("nan")), InvalidArgumentError),
    ]:
        with pytest.raises(kind):
            call()
    assert ds.reads_in_flight == 0 and ds.wait_reads(1.0)


@pytest.mark.parametrize("events_wanted", [True, False])
def test_planner_refuses_more_computed_tokens_than_the_request_has(events_wanted):
    """A request claiming blocks beyond its tokens is refused whether or not events are read
    (with events off it planned stores of no tokens and sized a scratch buffer by the claim)."""
    bs = 2**20
    p = _core.ConnectorPlanner(bs, 128, False)
    p.events_wanted = events_wanted
    req = _PlannerReq([1] * 10, 10, bs)
    req.num_computed_tokens = 64 * bs
    req.block_hashes = list(range(1, 65))
    p.track(req)
    with pytest.raises(InvalidArgumentError, match="tokens asked, the request has 10"):
        p.finish(req, list(range(64)))
    assert p.host_stats()["stores_started"] == 0
    assert p.check_invariants() is None


def test_planner_malformed_cached_reqs_change_nothing():
    """scheduled_cached_reqs' lists of unequal lengths are refused before the step begins: the
    mirrored block tables, the step and a finished request's deferred stores are as before."""
    import types

    bs = 4
    p = _core.ConnectorPlanner(bs, 64, False)
    reqs = []
    for i in range(4):
        r = _PlannerReq([5] * 12, 12, bs)
        r.request_id = f"r{i}"
        r.block_hashes = [i * 10 + j + 1 for j in range(3)]
        p.track(r)
        reqs.append(r)
    empty = types.SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    p.build(types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: 12 for r in reqs}, preempted_req_ids=set(),
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id, block_ids=([i * 10, i * 10 + 1, i * 10 + 2],),
                                                  num_computed_tokens=0) for i, r in enumerate(reqs)],
        scheduled_cached_reqs=empty))
    p.complete(p.step, 1, None, 0)
    p.finish(reqs[3], [30, 31, 32])  # its stores are deferred to the next step
    ids = [r.request_id for r in reqs[:3]]
    before = (p.step, [p.device_blocks(i) for i in ids])

    def output(nb):
        return types.SimpleNamespace(
            num_scheduled_tokens={i: 4 for i in ids}, preempted_req_ids=set(), scheduled_new_reqs=[],
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=list(ids), new_block_ids=nb,
                                                        num_computed_tokens=[12] * 3, resumed_req_ids=set()))

    with pytest.raises(InvalidArgumentError, match="3 req_ids, 2 new_block_ids"):
        p.build(output([([60],), ([61],)]))
    assert (p.step, [p.device_blocks(i) for i in ids]) == before
    step, dev, _, _ = p.build(output([([60],), ([61],), ([62],)]))
    assert step == before[0] + 1
    assert [p.device_blocks(i) for i in ids] == [b + [60 + k] for k, b in enumerate(before[1])]
    assert {30, 31, 32} <= set(dev)  # the finished request's deferred stores were kept
    assert p.check_invariants() is None


@pytest.mark.parametrize("ctor", [
    "DeviceKVManager(2**31 - 1, 16, max_model_len=1024)",
    "SlotManager(2**31 - 1, 16)",
    "HostCache(2**31 - 1, 16)",
    "ConnectorPlanner(16, 2**31 - 1, False)",
    "DiskIndex(2**32 - 2, 16)",
])
def test_too_many_blocks_is_an_error_not_an_abort(ctor):
    """A block count whose metadata cannot be allocated is an InvalidArgumentError (``vec![0;
    n]`` aborted the process: 'memory allocation of 68719476704 bytes failed')."""
    import resource
    import subprocess
    import sys

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    # A cap on the address space makes the allocation fail on any host; the test runs it in a
    # child process so the cap does not reach the rest of the suite.
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, %d))\n"
        "from kvslots import _core\n"
        "from kvslots.errors import InvalidArgumentError\n"
        "try:\n"
        "    _core.%s\n"
        "except InvalidArgumentError as e:\n"
        "    assert 'cannot be allocated' in str(e), e\n"
        "    print('refused')\n"
        "m = _core.DeviceKVManager(64, 16, max_model_len=1024)\n"
        "assert m.check_invariants() is None\n"
    ) % (hard, ctor)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "refused"


def test_device_manager_block_size_range_is_named():
    with pytest.raises(InvalidArgumentError, match=r"block_size must be in \[1, 4294967295\]"):
        _core.DeviceKVManager(16, 2**32, max_model_len=1024)


def test_copy_keeps_a_tensor_storage_another_thread_replaces():
    """copy_blocks runs without the GIL: a thread giving the source tensor a new storage
    (``set_``) meanwhile freed the bytes being read (a segfault); the copy now holds the storage
    it checked, so it finishes or refuses the moved region."""
    torch = pytest.importorskip("torch")
    import time

    n, bb = 32 << 20, 1 << 20  # large enough to be mmap-backed: freed memory is unmapped
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    rs = _core.BlockRegion(src, block_bytes=bb, num_blocks=n // bb)
    rd = _core.BlockRegion(dst, block_bytes=bb, num_blocks=n // bb)
    ids = list(range(n // bb))
    stop = time.monotonic() + 2
    unexpected = []

    def copier():
        while time.monotonic() < stop:
            try:
                _core.copy_blocks(rs, rd, ids, ids)
            except InvalidArgumentError as e:
                if "moved" not in str(e):
                    unexpected.append(e)

    def swapper():
        while time.monotonic() < stop:
            src.set_(torch.ones(n, dtype=torch.uint8))
            time.sleep(0.001)

    threads = [threading.Thread(target=copier), threading.Thread(target=swapper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not unexpected


# ---- DiskStore ----

DISK_CALLS = {"submit": 4, "take_done": 0, "read_into": 3, "read_rows": 4, "read_rows_async": 4, "take_reads": 0,
              "wait_reads": 1, "invalidate": 1, "flush": 0}
DISK_KWARGS = {"submit": ["successor", "parent_hash", "lora_id"]}


@SETTINGS
@given(data=st.data())
def test_disk_store_any_arguments(data, tmp_path_factory):
    """The disk tier's store with any arguments: success or a kvslots error with its file and
    counters unchanged (the background writer and readers are settled before each look)."""
    path = tmp_path_factory.mktemp("disk") / "f.bin"
    ds = _core.DiskStore(str(path), num_slots=4, block_size=2, num_layers=1, bytes_per_block=8, dtype="uint8",
                         fingerprint=1)
    assert ds.submit(1, np.arange(8, dtype=np.uint8), 11, [1, 2])

    def state():
        ds.flush()
        assert ds.wait_reads(10.0)
        return ds.stats(), ds.reads_in_flight, path.read_bytes()

    block = np.arange(8, dtype=np.uint8)
    valid = [0, 1, 3, 11, [1], [11], [0, 1], [11, 11], [1, 2], block, np.zeros((1, 8), np.uint8),
             np.zeros((2, 8), np.uint8), 0.5, 1.0]
    for _ in range(3):
        name = data.draw(st.sampled_from(sorted(DISK_CALLS)))
        args = _args(data, DISK_CALLS[name], valid)
        kw = {k: data.draw(ANY) for k in DISK_KWARGS.get(name, []) if data.draw(st.booleans())}
        _call(ds, name, args, kw, state)
    state()
    ds.take_reads()


def test_disk_store_from_many_threads(tmp_path):
    """Four threads write, invalidate and read (sync and async) one store at once: every call
    succeeds or is a kvslots error, every accepted write is accounted for, and every block read
    back whole is one that was written to that slot (never a torn or foreign one)."""
    import threading

    ds = _core.DiskStore(str(tmp_path / "f.bin"), num_slots=8, block_size=2, num_layers=1, bytes_per_block=64,
                         dtype="uint8", fingerprint=1, queue_len=4)
    errors: list[BaseException] = []
    accepted = [0] * 4

    def block(h: int) -> np.ndarray:
        return np.full(64, h % 251, np.uint8)

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        out = np.zeros((2, 64), np.uint8)
        try:
            for i in range(300):
                slot, h = int(rng.integers(0, 8)), 1000 + int(rng.integers(0, 16))
                op = int(rng.integers(0, 5))
                try:
                    if op == 0:
                        accepted[t] += ds.submit(slot, block(h), h, [h, h + 1])
                    elif op == 1:
                        ds.invalidate(slot)
                    elif op == 2:
                        failed = dict(ds.read_into([slot], [h], out[:1]))
                        if 0 not in failed:
                            assert (out[0] == block(h)).all(), (slot, h, out[0][:4])
                    elif op == 3:
                        ds.read_rows_async([slot, (slot + 1) % 8], [h, h], out, [0, 1])
                        ds.wait_reads(5.0)
                        ds.take_reads()
                    else:
                        ds.take_done()
                except KVSlotsError:
                    pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    ds.flush()
    assert ds.wait_reads(10.0)
    s = ds.stats()
    assert s["written_blocks"] + s["write_failures"] == sum(accepted), (s, accepted)
    assert s["queue_depth"] == 0 and ds.reads_in_flight == 0


# ---- DeviceKVManager ----


class _DeviceReq:
    """What DeviceKVManager reads of a vLLM Request."""

    def __init__(self, rid, n=8, bs=4):
        self.request_id = rid
        self.num_computed_tokens = 0
        self._all_token_ids = list(range(1, n + 1))
        self.block_hashes = [bytes([i + 1]) * 32 for i in range(n // bs)]


def _device_state(m):
    return (m.num_free_blocks(), m.num_cached_blocks(), m.num_held_blocks(), m.num_reserved_blocks(),
            m.num_deferred(), sorted(m.request_ids()), {r: m.block_ids(r) for r in m.request_ids()},
            m.device_stats(), m.check_invariants())


def test_finish_step_with_a_scheduled_that_raises_keeps_the_deferred_lookahead():
    """finish_step took the step's deferred lookahead, then asked ``scheduled`` about each: one
    that raised (or was no container) escaped as a builtin exception and the deferral was
    lost, its reservation kept. Now a kvslots error, nothing changed, and a retry materialises
    the lookahead."""

    class Raises:
        def __contains__(self, rid):
            raise ZeroDivisionError("boom")

    m = _core.DeviceKVManager(64, 4, max_model_len=256, defer_lookahead=True)
    m.allocate_slots(_DeviceReq("a"), 8, num_lookahead_tokens=4)
    assert m.num_deferred() == 1 and m.block_ids("a") == [1, 2]
    before = _device_state(m)
    for scheduled, kind in ((Raises(), InvalidArgumentError), (5, ArgumentTypeError)):
        with pytest.raises(kind) as e:
            m.finish_step(0, scheduled)
        assert isinstance(e.value, KVSlotsError) and e.value.__cause__ is not None
        assert _device_state(m) == before
    assert m.finish_step(0, {"a"}) == [("a", [3])]
    assert m.num_deferred() == 0 and m.num_reserved_blocks() == 0
    assert m.check_invariants() is None


@pytest.mark.parametrize("how", ["free", "free_request", "pop_blocks_for_free"])
def test_a_freed_request_takes_its_deferred_lookahead_with_it(how):
    """A request freed within the step kept its deferred lookahead: the same id allocated again
    before finish_step got the old allocation's lookahead too (32 tokens' worth, past its
    reservation), and finish_step raised CapacityExceededError with the table already grown."""
    m = _core.DeviceKVManager(64, 4, max_model_len=256, defer_lookahead=True)
    m.allocate_slots(_DeviceReq("a", n=32), 32, num_lookahead_tokens=4)
    if how == "free":
        m.free(_DeviceReq("a"))
    elif how == "free_request":
        m.free_request("a")
    else:
        m.release_blocks(m.pop_blocks_for_free(_DeviceReq("a")))
    assert m.num_deferred() == 0
    m.allocate_slots(_DeviceReq("a", n=8), 8, num_lookahead_tokens=4)
    assert m.num_deferred() == 1
    table = m.block_ids("a")
    assert m.finish_step(0, {"a"}) == [("a", [table[-1] + 1])]
    assert len(m.block_ids("a")) == 3 and m.num_reserved_blocks() == 0
    assert m.check_invariants() is None


def test_finish_step_refuses_a_scheduled_that_allocates_meanwhile():
    m = _core.DeviceKVManager(64, 4, max_model_len=256, defer_lookahead=True)
    m.allocate_slots(_DeviceReq("a"), 8, num_lookahead_tokens=4)

    class Allocates:
        def __contains__(self, rid):
            if "b" not in m:
                m.allocate_slots(_DeviceReq("b"), 8, num_lookahead_tokens=4)
            return True

    with pytest.raises(ConcurrentUseError):
        m.finish_step(0, Allocates())
    assert m.num_deferred() == 2
    got = dict(m.finish_step(0, {"a", "b"}))
    assert sorted(got) == ["a", "b"] and all(len(v) == 1 for v in got.values())
    assert m.check_invariants() is None


def test_device_manager_calls_during_an_allocation_are_concurrent_use_errors():
    """A request's ``block_hashes`` is read while the core allocates (the manager borrowed): a
    property (or a sequence's ``__getitem__``) that called back into the manager got pyo3's
    builtin ``RuntimeError: Already mutably borrowed`` from the queries (``usage``,
    ``num_free_blocks``, ...), and the allocation then failed with 'block_hashes is missing'.
    Now every call made meanwhile is a ConcurrentUseError, and the failed allocation raises it."""
    m = _core.DeviceKVManager(64, 4, max_model_len=256)
    queries = [lambda: m.usage, lambda: m.num_free_blocks(), lambda: m.check_invariants(),
               lambda: m.request_ids(), lambda: m.device_stats(), lambda: m.num_deferred(),
               lambda: m.last_commit(), lambda: m.block_size, lambda: m.empty_kv_cache_blocks,
               lambda: m.free_request("x")]
    seen = []

    class Calls(_DeviceReq):
        @property
        def block_hashes(self):
            for q in queries:
                try:
                    q()
                except BaseException as e:  # noqa: BLE001 - what it raises is the point
                    seen.append(e)
                else:
                    seen.append(None)
            return [bytes([i + 1]) * 32 for i in range(2)]

        @block_hashes.setter
        def block_hashes(self, v):
            pass

    m.allocate_slots(Calls("a"), 8)
    assert len(seen) == len(queries) and all(isinstance(e, ConcurrentUseError) for e in seen), seen
    m.free_request("a")

    class Peeks(_DeviceReq):
        @property
        def block_hashes(self):
            m.num_free_blocks()
            return [bytes([i + 1]) * 32 for i in range(2)]

        @block_hashes.setter
        def block_hashes(self, v):
            pass

    before = _device_state(m)
    with pytest.raises(ConcurrentUseError):
        m.allocate_slots(Peeks("a"), 8)
    assert _device_state(m) == before

    class RaisingItems:  # a sequence, not a list: read through __getitem__
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            raise ZeroDivisionError("boom")

    req = _DeviceReq("b")
    req.block_hashes = RaisingItems(req.block_hashes)
    with pytest.raises(InvalidArgumentError, match=r"block_hashes\[0\]") as e:
        m.computed_blocks(req, 4)
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert _device_state(m) == before
    m.allocate_slots(_DeviceReq("a"), 8)
    assert len(m.block_ids("a")) == 2 and m.check_invariants() is None


def test_device_manager_errors_raised_by_arguments_are_kvslots_errors():
    """allocate_slots' ``request.status`` (read under a watermark), its
    ``skip_zeroing_group_ids`` items and release_blocks' / evict_blocks' items let a builtin
    exception escape (AttributeError, or whatever the object raised); now a kvslots error with
    the original as its cause, nothing changed."""

    def gen():
        yield 0
        raise ZeroDivisionError("boom")

    class Status:
        def __eq__(self, other):
            raise ZeroDivisionError("boom")

        __hash__ = None

    m = _core.DeviceKVManager(64, 4, max_model_len=256, watermark_blocks=2)
    m._set_watermark_statuses(["WAITING"])
    held = _DeviceReq("held")
    held.status = "RUNNING"
    m.allocate_slots(held, 8)
    popped = m.pop_blocks_for_free(held)
    no_status = _DeviceReq("a")
    bad_status = _DeviceReq("b")
    bad_status.status = Status()
    before = _device_state(m)
    for call in (
        lambda: m.allocate_slots(no_status, 8, has_scheduled_reqs=True),
        lambda: m.allocate_slots(bad_status, 8, has_scheduled_reqs=True),
        lambda: m.allocate_slots(_DeviceReq("c"), 8, has_scheduled_reqs=False, skip_zeroing_group_ids=gen()),
        lambda: m.release_blocks(gen()),
        lambda: m.evict_blocks(gen()),
    ):
        with pytest.raises(KVSlotsError) as e:
            call()
        assert e.value.__cause__ is not None, e.value
        assert _device_state(m) == before
    m.release_blocks(popped)
    assert m.check_invariants() is None


def test_planner_complete_promote_successors_are_typed():
    """complete_promote iterated ``successors`` with a bare '?': a non-iterable (None, an int)
    or an iterator that raised escaped as a builtin TypeError / the raised exception, and
    2**32 - 1 (the core's 'none' marker) was taken as no successor. Now the same rules as
    HostCache.begin_store_run's successors: a list or tuple of token ids below 2**32 - 1 or
    None; anything else is a kvslots error and nothing changes."""

    def gen():
        yield 1
        raise ZeroDivisionError("boom")

    p = _core.ConnectorPlanner(2, 8, True)
    p.enable_spill()
    [(_, block)] = p.begin_promote([11])
    before = (p.num_held, p.num_cached, p.num_storing, p.registered_hashes(), p.num_pending_events())
    for bad, kind in ((None, ArgumentTypeError), (5, ArgumentTypeError), (gen(), ArgumentTypeError),
                      ([2**32 - 1], InvalidArgumentError), (["x"], ArgumentTypeError), ([1, 2], InvalidArgumentError)):
        with pytest.raises(kind):
            p.complete_promote([11], [block], [1, 2], bad)
        assert (p.num_held, p.num_cached, p.num_storing, p.registered_hashes(), p.num_pending_events()) == before
    p.complete_promote([11], [block], [1, 2], (7,))
    assert p.registered_hashes() == [11] and p.successor(11) == 7
    assert p.check_invariants() is None


def test_drain_events_raw_with_a_raw_that_raises_keeps_the_queue():
    """drain_events_raw's ``raw`` callable raising (not msgspec.Raw, a wrong one) let its
    builtin exception escape; now a kvslots error with it as the cause, the queue kept."""

    def bad(b):
        raise ValueError("nope")

    p = _core.ConnectorPlanner(2, 8, False)
    [(_, block)] = p.begin_promote([11])
    p.complete_promote([11], [block], [1, 2], [None])
    assert p.num_pending_events() == 1
    with pytest.raises(InvalidArgumentError) as e:
        p.drain_events_raw(bad)
    assert isinstance(e.value.__cause__, ValueError)
    assert p.num_pending_events() == 1
    assert len(p.drain_events_raw(bytes)) == 1 and p.num_pending_events() == 0


def test_device_manager_block_lists_take_numpy_integers():
    """release_blocks / evict_blocks took ints and block objects but refused numpy integers
    (and so a numpy array of ids), which every other integer argument takes."""
    m = _core.DeviceKVManager(64, 4, max_model_len=256)
    r = _DeviceReq("a")
    m.allocate_slots(r, 8)
    m.cache_blocks(r, 8)
    blocks = m.pop_blocks_for_free(r)
    m.release_blocks(np.array(blocks, dtype=np.int64))
    assert m.num_registered_blocks() == 2
    assert m.evict_blocks(np.array(blocks[:1], dtype=np.uint32)) == 1
    assert m.evict_blocks([np.int64(blocks[1])]) == 1
    before = _device_state(m)
    for bad, kind in (([np.int64(-1)], InvalidArgumentError), ([1.5], ArgumentTypeError),
                      ([object()], ArgumentTypeError), ([True], ArgumentTypeError)):
        with pytest.raises(kind):
            m.evict_blocks(bad)
        assert _device_state(m) == before
    assert m.check_invariants() is None


def test_device_manager_computed_blocks_refuses_a_bool_count():
    """computed_blocks took ``max_blocks=False`` as 0 (a non-positive count is no blocks) while
    every count argument refuses a bool; True was refused already."""
    m = _core.DeviceKVManager(64, 4, max_model_len=256)
    r = _DeviceReq("a")
    for flag_value in (False, True):
        with pytest.raises(ArgumentTypeError, match="max_blocks"):
            m.computed_blocks(r, flag_value)
    assert m.computed_blocks(r, -3).num_blocks == 0 and m.computed_blocks(r, 0).num_blocks == 0


def _region():
    return _core.BlockRegion(np.zeros(64, np.uint8), block_bytes=8, num_blocks=8)


def _stats():
    ix = _core.PrefixIndex()
    ix.add_worker("w")
    return ix.apply("w", _core.encode_event_batch([("BlockStored", [1], None, [1, 2], 2, None)], 0.0))


def _slot_info():
    t = _core.SlotTracker(4)
    t.add("r")
    return t.slot_info("r")


def _device_manager():
    m = _core.DeviceKVManager(64, 4, max_model_len=256)
    m.allocate_slots(_DeviceReq("a"), 8)
    return m


#: For every class of ``kvslots._core``: (build an instance, a call that reads its state). A new
#: class fails ``test_no_object_of_the_extension_pickles_or_copies`` until it is listed here.
_EVERY_CLASS = {
    "SlotManager": (lambda tmp: _core.SlotManager(64, 4), lambda o: (o.num_free, len(o))),
    "SlotTracker": (lambda tmp: _core.SlotTracker(4), len),
    "SlotInfo": (lambda tmp: _slot_info(), repr),
    "HostCache": (lambda tmp: _core.HostCache(8, 2), lambda o: (o.num_free, o.check_invariants())),
    "ConnectorPlanner": (lambda tmp: _core.ConnectorPlanner(2, 8, False), lambda o: o.num_tracked),
    "DiskIndex": (lambda tmp: _core.DiskIndex(4, 2), lambda o: (o.num_free, o.check_invariants())),
    "DiskStore": (lambda tmp: _core.DiskStore(str(tmp / "f.bin"), num_slots=4, block_size=2, num_layers=1,
                                              bytes_per_block=8, dtype="uint8", fingerprint=1),
                  lambda o: (o.num_slots, o.stats())),
    "PrefixIndex": (lambda tmp: _core.PrefixIndex(), lambda o: (len(o), o.check_invariants())),
    "ApplyStats": (lambda tmp: _stats(), repr),
    "BlockRegion": (lambda tmp: _region(), lambda o: (o.num_blocks, o.nbytes)),
    "KVBlocks": (lambda tmp: _core.KVBlocks([3, 4]), lambda o: o.get_block_ids()),
    "DeviceKVManager": (lambda tmp: _device_manager(), _device_state),
}


def _core_classes():
    return sorted(n for n, v in vars(_core).items() if isinstance(v, type) and v.__module__ == "kvslots._core")


#: Plain values (counters, a list of ids): these pickle and copy (test_bindings_objects.py).
VALUE_CLASSES = ("ApplyStats", "KVBlocks", "SlotInfo")


@pytest.mark.parametrize("name", [n for n in _core_classes() if n not in VALUE_CLASSES] + ["kvslots.SlotManager"])
def test_no_object_of_the_extension_pickles_or_copies(name, tmp_path):
    """pickle.dumps, copy.copy and copy.deepcopy of an object of the extension raised a builtin
    TypeError ("cannot pickle ..."). The objects hold native state (memory, locks, files,
    threads, the objects they were built from) that must not be silently duplicated: every one
    now refuses with ``NotCopyableError`` (a kvslots error, still a TypeError) naming its class,
    and stays usable; VALUE_CLASSES are values and copy. Enumerates the module, so a class added
    without the rule fails here."""
    import copy
    import pickle

    from kvslots.errors import NotCopyableError

    if name == "kvslots.SlotManager":  # a Python subclass: named as itself
        build, read, cls_name = (lambda tmp: kvslots.SlotManager(64, 4)), (lambda o: o.num_free), "SlotManager"
    else:
        assert name in _EVERY_CLASS, f"kvslots._core.{name} is new: add it to _EVERY_CLASS"
        (build, read), cls_name = _EVERY_CLASS[name], name
    obj = build(tmp_path)
    before = read(obj)
    for call in (pickle.dumps, lambda o: pickle.dumps(o, protocol=0), lambda o: pickle.dumps(o, protocol=5),
                 copy.copy, copy.deepcopy, lambda o: copy.deepcopy([o, {"k": o}])):
        with pytest.raises(NotCopyableError, match=rf"cannot pickle or copy .*\b{cls_name}: .") as e:
            call(obj)
        assert isinstance(e.value, KVSlotsError) and isinstance(e.value, TypeError)
        assert "\n" not in str(e.value)
        assert read(obj) == before
    assert type(pickle.loads(pickle.dumps(e.value))) is NotCopyableError  # the error itself pickles
    if name == "kvslots.SlotManager":
        assert "kvslots.slots.manager.SlotManager" in str(e.value)


def test_every_class_of_the_extension_is_checked_for_copying():
    assert sorted(_EVERY_CLASS) == _core_classes()


@pytest.mark.parametrize("call", ["chain_keys", "block_hash"])
def test_a_signal_handler_cutting_a_list_short_mid_read_is_no_index_error(call):
    """Reading a long list runs Python's signal handlers every 65,536 items: one that cut the
    list short made the next read a raw IndexError (the fast path's cached length was stale,
    and the general path read past the new end). The read now ends at the new end."""
    import signal

    n = 16_000_000
    lst = [1] * n

    def cut(signum, frame):
        del lst[100_000:]

    old = signal.signal(signal.SIGALRM, cut)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.005)
        try:
            if call == "chain_keys":
                _core.PrefixIndex().chain_keys(lst, 4)
            else:
                _core.block_hash(0, lst)
        except KVSlotsError:
            pass  # a kvslots error is an allowed outcome; IndexError is not
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(lst) == 100_000, "the handler did not run during the read: the test proves nothing"
