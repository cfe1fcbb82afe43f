"""``DiskStore`` reads into memory another read is still writing: refused. Two background reads
into the same rows (or a blocking read into rows a background read still writes) raced: a row
could hold the other read's block while this read was reported intact. Rows of one array that
do not overlap, and the same rows once the first read is taken, are read as before."""

from __future__ import annotations

import numpy as np
import pytest

from kvslots._core import DiskStore
from kvslots.errors import InvalidArgumentError

BS = 2
BPB = 4096


def block(h: int) -> np.ndarray:
    return np.full(BPB, h % 251, np.uint8)


@pytest.fixture
def ds(tmp_path):
    s = DiskStore(str(tmp_path / "f"), num_slots=8, block_size=BS, num_layers=1, bytes_per_block=BPB,
                  dtype="uint8", fingerprint=1)
    for slot in range(8):
        assert s.submit(slot, block(10 + slot), 10 + slot, [slot, slot])
    s.flush()
    assert s.take_done() == [(i, True) for i in range(8)]
    yield s
    s.wait_reads(30.0)


def test_a_second_async_read_into_rows_in_flight_is_refused(ds):
    out = np.zeros((4, BPB), np.uint8)
    first = ds.read_rows_async([0, 1], [10, 11], out, [0, 1])
    with pytest.raises(InvalidArgumentError, match="being read into"):
        ds.read_rows_async([5], [15], out, [1])
    # A view of the same memory is the same memory.
    with pytest.raises(InvalidArgumentError, match="being read into"):
        ds.read_rows_async([6], [16], out[1:3], [0])
    # A blocking read into those rows too (it would run beside the background one).
    with pytest.raises(InvalidArgumentError, match="being read into"):
        ds.read_into([7], [17], out[:1])
    # Other rows of the same array are fine.
    second = ds.read_rows_async([2], [12], out, [2])
    assert ds.read_rows([3], [13], out, [3]) == []
    assert ds.wait_reads(30.0)
    assert sorted(ds.take_reads()) == [(first, [], None), (second, [], None)]
    for r, h in enumerate([10, 11, 12, 13]):
        assert (out[r] == block(h)).all(), r
    # Taken: the rows are free again.
    third = ds.read_rows_async([5], [15], out, [1])
    assert ds.wait_reads(30.0) and ds.take_reads() == [(third, [], None)]
    assert (out[1] == block(15)).all()
    assert ds.read_into([7], [17], out[:1]) == [] and (out[0] == block(17)).all()


def test_a_refused_read_changes_nothing(ds):
    out = np.zeros((2, BPB), np.uint8)
    t = ds.read_rows_async([0], [10], out, [0])
    before = ds.reads_in_flight
    with pytest.raises(InvalidArgumentError):
        ds.read_rows_async([1, 2], [11, 12], out, [1, 0])  # row 1 free, row 0 not: none queued
    assert ds.reads_in_flight <= before
    assert ds.wait_reads(30.0) and ds.take_reads() == [(t, [], None)]
    assert (out[1] == 0).all(), "nothing of the refused read landed"
    t2 = ds.read_rows_async([1, 2], [11, 12], out, [1, 0])
    assert ds.wait_reads(30.0) and ds.take_reads() == [(t2, [], None)]
    assert (out[1] == block(11)).all() and (out[0] == block(12)).all()
