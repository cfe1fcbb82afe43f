"""kvslots' exceptions survive pickling (vLLM sends them across its process boundaries) with
their class, message and attributes."""

from __future__ import annotations

import copy
import pickle

import pytest

import kvslots.errors as E
from kvslots import SlotManager

ATTRS = ("request_id", "details", "field", "source", "version", "kind", "reason", "needed")


def make(cls: type[E.KVSlotsError]) -> E.KVSlotsError:
    if issubclass(cls, E.UnsupportedVLLMVersionError):
        return cls("vLLM 0.1.0 is not supported", version="0.1.0")
    if issubclass(cls, E.ConfigError):
        return cls("must be > 0", field="speculative_config.max_draft_len", source="engine.yaml")
    return cls(f"{cls.__name__}: request 'r-1' wants 3", "r-1", {"kind": "peer", "needed": 3})


def same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b) and a.args == b.args
    assert a.__dict__ == b.__dict__
    for name in ATTRS:
        assert getattr(a, name, "absent") == getattr(b, name, "absent"), name


@pytest.mark.parametrize("name", E.__all__)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_error_class_round_trips_through_pickle(name, protocol):
    err = make(getattr(E, name))
    same(err, pickle.loads(pickle.dumps(err, protocol)))
    same(err, copy.deepcopy(err))


def test_attributes_of_each_constructor_survive():
    v = pickle.loads(pickle.dumps(E.UnsupportedVLLMVersionError("bad", version="0.1")))
    assert v.version == "0.1" and str(v) == "bad" and v.field is None and v.source is None
    c = pickle.loads(pickle.dumps(E.ConfigError("bad", field="a.b", source="f.yaml")))
    assert str(c) == "f.yaml: a.b: bad" and (c.field, c.source, c.reason) == ("a.b", "f.yaml", "bad")
    t = pickle.loads(pickle.dumps(E.TransferError("timed out", details={"kind": "timeout", "num_blocks": 4})))
    assert t.kind == "timeout" and t.num_blocks == 4 and t.details == {"kind": "timeout", "num_blocks": 4}
    k = pickle.loads(pickle.dumps(E.UnknownRequestError('unknown request "x"', "x")))
    assert str(k) == 'unknown request "x"' and k.request_id == "x" and isinstance(k, KeyError)


def test_errors_raised_by_the_rust_core_round_trip():
    m = SlotManager(4, 2)
    with pytest.raises(E.UnknownRequestError) as unknown:
        m.finish("zz")
    m.create("a", [1])
    with pytest.raises(E.OutOfBlocksError) as out:
        m.reserve("a", 100)
    for err in (unknown.value, out.value):
        same(err, pickle.loads(pickle.dumps(err)))
    assert pickle.loads(pickle.dumps(out.value)).needed == out.value.needed > 0


def test_a_core_error_past_two_to_the_64_keeps_its_exact_figures():
    # The core's error fields were u64: `needed` read 2**64-1 for the 2**65-2 blocks (new tokens
    # plus lookahead, at block size 1) this takes.
    m = SlotManager(4, 1)
    m.create("a", [], lookahead=2**64 - 1)
    with pytest.raises(E.OutOfBlocksError) as e:
        m.reserve("a", 2**64 - 1)
    assert (e.value.needed, e.value.available, e.value.total) == (2**65 - 2, 4, 4)
    assert "needs 36893488147419103230 more block(s)" in str(e.value)
    same(e.value, pickle.loads(pickle.dumps(e.value)))
