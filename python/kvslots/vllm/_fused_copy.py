"""One Triton kernel that moves a chunk of staged blocks to or from every layer of the KV cache.

BlockCopier's CUDA path otherwise launches one torch kernel per layer and chunk (``index_copy_``
to scatter, ``index_select`` + ``copy_`` to gather). A copy that fits one staging chunk is then
bound by issuing those kernels, not by the bus: on an H100, 32 layers, 64 blocks (128 MiB) moved
at 0.56x / 0.68x of a plain pinned copy (store / load). Here one launch covers every segment of
every layer: program (row, segment, part) moves ``WORDS`` 8-byte words of staged row ``row``
to or from device block ``idx[row]`` of that segment.

The same kernel also moves blocks straight between the layers and the pinned host region
(``move_direct``): the GPU reads and writes host memory through its unified address, so a small
copy is one launch with no staging buffer and no bus copy per run of host blocks.

The kernel reads each segment's device address from a table, so the table is rebuilt whenever
a layer tensor's memory moves (checked on every call), as the Rust CPU path rereads its regions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import InvalidStateError

#: 8-byte words one program moves (8 KiB): a 32 KiB flash-attention block segment is 4 programs.
WORDS = 1024


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # row_words is never specialized: as a constant (Triton makes an int argument of 1 one) it
    # would drop out of the compiled parameters the driver issue path packs by position.
    @triton.jit(do_not_specialize=["row_words"])
    def move_blocks(stage_ptr, row_words, idx_ptr, addr_ptr, words_ptr, host_ptr, rows_ptr, rows_base_ptr,
                    TO_STAGE: tl.constexpr, WORDS: tl.constexpr, DIRECT: tl.constexpr):
        row = tl.program_id(0)
        seg = tl.program_id(1)
        part = tl.program_id(2)
        block = tl.load(idx_ptr + row)
        words = tl.load(words_ptr + seg)
        base = tl.load(addr_ptr + seg).to(tl.pointer_type(tl.int64))
        offs = part * WORDS + tl.arange(0, WORDS)
        mask = offs < words
        dev = base + block * words + offs
        if DIRECT:  # rows are host blocks rows_ptr[row] of the pinned host region itself
            rows = tl.load(rows_base_ptr).to(tl.pointer_type(tl.int64))
            staged = rows + tl.load(rows_ptr + row) * row_words + tl.load(host_ptr + seg) + offs
        else:
            staged = stage_ptr + row * row_words + tl.load(host_ptr + seg) + offs
        if TO_STAGE:
            tl.store(staged, tl.load(dev, mask=mask), mask=mask)
        else:
            tl.store(dev, tl.load(staged, mask=mask), mask=mask)

    return move_blocks


class FusedMover:
    """Moves staged rows ``[n, bytes_per_block]`` to or from blocks ``idx`` of every segment.

    ``segments``: (uint8 view ``[num_blocks, block_bytes]`` of one segment, its byte offset in a
    host block), in host-block order. Build it only where :meth:`supports` is true.
    """

    def __init__(self, segments: list[tuple[torch.Tensor, int]], bytes_per_block: int, device: torch.device):
        self._segments = segments
        self._views = [view for view, _ in segments]
        # One view per distinct storage is enough to see a move (a storage reallocated by
        # resize_ moves every view of it): vLLM's layers are often views of one allocation.
        reps: dict[int, torch.Tensor] = {}
        for view in self._views:
            reps.setdefault(view.untyped_storage().data_ptr(), view)
        self._reps = list(reps.values())
        self._rep_addrs: tuple[int, ...] = ()
        # Tables replaced after a move, kept: a copy queued before may still read one on the
        # device (a move is rare: a resize or a sleep / wake-up), and freed memory is reused.
        self._retired: list[torch.Tensor] = []
        self._row_words = bytes_per_block // 8
        self._device = device
        words = [view.shape[1] // 8 for view, _ in segments]
        self._max_words = max(words)
        self._words = torch.tensor(words, dtype=torch.int64, device=device)
        self._offsets = torch.tensor([off // 8 for _, off in segments], dtype=torch.int64, device=device)
        self._addr_table: torch.Tensor | None = None
        self._host_addr: tuple[int, torch.Tensor] | None = None  # (host region address, on the device)
        #: Triton's compiled kernel per (to_stage, direct) variant, from its first launch (the
        #: warm-ups: every pointer 16-byte aligned), for launches through the CUDA driver.
        self.compiled: dict[tuple[bool, bool], Any] = {}

    @staticmethod
    def supports(segments: list[tuple[torch.Tensor, int]], bytes_per_block: int) -> bool:
        """Triton is installed and every segment and host offset is whole 8-byte words."""
        return (_kernel() is not None and bytes_per_block % 8 == 0 and 0 < len(segments) < 65536  # grid axis 1
                and all(view.shape[1] % 8 == 0 and off % 8 == 0 and view.data_ptr() % 8 == 0
                        for view, off in segments))

    def warm_up(self) -> None:
        """Compiles both directions now, not in the first copy: gathers device block 0 into a
        scratch row and writes the same bytes back. Raises whatever Triton raises where it
        cannot compile or launch (no C compiler, an unsupported GPU)."""
        scratch = torch.empty((1, self._row_words * 8), dtype=torch.uint8, device=self._device)
        first = torch.zeros(1, dtype=torch.int64, device=self._device)
        self.move(scratch, first, to_stage=True)
        self.move(scratch, first, to_stage=False)
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _table(self) -> torch.Tensor:
        reps = tuple(map(torch.Tensor.data_ptr, self._reps))  # every call: ~2x a generator's speed
        if reps != self._rep_addrs:  # first use, or a layer's memory moved (resize_)
            addrs = tuple(map(torch.Tensor.data_ptr, self._views))
            if any(a % 8 for a in addrs):
                raise InvalidStateError("a KV layer tensor moved to memory not aligned to 8 bytes")
            if self._addr_table is not None:
                self._retired.append(self._addr_table)
            self._addr_table = torch.tensor(addrs, dtype=torch.int64, device=self._device)
            self._rep_addrs = reps
        assert self._addr_table is not None
        return self._addr_table

    def move(self, stage: torch.Tensor, idx: torch.Tensor, *, to_stage: bool) -> None:
        """One launch on the current stream: staged row i <-> device block ``idx[i]``."""
        n = idx.shape[0]
        if n == 0:
            return
        grid = (n, len(self._segments), -(-self._max_words // WORDS))
        ck = _kernel()[grid](stage.view(torch.int64), self._row_words, idx, self._table(), self._words,
                             self._offsets, idx, idx, TO_STAGE=to_stage, WORDS=WORDS, DIRECT=False)
        if (to_stage, False) not in self.compiled:
            self.compiled[(to_stage, False)] = ck

    def move_direct(self, host: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, *, to_host: bool) -> None:
        """One launch on the current stream: host region row ``rows[i]`` <-> device block
        ``idx[i]``. ``host`` is ``[num_host_blocks, bytes_per_block]`` uint8 in memory the GPU
        can address (pinned, or any CPU tensor under Triton's interpreter)."""
        n = idx.shape[0]
        if n == 0:
            return
        base = self.host_base(host)
        grid = (n, len(self._segments), -(-self._max_words // WORDS))
        ck = _kernel()[grid](base, self._row_words, idx, self._table(), self._words, self._offsets, rows, base,
                             TO_STAGE=to_host, WORDS=WORDS, DIRECT=True)
        if (to_host, True) not in self.compiled:
            self.compiled[(to_host, True)] = ck

    def host_base(self, host: torch.Tensor) -> torch.Tensor:
        """The host region's address, in a one-element tensor on the device (the direct kernel
        reads it there), remade when the region moves."""
        addr = host.data_ptr()
        if self._host_addr is None or self._host_addr[0] != addr:
            if addr % 8:
                raise InvalidStateError("the host region is not aligned to 8 bytes")
            self._host_addr = (addr, torch.tensor([addr], dtype=torch.int64, device=self._device))
        return self._host_addr[1]
