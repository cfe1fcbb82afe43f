"""The disk tier's storage and bookkeeping through the extension: records round-trip and survive
a reopen, a mismatched header or a damaged record is never served, a kill -9 while writing loses
at most the records in flight, hostile arguments raise kvslots errors, and ``DiskIndex`` agrees
with a small reference model (hypothesis)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvslots import KVSlotsError
from kvslots._core import DiskIndex, DiskStore

BS = 4
BPB = 3000
LAYOUT = dict(block_size=BS, num_layers=2, bytes_per_block=BPB, dtype="float32", fingerprint=1234)


def store(path: Path, n: int = 8, **kw) -> DiskStore:
    return DiskStore(str(path), num_slots=n, **{**LAYOUT, **kw})


def block(h: int) -> np.ndarray:
    return np.random.default_rng(h).integers(0, 256, BPB, dtype=np.uint8)


def write(s: DiskStore, slot: int, h: int) -> None:
    assert s.submit(slot, block(h), h, [h] * BS, successor=h + 1, parent_hash=h - 1 if h else None)


def fill(s: DiskStore, hashes) -> DiskStore:
    """`s` with block `hashes[i]` written to slot i, flushed."""
    for slot, h in enumerate(hashes):
        write(s, slot, h)
    s.flush()
    return s


#: A record's header: 64 fixed bytes and the tokens, 64-aligned; records are `stride` apart.
RECORD_HDR = (64 + 4 * BS + 63) // 64 * 64


def stride(path: Path, n: int = 8) -> int:
    return (path.stat().st_size - 4096) // n


def restore(path: Path, n: int = 8, **kw) -> tuple[DiskIndex, tuple[int, int, str | None]]:
    idx = DiskIndex(n, BS)
    args = {k: v for k, v in {**LAYOUT, **kw}.items() if k != "block_size"}
    return idx, idx.restore_from_file(str(path), **args)


def test_records_round_trip_and_are_found_again_after_a_restart(tmp_path: Path) -> None:
    p = tmp_path / "tier.kvs"
    s = store(p)
    assert s.opened == "created"
    for slot, h in [(0, 10), (3, 11), (5, 12)]:
        write(s, slot, h)
    s.flush()
    assert sorted(s.take_done()) == [(0, True), (3, True), (5, True)]
    out = np.zeros((2, BPB), np.uint8)
    assert s.read_into([3, 5], [11, 12], out) == []
    assert (out[0] == block(11)).all() and (out[1] == block(12)).all()
    st_ = s.stats()
    assert st_["bytes_written"] == 3 * BPB and st_["bytes_read"] == 2 * BPB and st_["queue_depth"] == 0
    del s
    # A restart with the same layout: the index is rebuilt, each block published on STORAGE.
    idx, (n, damaged, why) = restore(p)
    assert (n, damaged, why) == (3, 0, None)
    assert idx.match_prefix([10, 11, 12, 13]) == 3
    assert idx.successor(11) == 12
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(idx.events_msgpack(1.0, drain=True), type=KVEventBatch)
    assert [e.medium for e in batch.events] == ["STORAGE"] * 3
    assert sorted(e.block_hashes[0] for e in batch.events) == [10, 11, 12]
    assert idx.num_pending_events() == 0
    s = store(p)
    assert s.opened == "reused"
    out = np.zeros((1, BPB), np.uint8)
    assert s.read_into([idx.lookup(12)], [12], out) == [] and (out[0] == block(12)).all()


@pytest.mark.parametrize("change, word", [({"fingerprint": 99}, "fingerprint"), ({"dtype": "bfloat16"}, "dtype"),
                                          ({"num_layers": 3}, "layers"), ({"bytes_per_block": 4096}, "bytes per block")])
def test_a_file_of_another_model_or_layout_is_never_served(tmp_path: Path, change: dict, word: str) -> None:
    p = tmp_path / "tier.kvs"
    s = store(p)
    write(s, 0, 7)
    s.flush()
    del s
    idx, (n, _, why) = restore(p, **change)
    assert n == 0 and why is not None and word in why
    s = store(p, **change)
    assert s.opened.startswith("discarded") and word in s.opened
    # Started afresh: the old record is gone for the old layout too.
    _, (n, _, why) = restore(p)
    assert n == 0 and why is not None


def test_a_torn_header_or_damaged_record_is_detected(tmp_path: Path) -> None:
    p = tmp_path / "tier.kvs"
    s = fill(store(p), [20, 21, 22])
    with open(p, "r+b") as f:
        f.seek(4096 + 1 * stride(p) + RECORD_HDR + 100)  # a data byte of slot 1
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
        f.seek(4096 + 2 * stride(p) + 64)  # a token of slot 2: its header fails
        f.write(b"\xff")
    out = np.zeros((3, BPB), np.uint8)
    bad = s.read_into([0, 1, 2], [20, 21, 22], out)
    assert [i for i, _ in bad] == [1, 2]
    assert "checksum" in bad[0][1]
    assert s.stats()["corrupt_blocks"] == 2
    idx, (n, damaged, why) = restore(p)
    assert (n, damaged, why) == (2, 1, None), "slot 2's header is damaged; slot 1's is caught on read"
    # A record of another hash is not served either.
    assert s.read_into([0], [21], out[:1])[0][1].find("hash") >= 0
    # A torn file header: the file is not used.
    with open(p, "r+b") as f:
        f.seek(20)
        f.write(b"\x01")
    _, (n, _, why) = restore(p)
    assert n == 0 and "checksum" in why


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from kvslots._core import DiskStore
    s = DiskStore(sys.argv[1], num_slots=256, block_size=4, num_layers=2, bytes_per_block=3000,
                  dtype="float32", fingerprint=1234, queue_len=8)
    print("ready", flush=True)
    i = 0
    while True:
        h = 1000 + i
        data = np.full(3000, h % 251, np.uint8)
        s.submit(i % 256, data, h, [h] * 4)
        i += 1
""")


def test_kill_9_while_writing_loses_at_most_the_records_in_flight(tmp_path: Path) -> None:
    p = tmp_path / "tier.kvs"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(p)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    idx, (n, damaged, why) = restore(p, n=256)
    assert why is None and n > 0
    s = store(p, n=256)
    assert s.opened == "reused"
    # Every restored block either reads back exactly what was written, or is reported.
    restored = [(idx.lookup(h), h) for h in _hashes_of(idx)]
    slots = [x[0] for x in restored]
    hashes = [x[1] for x in restored]
    out = np.zeros((len(slots), BPB), np.uint8)
    bad = s.read_into(slots, hashes, out)
    assert len(bad) + damaged <= 1, f"at most the one record being written when killed: {bad}, {damaged}"
    good = set(range(len(slots))) - {i for i, _ in bad}
    for i in good:
        assert (out[i] == hashes[i] % 251).all()


def _hashes_of(idx: DiskIndex) -> list[int]:
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(idx.events_msgpack(0.0), type=KVEventBatch)
    return [e.block_hashes[0] for e in batch.events]


def test_hostile_arguments_raise_kvslots_errors_and_change_nothing(tmp_path: Path) -> None:
    p = tmp_path / "tier.kvs"
    s = store(p)
    good = block(1)
    with pytest.raises(KVSlotsError):
        s.submit(8, good, 1, [1] * BS)  # slot out of range
    with pytest.raises(KVSlotsError):
        s.submit(-1, good, 1, [1] * BS)
    with pytest.raises(KVSlotsError):
        s.submit(0, good[:-1], 1, [1] * BS)  # short data
    with pytest.raises(KVSlotsError):
        s.submit(0, good, 1, [1] * (BS + 1))
    with pytest.raises(KVSlotsError):
        s.submit(0, good, -5, [1] * BS)
    with pytest.raises(KVSlotsError):
        s.submit(0, good, 1, [1, 2, "x", 4])
    with pytest.raises((KVSlotsError, TypeError)):
        s.submit(0, np.zeros(BPB, np.float32), 1, [1] * BS)
    out = np.zeros((1, BPB), np.uint8)
    with pytest.raises(KVSlotsError):
        s.read_into([0, 1], [1], out)
    with pytest.raises(KVSlotsError):
        s.read_into([99], [1], out)
    with pytest.raises(KVSlotsError):
        s.read_into([0], [1], np.zeros((1, BPB), np.uint8)[:, ::-1].copy()[:, :BPB - 1])
    s.flush()
    assert s.take_done() == [] and s.stats()["written_blocks"] == 0
    for bad in [dict(bytes_per_block=0), dict(block_size=0), dict(dtype="x" * 40), dict(fingerprint=-1),
                dict(num_slots=float("nan")), dict(queue_len=0)]:
        with pytest.raises(KVSlotsError):
            DiskStore(str(tmp_path / "other.kvs"), **{"num_slots": 4, **LAYOUT, **bad})
    with pytest.raises(KVSlotsError):
        DiskStore(str(tmp_path / "no-such-dir" / "x.kvs"), num_slots=4, **LAYOUT)
    idx = DiskIndex(2, BS)
    for bad in (["x"], [-1], [2**64], [float("nan")], "123", None):
        with pytest.raises(KVSlotsError):
            idx.held(bad)
    assert idx.held([]) == [] and idx.held([5, 5]) == []
    with pytest.raises(KVSlotsError):
        idx.begin_write(1, [1] * (BS - 1))
    with pytest.raises(KVSlotsError):
        idx.complete_write(0, True)
    with pytest.raises(KVSlotsError):
        idx.begin_read([1])
    with pytest.raises(KVSlotsError):
        idx.end_read([0])
    with pytest.raises(KVSlotsError):
        DiskIndex(-1, BS)
    assert idx.num_free == 2 and idx.check_invariants() is None


class Model:
    """Reference: stored hashes oldest-used first, writes under way, read pins."""

    def __init__(self, cap: int) -> None:
        self.cap, self.lru, self.writing, self.pins = cap, [], {}, {}

    def begin_write(self, h: int) -> bool:
        if h in self.lru or h in self.writing.values():
            return False
        if len(self.lru) + len(self.writing) == self.cap:
            victims = [x for x in self.lru if not self.pins.get(x)]
            if not victims:
                return False
            self.lru.remove(victims[0])
        return True


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 5), ops=st.lists(st.tuples(st.sampled_from("wcrem"), st.integers(0, 9), st.booleans()),
                                            max_size=60))
def test_disk_index_agrees_with_the_reference_model(cap: int, ops: list) -> None:
    idx, m = DiskIndex(cap, 1), Model(cap)
    reads: list[tuple[list[int], int]] = []
    for kind, h, flag in ops:
        if kind == "w":
            expect = m.begin_write(h)
            slot = idx.begin_write(h, [h])
            assert (slot is not None) == expect
            if slot is not None:
                m.writing[slot] = h
        elif kind == "c" and m.writing:
            slot = sorted(m.writing)[h % len(m.writing)]
            hh = m.writing.pop(slot)
            ok = flag or h % 3 != 0
            idx.complete_write(slot, ok)
            if ok:
                m.lru.append(hh)
        elif kind == "r":
            if h in m.lru:
                reads.append((idx.begin_read([h]), h))
                m.pins[h] = m.pins.get(h, 0) + 1
                m.lru.remove(h)
                m.lru.append(h)
            else:
                with pytest.raises(KVSlotsError):
                    idx.begin_read([h])
        elif kind == "e" and reads:
            slots, hh = reads.pop(h % len(reads))
            idx.end_read(slots)
            m.pins[hh] -= 1
        elif kind == "m":
            expect = h in m.lru and not m.pins.get(h)
            assert idx.remove(h) == expect
            if expect:
                m.lru.remove(h)
        assert idx.num_stored == len(m.lru) and idx.num_writing == len(m.writing)
        assert idx.match_prefix(m.lru) == len(m.lru)
        assert idx.check_invariants() is None


#: Destination rows of blocks 0..11 in a 20-row array, in no order (rows 6, 8, 10, 11, 13, 14, 15,
#: 17 stay untouched).
SCATTERED_ROWS = [19, 0, 7, 3, 12, 5, 1, 16, 9, 2, 18, 4]


def twelve_blocks(tmp_path: Path):
    """A 16-slot store whose slots 0..11 hold blocks 100..111, written and flushed."""
    s = fill(store(tmp_path / "tier.kvs", n=16), range(100, 112))
    s.take_done()
    return s


def test_read_rows_lands_each_block_in_its_row_across_reader_threads(tmp_path: Path) -> None:
    from kvslots.errors import KVSlotsError

    s = twelve_blocks(tmp_path)
    out = np.zeros((20, BPB), np.uint8)
    rows = SCATTERED_ROWS
    assert s.read_rows(list(range(12)), [100 + i for i in range(12)], out, rows) == []
    for slot, r in enumerate(rows):
        assert (out[r] == block(100 + slot)).all()
    assert not out[[6, 8, 10, 11, 13, 14, 15, 17]].any(), "other rows untouched"
    # A wrong hash is reported with its index, wherever its row is; the others still land.
    out[:] = 0
    bad = s.read_rows([4, 9, 10], [104, 999, 110], out, [2, 0, 1])
    assert [i for i, _ in bad] == [1] and (out[2] == block(104)).all() and (out[1] == block(110)).all()
    for rows_bad in ([0, 0, 1], [0, 1, 20]):  # repeated or outside: refused, nothing read
        out[:] = 0
        try:
            s.read_rows([4, 9, 10], [104, 109, 110], out, rows_bad)
        except KVSlotsError:
            pass
        else:
            raise AssertionError(f"rows {rows_bad} accepted")
        assert not out.any()


def test_background_reads_land_in_their_rows_and_report_each_ticket_once(tmp_path: Path) -> None:
    s = twelve_blocks(tmp_path)
    before = s.stats()
    out = np.zeros((20, BPB), np.uint8)
    rows = SCATTERED_ROWS
    t1 = s.read_rows_async(list(range(12)), [100 + i for i in range(12)], out, rows)
    # A wrong hash in the middle of a run of consecutive slots: only that block is refused.
    own = np.zeros((3, BPB), np.uint8)
    t2 = s.read_rows_async([4, 5, 6], [104, 999, 106], own, [0, 1, 2])
    del own  # the store keeps the array alive until the ticket is taken
    assert t1 != t2
    assert s.wait_reads(30.0) and s.reads_in_flight == 0
    done = {t: (bad, err) for t, bad, err in s.take_reads()}
    assert s.take_reads() == [], "each ticket is reported once"
    assert set(done) == {t1, t2}
    assert done[t1] == ([], None)
    bad, err = done[t2]
    assert err is None and [i for i, _ in bad] == [1] and "holds hash" in bad[0][1]
    for slot, r in enumerate(rows):
        assert (out[r] == block(100 + slot)).all()
    assert not out[[6, 8, 10, 11, 13, 14, 15, 17]].any(), "other rows untouched"
    after = s.stats()
    assert after["read_blocks"] - before["read_blocks"] == 12 + 2
    assert after["corrupt_blocks"] - before["corrupt_blocks"] == 1


def test_background_reads_refuse_hostile_arguments_and_start_nothing(tmp_path: Path) -> None:
    s = store(tmp_path / "tier.kvs", n=8)
    write(s, 0, 100)
    s.flush()
    out = np.zeros((4, BPB), np.uint8)
    for args in (([0, 0], [100, 100], out, [0, 0]),  # a row twice
                 ([0], [100], out, [4]),  # outside the array
                 ([8], [100], out, [0]),  # outside the file
                 ([0], [100, 101], out, [0]),  # lengths differ
                 ([0], [100], np.zeros((4, BPB), np.float32), [0]),  # not uint8
                 ([0], [100], np.zeros((4, BPB + 1), np.uint8), [0]),  # not a block wide
                 ([0], [100], np.zeros((BPB, 4), np.uint8).T, [0]),  # not C-contiguous
                 ([-1], [100], out, [0]), (["x"], [100], out, [0]), ([0], [2**64], out, [0])):
        with pytest.raises((KVSlotsError, TypeError)):
            s.read_rows_async(*args)
    assert s.reads_in_flight == 0 and s.take_reads() == [] and not out.any()
    with pytest.raises((KVSlotsError, TypeError)):  # Fortran order: rows are not byte runs
        s.read_rows([0], [100], np.zeros((BPB, 4), np.uint8).T, [0])
    for t in (float("nan"), -1.0, float("inf"), 1e9):
        with pytest.raises(KVSlotsError):
            s.wait_reads(t)
    assert s.wait_reads(0.0)


def test_a_record_of_another_model_under_this_files_header_is_never_served(tmp_path: Path) -> None:
    # Two engines of different models (same KV layout) on one disk_path, or a record copied in
    # from another file: the record's own checksums hold, but it is not this model's KV.
    a, b = tmp_path / "a.kvs", tmp_path / "b.kvs"
    sa = store(a, fingerprint=1)
    write(sa, 0, 77)
    sa.flush()
    del sa
    assert store(b, fingerprint=2).opened == "created"  # an empty file of model 2
    with open(a, "rb") as fa, open(b, "r+b") as fb:
        fa.seek(4096)
        rec = fa.read(stride(a))
        fb.seek(4096)
        fb.write(rec)
    _, (n, damaged, why) = restore(b, fingerprint=2)
    assert (n, damaged, why) == (0, 1, None), "not restored: it belongs to model 1"
    sb = store(b, fingerprint=2)
    assert sb.opened == "reused"
    out = np.zeros((1, BPB), np.uint8)
    bad = sb.read_into([0], [77], out)
    assert [i for i, _ in bad] == [0] and "checksum" in bad[0][1]
    # Model 1 still reads its own record.
    del sb
    out[:] = 0
    assert store(a, fingerprint=1).read_into([0], [77], out) == [] and (out[0] == block(77)).all()


def test_a_second_store_on_a_file_in_use_is_refused_and_leaves_it_intact(tmp_path: Path) -> None:
    # Two engines pointed at one disk_path: the second one must not truncate (another layout) or
    # overwrite (same layout, its own slot numbers) the records the first one is serving.
    from kvslots.errors import DiskTierError

    p = tmp_path / "tier.kvs"
    a = store(p)
    write(a, 0, 5)
    a.flush()
    size = p.stat().st_size
    for other in (dict(fingerprint=2), dict(bytes_per_block=BPB * 2), {}):
        with pytest.raises(DiskTierError, match="in use"):
            store(p, **other)
        assert p.stat().st_size == size
    out = np.zeros((1, BPB), np.uint8)
    assert a.read_into([0], [5], out) == [] and (out[0] == block(5)).all()
    # A read-only restore (the scheduler's) still works while the worker holds the file.
    _, (n, _, why) = restore(p)
    assert (n, why) == (1, None)
    del a  # the lock goes with the store
    assert store(p).opened == "reused"


def test_the_largest_queue_len_allocates_nothing_up_front(tmp_path: Path) -> None:
    # disk_queue_len is taken up to 2^31 - 1 by the config; a queue preallocated for that many
    # writes aborted the process (a failed allocation in Rust) instead of starting the store.
    code = textwrap.dedent(f"""
        import numpy as np
        from kvslots._core import DiskStore
        for q in (2**31 - 1, 2**40):
            s = DiskStore({str(tmp_path / "q.kvs")!r}, num_slots=4, block_size=4, num_layers=2,
                          bytes_per_block=3000, dtype="float32", fingerprint=1, queue_len=q)
            assert s.submit(0, np.zeros(3000, np.uint8), 1, [1] * 4)
            s.flush()
            assert s.take_done() == [(0, True)]
            del s
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_huge_fresh_file_opens_without_reading_every_slot(tmp_path: Path) -> None:
    # A fresh file is one hole after its header (sparse). Opening it read every slot's record
    # header, one read each (2^28 slots: minutes, the store not yet returned).
    code = textwrap.dedent(f"""
        from kvslots._core import DiskStore
        from kvslots.errors import DiskTierError
        try:
            s = DiskStore({str(tmp_path / "huge.kvs")!r}, num_slots=2**28, block_size=4, num_layers=2,
                          bytes_per_block=3000, dtype="float32", fingerprint=1)
        except DiskTierError as e:  # a filesystem without files this large: refused, not stuck
            print("refused", e)
        else:
            print(s.opened, s.stats()["max_seq_at_open"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] in ("created", "refused"), proc.stdout


def test_a_truncated_file_is_not_restored_from(tmp_path: Path) -> None:
    # The worker starts a file of the wrong length afresh; the scheduler's restore raised on a
    # cut inside a record header (an engine that did not start) and, cut inside a record's
    # bytes, restored that record, whose read then failed as an I/O error.
    p = tmp_path / "tier.kvs"
    fill(store(p), range(30, 38))  # and closed: the store is let go at once
    full, rs = p.read_bytes(), stride(p)
    for cut in (4096 + 3 * rs + 10, 4096 + 3 * rs + 200, len(full) - 1, len(full) + 4096):
        p.write_bytes(full[:cut] + b"\0" * max(0, cut - len(full)))
        idx, (n, damaged, why) = restore(p)
        assert (n, damaged) == (0, 0) and why is not None and "bytes" in why, (cut, n, damaged, why)
        assert idx.num_stored == 0 and idx.num_pending_events() == 0


def test_a_restore_from_a_fifo_or_device_returns_at_once(tmp_path: Path) -> None:
    # Opening a FIFO to read waits for a writer: the restore hung there, holding the GIL.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from kvslots._core import DiskIndex
        for path in ({str(fifo)!r}, "/dev/zero", "/dev/null"):
            n, damaged, why = DiskIndex(8, 4).restore_from_file(path, num_layers=2, bytes_per_block=3000,
                                                                dtype="float32", fingerprint=1234)
            assert (n, damaged) == (0, 0) and why, (path, why)
            print(why)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all("regular file" in line for line in proc.stdout.splitlines()), proc.stdout


def forge_seq(path: Path, slot: int, seq: int, n: int = 8) -> None:
    """Sets the write sequence number of `slot`'s record to `seq`, its header checksum made
    valid again (seeded with the layout, as the store does): a record that verifies."""
    import struct

    import xxhash

    at = 4096 + slot * stride(path, n)
    seed = xxhash.xxh3_64_intdigest(struct.pack("<IIQQ32s", LAYOUT["block_size"], LAYOUT["num_layers"],
                                                LAYOUT["bytes_per_block"], LAYOUT["fingerprint"],
                                                LAYOUT["dtype"].encode()))
    with open(path, "r+b") as f:
        f.seek(at)
        h = bytearray(f.read(RECORD_HDR))
        h[8:16] = seq.to_bytes(8, "little")
        h[56:64] = xxhash.xxh3_64_intdigest(bytes(h[:56] + h[64:64 + 4 * BS]), seed=seed).to_bytes(8, "little")
        f.seek(at)
        f.write(h)


def test_a_forged_last_sequence_number_never_wraps_the_writers(tmp_path: Path) -> None:
    # A record numbered 2^64 - 1 (forged, its checksum valid) made the writer start at
    # max + 1 = 0: every later record was older than the ones already there, and a restart
    # served the stale copy of a hash written again.
    p = tmp_path / "tier.kvs"
    fill(store(p), [10, 11])  # and closed: the store is let go at once
    forge_seq(p, 1, 2**64 - 1)
    _, got = restore(p)
    assert got == (1, 1, None), "the forged record is damaged: not restored"
    s = store(p)
    assert s.opened == "reused" and s.stats()["max_seq_at_open"] < 2**62
    assert s.read_into([1], [11], np.zeros((1, BPB), np.uint8))[0][0] == 0, "nor served"
    assert s.submit(2, block(99), 10, [10] * BS)  # hash 10 again: the newer record must win
    s.flush()
    assert s.take_done() == [(2, True)]
    del s
    idx, got = restore(p)
    assert got[0] == 1 and idx.lookup(10) == 2
    # Numbered past any honest writer (2^62 and above, below the limit): the file is started
    # afresh, so the writer always has 2^62 numbers ahead of it.
    for seq in (2**62, 2**63 - 1):
        s = store(p)
        write(s, 3, 12)
        s.flush()
        del s
        forge_seq(p, 3, seq)
        s = store(p)
        assert s.opened.startswith("discarded") and "sequence" in s.opened, s.opened
        assert s.stats()["max_seq_at_open"] == 0
        del s
        assert restore(p)[1][0] == 0


@contextlib.contextmanager
def truncation_fails(path: Path):
    """The next ftruncate of `path` fails: append-only (chattr +a, root on ext4 or xfs: the
    records survive the failed wipe), else a file size limit of one header (SIGXFSZ ignored:
    the wipe cuts the file back, then cannot size it again)."""
    try:
        appends_only = subprocess.run(["chattr", "+a", str(path)], capture_output=True).returncode == 0
    except OSError:  # no chattr
        appends_only = False
    if appends_only:
        try:
            yield "append-only"
        finally:
            subprocess.run(["chattr", "-a", str(path)], check=True)
        return
    import resource

    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        yield "size limit"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_sig)


def test_a_failed_wipe_is_reported_and_nothing_from_before_it_is_served_again(tmp_path: Path, caplog) -> None:
    # A wipe (prefix-cache reset) that failed was ignored: the file kept the records of before
    # the reset (other weights, maybe), and a restart restored and served them.
    from kvslots.vllm.connector.disk import FILE_NAME, DiskLayout, DiskStepMeta, DiskWorker

    layout = DiskLayout(num_layers=2, bytes_per_block=BPB, dtype="float32", fingerprint=1234)
    w = DiskWorker(directory=str(tmp_path), num_slots=8, block_size=BS, layout=layout, queue_len=8)
    p, s = tmp_path / FILE_NAME, fill(w.store, [20, 21, 22])
    assert len(s.take_done()) == 3 and s.out_of_use is None
    with truncation_fails(p) as how:
        w.spill(DiskStepMeta(wipe=True))
        s.flush()
    with caplog.at_level("WARNING", logger="kvslots.vllm.connector.disk"):
        assert w.take_done() == [] and w.take_done() == []
    said = [r.getMessage() for r in caplog.records if "out of use" in r.getMessage()]
    assert len(said) == 1 and "prefix-cache reset failed" in said[0] and str(p) in said[0], (how, said)
    assert s.stats()["wipe_failures"] == 1 and "prefix-cache reset failed" in s.out_of_use
    out = np.zeros((1, BPB), np.uint8)
    bad = s.read_into([0], [20], out)
    assert [i for i, _ in bad] == [0] and "out of use" in bad[0][1] and not out.any(), how
    assert not s.submit(3, block(23), 23, [23] * BS) and s.take_done() == [(3, False)]
    del w, s
    # A restart: nothing from before the reset is found again.
    _, (n, _, why) = restore(p)
    assert n == 0 and why is not None, how
    assert store(p).opened.startswith("discarded"), how


def test_a_store_used_in_a_forked_child_raises_instead_of_queuing_for_no_writer(tmp_path: Path) -> None:
    # Threads do not survive fork(): in the child, a write was queued for a writer that is not
    # there (reported never), a flush waited for it forever, and so did dropping the store.
    from kvslots.errors import InvalidStateError

    s = store(tmp_path / "tier.kvs")
    write(s, 0, 10)
    s.flush()
    out = np.zeros((1, BPB), np.uint8)
    pid = os.fork()
    if pid == 0:  # the child: reports through its exit status, never returns into pytest
        code = 1
        try:
            signal.alarm(20)  # a hang is a failure, not a stuck suite
            uses = [lambda: s.submit(1, block(11), 11, [11] * BS), s.flush, s.take_done, s.wipe,
                    lambda: s.read_into([0], [10], out), lambda: s.read_rows_async([0], [10], out, [0]),
                    s.take_reads, lambda: s.wait_reads(1.0), lambda: s.invalidate(0), s.stats]
            refused = 0
            for use in uses:
                try:
                    use()
                except InvalidStateError as e:
                    refused += "fork" in str(e) and isinstance(e, RuntimeError)
            code = 0 if refused == len(uses) and s.opened == "created" else 10 + refused
            del uses, use
            del s  # dropped here: joins no thread that is not there
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's store is untouched and goes on.
    write(s, 1, 11)
    s.flush()
    assert sorted(s.take_done()) == [(0, True), (1, True)]
    assert s.read_into([0, 1], [10, 11], np.zeros((2, BPB), np.uint8)) == []
