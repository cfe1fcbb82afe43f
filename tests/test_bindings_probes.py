"""Inputs found by probing the extension's Python API from outside, each once an outcome other
than success or a kvslots error with the object unchanged: a process abort, a hang, a builtin
exception, or an error raised after the call had changed the object."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvslots import _core
from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError
from test_bindings_robust import _DeviceReq  # what DeviceKVManager reads of a vLLM Request

# What the child processes below share: the calls' outcomes, one line each, with whether the
# object they were made on is unchanged.
_CHILD = textwrap.dedent(
    """
    import kvslots
    from kvslots import _core
    from kvslots.errors import KVSlotsError

    class Req:
        def __init__(self, rid):
            self.request_id = rid
            self.num_computed_tokens = 0
            self._all_token_ids = list(range(1, 9))
            self.block_hashes = [bytes([i + 1]) * 32 for i in range(2)]

    def state(obj):
        if obj is None:
            return None
        return (repr(obj.__class__), getattr(obj, "check_invariants", lambda: None)(),
                sorted(getattr(obj, "request_ids", lambda: [])()),
                getattr(obj, "stats", getattr(obj, "device_stats", dict))())

    def report(calls, words=None):
        \"\"\"Per call: its name, the kvslots error it raised (and whether its message has
        `words`), and whether its object is unchanged.\"\"\"
        for name, (obj, call) in calls.items():
            before = state(obj)
            try:
                call()
                print(name, "succeeded")
            except KVSlotsError as e:
                said = [] if words is None else ["said" if words in str(e) else repr(str(e)[:80])]
                print(name, type(e).__name__, *said, "unchanged" if state(obj) == before else "CHANGED")
    """
)

# Run in a child: before the fix one call aborted the interpreter (Rust's allocation failure
# handler) and another never returned.
_HUGE_ARRAYS = _CHILD + textwrap.dedent(
    """
    import numpy as np

    # 2**40 ids with no memory behind them (stride 0): a copy of them cannot be allocated.
    big = np.broadcast_to(np.uint32(1), (2**40,))
    m = kvslots.SlotManager(16, 4)
    m.create("a", [1, 2, 3])
    c = _core.HostCache(8, 2)
    t = _core.SlotTracker(4)
    t.add("a")
    d = _core.DeviceKVManager(16, 4, max_model_len=64)
    d.allocate_slots(Req("a"), 8)
    region = _core.BlockRegion(np.zeros(8, np.uint8), block_bytes=8, num_blocks=1)
    calls = {
        "SlotManager.commit": (m, lambda: m.commit("a", big)),
        "SlotManager.create": (m, lambda: m.create("b", big)),
        "SlotManager.step": (m, lambda: m.step(big, [0], [], [0], [1])),
        "SlotTracker.reserve": (t, lambda: t.reserve("a", 1, big)),
        "HostCache.begin_store": (c, lambda: c.begin_store(big)),
        "HostCache.complete_store": (c, lambda: c.complete_store(big, None, [])),
        "DeviceKVManager.release_blocks": (d, lambda: d.release_blocks(big)),
        "DeviceKVManager.evict_blocks": (d, lambda: d.evict_blocks(big)),
        "DeviceKVManager.allocate_slots": (d, lambda: d.allocate_slots(Req("b"), 4, skip_zeroing_group_ids=big)),
        "DeviceKVManager._set_watermark_statuses": (d, lambda: d._set_watermark_statuses(big)),
        "PrefixIndex.load": (None, lambda: _core.PrefixIndex().load("w", big)),
        "block_hash": (None, lambda: _core.block_hash(0, big)),
        "copy_blocks": (None, lambda: _core.copy_blocks(region, region, big, big)),
    }
    report(calls)
    """
)


def test_a_broadcast_array_of_2_40_ids_is_refused_at_once():
    """A 1-D numpy array far larger than its memory (``np.broadcast_to``: stride 0) as an id or
    token list: the copy's ``Vec::with_capacity`` aborted the process ("memory allocation of
    4398046511104 bytes failed"); ``HostCache.complete_store`` (and every list of tuples)
    collected all 2**40 items before refusing the first, and ``DeviceKVManager``'s block and
    group id lists iterated them one by one: no end. Now each is a kvslots error at once."""
    r = subprocess.run([sys.executable, "-c", _HUGE_ARRAYS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 13, r.stdout
    for line in lines:
        name, outcome, *state = line.split()
        assert outcome in ("InvalidArgumentError", "ArgumentTypeError"), line
        assert state == ["unchanged"], line


# Bounded, so that a regression fails an allocation in the child instead of filling the machine.
_ENDLESS = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n" + _CHILD + textwrap.dedent(
    """
    import itertools

    m = kvslots.SlotManager(16, 4)
    m.create("a", [1, 2, 3])
    d = _core.DeviceKVManager(16, 4, max_model_len=64)
    d.allocate_slots(Req("a"), 8)
    report({
        "SlotManager.commit": (m, lambda: m.commit("a", itertools.repeat(1))),
        "SlotManager.create": (m, lambda: m.create("b", (i % 7 for i in itertools.count()))),
        "DeviceKVManager.release_blocks": (d, lambda: d.release_blocks(itertools.repeat(0))),
    }, words="endless iterator")
    """
)


def test_an_endless_iterator_is_refused_after_2_24_items():
    """An endless iterator as a token or block id list was read until memory ran out (the OOM
    killer, or with a memory limit an allocation error at some size). Now reading stops after
    ``MAX_ITER_ITEMS`` (2**24) items with a kvslots error naming the argument."""
    r = subprocess.run([sys.executable, "-c", _ENDLESS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert line.split()[1:] == ["InvalidArgumentError", "said", "unchanged"], line


def test_the_reference_model_stops_an_endless_iterator_where_the_extension_does(monkeypatch):
    """The pure-Python reference reads the extension's bound (lowered here, so the test reads
    100 items, not 2**24) and refuses the same item with the same words."""
    from kvslots.slots import reference

    monkeypatch.setattr(reference._core, "MAX_ITER_ITEMS", 100)
    ref = reference.ReferenceSlotManager(16, 4)
    ref.create("a", [1, 2, 3])
    before = (ref.slot_info("a"), ref.committed_tokens("a"))
    seen = []

    def endless():
        while True:
            seen.append(1)
            yield 1

    with pytest.raises(InvalidArgumentError, match=r"for request .a.: tokens gives more than 100 items \(an endless "
                       r"iterator\?\); pass a list or a numpy array"):
        ref.commit("a", endless())
    assert len(seen) == 100
    grown = [1]

    class Grows:  # each item's __index__ appends one more: a list that never ends
        def __index__(self):
            grown.append(Grows())
            return 1

    grown[0] = Grows()
    with pytest.raises(InvalidArgumentError, match="more than 100 items"):
        ref.commit("a", grown)
    assert (ref.slot_info("a"), ref.committed_tokens("a")) == before


def test_disk_index_events_msgpack_drain_must_be_a_bool():
    """``drain`` was pyo3's own bool: a str or an int raised a builtin TypeError."""
    d = _core.DiskIndex(4, 2)
    d.complete_write(d.begin_write(11, [1, 2]), True)
    for bad in ("r", 1, None):
        with pytest.raises(ArgumentTypeError, match="drain must be a bool"):
            d.events_msgpack(0.0, drain=bad)
        assert d.num_pending_events() == 1
    d.events_msgpack(0.0, drain=True)
    assert d.num_pending_events() == 0


def test_score_blocks_eagle_iterator_that_raises_is_a_kvslots_error():
    """An ``eagle`` iterator raising part way let its exception escape as it was."""

    def gen():
        yield "w"
        raise ZeroDivisionError("boom")

    ix = _core.PrefixIndex()
    ix.add_worker("w")
    before = (ix.dump(), ix.workers(), ix.worker_eagle("w"))
    with pytest.raises(InvalidArgumentError, match="eagle") as e:
        ix.score_blocks([{"w": 1}], list(range(8)), 4, gen())
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert (ix.dump(), ix.workers(), ix.worker_eagle("w")) == before


def test_watermark_statuses_are_a_list_or_tuple():
    """pyo3's Vec extraction raised a builtin TypeError for a non-sequence."""
    m = _core.DeviceKVManager(16, 4, max_model_len=64, watermark_blocks=2)
    for bad in (5, "WAITING", None, {"WAITING"}):
        with pytest.raises(ArgumentTypeError, match="statuses"):
            m._set_watermark_statuses(bad)
    m._set_watermark_statuses(("WAITING",))
    m._set_watermark_statuses(["WAITING", "PREEMPTED"])
    running = _DeviceReq("a")
    running.status = "RUNNING"  # the watermark reads each request's status now
    assert m.allocate_slots(running, 8) is not None and m.check_invariants() is None


def test_the_base_device_manager_records_evictions_without_a_hook():
    """``record_evictions=True`` on the extension's class itself (no ``_on_alloc``, which only
    the vLLM subclass defines): an allocation that registered or evicted blocks was made, then
    raised a builtin AttributeError, its new blocks lost to the caller. Now the allocation
    returns its blocks and the evictions wait in ``drain_evicted``."""
    m = _core.DeviceKVManager(8, 4, max_model_len=64, record_evictions=True)
    a = _DeviceReq("a")
    assert m.allocate_slots(a, 8).get_block_ids() == ([1, 2],)
    m.cache_blocks(a, 8)  # registers blocks 1, 2
    m.free(a)
    b = _DeviceReq("b", 28)
    blocks = m.allocate_slots(b, 28)  # needs every free block: evicts a's cached ones
    assert blocks is not None and len(blocks.get_block_ids()[0]) == 7
    assert len(m.drain_evicted()) == 2
    assert m.check_invariants() is None


def test_a_huge_list_of_tuples_is_refused_at_its_first_bad_item():
    """The same rule for a plain iterable: items are converted as they come."""
    c = _core.HostCache(8, 2)

    def items():
        yield (1, 2)
        yield 5
        raise AssertionError("read past the first bad item")

    before = (c.stats(), c.num_storing, c.registered_hashes())
    with pytest.raises(ArgumentTypeError, match=r"stores\[1\]"):
        c.complete_store(items(), None, [])
    assert (c.stats(), c.num_storing, c.registered_hashes()) == before
    with pytest.raises(KVSlotsError):
        c.abort_store(np.broadcast_to(np.uint32(1), (2**40,)))
