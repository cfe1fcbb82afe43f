"""Scheduler mode's KV events are built before an allocation or cache_blocks changes anything:
a request whose fields raise while its BlockStored is built leaves the manager as it was."""

from __future__ import annotations

import contextlib
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvslots.errors import KVSlotsError  # noqa: E402
from kvslots.vllm.scheduler import KVSlotsKVCacheManager  # noqa: E402

BS = 16
init_none_hash(sha256)
_HASHER = get_request_block_hasher(BS, sha256)


class Boom(Exception):
    pass


class BadLora:
    """A LoRA request whose fields raise once armed (the event reads them)."""

    armed = False
    lora_int_id = 1

    def __bool__(self) -> bool:
        return True

    def __getattr__(self, name):
        if type(self).armed:
            raise Boom(name)
        return 1 if name == "adapter_id" else "lora"


def manager() -> KVSlotsKVCacheManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVSlotsKVCacheManager(kv_cache_config=cfg, max_model_len=1024, scheduler_block_size=BS,
                                 hash_block_size=BS, enable_caching=True, log_stats=True,
                                 enable_kv_cache_events=True)


def request(rid: str, n: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(1, n + 1)),
                   sampling_params=SamplingParams(max_tokens=100), pooling_params=None, block_hasher=_HASHER)


def state(m: KVSlotsKVCacheManager):
    assert m.check_invariants() is None
    return (m.num_free_blocks(), m.num_cached_blocks(), m.num_held_blocks(), m.request_ids(),
            {r: m.block_ids(r) for r in m.request_ids()}, m.device_stats(), m.num_evicted_pending(),
            len(m._events), m.last_commit())


@contextlib.contextmanager
def raises_boom():
    """What the request's fields raise while the event is built: a kvslots error, from Boom."""
    with pytest.raises(KVSlotsError, match="KV event") as ei:
        yield
    assert isinstance(ei.value.__cause__, Boom)


@pytest.fixture(autouse=True)
def _disarm():
    BadLora.armed = False
    yield
    BadLora.armed = False


def test_a_raising_event_leaves_the_allocation_undone():
    """The request's fields raised while its BlockStored was built after the allocation was made:
    the blocks stayed allocated and registered (free 31 -> 28, two registered) while Boom was
    reported. Now the event is built first: Boom, and the manager as before; the same call
    without the fault then succeeds with the events vLLM's manager gives."""
    m = manager()
    other = request("other", 2 * BS)
    assert m.allocate_slots(other, 2 * BS) is not None
    before = state(m)
    r = request("r", 3 * BS)
    r.lora_request = BadLora()
    BadLora.armed = True
    with raises_boom():
        m.allocate_slots(r, 3 * BS)
    assert state(m) == before
    assert "r" not in m
    BadLora.armed = False
    assert len(m.allocate_slots(r, 3 * BS).get_block_ids()[0]) == 3
    events = m.take_events()
    assert [len(e.block_hashes) for e in events] == [2, 3]


def test_a_raising_event_leaves_a_running_request_and_cache_blocks_unchanged():
    """The per-step call of a running request that fills a block, and cache_blocks, likewise."""
    m = manager()
    r = request("r", BS + 4)
    r.lora_request = BadLora()
    assert m.allocate_slots(r, BS + 4) is not None
    m.take_events()
    r.num_computed_tokens = BS + 4
    for t in range(BS - 4):
        r.append_output_token_ids(100 + t)
    before = state(m)
    BadLora.armed = True
    with raises_boom():
        m.allocate_slots(r, BS - 4)
    assert state(m) == before
    # cache_blocks of the filled block (delayed caching registered nothing at allocation).
    with raises_boom():
        m.cache_blocks(r, 2 * BS)
    assert state(m) == before
    BadLora.armed = False
    assert m.allocate_slots(r, BS - 4) is not None
    assert [len(e.block_hashes) for e in m.take_events()] == [1]
    assert m.check_invariants() is None


def test_a_request_that_changes_the_manager_while_its_event_is_built_allocates_nothing():
    """The event is built with no borrow held, so the request's fields may call the manager: a
    request whose LoRA fields free another allocation of it meanwhile gets ConcurrentUseError
    and nothing allocated (its first allocation's free stands); the manager stays consistent."""
    from kvslots.errors import ConcurrentUseError

    m = manager()
    r = request("r", BS + 4)
    assert m.allocate_slots(r, BS + 4) is not None
    m.take_events()

    class Freeing(BadLora):
        def __getattr__(self, name):
            m.free(r)
            return super().__getattr__(name)

    r.num_computed_tokens = BS + 4
    for t in range(BS - 4):
        r.append_output_token_ids(100 + t)
    r.lora_request = Freeing()  # after the appends: the block hasher reads it too
    free_after_free = m.num_free_blocks() + 2
    with pytest.raises(ConcurrentUseError, match="nothing was allocated"):
        m.allocate_slots(r, BS - 4)
    assert "r" not in m
    assert m.num_free_blocks() == free_after_free
    assert m.check_invariants() is None


def test_a_duck_typed_request_without_vllm_fields_gets_a_kvslots_error():
    """A request with what allocate_slots reads but not the fields vLLM's event helpers read
    (mm_features): Python's AttributeError came out of allocate_slots with events on."""
    m = manager()

    class Duck:
        request_id = "duck"
        num_computed_tokens = 0
        block_hashes = [bytes([i]) * 32 for i in range(1, 3)]
        all_token_ids = _all_token_ids = list(range(2 * BS))
        lora_request = None
        status = None

    before = state(m)
    with pytest.raises(KVSlotsError, match="KV event") as ei:
        m.allocate_slots(Duck(), 2 * BS)
    assert isinstance(ei.value.__cause__, AttributeError)
    assert state(m) == before
