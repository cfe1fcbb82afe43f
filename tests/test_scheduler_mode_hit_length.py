"""Scheduler mode's get_computed_blocks reads max_cache_hit_length (vLLM 0.33) and the request's
num_tokens as the bindings read every integer: int() took True as 1, "5" as 5 and 3.9 as 3,
and raised Python's ValueError for NaN."""

from __future__ import annotations

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

from kvslots.errors import ArgumentTypeError  # noqa: E402
from kvslots.vllm.scheduler import KVSlotsKVCacheManager  # noqa: E402

BS = 16
init_none_hash(sha256)
_HASHER = get_request_block_hasher(BS, sha256)


def _setup():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    m = KVSlotsKVCacheManager(kv_cache_config=cfg, max_model_len=1024, scheduler_block_size=BS,
                              hash_block_size=BS, enable_caching=True, log_stats=True)

    def req(rid):
        return Request(request_id=rid, prompt_token_ids=list(range(1, 4 * BS + 2)),
                       sampling_params=SamplingParams(max_tokens=4), pooling_params=None, block_hasher=_HASHER)

    a = req("a")
    assert m.allocate_slots(a, 4 * BS + 1) is not None
    m.free(a)  # its 4 full blocks stay cached
    return m, req("b")


@pytest.mark.parametrize("bad", [True, 3.9, float("nan"), "32", b"1"])
def test_a_hit_length_that_is_no_int_is_refused(bad):
    m, b = _setup()
    with pytest.raises(ArgumentTypeError, match="max_cache_hit_length"):
        m.get_computed_blocks(b, bad)
    assert m.num_cached_blocks() == 4


def test_int_hit_lengths_still_cap_the_hit():
    m, b = _setup()
    assert m.get_computed_blocks(b)[1] == 4 * BS
    assert m.get_computed_blocks(b, 2 * BS + 3)[1] == 2 * BS
    assert m.get_computed_blocks(b, -5)[1] == 0


@pytest.mark.parametrize("blocks, tokens, err", [
    ("hit", 2 * BS + 1, "not block aligned"), ("hit", 8 * BS, "cannot truncate"), ("hit", True, "must be an int"),
    ("hit", "32", "must be an int"), ("hit", float("nan"), "must be an int"), (None, BS, "must be KVBlocks"),
])
def test_truncate_computed_blocks_raises_kvslots_errors(blocks, tokens, err):
    """Python's ValueError (and for True, a str or None: 1 % 16's ValueError, TypeError,
    AttributeError) before."""
    from kvslots.errors import KVSlotsError

    m, b = _setup()
    hit = m.get_computed_blocks(b)[0] if blocks == "hit" else blocks
    with pytest.raises(KVSlotsError, match=err):
        m.truncate_computed_blocks(hit, tokens)


def test_truncate_computed_blocks_truncates():
    m, b = _setup()
    hit = m.get_computed_blocks(b)[0]
    assert m.truncate_computed_blocks(hit, 2 * BS).get_block_ids() == ([*hit.get_block_ids()[0][:2]],)
    assert m.truncate_computed_blocks(hit, 0).num_blocks == 0
