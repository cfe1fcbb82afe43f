"""The extension's objects as Python objects: weak references, the garbage collector, copies,
hashing, subclassing. Every class of ``kvslots._core`` is enumerated (``_EVERY_CLASS`` of
test_bindings_robust), so a class added without the rule fails here."""

import gc
import weakref

import numpy as np
import pytest

import kvslots
from kvslots import _core

from test_bindings_robust import _EVERY_CLASS, _PlannerReq, _core_classes


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
