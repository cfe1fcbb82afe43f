"""Where each KV block lives in a worker's memory: the unit a prefill worker describes and a
decode worker reads.

A *segment* is one run of equally sized blocks at a fixed stride: block ``b`` of the segment
is the ``block_bytes`` bytes at ``addr + b * stride``. A layer tensor with its block dimension
first (vLLM's CPU backend: ``[num_blocks, heads, block_size, 2*head_size]``) is one segment; one
with dimensions before the block dimension (CUDA flash-attn's ``[2, num_blocks, ...]``: K and V)
is one segment per outer index. A :class:`BlockLayout` lists the segments of *every* layer vLLM
registered with the connector, target and draft layers alike, so a block id moved through it
moves the drafter's KV with the target's.

Layouts cross process boundaries (inside vLLM's ``kv_transfer_params``), so they are plain
msgspec structs; :meth:`BlockLayout.to_wire` / :meth:`BlockLayout.from_wire` give a JSON-safe
form. Two workers can exchange blocks only when their layouts have the same segment names and
block sizes in the same order (:meth:`BlockLayout.check_compatible`); addresses and block counts
may differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from ...errors import ArgumentTypeError, InvalidArgumentError, TransferError

__all__ = ["Segment", "BlockLayout"]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    name: str
    addr: int
    block_bytes: int
    stride: int
    num_blocks: int

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the bytes the segment's blocks occupy."""
        return self.addr, self.addr + (self.num_blocks - 1) * self.stride + self.block_bytes


class BlockLayout(msgspec.Struct, frozen=True):
    segments: tuple[Segment, ...]
    num_blocks: int

    # ---- construction ----

    @classmethod
    def from_tensors(cls, layers: Mapping[str, Any], num_blocks: int, *, block_dim: int | None = None) -> BlockLayout:
        """The layout of vLLM's KV cache tensors (``register_kv_caches``' mapping; a value may be
        a sequence of tensors). Each tensor must be contiguous and have exactly one dimension of
        size ``num_blocks`` (or pass ``block_dim``). A tensor registered under several names
        (shared KV) is described once."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise ArgumentTypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be >= 1, got {num_blocks}")
        n = int(num_blocks)
        segments: list[Segment] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, value in layers.items():
            tensors = [(name, value)] if hasattr(value, "data_ptr") else [(f"{name}[{i}]", t) for i, t in enumerate(value)]
            for tname, t in tensors:
                if not hasattr(t, "data_ptr"):
                    raise InvalidArgumentError(f"layer {tname!r}: expected a tensor, got {type(t).__name__}")
                key = (t.data_ptr(), tuple(t.shape))
                if key in seen:
                    continue
                seen.add(key)
                segments.extend(_segments_of(tname, t, n, block_dim))
        if not segments:
            raise InvalidArgumentError("a block layout needs at least one layer tensor")
        return cls(segments=tuple(segments), num_blocks=n)

    @classmethod
    def from_buffer(cls, addr: int, *, block_bytes: int, num_blocks: int, num_segments: int = 1,
                    name: str = "buf") -> BlockLayout:
        """A plain buffer cut into ``num_segments`` segments of ``num_blocks`` blocks each
        (segment ``s`` block ``b`` at ``addr + (s * num_blocks + b) * block_bytes``): tests and
        benches use it to stand in for a KV cache."""
        for key, v in (("addr", addr), ("block_bytes", block_bytes), ("num_blocks", num_blocks),
                       ("num_segments", num_segments)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ArgumentTypeError(f"{key} must be an int, got {type(v).__name__}")
            if v < (0 if key == "addr" else 1):
                raise InvalidArgumentError(f"{key} must be positive, got {v}")
        segs = tuple(Segment(f"{name}.{s}", int(addr) + s * num_blocks * block_bytes, int(block_bytes),
                             int(block_bytes), int(num_blocks)) for s in range(num_segments))
        return cls(segments=segs, num_blocks=int(num_blocks))

    # ---- properties ----

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across every segment (what one block id moves)."""
        return sum(s.block_bytes for s in self.segments)

    def regions(self) -> list[tuple[int, int]]:
        """Disjoint (addr, nbytes) memory regions covering every segment: what the transfer
        engine registers. Overlapping or touching spans are merged."""
        spans = sorted(s.span for s in self.segments)
        out: list[list[int]] = []
        for start, end in spans:
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(a, b - a) for a, b in out]

    def signature(self) -> tuple[tuple[str, int], ...]:
        """What must agree between two workers: segment names and block sizes, in order."""
        return tuple((s.name, s.block_bytes) for s in self.segments)

    def check_compatible(self, remote: BlockLayout) -> None:
        """Raises :class:`TransferError` (kind ``"layout"``) unless blocks of ``remote`` can be
        copied into blocks of this layout segment by segment."""
        mine, theirs = self.signature(), remote.signature()
        if mine == theirs:
            return
        if len(mine) != len(theirs):
            msg = f"{len(theirs)} remote segments vs {len(mine)} local (different model or drafter?)"
        else:
            i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            msg = f"segment {i}: remote {theirs[i]} vs local {mine[i]}"
        raise TransferError(f"block layouts differ: {msg}", details={"kind": "layout"})

    # ---- wire form ----

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe form (kv_transfer_params travel as JSON through the proxy)."""
        return {"num_blocks": self.num_blocks, "segments": [list(msgspec.structs.astuple(s)) for s in self.segments]}

    @classmethod
    def from_wire(cls, obj: Any) -> BlockLayout:
        """Inverse of :meth:`to_wire`; anything malformed is a :class:`TransferError` (kind
        ``"layout"``), never a crash."""
        try:
            layout = msgspec.convert(obj, cls)
        except (msgspec.ValidationError, TypeError) as e:
            raise TransferError(f"malformed remote block layout: {e}", details={"kind": "layout"}) from None
        if layout.num_blocks < 1 or not layout.segments:
            raise TransferError("malformed remote block layout: no blocks or no segments", details={"kind": "layout"})
        for s in layout.segments:
            if s.addr < 0 or s.block_bytes < 1 or s.stride < s.block_bytes or s.num_blocks != layout.num_blocks:
                raise TransferError(f"malformed remote block layout: segment {s}", details={"kind": "layout"})
        return layout


def _segments_of(name: str, t: Any, n: int, block_dim: int | None) -> list[Segment]:
    shape = tuple(int(x) for x in t.shape)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"layer {name!r}: KV tensor of shape {shape} is not contiguous")
    if block_dim is not None:
        if not -len(shape) <= block_dim < len(shape) or shape[block_dim] != n:
            raise InvalidArgumentError(f"layer {name!r}: block_dim {block_dim} of shape {shape} is not of size {n}")
        d = block_dim % len(shape)
    else:
        dims = [i for i, s in enumerate(shape) if s == n]
        if len(dims) != 1:
            raise InvalidArgumentError(
                f"layer {name!r}: {len(dims)} dimensions of shape {shape} have size num_blocks={n}; "
                "pass block_dim to say which one holds the blocks"
            )
        d = dims[0]
    outer = int(np.prod(shape[:d], dtype=np.int64))
    block_bytes = int(np.prod(shape[d + 1 :], dtype=np.int64)) * t.element_size()
    if block_bytes == 0 or outer == 0:
        raise InvalidArgumentError(f"layer {name!r}: KV tensor of shape {shape} holds no bytes")
    base = t.data_ptr()
    if outer == 1:
        return [Segment(name, base, block_bytes, block_bytes, n)]
    return [Segment(f"{name}.{o}", base + o * n * block_bytes, block_bytes, block_bytes, n) for o in range(outer)]


def _as_ids(name: str, ids: Sequence[int] | np.ndarray, limit: int) -> np.ndarray:
    """Block ids as int64, each in [0, limit)."""
    if isinstance(ids, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(f"{name} must be a sequence of ints: {e}") from None
    if arr.ndim != 1:
        raise ArgumentTypeError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype == object and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr):
            arr = np.array([int(x) for x in arr], dtype=object)
        else:
            raise ArgumentTypeError(f"{name} must hold ints, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= limit:
        raise InvalidArgumentError(f"{name}: block id {lo if lo < 0 else hi} out of range [0, {limit})")
    return arr.astype(np.int64)
