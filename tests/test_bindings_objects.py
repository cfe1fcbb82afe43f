"""The extension's objects as Python objects: weak references, the garbage collector, copies,
hashing, subclassing. Every class of ``kvslots._core`` is enumerated (``_EVERY_CLASS`` of
test_bindings_robust), so a class added without the rule fails here."""

import copy
import gc
import pickle
import weakref

import numpy as np
import pytest

import kvslots
from kvslots import _core
from kvslots.errors import ArgumentTypeError, InvalidArgumentError

from test_bindings_robust import _EVERY_CLASS, VALUE_CLASSES, _PlannerReq, _core_classes


def test_every_class_is_listed():
    assert sorted(_EVERY_CLASS) == _core_classes()


@pytest.mark.parametrize("name", _core_classes() + ["kvslots.SlotManager"])
def test_every_object_of_the_extension_takes_a_weak_reference(name, tmp_path):
    """weakref.ref(HostCache(...)) (and of every other class) raised TypeError: "cannot create
    weak reference to 'kvslots._core.HostCache' object"; caches, registries and vLLM's own
    code keep weak references to objects they do not own. Now every class takes one (and a
    WeakValueDictionary, a finalizer), the reference dies with the object, and the object
    works as before."""
    if name == "kvslots.SlotManager":  # the Python subclass
        build, read = (lambda tmp: kvslots.SlotManager(64, 4)), (lambda o: o.num_free)
    else:
        build, read = _EVERY_CLASS[name]
    obj = build(tmp_path)
    before = read(obj)
    ref = weakref.ref(obj)
    assert ref() is obj
    proxy = weakref.proxy(obj)
    assert repr(proxy)
    registry = weakref.WeakValueDictionary({"k": obj})
    finalized = []
    weakref.finalize(obj, finalized.append, name)
    assert read(obj) == before and registry["k"] is obj
    del obj, proxy
    gc.collect()
    assert ref() is None and "k" not in registry and finalized == [name]


class _Holder:
    """Any Python object with attributes (a vLLM request, a status) that can refer back."""


class _Array(np.ndarray):
    """An array with attributes (a torch tensor has them too)."""


def _planner_cycle(tmp):
    p = _core.ConnectorPlanner(2, 8, False)
    req = _PlannerReq([1, 2, 3, 4], 4, 2)
    req.back = p
    p.track(req)
    assert p.num_tracked == 1
    return p


def _region_cycle(tmp):
    a = np.zeros(64, np.uint8).view(_Array)
    a.back = _core.BlockRegion(a, block_bytes=8, num_blocks=8)
    return a.back


def _device_manager_cycle(tmp):
    m = _core.DeviceKVManager(64, 4, max_model_len=256)
    status = _Holder()
    status.back = m
    m._set_watermark_statuses([status])
    return m


def _disk_store_cycle(tmp):
    s = _core.DiskStore(str(tmp / "f.bin"), num_slots=4, block_size=2, num_layers=1, bytes_per_block=8,
                        dtype="uint8", fingerprint=1)
    out = np.zeros((2, 8), np.uint8).view(_Array)
    out.back = s
    s.read_rows_async([0], [5], out, [0])  # an empty slot: kept until take_reads
    assert s.wait_reads(5)
    return s


@pytest.mark.parametrize("make", [_planner_cycle, _region_cycle, _device_manager_cycle, _disk_store_cycle])
def test_a_reference_cycle_through_an_object_of_the_extension_is_collected(make, tmp_path):
    """The classes that hold Python objects (a planner its vLLM requests, a region its array, a
    device manager its watermark statuses, a disk store the arrays of its reads) did not tell
    the cycle collector about them: a cycle through one (a request or array whose attribute
    refers back, easily made by a cache or a callback) was never freed, objects and native
    memory with it. Now gc.collect() frees it, and gc.get_referents names what it holds."""
    obj = make(tmp_path)
    assert len(gc.get_referents(obj)) > 1  # its type, and what it holds
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    assert ref() is None


def _kv_blocks(tmp):
    return _core.KVBlocks([3, 4, 9])


@pytest.mark.parametrize("name", sorted(VALUE_CLASSES))
def test_the_value_classes_pickle_and_copy_as_values(name, tmp_path):
    """SlotInfo (seven counters), ApplyStats (nine counts) and KVBlocks (a list of block ids)
    refused pickle / copy.copy / copy.deepcopy with NotCopyableError, though each is a plain
    value the engine hands out (the reference model's SlotInfo, a frozen dataclass, pickles and
    hashes; the core's was not even hashable). Now each gives an equal value, of the same
    class, that does not share anything mutable."""
    build = _kv_blocks if name == "KVBlocks" else _EVERY_CLASS[name][0]
    obj = build(tmp_path)
    key = (lambda o: o.get_block_ids()) if name == "KVBlocks" else (lambda o: o)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(obj, protocol=proto))
        assert type(back) is type(obj) and key(back) == key(obj) and repr(back) == repr(obj)
    for call in (copy.copy, copy.deepcopy):
        assert key(call(obj)) == key(obj)
    [inner] = copy.deepcopy([obj])
    assert key(inner) == key(obj)
    if name != "KVBlocks":  # frozen values: equal ones hash alike
        assert hash(back) == hash(obj) and {obj: 1}[back] == 1 and obj != object()


def test_slot_info_and_apply_stats_equal_and_hash_as_values():
    t = _core.SlotTracker(4)
    t.add("a")
    t.add("b")
    assert t.slot_info("a") == t.slot_info("b") and len({t.slot_info("a"), t.slot_info("b")}) == 1
    fields = ("committed", "pending", "lookahead", "reserved_lookahead", "num_blocks", "num_immutable", "capacity")
    info = _core.SlotInfo(*range(1, 8))
    assert tuple(getattr(info, f) for f in fields) == tuple(range(1, 8))
    assert _core.SlotInfo(**dict(zip(fields, range(1, 8)))) == info


@pytest.mark.parametrize("bad, kind", [(-1, InvalidArgumentError), (2**64, InvalidArgumentError),
                                       (True, ArgumentTypeError), (1.0, ArgumentTypeError),
                                       (float("nan"), ArgumentTypeError), ("1", ArgumentTypeError),
                                       (None, ArgumentTypeError)])
def test_the_value_constructors_take_counts_only(bad, kind):
    """The constructors pickle rebuilds with take non-negative ints only (a crafted pickle
    cannot make a negative or wrapped counter)."""
    with pytest.raises(kind):
        _core.SlotInfo(bad, 0, 0, 0, 0, 0, 0)
    with pytest.raises(kind):
        _core.ApplyStats(0, 0, 0, 0, 0, 0, 0, 0, bad)
    with pytest.raises(kind):
        _core.KVBlocks([bad])
