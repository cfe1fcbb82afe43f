"""Hostile input to kvslots.vllm's entry points that do not need vLLM's engine: version strings
(kvslots.vllm.compat). Each ends in success or a kvslots exception."""

from __future__ import annotations

import pytest

from kvslots.errors import KVSlotsError
from kvslots.vllm.compat import UnsupportedVLLMVersionError, features_for, parse_series


class _ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize("junk", [
    "9" * 5000 + ".32",          # was int()'s ValueError (over its 4300-digit limit)
    "0." + "3" * 5000,
    "0" * 100_000 + ".32",
    "\uff10.\uff13\uff12",       # full-width digits: were read as 0.32
    "\u0660.\u0663\u0662",       # Arabic-Indic digits: the same
    "-0.32", "0..32", "1e5.2", _ReprRaises(), float("nan"), ["0.32"],
])
def test_odd_version_strings_are_kvslots_errors(junk):
    with pytest.raises(UnsupportedVLLMVersionError) as ei:
        parse_series(junk)
    assert isinstance(ei.value, KVSlotsError)
    assert len(str(ei.value)) < 300  # the version is shortened in the message


@pytest.mark.parametrize("version, series", [
    ("0.32.0", (0, 32)), (" v0.33.1rc1.dev3+g1", (0, 33)), ("000.032", (0, 32)), ("0.32-", (0, 32)),
])
def test_plain_versions_still_parse(version, series):
    assert parse_series(version) == series


def test_unsupported_long_version_message_is_short():
    with pytest.raises(UnsupportedVLLMVersionError, match="0.99") as ei:
        features_for("0.99." + "x" * 10_000)
    assert len(str(ei.value)) < 300


def _kcc(num_blocks: int = 64, groups: int = 1):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    layers, page = ["a", "b"], 16 * 2 * 2 * 4
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page * num_blocks,
                                        block_stride=page) for n in layers],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)] * groups)


@pytest.mark.parametrize("kw", [
    {"watermark": float("nan")},   # was int()'s ValueError
    {"watermark": float("inf")},   # was an OverflowError
    {"watermark": "0.1"},          # was a TypeError
    {"watermark": None},
    {"watermark": 1.5},            # vLLM's own SchedulerConfig refuses >= 1
    {"num_hash_lookahead_tokens": "x"},           # was a ValueError
    {"num_hash_lookahead_tokens": float("nan")},
    {"num_hash_lookahead_tokens": -1},            # was taken as is
])
def test_scheduler_mode_manager_hostile_options_are_scheduler_mode_errors(kw):
    from kvslots.vllm.scheduler.kv_cache_manager import KVSlotsKVCacheManager, SchedulerModeError

    with pytest.raises(SchedulerModeError):
        KVSlotsKVCacheManager(_kcc(), max_model_len=2048, scheduler_block_size=16, hash_block_size=16, **kw)


def test_scheduler_mode_with_no_kv_cache_group_is_refused_by_name():
    # An attention-free model has no KV cache group: kv_cache_groups[0] was an IndexError.
    from kvslots.vllm.scheduler.kv_cache_manager import KVSlotsKVCacheManager, SchedulerModeError

    with pytest.raises(SchedulerModeError, match="0 KV cache groups"):
        KVSlotsKVCacheManager(_kcc(groups=0), max_model_len=2048, scheduler_block_size=16, hash_block_size=16)


def test_scheduler_mode_manager_plain_options_still_work():
    from kvslots.vllm.scheduler.kv_cache_manager import KVSlotsKVCacheManager

    m = KVSlotsKVCacheManager(_kcc(), max_model_len=2048, scheduler_block_size=16, hash_block_size=16,
                              watermark=0.5, num_hash_lookahead_tokens=None)
    assert m.watermark_blocks == 32 and m.num_hash_lookahead_tokens == 0


@pytest.mark.parametrize("data", [None, {}, {"gauges": None}, {"counters": [1, 2]}, {"gauges": 5, "counters": "x"},
                                  [("gauges", {})], {"gauges": {"host/used_blocks": 3}}])
def test_connector_stats_from_odd_data(data):
    # {"gauges": None} and {"counters": [1, 2]} were TypeErrors from dict()
    pytest.importorskip("vllm")
    from kvslots.vllm.connector import KVSlotsConnector

    stats = KVSlotsConnector.build_kv_connector_stats(data)
    assert set(stats.data) == {"gauges", "counters"}
    assert all(isinstance(v, dict) for v in stats.data.values())
    if isinstance(data, dict) and isinstance(data.get("gauges"), dict):
        assert stats.data["gauges"] == data["gauges"] and stats.data["gauges"] is not data["gauges"]
