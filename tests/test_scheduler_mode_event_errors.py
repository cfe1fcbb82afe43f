"""Scheduler mode's errors while a KV event is built blame the right party: what the request's
fields raise is the request's (InvalidArgumentError, ArgumentTypeError for a TypeError), and
what building the event raises otherwise (a vLLM whose BlockStored takes a new argument, a
subclass's _prepare_stored) is a KVSlotsError naming the request ("building the KV event for
request ... failed"); every one keeps its cause and leaves the manager as it was. Before, all of
them were "invalid argument: cannot read the request's fields for its KV event", naming no
request. get_computed_blocks's integer errors name the request too."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

import vllm.distributed.kv_events as kve  # noqa: E402

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError  # noqa: E402

from test_scheduler_mode_hook_atomic import BS, BadLora, Boom, manager, request, state  # noqa: E402


def test_a_changed_block_stored_is_not_blamed_on_the_request(monkeypatch):
    orig = kve.BlockStored

    def new_block_stored(*a, new_required_field, **kw):  # a vLLM release adding a field
        return orig(*a, **kw)
    monkeypatch.setattr(kve, "BlockStored", new_block_stored)
    m, r = manager(), request("r", 4 * BS)
    before = state(m)
    with pytest.raises(KVSlotsError, match="building the KV event for request 'r' failed") as ei:
        m.allocate_slots(r, 4 * BS)
    assert not isinstance(ei.value, InvalidArgumentError)
    assert isinstance(ei.value.__cause__, TypeError) and ei.value.request_id == "r"
    assert state(m) == before


@pytest.mark.parametrize("raised, kind", [(Boom, InvalidArgumentError), (TypeError, ArgumentTypeError)])
def test_a_raising_request_field_is_the_requests_fault(monkeypatch, raised, kind):
    m, r = manager(), request("r", 4 * BS)

    class Lora(BadLora):
        def __getattr__(self, name):
            raise raised(name)
    r.lora_request = Lora()
    before = state(m)
    with pytest.raises(kind, match="cannot read the request's fields for its KV event") as ei:
        m.allocate_slots(r, 4 * BS)
    assert isinstance(ei.value.__cause__, raised) and ei.value.request_id == "r"
    assert state(m) == before


def test_a_subclass_prepare_stored_raising_is_a_neutral_kvslots_error():
    class M(type(manager())):
        def _prepare_stored(self, request, start, end):
            raise ValueError("its own bug")
    m0 = manager()
    m0.__class__ = M
    r = request("r", 4 * BS)
    before = state(m0)
    with pytest.raises(KVSlotsError, match="building the KV event for request \"r\" failed: ValueError: its own bug") as ei:
        m0.allocate_slots(r, 4 * BS)
    assert not isinstance(ei.value, InvalidArgumentError)
    assert isinstance(ei.value.__cause__, ValueError) and ei.value.request_id == "r"
    assert state(m0) == before


@pytest.mark.parametrize("length", [True, "32"])
def test_a_bad_hit_length_names_the_request(length):
    m, r = manager(), request("b", 4 * BS)
    with pytest.raises(ArgumentTypeError, match="for request") as ei:
        m.get_computed_blocks(r, length)
    assert ei.value.request_id == "b"
