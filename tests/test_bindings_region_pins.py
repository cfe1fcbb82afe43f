"""BlockRegion's memory stays where it was registered: numpy cannot reallocate a registered
array under a copy, and a TorchFunctionMode cannot answer another address for a tensor."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvslots import _core


def test_a_registered_array_cannot_be_resized_in_place():
    """``ndarray.resize(refcheck=False)`` reallocated a registered array's bytes (freeing them
    under a copy running without the GIL); the region's weak reference makes numpy refuse it, for
    the array and for the array a registered view belongs to, until the region is gone."""
    a = np.zeros(4096, np.uint8)
    r = _core.BlockRegion(a, block_bytes=64, num_blocks=64)
    with pytest.raises(ValueError):
        a.resize(1, refcheck=False)
    assert a.size == 4096
    owner = np.zeros(4096 + 64, np.uint8)
    view = owner[64:]
    rv = _core.BlockRegion(view, block_bytes=64, num_blocks=64)
    with pytest.raises(ValueError):
        owner.resize(1, refcheck=False)
    assert _core.copy_blocks(rv, r, [1], [2]) == 64
    del r, rv, view
    gc.collect()
    a.resize(1, refcheck=False)
    owner.resize(1, refcheck=False)
    assert a.size == owner.size == 1


def test_a_strided_view_pins_the_array_behind_it():
    # as_strided's (and sliding_window_view's) views have numpy's DummyArray as their base: the
    # pin stopped there, the array could be resized and a copy into the view wrote freed memory.
    x = np.zeros(4096, np.uint8)
    v = np.lib.stride_tricks.as_strided(x, shape=(4096,), strides=(1,))
    r = _core.BlockRegion(v, block_bytes=64, num_blocks=64)
    with pytest.raises(ValueError):
        x.resize(1, refcheck=False)
    del r, v
    gc.collect()
    w = np.lib.stride_tricks.sliding_window_view(x, 1)[:, 0]  # read-only: a copy's source
    rw = _core.BlockRegion(w, block_bytes=64, num_blocks=64)
    del w
    with pytest.raises(ValueError):
        x.resize(1, refcheck=False)
    del rw
    gc.collect()
    x.resize(1, refcheck=False)  # released with the regions
    assert x.size == 1


def test_an_array_over_a_memoryview_pins_the_array_behind_it(tmp_path):
    """``np.frombuffer(memoryview(a))``'s base is the memoryview, and numpy resizes ``a`` in
    place whatever buffers it has exported: a region (or a disk read) over such an array left
    ``a.resize(1, refcheck=False)`` free to free its bytes. The pin follows ``memoryview.obj``."""
    a = np.zeros(4096, np.uint8)
    v = np.frombuffer(memoryview(a)[64:], np.uint8)
    r = _core.BlockRegion(v, block_bytes=64, num_blocks=8)
    with pytest.raises(ValueError):
        a.resize(1, refcheck=False)
    b = np.zeros(4096, np.uint8)
    ds = _core.DiskStore(str(tmp_path / "f.bin"), num_slots=1, block_size=2, num_layers=1, bytes_per_block=64,
                         dtype="uint8", fingerprint=1)
    assert ds.submit(0, np.full(64, 9, np.uint8), 5, [1, 2])
    ds.flush()
    out = np.frombuffer(memoryview(b), np.uint8).reshape(64, 64)
    ds.read_rows_async([0], [5], out, [3])
    with pytest.raises(ValueError):
        b.resize(1, refcheck=False)
    assert ds.wait_reads(10.0) and ds.take_reads()
    assert b[3 * 64:4 * 64].tolist() == [9] * 64
    del r, v, out
    gc.collect()
    a.resize(1, refcheck=False)
    b.resize(1, refcheck=False)


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_an_array_resized_during_a_copy_frees_nothing_being_written():
    """Another thread's ``dst.resize(1, refcheck=False)`` while copy_blocks wrote into ``dst``
    unmapped the bytes being written: the child died with SIGSEGV. Now the resize is refused and
    every copy finishes."""
    r = _child("""
        import threading, time
        import numpy as np
        from kvslots import _core
        n, bb = 64 << 20, 64 << 10  # mmap-backed: a shrunk allocation's tail is unmapped
        src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        rs = _core.BlockRegion(src, block_bytes=bb, num_blocks=n // bb)
        rd = _core.BlockRegion(dst, block_bytes=bb, num_blocks=n // bb)
        ids = np.arange(n // bb, dtype=np.int64)
        refused = 0
        for _ in range(5):
            t = threading.Thread(target=_core.copy_blocks, args=(rs, rd, ids, ids))
            t.start()
            time.sleep(0.002)
            try:
                dst.resize(1, refcheck=False)
            except ValueError:
                refused += 1
            t.join()
        print(refused, int(dst[-1]))
    """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["5", "1"]


def test_a_torch_function_mode_cannot_forge_a_tensor_address():
    """A TorchFunctionMode sees even ``TensorBase.data_ptr`` of a plain tensor: one answering
    another array's address (and a storage object saying the same) made the region point there,
    and a copy wrote into that array. The tensor is now read with torch functions disabled."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    victim = np.zeros(1 << 16, np.uint8)

    class Storage:
        class device:
            type = "cpu"

        def data_ptr(self):
            return victim.ctypes.data

        def nbytes(self):
            return victim.nbytes

    class Forge(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "data_ptr":
                return victim.ctypes.data
            if name == "untyped_storage":
                return Storage()
            out = func(*args, **(kwargs or {}))
            return victim.nbytes if name == "__get__" and type(out) is int else out

    t = torch.zeros(64, dtype=torch.uint8)
    host = _core.BlockRegion(np.full(64, 7, np.uint8), block_bytes=8, num_blocks=8)
    plain = _core.BlockRegion(t, block_bytes=8, num_blocks=8)
    with Forge():
        forged = _core.BlockRegion(t, block_bytes=8, num_blocks=8)
        assert forged.nbytes == 64
        assert _core.copy_blocks(host, forged, [0], [1]) == 8
        assert _core.copy_blocks(host, plain, [0], [2]) == 8
    assert not victim.any()
    assert t.tolist() == [0] * 8 + [7] * 16 + [0] * 40
    # A mode that only passes calls on (torch.device's) is no obstacle.
    with torch.device("cpu"):
        assert _core.copy_blocks(host, _core.BlockRegion(t, block_bytes=8, num_blocks=8), [0], [7]) == 8
    assert t[56:].tolist() == [7] * 8


def test_an_async_disk_read_pins_its_array(tmp_path):
    """DiskStore.read_rows_async keeps its array alive until take_reads, and the reader threads
    write into it meanwhile; ``out.resize(1, refcheck=False)`` freed it under them (a read
    landing in the arrays allocated next: 'malloc(): unsorted double linked list corrupted', an
    abort). numpy now refuses, for the array and for the array it views, until the read is
    taken."""
    bpb, n = 4096, 4
    ds = _core.DiskStore(str(tmp_path / "f.bin"), num_slots=n, block_size=2, num_layers=1, bytes_per_block=bpb,
                         dtype="uint8", fingerprint=1)
    for i in range(n):
        assert ds.submit(i, np.full(bpb, i + 1, np.uint8), 100 + i, [1, 2])
    ds.flush()
    owner = np.zeros((n + 1) * bpb, np.uint8)
    out = owner[bpb:].reshape(n, bpb)
    whole = np.zeros((n, bpb), np.uint8)
    ticket = ds.read_rows_async(list(range(n)), [100 + i for i in range(n)], out, list(range(n)))
    ticket2 = ds.read_rows_async(list(range(n)), [100 + i for i in range(n)], whole, list(range(n)))
    for a in (owner, whole):
        with pytest.raises(ValueError):
            a.resize(1, refcheck=False)
    assert ds.wait_reads(10.0)
    assert sorted(t for t, bad, err in ds.take_reads() if not bad and err is None) == [ticket, ticket2]
    assert out[:, 0].tolist() == whole[:, 0].tolist() == [1, 2, 3, 4]
    del out
    gc.collect()
    owner.resize(1, refcheck=False)
    whole.resize(1, refcheck=False)
    assert owner.size == whole.size == 1
