"""The few CUDA driver calls of BlockCopier's issue path, made through ctypes on libcuda.so.1.

A small copy is bound by the host time spent queueing it: a 16-block load (32 MiB) crosses the
bus in about 0.6 ms, and torch's ``copy_``, ``Event.record``, ``Stream.wait_event``, stream
switches and Triton's launcher each cost 5-30 us of Python and dispatch (H100 profile in
docs/connector.md). The driver calls themselves take about 1 us each. This module wraps exactly
those calls, on the handles torch already owns (its streams, its events, the staging buffers,
the pinned host region), and launches the fused Triton kernel that Triton compiled, with the
parameter layout the driver reports for it. It holds no memory; the pinned ring of block ids
and its device copy belong to ``transfer._DriverPath``.

Everything here is probed once at construction by BlockCopier against the torch path (bytes
compared); any mismatch, missing symbol or unexpected kernel layout leaves the torch path in use.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from ..errors import TransferError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INVALID_VALUE = 1
CU_EVENT_DISABLE_TIMING = 2

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p
_sz = ctypes.c_size_t
_ui = ctypes.c_uint


#: The driver entry points used, by attribute name: (symbol, argument types); all return CUresult.
_ENTRY_POINTS: dict[str, tuple[str, list[Any]]] = {
    "_htod": ("cuMemcpyHtoDAsync_v2", [_u64, _vp, _sz, _vp]),
    "_dtoh": ("cuMemcpyDtoHAsync_v2", [_vp, _u64, _sz, _vp]),
    "_record": ("cuEventRecord", [_vp, _vp]),
    "_wait": ("cuStreamWaitEvent", [_vp, _vp, _ui]),
    "_launch": ("cuLaunchKernel", [_vp, _ui, _ui, _ui, _ui, _ui, _ui, _ui, _vp, _vp, _vp]),
    "_event_create": ("cuEventCreate", [ctypes.POINTER(_vp), _ui]),
    "event_destroy": ("cuEventDestroy_v2", [_vp]),
    "_event_query": ("cuEventQuery", [_vp]),
    "_event_sync": ("cuEventSynchronize", [_vp]),
    "_stream_sync": ("cuStreamSynchronize", [_vp]),
    "_ctx_get": ("cuCtxGetCurrent", [ctypes.POINTER(_vp)]),
    "_ctx_push": ("cuCtxPushCurrent_v2", [_vp]),
    "_ctx_pop": ("cuCtxPopCurrent_v2", [ctypes.POINTER(_vp)]),
    # CUDA 12.4+: where it is missing (an older driver) this path is not used
    "_param_info": ("cuFuncGetParamInfo", [_vp, _sz, ctypes.POINTER(_sz), ctypes.POINTER(_sz)]),
}


class CudaDriver:
    """libcuda's entry points used on the issue path, with argument types set once."""

    _htod: Any
    _dtoh: Any
    _record: Any
    _wait: Any
    _launch: Any
    _event_create: Any
    event_destroy: Any
    _event_query: Any
    _event_sync: Any
    _stream_sync: Any
    _ctx_get: Any
    _ctx_push: Any
    _ctx_pop: Any
    _param_info: Any

    def __init__(self, lib: Any):
        self._lib = lib
        for attr, (symbol, argtypes) in _ENTRY_POINTS.items():
            f = getattr(lib, symbol)
            f.argtypes, f.restype = argtypes, ctypes.c_int
            setattr(self, attr, f)

    @classmethod
    def open(cls) -> CudaDriver:
        """The driver of this process (raises OSError or AttributeError where it is missing)."""
        return cls(ctypes.CDLL("libcuda.so.1"))

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != CUDA_SUCCESS:
            raise TransferError(f"CUDA driver call {what} failed with CUresult {rc}")

    # ---- the issue path: one check per call, no Python objects made ----

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._htod(dst, src, nbytes, stream)
        if rc:
            self._ok(rc, "cuMemcpyHtoDAsync")

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._dtoh(dst, src, nbytes, stream)
        if rc:
            self._ok(rc, "cuMemcpyDtoHAsync")

    def record(self, event: int, stream: int) -> None:
        rc = self._record(event, stream)
        if rc:
            self._ok(rc, "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        rc = self._wait(stream, event, 0)
        if rc:
            self._ok(rc, "cuStreamWaitEvent")

    def launch(self, function: int, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
               params: Any) -> None:
        rc = self._launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, params, None)
        if rc:
            self._ok(rc, "cuLaunchKernel")

    # ---- events and contexts ----

    def event_create(self) -> int:
        h = _vp()
        self._ok(self._event_create(ctypes.byref(h), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return int(h.value or 0)

    def event_query(self, event: int) -> bool:
        rc = self._event_query(event)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self._ok(rc, "cuEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._ok(self._event_sync(event), "cuEventSynchronize")

    def stream_synchronize(self, stream: int) -> None:
        self._ok(self._stream_sync(stream), "cuStreamSynchronize")

    def current_context(self) -> int:
        h = _vp()
        self._ok(self._ctx_get(ctypes.byref(h)), "cuCtxGetCurrent")
        return int(h.value or 0)

    def push_context(self, ctx: int) -> None:
        self._ok(self._ctx_push(ctx), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        h = _vp()
        self._ok(self._ctx_pop(ctypes.byref(h)), "cuCtxPopCurrent")

    def param_sizes(self, function: int) -> list[int]:
        """Byte size of each parameter of a loaded kernel, in order."""
        sizes: list[int] = []
        off, size = _sz(), _sz()
        for i in range(64):  # the fused kernel has 8 and Triton adds at most 2 scratch pointers
            rc = self._param_info(function, i, ctypes.byref(off), ctypes.byref(size))
            if rc == CUDA_ERROR_INVALID_VALUE:
                return sizes
            self._ok(rc, "cuFuncGetParamInfo")
            sizes.append(int(size.value))
        raise TransferError("the kernel reports more than 64 parameters")


class DriverEvent:
    """A completion event of one copy (``Transfer`` reads it): made without timing, destroyed
    with the object (the driver frees it once the recorded work is done). Its calls run with
    the copier's context current (``ctx``), from whichever thread waits on it."""

    __slots__ = ("_driver", "_ctx", "handle")

    def __init__(self, driver: CudaDriver, ctx: Any):
        self._driver = driver
        self._ctx = ctx
        self.handle = driver.event_create()

    def query(self) -> bool:
        with self._ctx:
            return self._driver.event_query(self.handle)

    def synchronize(self) -> None:
        with self._ctx:
            self._driver.event_synchronize(self.handle)

    def __del__(self) -> None:
        h, self.handle = getattr(self, "handle", 0), 0
        if h:
            try:
                with self._ctx:
                    self._driver.event_destroy(h)
            except Exception:  # interpreter shutdown: the driver may be gone already
                pass


class KernelLaunch:
    """One compiled variant of the fused copy kernel, launched with ``cuLaunchKernel``: its 8
    arguments (pointers and the row length in words) and any scratch pointers Triton appended
    (null: the kernel asks for no scratch) sit in a parameter block set up once; a launch
    rewrites the values only. ``compiled`` is Triton's CompiledKernel, already loaded."""

    ARGS = 8  # move_blocks(stage, row_words, idx, addr, words, host, rows, rows_base)
    #: Metadata fields of the Triton versions that append a scratch pointer to every kernel.
    SCRATCH = ("global_scratch_size", "profile_scratch_size")

    def __init__(self, driver: CudaDriver, compiled: Any):
        md = compiled.metadata
        for name in ("global_scratch_size", "profile_scratch_size"):
            if getattr(md, name, 0):
                raise TransferError(f"the kernel needs {name}={getattr(md, name)}")
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) \
                or getattr(md, "launch_pdl", False):
            raise TransferError("the kernel needs a cluster, cooperative or PDL launch")
        function = int(compiled.function or 0)
        if not function:
            raise TransferError("the kernel is not loaded")
        sizes = driver.param_sizes(function)
        # Exactly the 8 arguments (row_words an i32: the kernel never specializes it, so a
        # value of 1 cannot drop it from the parameters) and one pointer per scratch field.
        want = [8, 4] + [8] * (self.ARGS - 2 + sum(hasattr(md, f) for f in self.SCRATCH))
        if sizes != want:
            raise TransferError(f"unexpected kernel parameters (byte sizes {sizes}, expected {want})")
        self._driver = driver
        self._function = function
        self._threads = 32 * int(md.num_warps)
        self._shared = int(md.shared)
        self._values: list[Any] = [(ctypes.c_int32 if s == 4 else ctypes.c_uint64)() for s in sizes]
        self._params = (_vp * len(sizes))(*[ctypes.cast(ctypes.pointer(v), _vp) for v in self._values])

    def __call__(self, grid: tuple[int, int, int], stream: int, args: tuple[int, ...]) -> None:
        values = self._values
        for i, a in enumerate(args):
            values[i].value = a
        self._driver.launch(self._function, grid, self._threads, self._shared, stream, self._params)


class ContextGuard:
    """Makes the copier's CUDA context current around an issue from a thread where another (or
    none) is: torch sets the primary context on threads that made runtime calls; a thread that
    only ever copies through this path may not have. Costs one query where it is already set.
    Nests (an event waited for inside a copy): each exit undoes only its own entry."""

    __slots__ = ("_driver", "_ctx", "_local")

    def __init__(self, driver: CudaDriver, ctx: int):
        self._driver = driver
        self._ctx = ctx
        self._local = threading.local()

    def __enter__(self) -> None:
        pushed = self._driver.current_context() != self._ctx
        if pushed:
            self._driver.push_context(self._ctx)
        stack = getattr(self._local, "pushed", None)
        if stack is None:
            stack = self._local.pushed = []
        stack.append(pushed)

    def __exit__(self, *exc: object) -> None:
        if self._local.pushed.pop():
            self._driver.pop_context()
