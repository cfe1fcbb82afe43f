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


@contextlib.contextmanager
def a_stalled_disk(tmp_path):
    """A directory whose filesystem is frozen (fsfreeze: every write waits) while the block
    runs: a small ext4 image mounted on a loop device. Root only; skipped where it cannot be."""
    import shutil
    import subprocess
    import threading

    import pytest

    if os.geteuid() != 0 or not (shutil.which("mkfs.ext4") and shutil.which("fsfreeze")):
        pytest.skip("needs root, mkfs.ext4 and fsfreeze (a loop-mounted filesystem to freeze)")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    run = lambda *a: subprocess.run(a, capture_output=True, timeout=30)  # noqa: E731
    if run("mkfs.ext4", "-q", "-F", str(img)).returncode or run("mount", "-o", "loop", str(img), str(mnt)).returncode:
        pytest.skip("cannot mount a loop device here")
    # A frozen filesystem left behind (pytest killed by a CI timeout before its finally) would
    # hang whatever writes there later, pytest's own clean-up of old temp dirs included: a
    # watchdog in its own session thaws and unmounts it after 60 s whatever happens to this one.
    watchdog = subprocess.Popen(["sh", "-c", f"sleep 60; fsfreeze -u '{mnt}'; umount -l '{mnt}'"],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    frozen = threading.Event()

    def freeze(on: bool) -> None:
        if on:
            assert run("fsfreeze", "-f", str(mnt)).returncode == 0
            frozen.set()
        elif frozen.is_set():
            frozen.clear()
            run("fsfreeze", "-u", str(mnt))

    try:
        yield mnt, freeze
    finally:
        freeze(False)
        run("umount", "-l", str(mnt))
        os.killpg(watchdog.pid, signal.SIGKILL)  # its session: the sh and its sleep
        watchdog.wait()


def test_dropping_a_store_does_not_wait_for_a_stalled_disk_to_take_its_queue(tmp_path):
    # Shutdown with a slow or hung disk behind the writer's queue: dropping the store joined
    # the writer, which first wrote every queued block (disk_queue_len of them, up to 2**31),
    # with the GIL held; on a hung disk for ever. Now it waits CLOSE_WAIT (2 s) at most.
    import subprocess
    import time

    from kvslots._core import DiskStore

    with a_stalled_disk(tmp_path) as (mnt, freeze):
        s = DiskStore(str(mnt / "f.kvs"), num_slots=64, block_size=4, num_layers=1, bytes_per_block=1 << 16,
                      dtype="uint8", fingerprint=1, queue_len=64)
        blk = np.ones(1 << 16, np.uint8)
        assert s.submit(0, blk, 1, [1] * 4)
        s.flush()
        freeze(True)
        assert all(s.submit(i, blk, i + 1, [1] * 4) for i in range(1, 20))
        # Thawed by another process: the old code held the GIL while it waited (a thread of
        # this one would never run), and returns only then.
        thaw = subprocess.Popen(["sh", "-c", f"sleep 12; fsfreeze -u '{mnt}'"])
        try:
            t = time.monotonic()
            del s
            took = time.monotonic() - t
        finally:
            thaw.kill()
            thaw.wait()
            freeze(False)
        assert took < 6.0, f"dropping the store took {took:.1f} s"
