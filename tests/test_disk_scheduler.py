"""The disk tier with vLLM's real Scheduler, driven step by step (tests/vllm_harness.py): a disk
hit loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS while the batch runs on),
lands in the device blocks with the right KV, moves up to the host tier and leaves the disk; a
corrupt record is recomputed; a connector reset clears the disk tier and wipes its file."""

from __future__ import annotations

import copy
import logging
import os
import random
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from kvslots.events import external_block_hash  # noqa: E402

from vllm_harness import BLOCK_SIZE, DRAFT_BASE, LAYERS, Harness, engine_config  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

PROMPT = 5 * BLOCK_SIZE + 10  # 5 full blocks served from disk, 10 tokens computed


@pytest.fixture(scope="module")
def plain_cfg(tmp_path_factory):
    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    cfg = engine_config(models["target"], None, num_blocks=64)
    cfg.kv_transfer_config.kv_load_failure_policy = "recompute"
    return cfg


def disk_harness(cfg, tmp_path, *, host_blocks: int = 8, slot_manager: str = "vllm") -> Harness:
    cfg = copy.deepcopy(cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = {
        "host_cache_blocks": host_blocks, "disk_path": str(tmp_path / "disk"), "disk_blocks": 64}
    cls = None
    if slot_manager == "kvslots":  # scheduler mode: the Rust core allocates the device blocks
        from kvslots.vllm import KVSlotsScheduler as cls
    return Harness(cfg, num_blocks=64, seed=3, scheduler_cls=cls)


# Asynchronous loads over both device KV managers: vLLM's and scheduler mode's.
SLOT_MANAGERS = pytest.mark.parametrize("slot_manager", ["vllm", "kvslots"])


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, DRAFT_BASE) for _ in range(n)]


def settle(h: Harness) -> None:
    """Waits for the disk writer, then one (empty) step carries its report to the scheduler."""
    for w in h.workers:
        w._disk_worker.store.flush()
    h.step()


def check_one_tier(h: Harness) -> None:
    """No block is registered in the host tier and stored on disk at a step boundary (reads in
    flight pin their disk copies only while copying, and none is in flight here)."""
    disk = h.connector._disk_sched
    both = [x for x in h.sched_side.host.registered_hashes() if disk.index.contains(x)]
    assert both == [], f"in both tiers: {both}"


def spill_prompt_to_disk(h: Harness, prompt: list[int], rng: random.Random) -> list[int]:
    """Runs `prompt`, then enough other work to push its blocks out of the host tier onto disk.
    Returns the external hashes of its served blocks."""
    a = h.add("a", prompt, max_tokens=2)
    h.run_until_done()
    hashes = [external_block_hash(x) for x in a.block_hashes[:5]]
    h.add("push", tokens(rng, 10 * BLOCK_SIZE + 5), max_tokens=2)
    h.run_until_done()
    settle(h)
    disk, host = h.connector._disk_sched.index, h.sched_side.host
    assert all(disk.contains(x) for x in hashes), "the prompt's blocks were spilled to disk"
    assert not any(host.lookup_block(x) is not None for x in hashes)
    check_one_tier(h)
    assert h.scheduler.reset_prefix_cache()  # the device tier only: the next hit comes from disk
    return hashes


def step_until_scheduled(h: Harness, rid: str, timeout: float = 60.0):
    """Steps (as an engine does while a request waits for its KV) until `rid` is scheduled."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        so = h.step()
        if rid in so.num_scheduled_tokens:
            return so
        time.sleep(0.01)
    pytest.fail(f"{rid} was never scheduled after its read")


class SlowStore:
    """A worker's DiskStore whose background reads look unfinished until `gate` is set (a slow
    disk; with `delay`, set that long after the first read starts); records every wait."""

    def __init__(self, store, delay: float | None = None) -> None:
        self._store = store
        self.gate = threading.Event()
        self.delay = delay
        self.waits: list[float] = []

    def read_rows_async(self, *args):
        if self.delay is not None and not self.waits:
            threading.Timer(self.delay, self.gate.set).start()
        return self._store.read_rows_async(*args)

    def take_reads(self):
        return self._store.take_reads() if self.gate.is_set() else []

    def wait_reads(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return self.gate.wait(timeout_s) and self._store.wait_reads(timeout_s)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def device_tokens(h: Harness, rid: str, block: int) -> list[float]:
    b = h.scheduler.kv_cache_manager.get_block_ids(rid)[0][block]
    return h.kv[0][LAYERS[0]][b, 0, :, 0].tolist()


@SLOT_MANAGERS
def test_a_disk_hit_waits_for_its_read_while_the_batch_runs_on_then_moves_up(plain_cfg, tmp_path, slot_manager):
    h = disk_harness(plain_cfg, tmp_path, slot_manager=slot_manager)
    rng = random.Random(5)
    prompt = tokens(rng, PROMPT)
    hashes = spill_prompt_to_disk(h, prompt, rng)
    # Hold the disk reads back until released, as a slow disk would.
    dw = h.workers[0]._disk_worker
    dw.store = slow = SlowStore(dw.store)
    h.add("b", tokens(rng, 40), max_tokens=40)
    h.step()
    a2 = h.add("a2", prompt, max_tokens=4)
    for _ in range(6):
        so = h.step()
        assert a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert "a2" not in so.num_scheduled_tokens and "b" in so.num_scheduled_tokens, "b runs on"
    assert slow.waits == [], "a step with a forward never waits for a disk read"
    slow.gate.set()
    so = step_until_scheduled(h, "a2")
    assert so.num_scheduled_tokens["a2"] == PROMPT - 5 * BLOCK_SIZE, "the 5 disk blocks were not recomputed"
    for i in range(5):
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    h.run_until_done()
    settle(h)
    # Moved up: registered in the host tier (medium CPU), gone from disk (medium STORAGE).
    host, disk = h.sched_side.host, h.connector._disk_sched
    assert all(host.lookup_block(x) is not None for x in hashes)
    assert not any(disk.index.contains(x) for x in hashes)
    stored_cpu = {x for e in h.events if type(e).__name__ == "BlockStored" and e.medium == "CPU"
                  for x in e.block_hashes}
    removed_disk = {x for e in h.events if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"
                    for x in e.block_hashes}
    assert set(hashes) <= stored_cpu and set(hashes) <= removed_disk
    assert disk.stats["promoted_blocks"] == 5 and disk.index.num_writing == 0
    if slot_manager == "kvslots":  # every request ended: the Rust pool is whole
        mgr = h.scheduler.kv_cache_manager
        mgr.check()
        assert mgr.usage == 0.0, mgr.usage
    assert disk.index.check_invariants() is None and host.check_invariants() is None
    assert host.num_held == 0 and host.num_storing == 0, "every pin and promotion completed"
    check_one_tier(h)
    # The next hit is a host hit: synchronous, no wait.
    h.scheduler.reset_prefix_cache()
    a3 = h.add("a3", prompt, max_tokens=2)
    so = h.step()
    assert so.num_scheduled_tokens.get("a3") == PROMPT - 5 * BLOCK_SIZE and a3.status == RequestStatus.RUNNING


def test_a_disk_hit_alone_is_reported_in_the_step_that_reads_it(plain_cfg, tmp_path):
    """Nothing else runs: the step that starts the read has no forward, so the worker waits
    for the read there (bounded) and reports it received in that same step; the request is
    scheduled in the next one, with the right KV in its device blocks."""
    h = disk_harness(plain_cfg, tmp_path)
    rng = random.Random(8)
    prompt = tokens(rng, PROMPT)
    spill_prompt_to_disk(h, prompt, rng)
    dw = h.workers[0]._disk_worker
    dw.store = slow = SlowStore(dw.store, delay=0.3)  # a read that takes 0.3 s
    dw.IDLE_WAIT_S = 30.0  # a bound only: returns as soon as the read is done
    a2 = h.add("a2", prompt, max_tokens=2)
    so = h.step()
    assert "a2" not in so.num_scheduled_tokens and so.total_num_scheduled_tokens == 0
    assert so.kv_connector_metadata.disk.idle and so.kv_connector_metadata.disk.loads
    assert slow.waits == [30.0] and dw.num_pending == 0, "the read was finished in the step that started it"
    assert "a2" in h.scheduler.finished_recving_kv_req_ids, "reported received in that same step"
    so = h.step()
    assert so.num_scheduled_tokens.get("a2") == PROMPT - 5 * BLOCK_SIZE and a2.status == RequestStatus.RUNNING
    for i in range(5):
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    h.run_until_done()
    settle(h)
    assert h.connector._disk_sched.stats["promoted_blocks"] == 5
    assert h.sched_side.host.num_held == 0 and h.sched_side.host.num_storing == 0
    check_one_tier(h)


def test_a_step_with_no_forward_waits_for_disk_reads_only_up_to_its_bound(plain_cfg, tmp_path):
    """A read slower than the idle wait: the step returns after the bound with the read still
    in flight, and the request is reported by a later step."""
    h = disk_harness(plain_cfg, tmp_path)
    rng = random.Random(9)
    prompt = tokens(rng, PROMPT)
    spill_prompt_to_disk(h, prompt, rng)
    dw = h.workers[0]._disk_worker
    dw.store = slow = SlowStore(dw.store)
    a2 = h.add("a2", prompt, max_tokens=2)
    for _ in range(3):
        so = h.step()
        assert "a2" not in so.num_scheduled_tokens and a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert slow.waits == [dw.IDLE_WAIT_S] * 3, slow.waits
    assert dw.num_pending == 1
    slow.gate.set()
    so = step_until_scheduled(h, "a2")
    assert so.num_scheduled_tokens["a2"] == PROMPT - 5 * BLOCK_SIZE
    for i in range(5):
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


@SLOT_MANAGERS
def test_a_corrupt_record_read_asynchronously_is_recomputed(plain_cfg, tmp_path, caplog, slot_manager):
    h = disk_harness(plain_cfg, tmp_path, slot_manager=slot_manager)
    rng = random.Random(6)
    prompt = tokens(rng, PROMPT)
    hashes = spill_prompt_to_disk(h, prompt, rng)
    disk = h.connector._disk_sched
    slot = disk.index.lookup(hashes[2])
    stride = (os.path.getsize(disk.path) - 4096) // disk.index.num_slots
    header = (64 + 4 * BLOCK_SIZE + 63) // 64 * 64  # a record's header (disk/file.rs)
    with open(disk.path, "r+b") as f:
        f.seek(4096 + slot * stride + header + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x5A]))
    a2 = h.add("a2", prompt, max_tokens=3)
    with caplog.at_level(logging.WARNING, logger="kvslots.vllm.connector.disk"):
        so = step_until_scheduled(h, "a2")
    # vLLM recomputes from the first bad block on: two blocks loaded, the rest computed.
    assert so.num_scheduled_tokens["a2"] == PROMPT - 2 * BLOCK_SIZE
    assert len([r for r in caplog.records if "not loaded" in r.getMessage()]) == 1
    for i in range(5):  # loaded (0, 1) or recomputed in this step, every block holds its tokens
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    h.run_until_done()
    settle(h)
    assert not disk.index.contains(hashes[2]) and disk.stats["corrupt_blocks"] == 1
    assert disk.stats["promoted_blocks"] == 2, "only the blocks read intact moved up"
    if slot_manager == "kvslots":
        h.scheduler.kv_cache_manager.check()
        assert h.scheduler.kv_cache_manager.usage == 0.0
    assert h.sched_side.host.num_held == 0 and h.sched_side.host.num_storing == 0
    check_one_tier(h)


def test_a_connector_reset_clears_the_disk_tier_and_its_file(plain_cfg, tmp_path):
    from kvslots._core import DiskIndex

    h = disk_harness(plain_cfg, tmp_path)
    rng = random.Random(7)
    prompt = tokens(rng, PROMPT)
    hashes = spill_prompt_to_disk(h, prompt, rng)
    disk = h.connector._disk_sched
    stored = disk.index.num_stored
    assert stored >= 5
    n_events = len(h.events)
    assert h.connector.reset_cache()
    assert disk.index.num_stored == 0 and h.sched_side.host.registered_hashes() == []
    h.step()  # the wipe travels with the next step's metadata
    settle(h)
    new = h.events[n_events:]
    # The host tier: AllBlocksCleared. The disk tier names its blocks (BlockRemoved, medium
    # STORAGE): vLLM's AllBlocksCleared carries no medium, so a subscriber of this one stream
    # could not tell which tier it clears.
    assert [type(e).__name__ for e in new].count("AllBlocksCleared") == 1
    removed = {x for e in new if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE" for x in e.block_hashes}
    assert set(hashes) <= removed and len(removed) == stored
    # Nothing comes back from the file after a restart either.
    fresh = DiskIndex(disk.index.num_slots, BLOCK_SIZE)
    restored, _, why = fresh.restore_from_file(disk.path, **h.workers[0]._disk_worker.layout.kwargs())
    assert why is None and restored == 0
    a2 = h.add("a2", prompt, max_tokens=2)
    so = h.step()
    assert so.num_scheduled_tokens.get("a2") == PROMPT, "no hit left: computed in full"
    assert a2.status == RequestStatus.RUNNING


def test_after_a_wake_up_the_disk_worker_uses_the_new_host_region(plain_cfg, tmp_path):
    import numpy as np

    h = disk_harness(plain_cfg, tmp_path)
    w = h.workers[0]
    old = w._disk_worker.host_np
    w.unregister_kv_caches()
    w.restore_kv_caches()
    assert w._disk_worker.copier is w._worker.copier
    new = w._worker.copier.host.numpy()
    assert np.shares_memory(w._disk_worker.host_np, new) and not np.shares_memory(old, new)


def a_disk_read_in_flight(plain_cfg, tmp_path, seed, store_cls):
    """A prompt spilled to disk, asked again while a batch runs: request "a2" waits on one disk
    read through ``store_cls`` (a SlowStore, held at its gate)."""
    h = disk_harness(plain_cfg, tmp_path)
    rng = random.Random(seed)
    prompt = tokens(rng, PROMPT)
    spill_prompt_to_disk(h, prompt, rng)
    w = h.workers[0]
    dw = w._disk_worker
    dw.store = slow = store_cls(dw.store)
    h.add("b", tokens(rng, 40), max_tokens=40)  # a batch runs: the steps do not wait for reads
    h.step()
    a2 = h.add("a2", prompt, max_tokens=2)
    h.step()
    assert a2.status == RequestStatus.WAITING_FOR_REMOTE_KVS and dw.num_pending == 1
    return h, w, dw, slow, prompt


def test_a_sleep_finishes_the_disk_reads_in_flight_first(plain_cfg, tmp_path):
    """Sleep drops the worker's views of the device tensors and its host region: a disk read
    in flight is finished and copied before that, and its request is reported received at the
    next step after the wake-up, with the right KV in its device blocks."""
    h, w, dw, slow, prompt = a_disk_read_in_flight(plain_cfg, tmp_path, 10, SlowStore)
    threading.Timer(0.3, slow.gate.set).start()
    w.unregister_kv_caches()
    assert slow.waits == [60.0] and dw.num_pending == 0, "the read was finished before the sleep"
    w.restore_kv_caches()
    so = step_until_scheduled(h, "a2")
    assert so.num_scheduled_tokens["a2"] == PROMPT - 5 * BLOCK_SIZE
    for i in range(5):
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]


class StalledStore(SlowStore):
    """A disk stalled past the sleep's bound: waiting for its reads gives up at once."""

    def wait_reads(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return False


def test_a_read_still_in_flight_across_a_sleep_is_recomputed_not_copied_from_the_new_host_region(plain_cfg,
                                                                                                 tmp_path):
    """The read lands in the host region of before the sleep; after the wake-up the copier has a
    new one, from which those host blocks were copied to the device: KV that is not the
    request's. That read is reported failed instead (its blocks recomputed or read again)."""
    h, w, dw, slow, prompt = a_disk_read_in_flight(plain_cfg, tmp_path, 11, StalledStore)
    w.unregister_kv_caches()
    assert slow.waits == [60.0] and dw.num_pending == 1, "still reading after the sleep's wait"
    w.restore_kv_caches()
    slow.gate.set()
    step_until_scheduled(h, "a2")  # (vLLM looks the request up again: a fresh read, into the new region)
    for i in range(5):
        assert device_tokens(h, "a2", i) == [float(t) for t in prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
