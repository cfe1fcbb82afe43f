"""A step's disk work is done once even when its hook is called again after raising part-way,
and a store this process cannot use (opened before a fork) gives a clear result, not an error
at every step: each write and read is reported to the scheduler (and vLLM) exactly once."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest

from kvslots.vllm.connector.disk import DiskLayout, DiskLoad, DiskStepMeta, DiskWorker

BPB, BS = 256, 4
LAYOUT = DiskLayout(num_layers=1, bytes_per_block=BPB, dtype="uint8", fingerprint=7)


def worker(tmp_path) -> DiskWorker:
    w = DiskWorker(directory=str(tmp_path), num_slots=16, block_size=BS, layout=LAYOUT, queue_len=16)
    w.host_np = np.arange(8 * BPB, dtype=np.uint8).reshape(8, BPB)  # register()'s host region
    return w


def test_a_step_started_again_reads_and_reports_its_loads_once(tmp_path):
    # The same step metadata started twice queued each read twice, and poll reported the
    # request received twice ([("r", 0), ("r", 0)]: vLLM's finished_recving and the
    # scheduler's disk_loaded got it twice).
    w = worker(tmp_path)
    step = DiskStepMeta(loads=[DiskLoad("r", [], [], [5], [])])  # no pinned slots: nothing read, an error
    w.start(step)
    w.start(step)
    errors: set[int] = set()
    assert w.num_pending == 1
    assert w.poll(errors, set()) == [("r", 0)] and errors == {5}
    assert w.poll(errors, set()) == []
    w.start(DiskStepMeta(loads=[DiskLoad("r", [], [], [5], [])]))  # a new step: read again
    assert w.poll(errors, set()) == [("r", 0)]
    w.close()


def test_a_step_spilled_again_writes_and_reports_each_block_once(tmp_path):
    w = worker(tmp_path)
    step = DiskStepMeta(spills=[(1, 3, 33, [3] * BS, None, None, None)])
    w.spill(step)
    w.spill(step)
    w.store.flush()
    assert w.take_done() == [(3, True)]  # [(3, True), (3, True)] on the old code
    w.close()


def test_a_forked_stores_take_done_reports_the_refused_spills_and_does_not_raise(tmp_path):
    # In a process forked after the store was opened its writer is not there: submit refuses
    # (the spill is reported not written), but take_done raised InvalidStateError at every
    # step (out of build_connector_worker_meta), and the refused spills were never reported:
    # their slots stayed "writing" at the scheduler.
    w = worker(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child: reports through its exit status, never returns into pytest
        code = 1
        try:
            signal.alarm(20)
            logging.disable(logging.CRITICAL)
            w.spill(DiskStepMeta(spills=[(1, 3, 33, [3] * BS, None, None, None)]))
            try:
                first = w.take_done()
            except Exception:
                code = 3
            else:
                again = w.take_done()
                code = 0 if first == [(3, False)] and again == [] and w.stats() == {} else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's store goes on.
    w.spill(DiskStepMeta(spills=[(2, 4, 44, [4] * BS, None, None, None)]))
    w.store.flush()
    assert w.take_done() == [(4, True)] and w.stats()["written_blocks"] == 1
    w.close()


def test_handle_preemptions_retried_after_its_stores_raised_spills_once(tmp_path):
    # The step's spills were queued, then its host stores raised (the caches unregistered:
    # asleep); the step called again after wake-up queued the spills again: each written and
    # reported twice, and the scheduler's DiskIndex refuses the second report.
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
    import test_connector_worker_order as two
    from kvslots._dev.tiny import build_tiny_models
    from kvslots.errors import InvalidStateError
    from kvslots.vllm.connector.metadata import KVSlotsMetadata

    models = build_tiny_models(str(tmp_path / "tiny"))
    cfg = two.engine_config(models["target"], models["eagle"], k=3, num_blocks=16)
    w = two.connector(cfg, disk_path=str(tmp_path / "disk"), disk_blocks=8)
    w.register_kv_caches(two.caches())
    step = KVSlotsMetadata(step=1, store_device_blocks=[3], store_host_blocks=[7],
                           disk=DiskStepMeta(spills=[(7, 0, 0xABC, [1] * two.BLOCK_SIZE, None, None, None)]))
    w.unregister_kv_caches()
    with pytest.raises(InvalidStateError, match="asleep"):
        w.handle_preemptions(step)
    w.restore_kv_caches()
    w.handle_preemptions(step)
    assert w._worker.stats["stored_blocks"] == 1
    w._disk_worker.store.flush()
    meta = w.build_connector_worker_meta()
    assert meta.disk_done == [(0, True)]
    w.shutdown()
