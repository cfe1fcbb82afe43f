"""kv_connector_extra_config: defaults, unknown keys and bad values named at start-up, and the
vLLM plugin entry point that makes the module path optional."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from kvslots.vllm import CONNECTOR_NAME, ConnectorConfig, ConnectorConfigError, register  # noqa: E402


def test_empty_or_absent_config_uses_defaults():
    assert ConnectorConfig.from_extra_config(None) == ConnectorConfig.from_extra_config({}) == ConnectorConfig()
    cfg = ConnectorConfig.from_extra_config({"host_cache_gb": 0.5})
    assert cfg.num_host_blocks(1 << 20) == 512


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"host_cache_size": 1}, "host_cache_size"),
        ({"host_cache_gb": -1}, "host_cache_gb"),
        ({"host_cache_gb": "lots"}, "host_cache_gb"),
        ({"host_cache_blocks": 0}, "host_cache_blocks"),
        ({"copy_threads": 1.5}, "copy_threads"),
        ({"eagle_block_drop": "sometimes"}, "eagle_block_drop"),
        ({"events_endpoint": "localhost"}, "events_endpoint"),
        ({"events_topic": 3}, "events_topic"),
    ],
)
def test_bad_config_names_the_key(extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.parametrize("extra, named", [
    ({"host_cache_gb": float("inf")}, "host_cache_gb"),
    ({"host_cache_gb": float("nan")}, "host_cache_gb"),
    ({"host_cache_gb": 1 << 20}, "host_cache_gb"),
    ({"host_cache_blocks": 1 << 31}, "host_cache_blocks"),
    ({"copy_threads": 1025}, "copy_threads"),
    ({"events_hwm": 1 << 31}, "events_hwm"),
    ({"events_topic": "x" * 10_000, "bogus" * 1000: 1}, "unknown key"),
])
def test_sizes_are_bounded_so_sizing_never_overflows(extra, named):
    # infinity GiB once passed and then overflowed num_host_blocks (OverflowError)
    with pytest.raises(ConnectorConfigError, match=named) as ei:
        ConnectorConfig.from_extra_config(extra)
    assert len(str(ei.value)) < 2000  # values are shortened in messages
    big = ConnectorConfig.from_extra_config({"host_cache_gb": (1 << 20) - 1})
    assert big.num_host_blocks(4096) == ((1 << 20) - 1) * (1 << 30) // 4096


@pytest.mark.parametrize("extra", [[("host_cache_gb", 1)], "host_cache_gb=1", 5])
def test_extra_config_that_is_not_a_mapping(extra):
    with pytest.raises(ConnectorConfigError, match="must be a mapping"):
        ConnectorConfig.from_extra_config(extra)


def test_tiny_host_cache_is_refused():
    with pytest.raises(ConnectorConfigError, match="host_cache_gb"):
        ConnectorConfig(host_cache_gb=1e-9).num_host_blocks(4096)


def test_bad_key_stops_the_scheduler_at_start_up(tmp_path):
    from kvslots._dev.tiny import build_tiny_models
    from vllm_harness import Harness, engine_config

    models = build_tiny_models(str(tmp_path))
    cfg = engine_config(models["target"], None, extra={"bogus": True})
    with pytest.raises(ConnectorConfigError, match="bogus"):
        Harness(copy.deepcopy(cfg), num_blocks=16)


def test_plugin_registers_the_connector_by_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # vLLM may load plugins more than once per process
    assert CONNECTOR_NAME in KVConnectorFactory._registry
    # The installed entry point is what vLLM's plugin loader finds.
    code = ("from importlib.metadata import entry_points;"
            "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'kvslots'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kvslots.vllm:register" in out
