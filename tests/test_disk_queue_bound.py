"""disk_queue_len is bounded by what its queue can hold in host memory: each queued write is a
copy of its block (1,000 queued blocks of 1 MiB held 999 MB on a frozen disk), so a queue longer
than the host tier (and the default of 64) is refused when the connector starts, naming the
memory it could take; the config alone took up to 2**31."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from kvslots.errors import ConnectorConfigError  # noqa: E402
from kvslots.vllm.connector import KVSlotsConnector  # noqa: E402

from vllm_harness import engine_config, kv_cache_config  # noqa: E402


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    return engine_config(models["target"], None, num_blocks=16)


def connector(cfg, tmp_path, role, **extra):
    cfg = copy.deepcopy(cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = {"disk_path": str(tmp_path / "disk"), "disk_blocks": 32,
                                                        **extra}
    c = KVSlotsConnector(cfg, role, kv_cache_config(16))
    if c._disk_worker is not None:
        c._disk_worker.close()
    return c


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
@pytest.mark.parametrize("host, queue", [(8, 65), (8, 2**31 - 1), (200, 201)])
def test_a_queue_longer_than_the_host_tier_is_refused(cfg, tmp_path, role, host, queue):
    with pytest.raises(ConnectorConfigError, match=r"disk_queue_len=\d+: .* GiB of host memory.*at most") as e:
        connector(cfg, tmp_path, role, host_cache_blocks=host, disk_queue_len=queue)
    assert f"at most {max(64, host)}" in str(e.value)
    assert not (tmp_path / "disk").exists()  # refused before the file is made


@pytest.mark.parametrize("host, queue", [(8, 64), (8, 1), (200, 200)])
def test_a_queue_up_to_the_host_tier_or_the_default_is_taken(cfg, tmp_path, host, queue):
    c = connector(cfg, tmp_path, KVConnectorRole.WORKER, host_cache_blocks=host, disk_queue_len=queue)
    assert c._disk_worker is not None and c.config.disk_queue_len == queue
