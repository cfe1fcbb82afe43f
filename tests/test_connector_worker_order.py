"""The connector's worker-side calls out of order or with tensors they cannot take: a kvslots
error at the call, and nothing changed (the copies go on over the caches registered before)."""

from __future__ import annotations

import copy

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from kvslots.errors import ArgumentTypeError, InvalidArgumentError, InvalidStateError  # noqa: E402
from kvslots.vllm.connector import KVSlotsConnector  # noqa: E402
from kvslots.vllm.connector.metadata import KVSlotsMetadata, LoadSpec  # noqa: E402

from vllm_harness import BLOCK_SIZE, HEAD, HEADS, LAYERS, engine_config, kv_cache_config  # noqa: E402

STORES = KVSlotsMetadata(step=5, store_device_blocks=[3], store_host_blocks=[7])
LOADS = KVSlotsMetadata(step=6, loads=[LoadSpec("r", [9], [7])])
_steps = iter(range(100, 10**6))


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    return engine_config(models["target"], models["eagle"], k=3, num_blocks=16)


def connector(cfg, role=KVConnectorRole.WORKER, **extra):
    cfg = copy.deepcopy(cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": 16, **extra}
    return KVSlotsConnector(cfg, role, kv_cache_config(16))


def caches(dtype=torch.float32):
    return {n: torch.arange(16 * HEADS * BLOCK_SIZE * 2 * HEAD, dtype=torch.float32).to(dtype)
            .reshape(16, HEADS, BLOCK_SIZE, 2 * HEAD) for n in LAYERS}


def round_trip(w, kv) -> None:
    """Block 3 -> host 7 -> block 9 through the step hooks, in every layer of `kv`."""
    for t in kv.values():
        t[9].zero_()
    w.handle_preemptions(KVSlotsMetadata(step=next(_steps), store_device_blocks=[3], store_host_blocks=[7]))
    w.bind_connector_metadata(KVSlotsMetadata(step=next(_steps), loads=[LoadSpec("r", [9], [7])]))
    w.start_load_kv(None)
    w.clear_connector_metadata()
    for name, t in kv.items():
        assert torch.equal(t[9], t[3]), name


def test_worker_calls_out_of_order_are_kvslots_errors_and_copy_nothing(cfg):
    # They were RuntimeError (a copy before register_kv_caches, or while asleep) and bare
    # AssertionErrors (start_load_kv with nothing bound, metadata of another type, a worker
    # call on the scheduler's connector), and the assertions vanish under python -O.
    w = connector(cfg)
    with pytest.raises(InvalidStateError, match="register_kv_caches"):
        w.handle_preemptions(STORES)
    with pytest.raises(InvalidStateError, match="no connector metadata is bound"):
        w.start_load_kv(None)
    w.bind_connector_metadata(LOADS)
    with pytest.raises(InvalidStateError, match="register_kv_caches"):
        w.start_load_kv(None)
    w.clear_connector_metadata()
    for bad in (None, {}, object()):
        with pytest.raises(ArgumentTypeError, match="KVSlotsMetadata"):
            w.handle_preemptions(bad)
    assert w.build_connector_worker_meta() is None  # nothing was acked
    assert w.get_finished({"unknown"}) == (None, None)
    kv = caches()
    w.register_kv_caches(kv)
    round_trip(w, kv)
    w.unregister_kv_caches()
    with pytest.raises(InvalidStateError, match="asleep"):
        w.handle_preemptions(STORES)
    w.restore_kv_caches()
    round_trip(w, kv)
    s = connector(cfg, KVConnectorRole.SCHEDULER)
    for call in (lambda: s.register_kv_caches(kv), lambda: s.handle_preemptions(STORES),
                 lambda: s.start_load_kv(None)):
        with pytest.raises(InvalidStateError, match="worker-side call"):
            call()


def test_caches_refused_at_registration_leave_the_earlier_ones_in_use(cfg, tmp_path):
    # The worker kept the refused tensors as its caches before BlockCopier refused them (a
    # sleep and wake-up then registered those); a disk tier refusing them (blocks of another
    # size than its file's) raised a RuntimeError after the host copies had moved to them.
    w = connector(cfg, disk_path=str(tmp_path), disk_blocks=8)
    kv = caches()
    w.register_kv_caches(kv)
    copier = w._worker.copier
    short = {**caches(), LAYERS[0]: torch.zeros(8, HEADS, BLOCK_SIZE, 2 * HEAD)}
    for refused in ({}, short, caches(torch.float16)):
        with pytest.raises(InvalidArgumentError):
            w.register_kv_caches(refused)
        assert w._worker.copier is copier and w._worker._kv_caches is kv
    round_trip(w, kv)
    w.unregister_kv_caches()
    w.restore_kv_caches()  # the caches registered, not a refused set
    assert w._worker._kv_caches is kv
    round_trip(w, kv)
    w.shutdown()


def test_a_steps_hooks_run_once(cfg, tmp_path):
    # vLLM calls each once a step; a second call with the same metadata ran the step again: its
    # spills were written and reported twice (the scheduler's index refuses the second report),
    # its disk reads and P/D pulls queued again.
    from kvslots.vllm.connector.disk import DiskStepMeta
    from kvslots.vllm.connector.metadata import EMPTY_METADATA

    w = connector(cfg, disk_path=str(tmp_path), disk_blocks=8)
    kv = caches()
    w.register_kv_caches(kv)
    spill = KVSlotsMetadata(step=1, store_device_blocks=[3], store_host_blocks=[7],
                            disk=DiskStepMeta(spills=[(7, 0, 0xABC, [1] * BLOCK_SIZE, None, None, None)]))
    w.handle_preemptions(spill)
    with pytest.raises(InvalidStateError, match="twice for the step 1"):
        w.handle_preemptions(spill)
    w._disk_worker.store.flush()
    assert w._disk_worker.take_done() == [(0, True)]
    loads = KVSlotsMetadata(step=2, loads=[LoadSpec("r", [9], [7])])
    w.bind_connector_metadata(loads)
    w.start_load_kv(None)
    with pytest.raises(InvalidStateError, match="twice for the step 2"):
        w.start_load_kv(None)
    w.clear_connector_metadata()
    assert w._worker.stats["loaded_blocks"] == 1
    for _ in range(2):  # a step with nothing to copy: nothing to repeat
        w.handle_preemptions(EMPTY_METADATA)
        w.bind_connector_metadata(EMPTY_METADATA)
        w.start_load_kv(None)
        w.clear_connector_metadata()
    round_trip(w, kv)
    w.shutdown()
