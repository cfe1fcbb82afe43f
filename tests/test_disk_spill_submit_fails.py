"""A spill batch whose submit raises part-way (a bad block or slot, a full disk) leaves no
disk slot "writing": the blocks queued are written, the refused ones are reported not written
(their slots freed at the scheduler), one log line says so; the worker's hook does not raise."""

from __future__ import annotations

import gc
import logging
import os

import numpy as np

from kvslots._core import DiskIndex
from kvslots.errors import DiskTierError
from kvslots.vllm.connector.disk import FILE_NAME, DiskLayout, DiskStepMeta, DiskWorker

BPB, BS = 256, 4


class RaisingStore:
    """The worker's DiskStore whose submit (or wipe) raises on the chosen calls."""

    def __init__(self, store, fail_on: set[int], fail_wipe: bool = False) -> None:
        self._store, self.fail_on, self.fail_wipe, self.calls = store, fail_on, fail_wipe, 0
        self.wipes = 0

    def submit(self, *args):
        self.calls += 1
        if self.calls in self.fail_on:
            raise DiskTierError("No space left on device (os error 28)")
        return self._store.submit(*args)

    def wipe(self):
        self.wipes += 1
        if self.fail_wipe:
            raise DiskTierError("the disk store is closed")
        return self._store.wipe()

    def __getattr__(self, name: str):
        return getattr(self._store, name)


LAYOUT = DiskLayout(num_layers=1, bytes_per_block=BPB, dtype="uint8", fingerprint=7)


def setup(tmp_path, n: int):
    w = DiskWorker(directory=str(tmp_path), num_slots=16, block_size=BS, layout=LAYOUT, queue_len=16)
    w.host_np = np.arange(8 * BPB, dtype=np.uint8).reshape(8, BPB)  # register()'s host region
    index = DiskIndex(16, BS)
    spills = []
    for i in range(n):
        h, tokens = 1000 + i, [i] * BS
        slot = index.begin_write(h, tokens, None, None, None)
        spills.append((i, slot, h, tokens, None, None, None))
    return w, index, spills


def report(w: DiskWorker, index: DiskIndex) -> list[tuple[int, bool]]:
    w.store.flush()
    done = w.take_done()
    for slot, ok in done:
        index.complete_write(slot, ok)
    return done


def test_a_submit_raising_for_the_third_of_five_leaves_no_slot_writing(tmp_path, caplog):
    w, index, spills = setup(tmp_path, 5)
    w.store = RaisingStore(w.store, fail_on={3})
    caplog.set_level(logging.ERROR, logger="kvslots.vllm.connector.disk")
    w.spill(DiskStepMeta(spills=spills))  # raised on the old code, the batch's last three never reported
    done = report(w, index)
    slots = [s[1] for s in spills]
    assert sorted(done) == sorted((s, i != 2) for i, s in enumerate(slots))
    assert index.num_writing == 0 and index.num_stored == 4
    assert not index.contains(1002) and all(index.contains(1000 + i) for i in (0, 1, 3, 4))
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 1 and "1 spill(s)" in logs[0] and "No space left" in logs[0], logs
    assert report(w, index) == []  # reported once
    # A store that keeps raising: reported every time, said at most once a minute.
    w.store.fail_on = set(range(1, 100))
    more = [(i, index.begin_write(2000 + i, [i] * BS, None, None, None), 2000 + i, [i] * BS, None, None, None)
            for i in range(3)]
    w.spill(DiskStepMeta(spills=more))
    assert sorted(report(w, index)) == sorted((s[1], False) for s in more)
    assert index.num_writing == 0 and len(caplog.records) == 1
    w.close()


def test_a_wipe_that_cannot_be_queued_writes_none_of_its_step(tmp_path, caplog):
    w, index, spills = setup(tmp_path, 3)
    w.store = RaisingStore(w.store, fail_on=set(), fail_wipe=True)
    caplog.set_level(logging.ERROR, logger="kvslots.vllm.connector.disk")
    w.spill(DiskStepMeta(spills=spills, wipe=True))
    assert sorted(report(w, index)) == sorted((s[1], False) for s in spills)
    assert index.num_writing == 0 and index.num_stored == 0
    assert "wipe could not be queued" in caplog.records[0].getMessage()
    w.close()


def test_a_wipe_that_could_not_be_queued_is_tried_again_before_later_spills(tmp_path):
    # A record of before the reset, then a reset whose wipe raised once: the next step's spill
    # was written beside it, and a restart found the pre-reset record again.
    w, index, spills = setup(tmp_path, 2)
    w.spill(DiskStepMeta(spills=spills[:1]))
    assert report(w, index) == [(spills[0][1], True)]
    index.clear()  # the scheduler's reset
    w.store = RaisingStore(w.store, fail_on=set(), fail_wipe=True)
    w.spill(DiskStepMeta(spills=[], wipe=True))
    later = (1, index.begin_write(2000, [9] * BS, None, None, None), 2000, [9] * BS, None, None, None)
    w.spill(DiskStepMeta(spills=[later]))  # still failing: refused, the wipe tried again
    assert w.store.wipes == 2 and report(w, index) == [(later[1], False)]
    w.store.fail_wipe = False
    again = (1, index.begin_write(2000, [9] * BS, None, None, None), 2000, [9] * BS, None, None, None)
    w.spill(DiskStepMeta(spills=[again]))
    assert w.store.wipes == 3 and report(w, index) == [(again[1], True)]
    w.spill(DiskStepMeta(spills=[]))
    assert w.store.wipes == 3  # done: not again
    w.close()
    del w
    gc.collect()
    fresh = DiskIndex(16, BS)  # a restart: only what was written after the wipe
    fresh.restore_from_file(os.path.join(str(tmp_path), FILE_NAME), **LAYOUT.kwargs())
    assert fresh.contains(2000) and not fresh.contains(1000)


class SpillingPlanner:
    """What DiskScheduler asks of the connector's planner to plan spills."""

    def __init__(self, spills) -> None:
        self.spills = spills

    def enable_spill(self) -> None:
        pass

    def take_spills(self):
        out, self.spills = self.spills, []
        return out


def test_a_spill_the_index_refuses_leaves_the_rest_of_the_batch_planned(tmp_path, caplog):
    # The scheduler's half: begin_write raising for one block of a batch (a record of the wrong
    # length) raised out of build() with the earlier blocks' slots taken, never shipped, so
    # never reported: "writing" for ever. Now that block is not spilled, the others are.
    from kvslots.vllm.connector.disk import DiskScheduler

    layout = DiskLayout(num_layers=1, bytes_per_block=BPB, dtype="uint8", fingerprint=7)
    taken = [(i, 1000 + i, None, None, None, [i] * (BS if i != 1 else BS - 1)) for i in range(3)]
    sched = DiskScheduler(SpillingPlanner(taken), directory=str(tmp_path), num_slots=16, block_size=BS,
                          layout=layout, eagle=False)
    caplog.set_level(logging.WARNING, logger="kvslots.vllm.connector.disk")
    meta = sched.build()
    assert [s[2] for s in meta.spills] == [1000, 1002]
    assert sched.index.num_writing == 2 and sched.stats["spills_not_taken"] == 1
    assert any("0x3e9 not spilled" in r.getMessage() for r in caplog.records)


def test_an_engine_whose_store_refuses_every_spill_runs_on_with_no_slot_writing(tmp_path, caplog):
    # Through the connector and vLLM's scheduler: handle_preemptions raised out of the step (the
    # engine died) with the disk slots of the step's spills "writing" at the scheduler.
    import random

    import pytest

    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
    import test_disk_scheduler as tds
    from kvslots._dev.tiny import build_tiny_models
    from vllm_harness import engine_config

    models = build_tiny_models(str(tmp_path / "tiny"))
    cfg = engine_config(models["target"], None, num_blocks=64)
    h = tds.disk_harness(cfg, tmp_path)
    w = h.workers[0]._disk_worker
    w.store = RaisingStore(w.store, fail_on=set(range(1, 10_000)))
    caplog.set_level(logging.ERROR, logger="kvslots.vllm.connector.disk")
    rng = random.Random(5)
    h.add("a", tds.tokens(rng, tds.PROMPT), max_tokens=2)
    h.run_until_done()
    h.add("push", tds.tokens(rng, 10 * tds.BLOCK_SIZE + 5), max_tokens=2)
    h.run_until_done()
    tds.settle(h)
    disk = h.connector._disk_sched
    assert disk.stats["spilled_blocks"] > 0 and w.store.calls == disk.stats["spilled_blocks"]
    assert disk.index.num_writing == 0 and disk.index.num_stored == 0 and not disk._writing
    assert any("could not be queued" in r.getMessage() for r in caplog.records)
