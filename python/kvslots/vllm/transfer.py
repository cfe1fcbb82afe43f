"""Whole-block copies between vLLM's KV cache layers and one preallocated host region.

The unit is a *block* of every registered layer at once: ``store`` copies device blocks into
host blocks, ``load`` copies host blocks back into device blocks. Only whole blocks move, because
vLLM's CPU attention backend ([num_blocks, num_kv_heads, block_size, 2*head_size] per layer)
packs K transposed inside a block, so a per-token slice would be meaningless.

Layout. In each layer tensor the *block dimension* is the one whose size is
``num_device_blocks``; the dimensions before it are *segments* (CUDA flash-attn's
[2, num_blocks, block_size, heads, head_size] has two, K and V), the ones after it are one block's
bytes. The host region is a single uint8 tensor ``[num_host_blocks, bytes_per_block]``: host block
``h`` holds, back to back, block ``h``'s bytes of every segment of every layer (target and draft
layers alike), so one host block id covers the whole model.

Engines.
- CPU tensors (vLLM's CPU backend): ``kvslots._core.copy_blocks`` per segment, one memcpy per
  run of consecutive blocks, the GIL released, optionally split across ``threads`` threads. Each
  segment and its slice of the host region are registered once as ``_core.BlockRegion`` (from
  the tensors themselves); a copy names regions and block ids, never an address.
  Copies are synchronous: when ``store``/``load`` return, the bytes are in place.
- CUDA tensors: a pinned host region, a stream for the copy engine and high-priority streams
  for the gather / scatter kernels. Blocks are gathered on the GPU into one of two staging
  buffers and moved with one ``non_blocking`` copy per run of consecutive host blocks (loads:
  the reverse, then a scatter); while one buffer crosses the bus the kernels fill or empty the
  other. Where Triton is installed (vLLM's CUDA builds) one fused kernel per chunk moves every
  layer (``_fused_copy.py``); otherwise one torch kernel per layer (``index_select`` /
  ``index_copy_``), spread over several streams. With the fused kernel, stores of up to
  ``DIRECT_MAX_BYTES`` skip the staging buffers: one launch writes the pinned host rows through
  the GPU's unified address (probed once at construction; staged where the GPU cannot).
  Copies of up to ``DRIVER_RING_IDS`` blocks are queued through the CUDA driver itself
  (``_DriverPath``: the same streams, events and kernel, at a fraction of torch's host time per
  call; probed at construction against the torch path, which stays where it is unavailable). The
  kernel streams first wait for the compute stream, so a store sees the KV the forward wrote
  and a load does not overwrite blocks still being read; at high priority their thread blocks
  go ahead of the forward's queued ones instead of waiting behind them for SMs. Copies are
  asynchronous: ``store``/``load`` return a :class:`Transfer`; a stored host block is valid
  only once its transfer is ``done()``, and the forward must not read loaded blocks before
  :meth:`BlockCopier.synchronize` (or the load's ``wait()``) returns, unless it is queued after
  :meth:`BlockCopier.fence`, which orders the compute stream after the copies on the device.
  Device blocks being stored must not be rewritten, and host blocks being loaded must not be
  reused, until the transfer is done. Its indexing logic is the ``engine="torch"`` path, which
  the tests exercise on CPU tensors (the fused kernel under Triton's interpreter); on a GPU it
  was measured with ``benches/bench_cuda_copy.py`` (byte-exact; bandwidth and overlap in
  docs/connector.md) and tested with ``tests/test_transfer.py``'s CUDA cases.

Tensor parallelism: every worker rank holds its own shard tensors and builds its own
BlockCopier over them; block ids are the same on every rank, so nothing here is rank-specific.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch

from .. import _args, _core
from ..errors import ArgumentTypeError, InvalidArgumentError, TransferError
from ._cuda_driver import ContextGuard, CudaDriver, DriverEvent, KernelLaunch
from ._fused_copy import WORDS as FUSED_WORDS
from ._fused_copy import FusedMover

__all__ = ["BlockCopier", "Transfer"]

logger = logging.getLogger(__name__)

#: Device staging of the CUDA path, split into ``STAGING_BUFFERS`` buffers (each at most the host
#: pool's size). On an H100, 32 layers x K/V (64 segments of 32 KiB), 2 GiB scattered: 0.95x /
#: 0.98x of a plain pinned copy (store / load) with the fused kernel, 0.90x / 0.88x with
#: per-layer kernels, against 0.71x / 0.83x for the one-stream path before
#: (benches/bench_cuda_copy.py, benches/results/cuda_copy_h100.txt).
STAGING_BYTES = 256 << 20

#: Staging buffers the CUDA path cycles through: one crosses the bus while the other is
#: scattered (or gathered). On an H100, a 2 GiB load beside matmuls hid as much behind them with
#: 2 x 128 MiB as with 4 x 128 MiB (91% / 93%), and less with 4 x 64 MiB (67%): smaller chunks
#: mean more kernels, each one waiting for SMs.
STAGING_BUFFERS = 2

#: Largest store (bytes) the CUDA path moves in one fused launch straight from the layers into the
#: pinned host region, without staging: a staged store pays a gather pass and one bus copy per run
#: of consecutive host blocks, which small copies do not amortise. Share of a plain pinned copy,
#: direct / staged, 32 layers (medians, benches/results/cuda_copy_issue_*.txt): H200 32 MiB 0.77x /
#: 0.71x, 128 MiB 0.88x / 0.83x, 512 MiB 0.93x / 0.95x, 2 GiB 0.92x / 0.97x; H100 32 MiB 0.66x /
#: 0.57x, 128 MiB 0.88x / 0.89x: the largest size measured where direct was ahead (H200) or level
#: (H100). Loads stay staged: a direct load holds SMs for the whole bus transfer, so beside matmuls
#: it hid 3-18% of itself, staged loads 26-99%.
DIRECT_MAX_BYTES = 128 << 20

#: Streams the CUDA path spreads one chunk's per-layer kernels over where Triton is missing (the
#: fused kernel needs one). On one stream each kernel waits for the one before it and then for
#: SMs behind the forward's kernels; side by side they take SMs together. H100, 32 layers:
#: 1 stream hid 23% of a load behind matmuls, 4 streams 91%, 8 streams 6%: past CUDA's 8
#: hardware queues (CUDA_DEVICE_MAX_CONNECTIONS), streams share queues and the compute stream
#: can end up behind a kernel stream that waits for the bus.
KERNEL_STREAMS = 4

#: Largest copy (in blocks) issued through the CUDA driver instead of torch (``_DriverPath``): the
#: width of its pinned ring of block ids. Past a few hundred blocks a copy takes tens of ms and
#: the issue time is noise.
DRIVER_RING_IDS = 1024
#: Copies whose ids the ring holds at once: a copy reuses a slot once the copy that last used it
#: is done on the device (waiting for it if not, which 16 copies in flight make rare).
DRIVER_RING_SLOTS = 16

#: Most copy threads per call. ``_core.copy_blocks`` takes any machine-sized count (a count past
#: it failed every copy later); more threads than cores only adds overhead.
MAX_THREADS = 1024

#: Largest host region: torch cannot size a tensor past 2**63 bytes.
MAX_HOST_BYTES = 2**63 - 1
#: Most layer tensors one copier takes (a model has a few hundred, draft layers included).
MAX_LAYER_TENSORS = 1 << 16

Ids = Sequence[int] | np.ndarray | torch.Tensor


class Transfer:
    """Completion handle of one ``store`` or ``load``. CPU copies are complete on return."""

    __slots__ = ("_event", "nbytes")

    def __init__(self, nbytes: int, event: Any = None):
        self.nbytes = nbytes
        self._event = event

    def done(self) -> bool:
        """True once every byte of the transfer is in place (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Blocks the calling thread until the transfer is done."""
        if self._event is not None:
            self._event.synchronize()

    def __repr__(self) -> str:
        return f"Transfer(nbytes={self.nbytes}, done={self.done()})"


@dataclass(frozen=True)
class _Segment:
    """Blocks ``0..N`` of one outer index of one layer: ``tensor`` bytes
    ``dev_offset + b * block_bytes ..``, stored at ``host_offset`` inside every host block."""

    layer: str
    tensor: torch.Tensor  # the layer tensor itself (contiguous)
    u8: torch.Tensor  # [N, block_bytes] uint8 view of this segment
    dev_offset: int
    block_bytes: int
    host_offset: int
    block_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Group:
    """All segments of one layer tensor, copied by one kernel per chunk: ``u8`` is
    ``[outer, N, block_bytes]``, and segment ``o`` sits at ``host_offset + o * block_bytes``."""

    u8: torch.Tensor
    host_offset: int
    outer: int
    block_bytes: int

    def stage_view(self, stage: torch.Tensor) -> torch.Tensor:
        """This tensor's bytes of staged blocks ``[n, bytes_per_block]`` as ``[outer, n, block_bytes]``."""
        a = self.host_offset
        n = stage.shape[0]
        return stage[:, a : a + self.outer * self.block_bytes].view(n, self.outer, self.block_bytes).transpose(0, 1)


class BlockCopier:
    """Copies whole blocks of all layers between the device KV cache and a host region.

    ``layers`` maps layer names to their KV tensors (what vLLM passes to
    ``register_kv_caches``; a value may also be a sequence of tensors). All tensors must be
    contiguous, on one device, and have exactly one dimension of size ``num_device_blocks``
    (or pass ``block_dim``). Tensors registered under several names (shared KV) are copied once.

    ``engine``: ``"auto"`` (Rust memcpy for CPU tensors, the stream path for CUDA), ``"rust"``
    (CPU only) or ``"torch"`` (the gather/scatter path CUDA uses, on any device).
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        pin_memory: bool | None = None,
        threads: int = 1,
        block_dim: int | None = None,
        engine: Literal["auto", "rust", "torch"] = "auto",
        staging_bytes: int = STAGING_BYTES,
    ):
        # Copies from several threads take turns: the staging buffers and their events are
        # shared, and two threads' chunks interleaved in them (wrong bytes in 8 of 1,200
        # concurrent stores to disjoint host blocks). Uncontended (the connector's one thread)
        # it costs a lock per copy.
        self._lock = threading.Lock()
        # Every argument is checked before anything is allocated or registered.
        self._num_device_blocks = _args.integer(num_device_blocks, "num_device_blocks", 1)
        self._num_host_blocks = _args.integer(num_host_blocks, "num_host_blocks", 1)
        self._threads = _args.integer(threads, "threads", 1, MAX_THREADS)
        if block_dim is not None:
            block_dim = _args.integer(block_dim, "block_dim")
        staging_bytes = _args.integer(staging_bytes, "staging_bytes", 0)
        pin_memory = _args.flag(pin_memory, "pin_memory", optional=True)
        if not isinstance(layers, Mapping):
            raise ArgumentTypeError(
                f"layers must be a mapping of layer names to KV tensors, got {type(layers).__name__}"
            )

        tensors: list[tuple[str, torch.Tensor]] = []

        def room() -> None:
            # An endless iterator as a layer's value grew the list without bound (1.6 GB in 8 s).
            if len(tensors) >= MAX_LAYER_TENSORS:
                raise InvalidArgumentError(f"layers hold more than {MAX_LAYER_TENSORS} tensors")

        for name, value in layers.items():
            room()
            if isinstance(value, torch.Tensor):
                tensors.append((name, value))
                continue
            try:
                for i, t in enumerate(value):
                    room()
                    tensors.append((f"{name}[{i}]", t))
            except InvalidArgumentError:
                raise
            except Exception:  # not iterable, or its iterator fails
                raise ArgumentTypeError(
                    f"layer {name!r}: expected a torch.Tensor or a sequence of them, got {type(value).__name__}"
                ) from None
        if not tensors:
            raise InvalidArgumentError("BlockCopier needs at least one layer tensor")
        for name, t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            _check_plain(name, t)
        devices = {t.device for _, t in tensors}
        if len(devices) != 1:
            raise InvalidArgumentError(f"layer tensors are on several devices: {sorted(map(str, devices))}")
        self._device = devices.pop()
        if self._device.type == "meta":  # shapes without bytes: every copy failed in torch
            raise InvalidArgumentError("layer tensors are on the meta device: they hold no bytes to copy")
        is_cuda = self._device.type == "cuda"
        if engine == "auto":
            engine = "torch" if is_cuda else "rust"
        if engine == "rust" and self._device.type != "cpu":
            raise InvalidArgumentError(f"engine 'rust' copies host memory only, layers are on {self._device}")
        if engine not in ("rust", "torch"):
            raise InvalidArgumentError(f"engine must be 'auto', 'rust' or 'torch', got {engine!r}")
        self._engine = engine

        self._segments: list[_Segment] = []
        self._groups: list[_Group] = []
        seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
        offset = 0
        for name, t in tensors:
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key in seen:  # the same cache registered under two names (KV sharing)
                continue
            seen.add(key)
            segs, group = self._segments_of(name, t, block_dim, offset)
            self._groups.append(group)
            for seg in segs:
                self._segments.append(seg)
                offset += seg.block_bytes
        self._bytes_per_block = offset

        if pin_memory is None:
            pin_memory = is_cuda
        # One region for the whole host tier, never an allocation per block.
        nbytes = self._num_host_blocks * self._bytes_per_block
        if nbytes > MAX_HOST_BYTES:
            raise InvalidArgumentError(
                f"num_host_blocks={self._num_host_blocks} host blocks of {self._bytes_per_block} bytes "
                f"need {nbytes} bytes, over the {MAX_HOST_BYTES} a tensor can hold",
                details={"nbytes": nbytes},
            )
        try:
            self._host = torch.empty(
                (self._num_host_blocks, self._bytes_per_block), dtype=torch.uint8, pin_memory=pin_memory
            )
        except RuntimeError as e:  # out of (pinned) memory, or pinning without an accelerator
            raise InvalidArgumentError(
                f"cannot allocate the host region: num_host_blocks={self._num_host_blocks} host blocks of "
                f"{self._bytes_per_block} bytes need {nbytes} bytes{' of pinned memory' if pin_memory else ''} "
                f"({_first_line(e)})",
                details={"nbytes": nbytes},
            ) from e

        # (device region, host region) per segment: registered once, named by every copy.
        self._regions: list[tuple[Any, Any]] = []
        if self._engine == "rust":
            for seg in self._segments:
                dev = _core.BlockRegion(seg.tensor, block_bytes=seg.block_bytes, num_blocks=self._num_device_blocks,
                                        offset=seg.dev_offset)
                host = _core.BlockRegion(self._host, block_bytes=seg.block_bytes, num_blocks=self._num_host_blocks,
                                         stride=self._bytes_per_block, offset=seg.host_offset)
                self._regions.append((dev, host))

        # CUDA: host <-> staging copies on ``_stream``, gather / scatter kernels on
        # ``_kernel_streams`` at the highest priority (a negative number; torch clamps it to the
        # device's range), so they are not queued behind the forward's kernels.
        # One Triton launch per chunk for every layer where Triton is installed (vLLM's CUDA
        # builds have it), else one torch kernel per layer spread over KERNEL_STREAMS streams.
        self._fused: FusedMover | None = None
        if is_cuda and self._engine == "torch":
            self._enable_fused()
        self._stream = torch.cuda.Stream(self._device) if is_cuda else None
        n_kernel_streams = 1 if self._fused is not None else KERNEL_STREAMS
        self._kernel_streams = (
            [torch.cuda.Stream(self._device, priority=-100) for _ in range(n_kernel_streams)] if is_cuda else []
        )
        # Staging buffers of ``_chunk`` blocks: one crosses the bus while others are gathered or
        # scattered. Per buffer, ``_bus_done[b]`` marks the bus's last use and ``_kernels_done[b][i]``
        # kernel stream i's; each side waits for the other's before it touches the buffer.
        nbuf = STAGING_BUFFERS
        self._chunk = max(1, min(self._num_host_blocks, staging_bytes // (nbuf * self._bytes_per_block)))
        self._staging: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (buffer, view per group)
        self._bus_done = [torch.cuda.Event() for _ in range(nbuf)] if is_cuda else []
        self._kernels_done = [[torch.cuda.Event() for _ in self._kernel_streams] for _ in range(nbuf)]
        # Reused for every cross-stream wait: ``wait_stream`` makes a new CUDA event per call, 1.7-4x
        # the host time of recording one that exists (H100, benches/profiling/cuda_small_copies.py).
        # Re-recording is safe: a wait already queued keeps the record it was queued against.
        self._compute_mark = torch.cuda.Event() if is_cuda else None
        self._bus_mark = torch.cuda.Event() if is_cuda else None
        # Stores of at most this many bytes skip the staging buffers (-1: never).
        self._direct_max_bytes = -1
        if self._fused is not None and self._host.is_pinned():
            self._enable_direct()
        # Copies of at most DRIVER_RING_IDS blocks issued through the CUDA driver (None: torch).
        self._driver: _DriverPath | None = None
        if self._fused is not None and self._stream is not None and self._host.is_pinned():
            self._enable_driver()

    def _enable_fused(self) -> bool:
        """Moves chunks with the fused Triton kernel from now on, where it supports this layout."""
        segments = [(seg.u8, seg.host_offset) for seg in self._segments]
        if not FusedMover.supports(segments, self._bytes_per_block):
            return False
        mover = FusedMover(segments, self._bytes_per_block, self._device)
        try:
            mover.warm_up()
        except Exception as e:  # Triton installed but unable to build or launch here
            logger.warning("kvslots: fused copy kernel unavailable (%s); one kernel per layer instead",
                           _first_line(e))
            return False
        self._fused = mover
        return True

    def _enable_direct(self) -> bool:
        """Moves stores of up to DIRECT_MAX_BYTES with one fused launch straight into the host
        region, where a probe shows the GPU reads and writes it: device block 0 goes to host
        block 0 and back, compared with what the staged kernel gathers."""
        assert self._fused is not None
        try:
            zero = torch.zeros(1, dtype=torch.int64, device=self._device)
            scratch = torch.empty((1, self._bytes_per_block), dtype=torch.uint8, device=self._device)
            self._fused.move(scratch, zero, to_stage=True)
            self._fused.move_direct(self._host, zero, zero, to_host=True)
            self._fused.move_direct(self._host, zero, zero, to_host=False)
            if self._device.type == "cuda":
                torch.cuda.current_stream(self._device).synchronize()
            ok = torch.equal(scratch[0].cpu(), self._host[0])
        except Exception as e:  # the GPU cannot address this host memory
            ok = False
            logger.warning("kvslots: direct host copies unavailable (%s); every copy is staged",
                           _first_line(e))
        if not ok:
            return False
        self._direct_max_bytes = DIRECT_MAX_BYTES
        return True

    def _enable_driver(self) -> bool:
        """Issues copies of up to DRIVER_RING_IDS blocks through the CUDA driver from now on,
        where a probe shows its result is the torch path's (``_DriverPath.probe``: a staged
        store, two loads and, where enabled, a direct store of two blocks, compared byte for
        byte with the torch path's gather). Anything unexpected (no libcuda, an older driver,
        a kernel layout Triton changed) keeps the torch path, with a warning."""
        assert self._fused is not None and self._stream is not None
        try:
            path = _DriverPath.open(self)
            ok = path.probe()
        except Exception as e:
            ok = False
            logger.warning("kvslots: CUDA driver issue path unavailable (%s); copies issued through torch",
                           _first_line(e))
        if not ok:
            return False
        self._driver = path
        return True

    def _segments_of(
        self, name: str, t: torch.Tensor, block_dim: int | None, offset: int
    ) -> tuple[list[_Segment], _Group]:
        n = self._num_device_blocks
        shape = tuple(t.shape)
        if not t.is_contiguous():
            raise InvalidArgumentError(
                f"layer {name!r}: KV tensor of shape {shape} and strides {tuple(t.stride())} is not "
                "contiguous; whole-block copies need a contiguous cache tensor"
            )
        if block_dim is not None:
            if not -len(shape) <= block_dim < len(shape) or shape[block_dim] != n:
                raise InvalidArgumentError(
                    f"layer {name!r}: block_dim {block_dim} of shape {shape} is not of size "
                    f"num_device_blocks={n}"
                )
            d = block_dim % len(shape)
        else:
            dims = [i for i, s in enumerate(shape) if s == n]
            if not dims:
                raise InvalidArgumentError(
                    f"layer {name!r}: no dimension of shape {shape} has size num_device_blocks={n}"
                )
            if len(dims) > 1:
                raise InvalidArgumentError(
                    f"layer {name!r}: dimensions {dims} of shape {shape} all have size "
                    f"num_device_blocks={n}; pass block_dim to say which one holds the blocks"
                )
            d = dims[0]
        outer = int(np.prod(shape[:d], dtype=np.int64))
        block_bytes = int(np.prod(shape[d + 1 :], dtype=np.int64)) * t.element_size()
        if block_bytes == 0 or outer == 0:
            raise InvalidArgumentError(f"layer {name!r}: KV tensor of shape {shape} holds no bytes")
        u8 = t.reshape(-1).view(torch.uint8).view(outer, n, block_bytes)
        segments = [
            _Segment(
                layer=name,
                tensor=t,
                u8=u8[o],
                dev_offset=o * n * block_bytes,
                block_bytes=block_bytes,
                host_offset=offset + o * block_bytes,
                block_shape=shape[d + 1 :],
            )
            for o in range(outer)
        ]
        return segments, _Group(u8, offset, outer, block_bytes)

    # ---- properties ----

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every segment of every layer (one host block)."""
        return self._bytes_per_block

    @property
    def host(self) -> torch.Tensor:
        """The host region, uint8 ``[num_host_blocks, bytes_per_block]``."""
        return self._host

    @property
    def num_device_blocks(self) -> int:
        return self._num_device_blocks

    @property
    def num_host_blocks(self) -> int:
        return self._num_host_blocks

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def engine(self) -> str:
        return self._engine

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def host_block_view(self, host_block: int) -> dict[str, torch.Tensor]:
        """One host block, per layer, viewed in the layer's block shape and dtype (no copy);
        a layer with several segments (K and V outside the block dim) is stacked on dim 0.
        For inspection and tests."""
        host_block = _args.integer(host_block, "host_block")
        if not 0 <= host_block < self._num_host_blocks:
            raise InvalidArgumentError(f"host block {host_block} is outside 0..{self._num_host_blocks}")
        parts: dict[str, list[torch.Tensor]] = {}
        row = self._host[host_block]
        for seg in self._segments:
            raw = row[seg.host_offset : seg.host_offset + seg.block_bytes]
            parts.setdefault(seg.layer, []).append(raw.view(seg.tensor.dtype).view(seg.block_shape))
        return {name: v[0] if len(v) == 1 else torch.stack(v) for name, v in parts.items()}

    # ---- copies ----

    def store(self, device_blocks: Ids, host_blocks: Ids) -> Transfer:
        """Copies device block ``device_blocks[i]`` into host block ``host_blocks[i]`` for all i."""
        dev, host = self._check(device_blocks, host_blocks, to_host=True)
        with self._lock:
            return self._copy(dev, host, to_host=True)

    def load(self, host_blocks: Ids, device_blocks: Ids) -> Transfer:
        """Copies host block ``host_blocks[i]`` into device block ``device_blocks[i]`` for all i."""
        dev, host = self._check(device_blocks, host_blocks, to_host=False)
        with self._lock:
            return self._copy(dev, host, to_host=False)

    def synchronize(self) -> None:
        """Blocks until every store and load issued so far is complete (a no-op on CPU)."""
        if self._stream is not None:
            self._stream.synchronize()
            for s in self._kernel_streams:
                s.synchronize()

    def fence(self) -> None:
        """Makes the current (compute) stream wait, on the device, for every store and load
        issued so far; the calling thread does not block. A forward queued after it reads the
        loaded blocks and may overwrite the stored ones. A no-op on CPU, where copies are
        complete on return. Host-side readers and writers of the host region still need
        :meth:`synchronize` or the transfer's ``wait()``."""
        if self._stream is not None:
            compute = torch.cuda.current_stream(self._device)
            compute.wait_stream(self._stream)
            for s in self._kernel_streams:
                compute.wait_stream(s)

    # ---- internals ----

    def _check(self, device_blocks: Ids, host_blocks: Ids, *, to_host: bool) -> tuple[np.ndarray, np.ndarray]:
        """Validates both id lists up front, so a bad id raises before any segment is copied."""
        # A copy writes each destination block once: no list may be longer than the
        # destination has blocks (checked before the ids are scanned or copied, so a broadcast
        # array of 2**30 ids is refused at once instead of taking GiBs of masks and sets).
        most = self._num_host_blocks if to_host else self._num_device_blocks
        dev = _as_ids(device_blocks, "device_blocks", self._num_device_blocks, "device", most)
        host = _as_ids(host_blocks, "host_blocks", self._num_host_blocks, "host", most)
        if len(dev) != len(host):
            raise InvalidArgumentError(
                f"device_blocks has {len(dev)} ids but host_blocks has {len(host)}"
            )
        # A destination block written twice would make the result depend on copy order.
        dst, name = (host, "host_blocks") if to_host else (dev, "device_blocks")
        if len(set(dst.tolist())) < len(dst):  # a set: for a small copy, a tenth of an argsort's time
            order = np.argsort(dst, kind="stable")
            sd = dst[order]
            first = int(np.flatnonzero(sd[1:] == sd[:-1])[0])
            i, j = int(order[first]), int(order[first + 1])
            raise InvalidArgumentError(
                f"{name}[{j}] = {int(dst[j])} repeats {name}[{i}]; a destination block may be "
                "written only once per copy"
            )
        return dev, host

    def _copy(self, dev: np.ndarray, host: np.ndarray, *, to_host: bool) -> Transfer:
        nbytes = len(dev) * self._bytes_per_block
        if len(dev) == 0:
            return Transfer(0)
        if self._engine == "rust":
            self._copy_rust(dev, host, to_host)
            return Transfer(nbytes)
        if self._driver is not None and len(dev) <= self._driver.max_ids:
            return self._driver.copy(dev, host, to_host, nbytes)
        if to_host and nbytes <= self._direct_max_bytes and self._fused is not None:
            return self._copy_direct(dev, host, to_host, nbytes)
        if self._stream is None:
            self._copy_torch(dev, host, to_host)
            return Transfer(nbytes)
        # Only the kernels touch the layers, so only they wait for the compute stream: a store
        # must see the KV the forward wrote, a load must not overwrite blocks earlier kernels may
        # still read. Host <-> staging copies start at once.
        first, *others = self._kernel_streams
        self._after_compute(self._kernel_streams)
        self._copy_torch(dev, host, to_host)
        # The last step of a store is its last device -> host copy (after every gather); of a
        # load, the last scatters, joined on the first kernel stream.
        if to_host:
            last = self._stream
        else:
            last = first
            for s in others:
                first.wait_stream(s)
        event = torch.cuda.Event()
        event.record(last)
        return Transfer(nbytes, event)

    def _copy_direct(self, dev: np.ndarray, host: np.ndarray, to_host: bool, nbytes: int) -> Transfer:
        """One fused launch between the layers and the host rows themselves, on the kernel stream:
        after the compute stream (as staged kernels are) and after staged bus copies still
        reading or writing host rows; later bus copies wait for it in turn."""
        assert self._fused is not None
        ids = torch.from_numpy(np.stack([dev, host]))
        if self._stream is None:  # CPU tensors under Triton's interpreter (tests)
            self._fused.move_direct(self._host, ids[0], ids[1], to_host=to_host)
            return Transfer(nbytes)
        s = self._kernel_streams[0]
        self._after_compute([s])
        bus_mark = cast(torch.cuda.Event, self._bus_mark)  # made with the stream: set on CUDA
        bus_mark.record(self._stream)
        s.wait_event(bus_mark)
        with self._stream_ctx(s):
            ids = ids.pin_memory().to(self._device, non_blocking=True)
            self._fused.move_direct(self._host, ids[0], ids[1], to_host=to_host)
        event = torch.cuda.Event()
        event.record(s)
        self._stream.wait_event(event)  # the same as wait_stream(s), one event fewer to make
        return Transfer(nbytes, event)

    def _copy_rust(self, dev: np.ndarray, host: np.ndarray, to_host: bool) -> None:
        for dev_region, host_region in self._regions:
            if to_host:
                _core.copy_blocks(dev_region, host_region, dev, host, self._threads)
            else:
                _core.copy_blocks(host_region, dev_region, host, dev, self._threads)

    def _copy_torch(self, dev: np.ndarray, host: np.ndarray, to_host: bool) -> None:
        """Gather/scatter through the staging buffers on the layers' device, moving host rows in
        runs of consecutive host ids (one contiguous copy each). On CUDA, bus copies run on
        ``_stream`` and kernels on ``_kernel_streams``, ordered per buffer by events, so later
        chunks cross the bus while chunk k is scattered (or gathered); elsewhere both steps run
        in program order."""
        order = np.argsort(host, kind="stable")  # longest host runs
        dev, host = dev[order], host[order]
        self._ensure_staging()
        cuda = self._stream is not None
        kernel_streams: list[Any] = self._kernel_streams or [None]
        # Device ids are uploaded by the first kernel step, so a load's first bus copy is queued
        # before anything else: a small copy is bound by how soon its bytes start to move.
        idx_all: torch.Tensor | None = None
        for k, c0 in enumerate(range(0, len(dev), self._chunk)):
            b = k % len(self._staging)
            c1 = min(len(dev), c0 + self._chunk)
            stage, views = self._staging[b]
            if c1 - c0 < self._chunk:  # the last chunk
                stage = stage[: c1 - c0]
                if self._fused is None:  # only the per-layer kernels read the views
                    views = [v[:, : c1 - c0] for v in views]
            hs = host[c0:c1]
            bus_done = self._bus_done[b] if cuda else None
            kernels_done = self._kernels_done[b] if cuda else [None]
            # Each side waits for the other's last use of this buffer; a store gathers first,
            # a load crosses the bus first.
            if to_host:
                idx_all = self._kernel_step(kernel_streams, stage, views, dev, idx_all, c0, c1, bus_done,
                                            kernels_done, to_host)
                self._bus_step(stage, hs, bus_done, kernels_done, to_host)
            else:
                self._bus_step(stage, hs, bus_done, kernels_done, to_host)
                idx_all = self._kernel_step(kernel_streams, stage, views, dev, idx_all, c0, c1, bus_done,
                                            kernels_done, to_host)

    def _ensure_staging(self) -> None:
        if not self._staging:
            for _ in range(STAGING_BUFFERS):
                buf = torch.empty((self._chunk, self._bytes_per_block), dtype=torch.uint8, device=self._device)
                self._staging.append((buf, [g.stage_view(buf) for g in self._groups]))

    def _kernel_step(self, streams: list[Any], stage: torch.Tensor, views: list[torch.Tensor], dev: np.ndarray,
                     idx_all: torch.Tensor | None, c0: int, c1: int, bus_done: Any, kernels_done: list[Any],
                     to_host: bool) -> torch.Tensor:
        """Gathers blocks ``dev[c0:c1]`` into the staged rows (store) or scatters the rows into them
        (load). ``idx_all``: every device id of the copy on the device, None before the first
        step, which uploads them; returns it."""
        n_streams = len(streams)
        for i, s in enumerate(streams):
            with self._stream_ctx(s):
                if idx_all is None:
                    idx_all = self._upload_ids(dev, streams)
                self._after(s, bus_done)
                idx = idx_all[c0:c1]
                if self._fused is not None:
                    self._fused.move(stage, idx, to_stage=to_host)
                else:
                    for g, view in zip(self._groups[i::n_streams], views[i::n_streams]):
                        if to_host:
                            view.copy_(g.u8.index_select(1, idx))
                        else:
                            g.u8.index_copy_(1, idx, view)
                self._mark(s, kernels_done[i])
        assert idx_all is not None
        return idx_all

    def _upload_ids(self, dev: np.ndarray, streams: list[Any]) -> torch.Tensor:
        """The device ids on the layers' device, uploaded on the current stream (``streams[0]``)."""
        ids = torch.from_numpy(dev)
        if streams[0] is None:
            return ids
        # From pinned memory: a pageable upload could block this thread until the kernel
        # streams (which wait for the forward) have drained.
        ids = ids.pin_memory().to(self._device, non_blocking=True)
        for s in streams[1:]:
            s.wait_stream(streams[0])  # the upload
            ids.record_stream(s)  # read there too: not reused before they are done
        return ids

    def _bus_step(self, stage: torch.Tensor, hs: np.ndarray, bus_done: Any, kernels_done: list[Any],
                  to_host: bool) -> None:
        """Moves the staged rows to their host rows ``hs`` (store) or from them (load), one copy
        per run of consecutive host ids."""
        cuda = self._stream is not None
        with self._stream_ctx(self._stream):
            for e in kernels_done:
                self._after(self._stream, e)
            for i, j, h0 in _runs(hs):
                if to_host:
                    self._host[h0 : h0 + j - i].copy_(stage[i:j], non_blocking=cuda)
                else:
                    stage[i:j].copy_(self._host[h0 : h0 + j - i], non_blocking=cuda)
            self._mark(self._stream, bus_done)

    def _after_compute(self, streams: list[Any]) -> None:
        """Makes ``streams`` wait, on the device, for what the compute stream has queued so far."""
        mark = cast(torch.cuda.Event, self._compute_mark)  # set on CUDA, the only caller
        mark.record(torch.cuda.current_stream(self._device))
        for s in streams:
            s.wait_event(mark)

    @staticmethod
    def _stream_ctx(stream: Any) -> Any:
        return _OnStream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def _after(stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    @staticmethod
    def _mark(stream: Any, event: Any) -> None:
        if event is not None:
            event.record(stream)

    def __repr__(self) -> str:
        return (
            f"BlockCopier(device={self._device}, engine={self._engine!r}, segments={len(self._segments)}, "
            f"bytes_per_block={self._bytes_per_block}, num_device_blocks={self._num_device_blocks}, "
            f"num_host_blocks={self._num_host_blocks})"
        )


class _DriverPath:
    """BlockCopier's CUDA copies of up to DRIVER_RING_IDS blocks, issued through the CUDA driver
    (``_cuda_driver``): the same streams, events, staging buffers and fused kernel as the torch
    path and the same waits, at about 1 us per driver call where torch's ``copy_``, event and
    stream calls and Triton's launcher take 5-30 us each. The block ids go to a slot of a
    pinned ring instead of a ``pin_memory()`` per copy: a direct store's kernel reads them
    there through the GPU's unified address; staged kernels read a device copy of the slot,
    uploaded with the copy. A slot is reused once the copy that used it is done.

    Built by :meth:`open` on CUDA; the constructor takes the driver, the kernel launches per
    (to_stage, direct) variant and the raw stream and event handles, so the issue logic also
    runs on CPU memory under a stand-in driver (tests)."""

    SLOT_BYTES = 2 * DRIVER_RING_IDS * 8

    def __init__(self, c: BlockCopier, driver: Any, launches: dict[tuple[bool, bool], Any], *, ctx: Any,
                 bus: int, kernel: int, compute: Callable[[], int], compute_mark: int, bus_mark: int,
                 bus_done: list[int], kernels_done: list[int], pin_memory: bool = True):
        assert c._fused is not None
        # A proxy: the copier holds this path, and a cycle would keep its pinned host region
        # and staging buffers alive past the worker's release of it (sleep) until a full GC.
        self._c = cast(BlockCopier, weakref.proxy(c))
        fused = self._fused = c._fused
        self._d = driver
        self._ctx = ctx
        self._gather = launches[(True, False)]
        self._scatter = launches[(False, False)]
        self._direct = launches.get((True, True)) if c._direct_max_bytes > 0 else None
        # Kernel arguments: ids go at a 16-byte aligned address, as in the launches Triton
        # compiled these variants for; a chunk of odd length would put the next one off it.
        self.max_ids = DRIVER_RING_IDS if c._chunk % 2 == 0 else min(DRIVER_RING_IDS, c._chunk)
        self._ring = torch.zeros((DRIVER_RING_SLOTS, 2, DRIVER_RING_IDS), dtype=torch.int64, pin_memory=pin_memory)
        self._ring_np = self._ring.numpy()
        self._ring_ptr = self._ring.data_ptr()
        self._ring_dev = torch.empty((DRIVER_RING_SLOTS, 2, DRIVER_RING_IDS), dtype=torch.int64, device=c._device)
        self._ring_dev_ptr = self._ring_dev.data_ptr()
        self._slot_events: list[Any] = [None] * DRIVER_RING_SLOTS
        self._next_slot = 0
        c._ensure_staging()
        self._stage = [buf.data_ptr() for buf, _ in c._staging]
        self._bpb = c._bytes_per_block
        self._row_words = fused._row_words
        self._words = fused._words.data_ptr()
        self._offsets = fused._offsets.data_ptr()
        self._grid_yz = (len(fused._segments), -(-fused._max_words // FUSED_WORDS))
        self._bus, self._kernel, self._compute = bus, kernel, compute
        self._compute_mark, self._bus_mark = compute_mark, bus_mark
        self._bus_done, self._kernels_done = bus_done, kernels_done

    @classmethod
    def open(cls, c: BlockCopier) -> _DriverPath:
        """The path over ``c``'s CUDA streams and events; raises where the driver or the
        compiled kernels are not what it expects."""
        assert c._fused is not None and c._stream is not None
        d = CudaDriver.open()
        with torch.cuda.device(c._device):
            torch.cuda.current_stream(c._device).synchronize()  # the primary context exists
            ctx = ContextGuard(d, d.current_context())
        launches = {key: KernelLaunch(d, ck) for key, ck in c._fused.compiled.items()}
        # torch makes an event's CUDA handle at its first record: record each once (on the
        # stream that records it later), so the handles exist and torch's waits see them.
        compute_mark, bus_mark = cast(torch.cuda.Event, c._compute_mark), cast(torch.cuda.Event, c._bus_mark)
        events: list[tuple[torch.cuda.Event, torch.cuda.Stream]] = [
            (compute_mark, torch.cuda.current_stream(c._device)), (bus_mark, c._stream)]
        for b in range(len(c._bus_done)):
            events += [(c._bus_done[b], c._stream), (c._kernels_done[b][0], c._kernel_streams[0])]
        for ev, stream in events:
            ev.record(stream)
        handles = [ev.cuda_event for ev, _ in events]
        if not all(handles):
            raise TransferError("a torch CUDA event has no handle after recording")
        index = cast(int, c._device.index)
        raw_stream = torch._C._cuda_getCurrentRawStream
        return cls(c, d, launches, ctx=ctx, bus=c._stream.cuda_stream, kernel=c._kernel_streams[0].cuda_stream,
                   compute=lambda: raw_stream(index), compute_mark=compute_mark.cuda_event,
                   bus_mark=bus_mark.cuda_event, bus_done=[ev.cuda_event for ev in c._bus_done],
                   kernels_done=[evs[0].cuda_event for evs in c._kernels_done])

    def probe(self) -> bool:
        """Stores, loads and (where enabled) directly stores up to two blocks through this path
        and compares them with the torch path's gather; device blocks end as they began, also
        when a step raises."""
        c, fused = self._c, self._fused
        n = min(2, c._num_device_blocks, c._num_host_blocks, self.max_ids)
        ids = np.arange(n, dtype=np.int64)
        ids_dev = torch.from_numpy(ids).to(c._device)
        nbytes = n * self._bpb

        def gathered() -> torch.Tensor:
            scratch = torch.empty((n, self._bpb), dtype=torch.uint8, device=c._device)
            fused.move(scratch, ids_dev, to_stage=True)
            if c._device.type == "cuda":
                torch.cuda.current_stream(c._device).synchronize()
            return scratch.cpu()

        want = gathered()
        direct_max, c._direct_max_bytes = c._direct_max_bytes, -1
        try:
            self.copy(ids, ids, True, nbytes).wait()  # staged
        finally:
            c._direct_max_bytes = direct_max
        ok = torch.equal(c._host[:n], want)
        try:
            c._host[:n] = torch.bitwise_not(want)
            self.copy(ids, ids, False, nbytes).wait()
            ok = ok and torch.equal(gathered(), torch.bitwise_not(want))
        finally:  # the blocks' own bytes back, through the torch path's kernel
            fused.move(want.to(c._device), ids_dev, to_stage=False)
            if c._device.type == "cuda":
                torch.cuda.current_stream(c._device).synchronize()
        c._host[:n] = want
        self.copy(ids, ids, False, nbytes).wait()
        ok = ok and torch.equal(gathered(), want)
        if self._direct is not None:
            c._host[:n] = 0
            self.copy(ids, ids, True, nbytes).wait()
            ok = ok and torch.equal(c._host[:n], want)
        if not ok:
            logger.warning("kvslots: CUDA driver issue path moved other bytes than torch's in its probe; "
                           "copies issued through torch")
        return ok

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot = (slot + 1) % DRIVER_RING_SLOTS
        ev = self._slot_events[slot]
        if ev is not None and not ev.query():
            ev.synchronize()  # 16 copies later and still running: its kernels may read the ids
        return slot

    def copy(self, dev: np.ndarray, host: np.ndarray, to_host: bool, nbytes: int) -> Transfer:
        """What ``BlockCopier._copy`` does on CUDA for ``len(dev) <= max_ids`` blocks."""
        with self._ctx:
            try:
                return self._issue(dev, host, to_host, nbytes)
            except BaseException:
                # Part of the copy may be queued, its slot and buffer events not all recorded:
                # let it finish before the slot or a staging buffer can be handed out again.
                for stream in (self._bus, self._kernel):
                    with contextlib.suppress(Exception):
                        self._d.stream_synchronize(stream)
                raise

    def _issue(self, dev: np.ndarray, host: np.ndarray, to_host: bool, nbytes: int) -> Transfer:
        c, d = self._c, self._d
        n = len(dev)
        kernel, bus, bpb, host_ptr = self._kernel, self._bus, self._bpb, c._host.data_ptr()
        slot = self._take_slot()
        ids = self._ring_np[slot]
        if to_host and self._direct is not None and nbytes <= c._direct_max_bytes:
            # One launch between the layers and the host rows: after the forward (the KV
            # it wrote) and after staged bus copies still using host rows. It reads its ids
            # from the pinned ring: its time is the bus's, which hides the few reads.
            ids[0, :n] = dev
            ids[1, :n] = host
            idx = self._ring_ptr + slot * self.SLOT_BYTES
            base = self._fused.host_base(c._host).data_ptr()
            table = self._fused._table().data_ptr()  # every call: a layer's memory may have moved
            d.record(self._compute_mark, self._compute())
            d.wait(kernel, self._compute_mark)
            d.record(self._bus_mark, bus)
            d.wait(kernel, self._bus_mark)
            self._direct((n, *self._grid_yz), kernel, (base, self._row_words, idx, table, self._words,
                                                      self._offsets, idx + DRIVER_RING_IDS * 8, base))
            event = DriverEvent(d, self._ctx)
            d.record(event.handle, kernel)
            d.wait(bus, event.handle)
            self._slot_events[slot] = event
            return Transfer(nbytes, event)
        order = np.argsort(host, kind="stable")  # longest host runs
        dev, host = dev[order], host[order]
        ids[0, :n] = dev
        # Staged kernels read their ids from the device copy of the slot (read from the
        # pinned ring, a 16-block scatter took 33 us instead of 17 on an H200): a load
        # uploads them first on the bus stream, whose copies the scatter waits for anyway;
        # a store on the kernel stream, before it waits for the forward.
        idx = self._ring_dev_ptr + slot * self.SLOT_BYTES
        src = self._ring_ptr + slot * self.SLOT_BYTES
        chunks = [(k % len(self._stage), c0, min(n, c0 + c._chunk)) for k, c0 in enumerate(range(0, n, c._chunk))]
        if to_host:
            d.htod(idx, src, n * 8, kernel)
            d.record(self._compute_mark, self._compute())
            d.wait(kernel, self._compute_mark)
            table = self._fused._table().data_ptr()
            for b, c0, c1 in chunks:  # gather, then the bus
                stage, bus_done, kernels_done = self._stage[b], self._bus_done[b], self._kernels_done[b]
                d.wait(kernel, bus_done)
                self._gather((c1 - c0, *self._grid_yz), kernel,
                             (stage, self._row_words, idx + c0 * 8, table, self._words, self._offsets, idx, idx))
                d.record(kernels_done, kernel)
                d.wait(bus, kernels_done)
                for i, j, h0 in _runs(host[c0:c1]):
                    d.dtoh(host_ptr + h0 * bpb, stage + i * bpb, (j - i) * bpb, bus)
                d.record(bus_done, bus)
            last = bus
        else:
            # The bus copies first: a small load is bound by how soon its bytes move.
            for k, (b, c0, c1) in enumerate(chunks):
                stage = self._stage[b]
                d.wait(bus, self._kernels_done[b])
                if k == 0:
                    d.htod(idx, src, n * 8, bus)
                for i, j, h0 in _runs(host[c0:c1]):
                    d.htod(stage + i * bpb, host_ptr + h0 * bpb, (j - i) * bpb, bus)
                d.record(self._bus_done[b], bus)
                if k == 0:  # once, before the first scatter: the kernels wait for the forward
                    table = self._fused._table().data_ptr()
                    d.record(self._compute_mark, self._compute())
                    d.wait(kernel, self._compute_mark)
                d.wait(kernel, self._bus_done[b])
                self._scatter((c1 - c0, *self._grid_yz), kernel,
                              (stage, self._row_words, idx + c0 * 8, table, self._words, self._offsets, idx, idx))
                d.record(self._kernels_done[b], kernel)
            last = kernel
        event = DriverEvent(d, self._ctx)
        d.record(event.handle, last)
        self._slot_events[slot] = event
        return Transfer(nbytes, event)


class _OnStream:
    """``torch.cuda.stream(s)`` at less than half its host time (the copies switch streams several
    times per call; H100, benches/profiling/cuda_small_copies.py): saves and restores the current
    stream of ``s``'s own device, as torch's context does when that device is the current one."""

    __slots__ = ("_prev", "_stream")

    def __init__(self, stream: Any):
        self._stream = stream

    def __enter__(self) -> None:
        self._prev = torch.cuda.current_stream(self._stream.device_index)
        torch.cuda.set_stream(self._stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self._prev)


def _first_line(e: BaseException) -> str:
    """An exception's first line for a one-line warning, or its type's name where it has none."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(i, j, ids[i])`` for each run ``ids[i:j]`` of consecutive ids (one bus copy each).
    A Python loop: for the few ids of a small copy, a sixth of numpy's host time."""
    ids = ids.tolist()
    runs = []
    i = 0
    for j in range(1, len(ids)):
        if ids[j] != ids[j - 1] + 1:
            runs.append((i, j, ids[i]))
            i = j
    if ids:
        runs.append((i, len(ids), ids[i]))
    return runs


def _as_ids(ids: Ids, name: str, limit: int, kind: str, most: int) -> np.ndarray:
    """A contiguous int64 array of at most ``most`` ids in ``0..limit``, or a typed error
    naming the index."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 and 0 < ids.shape[0] <= most:
        # The common case at half the host time (a small copy is bound by it): min and max
        # instead of a mask; any id out of range takes the full check below for its message.
        if 0 <= ids.min() and ids.max() < limit:
            return np.ascontiguousarray(ids)
    try:
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise ArgumentTypeError(
                    f"{name} must be a 1-D sequence of integers, got a tensor of dtype {ids.dtype}"
                )
            if ids.dim() == 1:
                _check_count(name, ids.shape[0], most)  # before .cpu() copies it
            ids = ids.detach().cpu().numpy()
        a = np.asarray(ids)
    except (ArgumentTypeError, InvalidArgumentError):
        raise
    except Exception as e:  # whatever numpy or torch raise for a value that is not ids
        raise ArgumentTypeError(f"{name} must be a 1-D sequence of integers, got {type(ids).__name__}") from e
    if a.size == 0:
        return np.empty(0, dtype=np.int64)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ArgumentTypeError(
            f"{name} must be a 1-D sequence of integers, got shape {a.shape} dtype {a.dtype}"
        )
    _check_count(name, a.shape[0], most)
    bad = np.flatnonzero((a < 0) | (a >= limit))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(f"{name}[{i}] = {int(a[i])} is outside the {limit} {kind} blocks")
    return np.ascontiguousarray(a, dtype=np.int64)


def _check_count(name: str, n: int, most: int) -> None:
    if n > most:
        raise InvalidArgumentError(
            f"{name} has {n} ids: a copy writes at most the destination's {most} blocks, each once"
        )


def _check_plain(name: str, t: torch.Tensor) -> None:
    """Refuses a tensor whose memory is not its values as plain strided bytes: torch raised a
    RuntimeError for a sparse, nested, conjugate or negative view, and a quantized tensor's
    byte view crashed the process (a segmentation fault in torch)."""
    kind = None
    if t.is_nested:
        kind = "a nested tensor"
    elif t.layout != torch.strided:
        kind = f"a tensor of layout {t.layout}"
    elif t.is_quantized:
        kind = f"a quantized tensor ({t.dtype})"
    elif t.is_conj() or t.is_neg():
        kind = "a lazy conjugate or negative view (resolve_conj() / resolve_neg() first)"
    if kind is not None:
        raise InvalidArgumentError(f"layer {name!r}: {kind}; whole-block copies need a plain strided cache tensor")
