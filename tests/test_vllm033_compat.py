"""The vLLM version table (kvslots.vllm.compat), the start-up check, and sleep mode on the
connector (vLLM 0.33's sleep hooks), at scheduler level with vLLM's real Scheduler.

Runs in both environments: the 0.32 run checks the table's 0.32 row against the installed vLLM,
the 0.33 run (``make test-033``) the 0.33 row and the sleep hooks vLLM 0.33 calls.
"""

from __future__ import annotations

import copy
import random

import pytest

from kvslots.errors import ConfigError, KVSlotsError
from kvslots.vllm import compat
from kvslots.vllm.compat import UnsupportedVLLMVersionError, features_for, parse_series


@pytest.mark.parametrize("version, series", [
    ("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)), ("0.33.0", (0, 33)), ("0.33.1rc1.dev7+gabc", (0, 33)),
    ("v0.33.2", (0, 33)), ("0.32", (0, 32)),
])
def test_supported_versions_map_to_their_row(version, series):
    row = features_for(version)
    assert row.series == series
    assert row.block_stored_lookahead == (series == (0, 33))
    assert row.cli_args_module.endswith(("launchers.cli_args", "common.cli_args"))


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "0.3.30", "0.330.0"])
def test_unsupported_version_names_the_supported_range(version):
    with pytest.raises(UnsupportedVLLMVersionError) as ei:
        features_for(version)
    assert "0.32.x, 0.33.x" in str(ei.value) and version in str(ei.value)
    assert ei.value.version == version
    assert isinstance(ei.value, ConfigError) and isinstance(ei.value, KVSlotsError)


@pytest.mark.parametrize("junk", ["", "dev", "latest", "..", "\udcff", None, 33, b"0.33.0"])
def test_a_version_that_is_not_one_is_a_kvslots_error(junk):
    with pytest.raises(UnsupportedVLLMVersionError):
        parse_series(junk)  # type: ignore[arg-type]


def test_missing_vllm_is_reported_not_crashed(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda: None)
    compat.features.cache_clear()
    try:
        with pytest.raises(UnsupportedVLLMVersionError, match="not installed"):
            compat.check_supported()
    finally:
        compat.features.cache_clear()


# ---------------------------------------------------------------- with the installed vLLM

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")


def test_installed_vllm_is_supported_and_its_row_matches_it():
    import importlib

    from vllm.distributed import kv_events
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    import inspect

    row = compat.check_supported()
    assert row.series == parse_series(vllm.__version__)
    assert row.block_stored_lookahead == ("lookahead_token_ids" in kv_events.BlockStored.__struct_fields__)
    assert row.connector_sleep_hooks == hasattr(KVConnectorBase_V1, "restore_kv_caches")
    params = inspect.signature(KVCacheManager.__init__).parameters
    assert row.kv_manager_hash_lookahead == ("num_hash_lookahead_tokens" in params)
    gcb = inspect.signature(KVCacheManager.get_computed_blocks).parameters
    assert row.computed_blocks_max_hit_length == ("max_cache_hit_length" in gcb)
    mod = compat.cli_args_module()
    assert mod is importlib.import_module(row.cli_args_module)
    assert callable(mod.make_arg_parser) and callable(mod.validate_parsed_serve_args)


def test_connector_stops_at_start_up_on_an_unsupported_vllm(monkeypatch):
    from kvslots.vllm.connector import KVSlotsConnector

    monkeypatch.setattr(compat, "installed_version", lambda: "0.34.0")
    compat.features.cache_clear()
    try:
        with pytest.raises(UnsupportedVLLMVersionError, match=r"0\.32\.x, 0\.33\.x"):
            KVSlotsConnector(None, None, None)  # type: ignore[arg-type]
    finally:
        compat.features.cache_clear()


def test_scheduler_mode_stops_at_start_up_on_an_unsupported_vllm(monkeypatch):
    from kvslots.vllm.scheduler import KVSlotsScheduler

    monkeypatch.setattr(compat, "installed_version", lambda: "0.31.0")
    compat.features.cache_clear()
    try:
        with pytest.raises(UnsupportedVLLMVersionError, match=r"vLLM 0\.31\.0 is not supported"):
            KVSlotsScheduler.__init__(object.__new__(KVSlotsScheduler), None)
    finally:
        compat.features.cache_clear()


# ---------------------------------------------------------------- sleep mode


@pytest.fixture(scope="module")
def eagle_cfg(tmp_path_factory):
    from kvslots._dev.tiny import build_tiny_models
    from vllm_harness import engine_config

    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    return engine_config(models["target"], models["eagle"], k=3, num_blocks=64)


def test_sleep_drops_the_host_tier_and_wake_up_serves_again(eagle_cfg):
    from vllm_harness import DRAFT_BASE, Harness

    from kvslots.vllm.connector import KVSlotsConnector

    assert KVSlotsConnector.supports_sleep_mode(eagle_cfg.kv_transfer_config) is True
    cfg = copy.deepcopy(eagle_cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": 512}
    h = Harness(cfg, num_blocks=64, seed=4)
    rng = random.Random(4)
    shared = [rng.randrange(1, DRAFT_BASE) for _ in range(70)]
    h.add("a", shared + [1, 2, 3], max_tokens=20)
    h.run_until_done()
    assert h.sched_side.host.num_cached > 0
    h.check_host_tier()

    # What vLLM does on sleep (level >= 1): reset the prefix caches, the connector's included,
    # then the workers drop their KV registrations; on wake-up they register them again.
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    for w in h.workers:
        w.unregister_kv_caches()
        w.unregister_kv_caches()  # idempotent
        assert w._worker.copier is None
    assert h.sched_side.host.num_cached == 0
    h.step()  # the scheduler drains the connector's events into its publisher
    assert type(h.events[-1]).__name__ == "AllBlocksCleared"
    for w, caches in zip(h.workers, h.kv):
        w.restore_kv_caches()
        w.restore_kv_caches()  # idempotent
        assert w._worker.copier is not None
        assert set(w._worker._kv_caches) == set(caches)
        assert all(w._worker._kv_caches[n] is caches[n] for n in caches), "the same tensors"

    # After wake-up the connector stores and serves again, with the restored registrations.
    h.add("b", shared + [4, 5, 6], max_tokens=20)
    h.run_until_done()
    h.check_host_tier()
    assert h.sched_side.host.num_cached > 0
    before = h.sched_side.stats["hit_tokens"]
    h.scheduler.reset_prefix_cache()  # device prefix cache only: the host tier must serve
    h.add("c", shared + [7, 8, 9], max_tokens=5)
    h.run_until_done()
    assert h.sched_side.stats["hit_tokens"] > before
    h.check_host_tier()
