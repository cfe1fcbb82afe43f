"""BlockCopier's CUDA driver issue path (``_DriverPath``) on CPU memory: a stand-in driver runs
its calls in program order (bus copies as memmove, the fused kernel's launches by a Python model
of the kernel reading its raw arguments), so the ids in the pinned ring, the staging rows, the
runs of host rows, the chunks and the direct rows are checked against a reference without a GPU.
The real driver and kernel run in test_transfer.py's CUDA cases."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import random
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvslots.errors import TransferError
from kvslots.vllm import _cuda_driver
from kvslots.vllm._cuda_driver import ContextGuard, KernelLaunch
from kvslots.vllm._fused_copy import FusedMover
from kvslots.vllm.transfer import STAGING_BUFFERS, BlockCopier, _DriverPath

from test_transfer import _back_to_back, random_copies


def _i64(addr: int) -> int:
    return ctypes.c_int64.from_address(addr).value


class FakeDriver:
    """Runs each call at once on host memory; counts them."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._events = 0

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._count("htod")
        ctypes.memmove(dst, src, nbytes)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._count("dtoh")
        ctypes.memmove(dst, src, nbytes)

    def record(self, event: int, stream: int) -> None:
        assert event and stream, "a handle is missing"
        self._count("record")

    def wait(self, stream: int, event: int) -> None:
        assert event and stream, "a handle is missing"
        self._count("wait")

    def event_create(self) -> int:
        self._events += 1
        return self._events

    def event_query(self, event: int) -> bool:
        return True

    def event_synchronize(self, event: int) -> None:
        pass

    def event_destroy(self, event: int) -> int:
        return 0

    def stream_synchronize(self, stream: int) -> None:
        self._count("stream_synchronize")


def model_kernel(to_stage: bool, direct: bool, calls: list[tuple[int, ...]], blocks: int = 1 << 62) -> Any:
    """The fused kernel (``_fused_copy.move_blocks``) over raw addresses, program by program;
    a block id outside ``0..blocks`` (ids read before they were written) fails the test."""

    def launch(grid: tuple[int, int, int], stream: int, args: tuple[int, ...]) -> None:
        calls.append(grid)
        stage, row_words, idx, table, words, offsets, rows, base = args
        n, nseg, _parts = grid
        for r in range(n):
            block = _i64(idx + 8 * r)
            assert 0 <= block < blocks, f"the kernel read block id {block}"
            for s in range(nseg):
                w, addr, hoff = _i64(words + 8 * s), _i64(table + 8 * s), _i64(offsets + 8 * s)
                dev = addr + block * w * 8
                if direct:
                    staged = _i64(base) + _i64(rows + 8 * r) * row_words * 8 + hoff * 8
                else:
                    staged = stage + r * row_words * 8 + hoff * 8
                if to_stage:
                    ctypes.memmove(staged, dev, w * 8)
                else:
                    ctypes.memmove(dev, staged, w * 8)

    return launch


def install(c: BlockCopier, driver: FakeDriver | None = None,
            launched: list[tuple[int, ...]] | None = None) -> _DriverPath:
    """The driver path over a CPU copier (engine 'torch'), its fused mover built without Triton
    and held by the path alone: copies the path does not take run torch's per-layer kernels."""
    c._fused = FusedMover([(seg.u8, seg.host_offset) for seg in c._segments], c.bytes_per_block, c._device)
    launched = [] if launched is None else launched
    launches = {(t, dr): model_kernel(t, dr, launched, c.num_device_blocks) for t in (True, False) for dr in (True, False)}
    path = _DriverPath(c, driver or FakeDriver(), launches, ctx=contextlib.nullcontext(), bus=1, kernel=2,
                       compute=lambda: 3, compute_mark=11, bus_mark=12, bus_done=[13, 14],
                       kernels_done=[15, 16], pin_memory=False)
    c._driver = path
    c._fused = None
    return path


@pytest.mark.parametrize("seed", range(4))
def test_the_driver_path_moves_what_the_reference_does(seed):
    # Random stores, loads and forward writes with staging chunks of 1-5 blocks: odd chunks
    # leave copies longer than one chunk to torch's path, so the two interleave.
    _back_to_back("cpu", 30 + seed, fused=None, setup=install)


@pytest.mark.parametrize("seed", range(3))
def test_the_driver_path_with_direct_stores(seed):
    def setup(c: BlockCopier) -> None:
        c._direct_max_bytes = 10 * c.bytes_per_block
        install(c)
        assert c._driver is not None and c._driver._direct is not None

    _back_to_back("cpu", 40 + seed, setup=setup)


def _layers(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"l{i}": torch.randint(-100, 100, (2, n, 4, 2, 8), generator=g).to(torch.float16) for i in range(3)}


def test_one_call_per_run_of_host_rows_and_one_launch_per_chunk():
    n = 40
    layers = _layers(n)
    c = BlockCopier(layers, n, 32, engine="torch")
    d, launched = FakeDriver(), []
    install(c, d, launched)
    want = {k: v[:, [5, 1, 7, 3, 9]].clone() for k, v in layers.items()}
    c.store([5, 1, 7, 3, 9], [10, 11, 12, 20, 21])  # host runs 10-12 and 20-21
    assert d.calls["dtoh"] == 2 and len(launched) == 1 and launched[0][0] == 5
    assert d.calls["htod"] == 1  # the ids, to the device copy of the ring slot
    for v in layers.values():
        v[:, [30, 31, 32, 33, 34]] = 0
    c.load([21, 10, 20, 12, 11], [34, 30, 33, 32, 31])
    assert d.calls["htod"] == 1 + 1 + 2 and len(launched) == 2  # the ids, then one copy per run
    assert all(torch.equal(v[:, [30, 31, 32, 33, 34]], want[k]) for k, v in layers.items())


def test_chunks_cycle_the_staging_buffers():
    n = 64
    layers = _layers(n)
    probe = BlockCopier(layers, n, 64, engine="torch")
    c = BlockCopier(layers, n, 64, engine="torch", staging_bytes=2 * 4 * probe.bytes_per_block)  # chunks of 4
    d, launched = FakeDriver(), []
    install(c, d, launched)
    ids = np.arange(10) * 3
    want = {k: v[:, ids].clone() for k, v in layers.items()}
    c.store(ids, np.arange(10))
    assert [g[0] for g in launched] == [4, 4, 2]
    assert d.calls["dtoh"] == 3  # consecutive host rows: one bus copy per chunk
    for v in layers.values():
        v[:, ids] = 0
    c.load(np.arange(10), ids)
    assert all(torch.equal(v[:, ids], want[k]) for k, v in layers.items())


def test_an_odd_chunk_leaves_longer_copies_to_torch():
    n = 64
    layers = _layers(n)
    probe = BlockCopier(layers, n, 64, engine="torch")
    c = BlockCopier(layers, n, 64, engine="torch", staging_bytes=2 * 3 * probe.bytes_per_block)
    launched: list[tuple[int, ...]] = []
    path = install(c, launched=launched)
    assert path.max_ids == 3
    c.store([1, 2, 3], [0, 1, 2])
    assert len(launched) == 1
    c.store([1, 2, 3, 4], [0, 1, 2, 3])
    assert len(launched) == 1


def test_a_slot_is_reused_only_after_its_copy_is_done():
    n = 40
    c = BlockCopier(_layers(n), n, 32, engine="torch")

    class Pending(FakeDriver):
        waited: list[int] = []

        def event_query(self, event: int) -> bool:
            return False  # never done by itself

        def event_synchronize(self, event: int) -> None:
            self.waited.append(event)

    d = Pending()
    install(c, d)
    for i in range(_DriverPath.SLOT_BYTES // (2 * 8) and 16):
        c.store([i], [i])
    assert d.waited == []  # 16 slots, 16 copies: none reused yet
    c.store([1], [1])
    assert d.waited == [1]  # the 17th reuses slot 0: it waits for the first copy's event


class ParamDriver:
    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.launches: list[tuple[Any, ...]] = []

    def param_sizes(self, function: int) -> list[int]:
        return self.sizes

    def launch(self, function, grid, threads, shared, stream, params) -> None:
        self.launches.append((function, grid, threads, shared, stream, params))


def _compiled(scratch_fields: dict[str, int] | None = None, **md: Any) -> Any:
    meta: dict[str, Any] = dict(num_warps=4, shared=0, num_ctas=1)
    meta.update(dict(global_scratch_size=0, profile_scratch_size=0) if scratch_fields is None else scratch_fields)
    meta.update(md)
    return types.SimpleNamespace(function=0x1234, metadata=types.SimpleNamespace(**meta))


@pytest.mark.parametrize("scratch", [0, 1, 2])
def test_a_launch_packs_its_arguments_in_the_kernels_layout(scratch):
    sizes = [8, 4] + [8] * (6 + scratch)  # Triton 3.3+ appends a global, 3.5+ also a profile scratch pointer
    d = ParamDriver(sizes)
    md = {f: 0 for f in KernelLaunch.SCRATCH[:scratch]}
    k = KernelLaunch(d, _compiled(scratch_fields=md))  # type: ignore[arg-type]
    args = (1 << 40, 262144, 2 << 40, 3 << 40, 4 << 40, 5 << 40, 6 << 40, 7 << 40)
    k((16, 64, 4), 99, args)
    function, grid, threads, shared, stream, params = d.launches[0]
    assert (function, grid, threads, shared, stream) == (0x1234, (16, 64, 4), 128, 0, 99)
    got = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_int32 if s == 4 else ctypes.c_uint64)).contents.value
           for i, s in enumerate(sizes)]
    assert got == [*args, *([0] * (len(sizes) - 8))]  # Triton's scratch pointers: null


@pytest.mark.parametrize("sizes", [
    [8, 4, 8], [8, 4] + [8] * 9, [8, 2] + [8] * 8, [4, 4] + [8] * 8, [8, 8] + [8] * 8,
    [8] * 9,  # row_words specialized away as a constant (a value of 1): every argument one off
    [8, 4] + [8] * 6,  # the scratch pointers the metadata announces are missing
])
def test_an_unexpected_kernel_layout_is_refused(sizes):
    with pytest.raises(TransferError):
        KernelLaunch(ParamDriver(sizes), _compiled())  # type: ignore[arg-type]


def test_the_kernel_never_specializes_the_row_length():
    # As a constant it would leave the compiled parameters (the 8-byte-block case above).
    pytest.importorskip("triton", reason="Triton is not installed (the fused kernel needs it)")
    from kvslots.vllm._fused_copy import _kernel

    kernel = _kernel()
    row_words = next(p for p in kernel.params if p.name == "row_words")
    assert row_words.do_not_specialize


@pytest.mark.parametrize("md", [dict(global_scratch_size=64), dict(num_ctas=2), dict(launch_pdl=True)])
def test_a_kernel_that_needs_more_than_a_plain_launch_is_refused(md):
    with pytest.raises(TransferError):
        KernelLaunch(ParamDriver([8, 4] + [8] * 8), _compiled(**md))  # type: ignore[arg-type]


def test_a_failed_driver_call_is_a_transfer_error():
    class Lib:
        def __getattr__(self, name: str) -> Any:
            f = lambda *a: 700  # noqa: E731  CUDA_ERROR_ILLEGAL_ADDRESS
            return f

    d = _cuda_driver.CudaDriver.__new__(_cuda_driver.CudaDriver)
    d._htod = Lib().x
    with pytest.raises(TransferError, match="cuMemcpyHtoDAsync failed with CUresult 700"):
        d.htod(1, 2, 3, 4)


def test_no_driver_path_on_cpu():
    c = BlockCopier(_layers(12), 12, 4)
    assert c._driver is None


def test_the_kernels_address_table_follows_a_layer_that_moved():
    layers = _layers(12)
    c = BlockCopier(layers, 12, 4, engine="torch")
    m = FusedMover([(seg.u8, seg.host_offset) for seg in c._segments], c.bytes_per_block, c._device)
    assert len(m._reps) == 3  # one view per layer's storage is watched
    first = m._table().tolist()
    assert first == [seg.u8.data_ptr() for seg in c._segments]
    storage = layers["l1"].untyped_storage()
    storage.resize_(storage.nbytes() * 4)  # reallocated: every view of it moves
    second = m._table().tolist()
    assert second == [seg.u8.data_ptr() for seg in c._segments] and second != first


def test_layers_viewing_one_allocation_are_watched_through_one_view():
    big = torch.zeros(3, 2, 12, 4, 2, 8, dtype=torch.float16)  # vLLM's layers can share one buffer
    c = BlockCopier({f"l{i}": big[i] for i in range(3)}, 12, 4, engine="torch")
    m = FusedMover([(seg.u8, seg.host_offset) for seg in c._segments], c.bytes_per_block, c._device)
    assert len(m._reps) == 1
    assert m._table().tolist() == [seg.u8.data_ptr() for seg in c._segments]


class StreamSim(FakeDriver):
    """A stand-in driver that defers each call to its stream and runs queued operations in a
    random order that keeps only what CUDA guarantees: program order within a stream and
    event waits (a wait holds its stream until the record it was queued against has run).
    Memory is read when an operation runs, so a missing wait shows as wrong bytes."""

    COMPUTE = 3

    def __init__(self, rng: random.Random, compute_last: bool):
        super().__init__()
        self.rng = rng
        self.compute_last = compute_last  # the forward as late as the waits allow
        self.queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.issued: collections.Counter = collections.Counter()
        self.reached: collections.Counter = collections.Counter()
        self._events = 100

    def enqueue(self, stream: int, fn: Callable[[], object]) -> None:
        self.queues[stream].append(("run", fn))

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def record(self, event: int, stream: int) -> None:
        self.issued[event] += 1
        self.queues[stream].append(("record", event, self.issued[event]))

    def wait(self, stream: int, event: int) -> None:
        self.queues[stream].append(("wait", event, self.issued[event]))

    def _runnable(self) -> list[int]:
        return [s for s, q in self.queues.items() if q and (q[0][0] != "wait" or self.reached[q[0][1]] >= q[0][2])]

    def step(self) -> bool:
        ready = self._runnable()
        if not ready:
            assert not any(self.queues.values()), "deadlock: every stream waits"
            return False
        if self.compute_last and len(ready) > 1 and self.COMPUTE in ready:
            ready.remove(self.COMPUTE)
        op = self.queues[self.rng.choice(ready)].popleft()
        if op[0] == "run":
            op[1]()
        elif op[0] == "record":
            self.reached[op[1]] = max(self.reached[op[1]], op[2])
        return True

    def event_query(self, event: int) -> bool:
        return self.reached[event] >= self.issued[event]

    def event_synchronize(self, event: int) -> None:
        while self.reached[event] < self.issued[event]:
            self.step()

    def stream_synchronize(self, stream: int) -> None:
        while self.queues[stream]:
            self.step()

    def drain(self) -> None:
        while self.step():
            pass

    def some(self) -> None:
        for _ in range(self.rng.choice([0, 0, 1, 3, 10, 50])):
            if self.compute_last and self._runnable() == [self.COMPUTE] or not self.step():
                break


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("n", [32, 96])
@pytest.mark.parametrize("seed", range(3))
def test_the_driver_paths_waits_order_every_copy(seed, n, chunk, direct):
    """Random stores, loads and forward writes (never to a block with a copy in flight, as the
    copier's contract says), the driver's operations run in any order the streams and events
    allow: the layers and the host region end as a reference says."""
    rng, sim = np.random.default_rng(seed), StreamSim(random.Random(seed), compute_last=seed % 2 == 1)
    h = n // 2  # few blocks: a copy often names one the forward has just written; many: ring slots cycle
    g = torch.Generator().manual_seed(seed)
    cpu = {f"l{i}": torch.randint(-100, 100, (2, n, 16, 2, 8), generator=g).to(torch.float16) for i in range(4)}
    layers = {k: v.clone() for k, v in cpu.items()}
    probe = BlockCopier(layers, n, h, engine="torch")
    c = BlockCopier(layers, n, h, engine="torch", staging_bytes=chunk * STAGING_BUFFERS * probe.bytes_per_block)
    if direct:
        c._direct_max_bytes = 10 * c.bytes_per_block
    c._fused = FusedMover([(seg.u8, seg.host_offset) for seg in c._segments], c.bytes_per_block, c._device)
    launched: list[tuple[int, ...]] = []

    def deferred(to_stage: bool, dr: bool) -> Any:
        kernel = model_kernel(to_stage, dr, launched, n)
        return lambda grid, stream, args: sim.enqueue(stream, lambda: kernel(grid, stream, args))

    c._driver = _DriverPath(c, sim, {(t, dr): deferred(t, dr) for t in (True, False) for dr in (True, False)},
                            ctx=contextlib.nullcontext(), bus=1, kernel=2, compute=lambda: StreamSim.COMPUTE,
                            compute_mark=11, bus_mark=12, bus_done=[13, 14], kernels_done=[15, 16], pin_memory=False)
    c._fused = None

    def forward_write(name: str, d: int) -> None:  # the forward writes a block on the compute stream
        t = layers[name]
        sim.enqueue(StreamSim.COMPUTE, lambda: t[:, d].add_(1))

    host_ref = random_copies(c, cpu, rng, n, h, 200, max_blocks=min(19, h), write=forward_write, wait=sim.drain,
                             step=sim.some)
    sim.drain()
    assert all(torch.equal(layers[k], cpu[k]) for k in cpu)
    assert torch.equal(c.host, host_ref)


def test_a_dropped_copier_is_freed_at_once():
    # The path refers back to its copier: a cycle kept the pinned host region and the staging
    # buffers alive until a full collection after the worker let the copier go (sleep).
    c = BlockCopier(_layers(12), 12, 4, engine="torch")
    install(c)
    ref = weakref.ref(c)
    gc.disable()
    try:
        del c
        assert ref() is None
    finally:
        gc.enable()


def test_a_driver_call_failing_part_way_lets_queued_work_finish_before_raising():
    class Failing(FakeDriver):
        def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
            raise TransferError("cuMemcpyDtoHAsync failed with CUresult 700")

    c = BlockCopier(_layers(12), 12, 8, engine="torch")
    d = Failing()
    install(c, d)
    with pytest.raises(TransferError, match="CUresult 700"):
        c.store([1, 2], [3, 4])
    assert d.calls.get("stream_synchronize") == 2  # the bus and kernel streams, before the error
    c.load([3], [5])  # the copier still copies


def test_the_context_guard_nests():
    class Ctx:
        def __init__(self) -> None:
            self.current, self.stack = 0, []

        def current_context(self) -> int:
            return self.current

        def push_context(self, ctx: int) -> None:
            self.stack.append(self.current)
            self.current = ctx

        def pop_context(self) -> None:
            self.current = self.stack.pop()

    d = Ctx()
    guard = ContextGuard(d, 7)  # type: ignore[arg-type]
    with guard:
        assert d.current == 7
        with guard:  # an event waited for inside a copy
            assert d.current == 7
        assert d.current == 7
    assert d.current == 0 and d.stack == []
