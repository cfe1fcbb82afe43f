"""Spills the disk cannot take (a full, read-only or failing disk) are counted and said in the
log with the reason, at most once a minute."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal

import numpy as np

from kvslots.vllm.connector.disk import DiskLayout, DiskWorker


@contextlib.contextmanager
def files_end_at(limit: int):
    """Writes past `limit` bytes of any file fail (EFBIG, as a full disk's ENOSPC would)."""
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_sig)


def test_spills_the_disk_refuses_are_logged_with_the_reason_once_a_minute(tmp_path, caplog):
    # A disk that fills up under a running engine: every spill failed, counted in
    # disk_worker_write_failures, but nothing said so or why.
    layout = DiskLayout(num_layers=1, bytes_per_block=3000, dtype="float32", fingerprint=1)
    w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=4, layout=layout, queue_len=8)
    stride = (os.path.getsize(w.path) - 4096) // 8

    def spill(slots) -> list:
        for i in slots:
            assert w.store.submit(i, np.full(3000, i, np.uint8), 100 + i, [i] * 4)
        w.store.flush()
        return w.take_done()

    caplog.set_level(logging.WARNING, logger="kvslots.vllm.connector.disk")
    with files_end_at(4096 + 2 * stride):  # room for two records
        assert spill(range(4)) == [(0, True), (1, True), (2, False), (3, False)]
        assert spill(range(4, 6)) == [(4, False), (5, False)]  # within the minute: not said again
    st = w.store.stats()
    assert (st["write_failures"], st["written_blocks"]) == (4, 2)
    logs = [r.getMessage() for r in caplog.records]
    assert len(logs) == 1, logs
    assert "2 failed" in logs[0] and "File too large" in logs[0] and w.path in logs[0], logs
    w._failures_told_at -= w.FAILURE_LOG_S  # a minute later: the two since are said
    w._tell_failures()
    assert len(caplog.records) == 2 and "2 failed" in caplog.records[1].getMessage()
    assert "since start 4" in caplog.records[1].getMessage()
    w.close()
