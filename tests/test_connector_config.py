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
    ({"events_hwm": 1_000_001}, "events_hwm"),  # the publisher's MAX_HWM: refused at start, not at bind
    ({"events_topic": "x" * 10_000, "bogus" * 1000: 1}, "unknown key"),
])
def test_sizes_are_bounded_so_sizing_never_overflows(extra, named):
    # infinity GiB once passed and then overflowed num_host_blocks (OverflowError)
    with pytest.raises(ConnectorConfigError, match=named) as ei:
        ConnectorConfig.from_extra_config(extra)
    assert len(str(ei.value)) < 2000  # values are shortened in messages
    big = ConnectorConfig.from_extra_config({"host_cache_gb": (1 << 20) - 1})
    assert big.num_host_blocks(1 << 20) == ((1 << 20) - 1) * (1 << 30) // (1 << 20)
    with pytest.raises(ConnectorConfigError, match="host_cache_gb"):  # past the core's 2^31-1 blocks
        big.num_host_blocks(4096)


@pytest.mark.parametrize("extra", [[("host_cache_gb", 1)], "host_cache_gb=1", 5])
def test_extra_config_that_is_not_a_mapping(extra):
    with pytest.raises(ConnectorConfigError, match="must be a mapping"):
        ConnectorConfig.from_extra_config(extra)


def test_tiny_host_cache_is_refused():
    with pytest.raises(ConnectorConfigError, match="host_cache_gb"):
        ConnectorConfig(host_cache_gb=1e-9).num_host_blocks(4096)


def test_a_tier_that_holds_not_one_byte_is_refused_before_the_block_size_is_known():
    # kvslots serve checks this before vLLM starts (it was refused only in the engine).
    for kw, key in (({"host_cache_gb": 1e-300}, "host_cache_gb"), ({"host_cache_gb": 5e-324}, "host_cache_gb"),
                    ({"disk_path": "/x", "disk_gb": 1e-300}, "disk_gb")):
        cfg = ConnectorConfig(**kw)
        with pytest.raises(ConnectorConfigError, match=f"{key}=.* holds no block of 1 byte"):
            cfg.check_tiers_hold_a_block()
        assert cfg == ConnectorConfig(**kw)
    ConnectorConfig(host_cache_gb=1 / (1 << 30)).check_tiers_hold_a_block()  # one byte: a block may fit
    ConnectorConfig(host_cache_gb=1e-300, host_cache_blocks=4).check_tiers_hold_a_block()  # sized in blocks
    ConnectorConfig(disk_gb=1e-300).check_tiers_hold_a_block()  # no disk tier


@pytest.mark.parametrize("bpb", ["4096", None, 1.5, float("nan"), True, [4096]])
def test_sizing_needs_an_integer_bytes_per_block(bpb):
    # A str or None was a TypeError; NaN sized the tier as NaN blocks, 1.5 as a float count.
    from kvslots.errors import ArgumentTypeError

    cfg = ConnectorConfig(disk_path="/x")
    with pytest.raises(ArgumentTypeError, match="bytes_per_block"):
        cfg.num_host_blocks(bpb)
    with pytest.raises(ArgumentTypeError, match="bytes_per_block"):
        cfg.num_disk_blocks(bpb)
    assert cfg.num_host_blocks(1 << 20) == 4096


@pytest.mark.parametrize("says", [None, 1, 1.5, "true"])
def test_eagle_block_drop_needs_a_bool_from_vllm(says):
    from kvslots.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="vllm_says"):  # was returned as given
        ConnectorConfig().use_eagle_block_drop(says)
    assert ConnectorConfig().use_eagle_block_drop(True) is True
    assert ConnectorConfig(eagle_block_drop=False).use_eagle_block_drop(True) is False


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


class _ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def _deep(n: int) -> list:
    out: list = []
    cur = out
    for _ in range(n):
        cur.append([])
        cur = cur[0]
    return out


@pytest.mark.parametrize("extra, named", [
    # unknown keys of mixed types were sorted together: TypeError ('<' between str and int)
    ({1: 2, "a": 3}, "unknown key"),
    ({None: 1, ("t",): 2, "b": 3}, "unknown key"),
    ({_ReprRaises(): 1}, "unknown key"),
    # a value whose repr fails (nested past the recursion limit) was a RecursionError
    ({"host_cache_gb": _deep(100_000)}, "host_cache_gb"),
    ({"copy_threads": _ReprRaises()}, "copy_threads"),
    # 1, 0 and 1.0 equal True / False but are not booleans
    ({"eagle_block_drop": 1}, "eagle_block_drop"),
    ({"eagle_block_drop": 0}, "eagle_block_drop"),
    ({"eagle_block_drop": 1.0}, "eagle_block_drop"),
    # text that could never be encoded (lone surrogate) or holds NUL: refused up front, not
    # a UnicodeEncodeError in the worker (disk_path) or an unnamed error later (ZMQ, Mooncake)
    ({"disk_path": "/tmp/x\ud800"}, "disk_path"),
    ({"disk_path": "/tmp/\udc80"}, "disk_path"),
    ({"events_topic": "\ud800"}, "events_topic"),
    ({"events_topic": "a\0b"}, "events_topic"),
    ({"events_endpoint": "tcp://\ud800:1"}, "events_endpoint"),
    ({"events_endpoint": "tcp://127.0.0.1:5557\0"}, "events_endpoint"),
    ({"events_endpoint": "a://b"}, "events_endpoint"),
    ({"events_replay_endpoint": "udp://127.0.0.1:1"}, "events_replay_endpoint"),
    ({"pd_host": "\ud800"}, "pd_host"),
    ({"pd_host": "a\0b"}, "pd_host"),
    ({"pd_host": " "}, "pd_host"),
    ({"pd_host": "host name"}, "pd_host"),
    # wildcards would be advertised to peers (the rule of kvslots serve's --pd-host, one home)
    ({"pd_host": "*"}, "pd_host"),
    ({"pd_host": "0.0.0.0"}, "pd_host"),
])
def test_hostile_values_are_named_config_errors(extra, named):
    with pytest.raises(ConnectorConfigError, match=named) as ei:
        ConnectorConfig.from_extra_config(extra)
    assert len(str(ei.value)) < 2000


def test_accepted_text_and_booleans_are_unchanged():
    cfg = ConnectorConfig.from_extra_config({
        "eagle_block_drop": "false", "events_endpoint": "ipc:///tmp/kvs-ev", "events_topic": "",
        "pd_host": "10.0.0.1", "disk_path": "/tmp/kvslots disk"})
    assert cfg.eagle_block_drop is False and cfg.events_endpoint == "ipc:///tmp/kvs-ev"
    assert cfg.pd_host == "10.0.0.1" and cfg.disk_path == "/tmp/kvslots disk"
    for v in (True, False, "auto"):
        assert ConnectorConfig.from_extra_config({"eagle_block_drop": v}).eagle_block_drop == v


def test_disk_tier_too_large_for_its_index_is_a_config_error(tmp_path, monkeypatch):
    # 2^31-1 disk blocks made the disk index allocate ~160 GiB up front: the process aborted
    # (SIGABRT from the failed allocation in Rust) instead of stopping with a message.
    from kvslots._dev.tiny import build_tiny_models
    from kvslots.vllm.connector import connector as mod
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import engine_config, kv_cache_config

    models = build_tiny_models(str(tmp_path))
    cfg = engine_config(models["target"], None,
                        extra={"disk_path": str(tmp_path / "disk"), "disk_blocks": (1 << 31) - 1})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConnectorConfigError, match="disk_blocks"):
            mod.KVSlotsConnector(cfg, role, kv_cache_config(16))
    with pytest.raises(ConnectorConfigError, match="disk_gb"):
        mod._check_disk_index_fits(1 << 40, ConnectorConfig(disk_gb=1000.0))
    mod._check_disk_index_fits(1 << 10, ConnectorConfig())  # a small tier passes


def test_publisher_that_cannot_open_is_a_config_error(tmp_path, monkeypatch):
    from kvslots._dev.tiny import build_tiny_models
    from kvslots.errors import InvalidArgumentError
    from kvslots.vllm.connector import connector as mod
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import engine_config, kv_cache_config

    def refuse(cfg, dp_rank):
        raise InvalidArgumentError("endpoint refused")

    monkeypatch.setattr(mod, "_make_publisher", refuse)
    models = build_tiny_models(str(tmp_path))
    cfg = engine_config(models["target"], None, extra={"events_endpoint": "tcp://127.0.0.1:0"})
    with pytest.raises(ConnectorConfigError, match="events_endpoint.*endpoint refused"):
        mod.KVSlotsConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(16))


def test_tier_sized_in_gib_past_the_block_limit_is_named():
    # host_cache_gb 100000 at 1536-byte blocks: 7e10 blocks, refused by the planner with an
    # error naming num_blocks, not the key
    with pytest.raises(ConnectorConfigError, match="host_cache_gb"):
        ConnectorConfig(host_cache_gb=100000.0).num_host_blocks(1536)
    with pytest.raises(ConnectorConfigError, match="disk_gb"):
        ConnectorConfig(disk_gb=100000.0).num_disk_blocks(1536)
    assert ConnectorConfig(host_cache_gb=1.0).num_host_blocks(1) == 1 << 30


@pytest.mark.parametrize("kw, named", [
    ({"host_cache_gb": float("nan")}, "host_cache_gb"),   # was int()'s ValueError when sizing
    ({"host_cache_gb": float("inf")}, "host_cache_gb"),   # an OverflowError
    ({"disk_gb": "x"}, "disk_gb"),
    ({"host_cache_blocks": -5}, "host_cache_blocks"),     # was taken as -5 blocks
    ({"eagle_block_drop": 1}, "eagle_block_drop"),
    ({"pd_host": "a\0b"}, "pd_host"),
])
def test_public_constructor_checks_like_from_extra_config(kw, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorConfig(**kw)


def test_public_constructor_normalises_like_from_extra_config():
    import dataclasses

    cfg = ConnectorConfig(host_cache_gb=2, eagle_block_drop="TRUE", pd_timeout_s=5)
    assert cfg == ConnectorConfig.from_extra_config({"host_cache_gb": 2, "eagle_block_drop": "TRUE", "pd_timeout_s": 5})
    assert cfg.host_cache_gb == 2.0 and isinstance(cfg.host_cache_gb, float) and cfg.eagle_block_drop is True
    with pytest.raises(ConnectorConfigError, match="copy_threads"):
        dataclasses.replace(cfg, copy_threads=0)


def test_docs_key_table_lists_exactly_the_accepted_keys():
    """docs/connector.md's table of kv_connector_extra_config keys names every field, no more."""
    import dataclasses
    import re
    from pathlib import Path

    from kvslots.config.connector import ConnectorConfig as Config

    text = (Path(__file__).resolve().parents[1] / "docs" / "connector.md").read_text()
    section = text.split("## `kv_connector_extra_config`", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            documented |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    assert documented == {f.name for f in dataclasses.fields(Config)}
