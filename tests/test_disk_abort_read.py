"""A request aborted while its disk hit is being read (WAITING_FOR_REMOTE_KVS): vLLM keeps its
blocks until the read is reported, the read lands and moves up to the host tier, nothing stays
pinned or in flight, and the next request of that prompt is served from the host tier. (A pin:
no defect found; the probe of this stop.)"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

import test_disk_scheduler as tds  # noqa: E402
from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def test_an_abort_during_a_disk_read_frees_everything_once_the_read_lands(tmp_path):
    models = build_tiny_models(str(tmp_path / "tiny"))
    cfg = tds.engine_config(models["target"], None, num_blocks=64)
    cfg.kv_transfer_config.kv_load_failure_policy = "recompute"
    h = tds.disk_harness(cfg, tmp_path)
    rng = random.Random(1)
    prompt = tds.tokens(rng, tds.PROMPT)
    hashes = tds.spill_prompt_to_disk(h, prompt, rng)
    w = h.workers[0]
    slow = tds.SlowStore(w._disk_worker.store)
    w._disk_worker.store = slow
    b = h.add("b", prompt, max_tokens=2)
    h.step()
    disk = h.connector._disk_sched
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and list(disk._inflight) == ["b"]
    h.step(abort={"b"})
    assert b.status == RequestStatus.FINISHED_ABORTED and "b" in h.scheduler.requests  # blocks kept
    slow.gate.set()
    for _ in range(50):
        slow.wait_reads(1.0)
        h.step()
        if "b" not in h.scheduler.requests:
            break
    assert "b" not in h.scheduler.requests and not disk._inflight and w._disk_worker.num_pending == 0
    assert disk.index.check_invariants() is None and disk.index.num_writing == 0
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 63  # every block back (one is vLLM's null block)
    host = h.sched_side.host
    assert all(host.lookup_block(x) is not None for x in hashes)  # moved up, as if not aborted
    tds.check_one_tier(h)
    loaded = h.sched_side.stats["loaded_blocks"]
    h.add("c", prompt, max_tokens=2)
    h.run_until_done()
    assert h.sched_side.stats["loaded_blocks"] - loaded == len(hashes)  # the host hit
