"""The extension's objects as Python objects: weak references, the garbage collector, copies,
hashing, subclassing. Every class of ``kvslots._core`` is enumerated (``_EVERY_CLASS`` of
test_bindings_robust), so a class added without the rule fails here."""

import gc
import weakref

import pytest

import kvslots
from kvslots import _core

from test_bindings_robust import _EVERY_CLASS, _core_classes


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
