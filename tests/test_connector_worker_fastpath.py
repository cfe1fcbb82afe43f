"""The worker side on steps with nothing to copy: vLLM skips the per-layer hooks
(has_connector_metadata is False for the shared empty metadata, also after vLLM pickles it to a
worker process), and get_transfer_results reports nothing without building anything shared."""

from __future__ import annotations

import copy
import pickle

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from kvslots.vllm.connector import KVSlotsConnector  # noqa: E402
from kvslots.vllm.connector.metadata import EMPTY_METADATA, KVSlotsMetadata, LoadSpec  # noqa: E402

from vllm_harness import BLOCK_SIZE, HEAD, HEADS, LAYERS, engine_config, kv_cache_config  # noqa: E402


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=16)
    cfg = copy.deepcopy(cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": 16}
    w = KVSlotsConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(16))
    caches = {n: torch.arange(16 * HEADS * BLOCK_SIZE * 2 * HEAD, dtype=torch.float32).reshape(16, HEADS, BLOCK_SIZE, 2 * HEAD)
              for n in LAYERS}
    w.register_kv_caches(caches)
    return w, caches


def test_layer_hooks_skipped_only_without_copies(worker):
    w, caches = worker
    assert not w.has_connector_metadata()  # nothing bound
    for meta in (EMPTY_METADATA, pickle.loads(pickle.dumps(EMPTY_METADATA))):
        w.bind_connector_metadata(meta)
        assert not w.has_connector_metadata()
        w.clear_connector_metadata()
    stores = KVSlotsMetadata(step=5, store_device_blocks=[3], store_host_blocks=[7])
    loads = KVSlotsMetadata(step=6, loads=[LoadSpec("r", [9], [7])])
    for meta in (stores, pickle.loads(pickle.dumps(stores)), loads):
        w.bind_connector_metadata(meta)
        assert w.has_connector_metadata()
        w.clear_connector_metadata()
    # The copies still run through the step hooks.
    w.handle_preemptions(stores)
    w.bind_connector_metadata(loads)
    w.start_load_kv(None)
    w.clear_connector_metadata()
    for name, t in caches.items():
        assert torch.equal(t[9], t[3]), name  # block 3 -> host 7 -> block 9
    meta = w.build_connector_worker_meta()
    assert meta is not None and meta.acks == {5: 1, 6: 1}


def test_transfer_results_empty_and_not_shared(worker):
    w, _ = worker
    a = w.get_transfer_results(set())
    assert (a.finished_sending, a.finished_recving, a.failed_recving) == (set(), set(), set())
    a.finished_recving.add("x")  # vLLM takes the sets over: the next report must not see it
    b = w.get_transfer_results({"y"})
    assert b is not a and b.finished_recving == set()


class _RecordingCopier:
    """Stands in for BlockCopier: records which calls the worker makes, in order."""

    bytes_per_block = 64

    def __init__(self):
        self.calls: list[str] = []

    def store(self, device_blocks, host_blocks):
        self.calls.append("store")

    def load(self, host_blocks, device_blocks):
        self.calls.append("load")

    def fence(self):
        self.calls.append("fence")

    def synchronize(self):
        self.calls.append("synchronize")


def test_loads_fence_and_the_next_step_waits_for_them():
    """start_load_kv does not block the host on its loads (the compute stream waits on the
    device); the next step's start does, before its stores and before host rows are reused."""
    from kvslots.vllm.connector.worker_side import WorkerSide

    ws = WorkerSide(num_device_blocks=16, num_host_blocks=16)
    ws.copier = c = _RecordingCopier()
    ws.load(KVSlotsMetadata(step=1, loads=[LoadSpec("a", [3, 4], [0, 1]), LoadSpec("b", [5], [2])]))
    assert c.calls == ["load", "load", "fence"]
    ws.store(KVSlotsMetadata(step=2))  # a step with no stores still waits for the loads
    assert c.calls[3:] == ["synchronize"]
    ws.store(KVSlotsMetadata(step=3, store_device_blocks=[7], store_host_blocks=[9]))
    assert c.calls[4:] == ["store", "synchronize"]  # nothing left in flight: only the store's wait
    ws.load(KVSlotsMetadata(step=4))  # no loads: no fence, nothing in flight
    ws.store(KVSlotsMetadata(step=5))
    assert c.calls[6:] == []
    ws.load(KVSlotsMetadata(step=6, loads=[LoadSpec("c", [8], [3])]))
    ws.unregister_kv_caches()  # sleep: the device memory goes away, the loads finish first
    assert c.calls[6:] == ["load", "fence", "synchronize"] and ws.copier is None
