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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from ..._args import integer, text
from ...errors import ArgumentTypeError, InvalidArgumentError, TransferError

__all__ = ["MAX_ADDRESS", "MAX_SEGMENTS", "Segment", "BlockLayout"]

#: Every byte of a layout lies below this address: the transport computes block addresses as
#: int64 (numpy) and Mooncake takes them as uint64; user-space addresses are far lower (2**47
#: on x86-64). A span past it wrapped to a negative address or was an OverflowError.
MAX_ADDRESS = 2**63 - 1
#: Most segments in one layout. A model has a few hundred (layers x K/V, drafter included);
#: 10**7 from a caller or a peer took half a minute and gigabytes to build.
MAX_SEGMENTS = 1 << 16


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
        # Checked here: a list or None was an AttributeError, a str block_dim a TypeError, a
        # non-str layer name a Segment that no longer round-trips through to_wire / from_wire.
        if not isinstance(layers, Mapping):
            raise ArgumentTypeError(f"layers must be a mapping of layer name to tensor, got {type(layers).__name__}")
        if block_dim is not None:
            block_dim = integer(block_dim, "block_dim")
        segments: list[Segment] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, value in layers.items():
            name = text(name, "layer name")
            if hasattr(value, "data_ptr"):
                tensors = [(name, value)]
            elif isinstance(value, (list, tuple)):
                tensors = [(f"{name}[{i}]", t) for i, t in enumerate(value)]
            else:  # an int was a TypeError; a str was walked character by character
                raise InvalidArgumentError(f"layer {name!r}: expected a tensor or a list of tensors, "
                                           f"got {type(value).__name__}")
            for tname, t in tensors:
                if not hasattr(t, "data_ptr"):
                    raise InvalidArgumentError(f"layer {tname!r}: expected a tensor, got {type(t).__name__}")
                _check_plain(tname, t)
                key = (t.data_ptr(), tuple(t.shape))
                if key in seen:
                    continue
                seen.add(key)
                segments.extend(_segments_of(tname, t, n, block_dim))
        if not segments:
            raise InvalidArgumentError("a block layout needs at least one layer tensor")
        if len(segments) > MAX_SEGMENTS:
            raise InvalidArgumentError(f"{len(segments)} segments, more than {MAX_SEGMENTS}")
        for seg in segments:
            _check_span(seg, InvalidArgumentError)
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
        name = text(name, "name")
        # Before any segment is made: 10**7 segments took half a minute, and an end past
        # MAX_ADDRESS registered as a pybind TypeError or planned wrapped, negative addresses.
        if num_segments > MAX_SEGMENTS:
            raise InvalidArgumentError(f"num_segments must be at most {MAX_SEGMENTS}, got {num_segments}")
        end = int(addr) + int(num_segments) * int(num_blocks) * int(block_bytes)
        if end > MAX_ADDRESS + 1:
            raise InvalidArgumentError(f"a buffer of {num_segments} x {num_blocks} blocks of {block_bytes} bytes at "
                                       f"{int(addr):#x} ends past address 2**63")
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
        if len(layout.segments) > MAX_SEGMENTS:
            raise TransferError(f"malformed remote block layout: {len(layout.segments)} segments, more than "
                                f"{MAX_SEGMENTS}", details={"kind": "layout"})
        for s in layout.segments:
            if s.addr < 0 or s.block_bytes < 1 or s.stride < s.block_bytes or s.num_blocks != layout.num_blocks:
                raise TransferError(f"malformed remote block layout: segment {_brief(s)}", details={"kind": "layout"})
            _check_span(s, TransferError)
        return layout


def _brief(seg: Segment) -> str:
    r = repr(seg)
    return r if len(r) <= 200 else r[:197] + "..."


def _check_span(seg: Segment, error: type[InvalidArgumentError] | type[TransferError]) -> None:
    """A segment's bytes end at or below MAX_ADDRESS + 1 and its name is text: a peer's address
    past it (2**70, or a stride that reaches past it) was an OverflowError in plan or wrapped
    to a negative address; a name with a lone surrogate failed to encode in the hello reply."""
    problem = None
    if seg.span[1] > MAX_ADDRESS + 1:
        problem = "ends past address 2**63"
    else:
        try:
            seg.name.encode("utf-8")
        except UnicodeEncodeError:
            problem = "name is not valid Unicode (a lone surrogate)"
    if problem is None:
        return
    what = f"segment {_brief(seg)}: {problem}"
    if error is TransferError:
        raise TransferError(f"malformed remote block layout: {what}", details={"kind": "layout"})
    raise InvalidArgumentError(what)


def _check_plain(name: str, t: Any) -> None:
    """Refuses a tensor whose memory is not its values at ``data_ptr()``: a sparse one's
    data_ptr was a RuntimeError, a nested one's shape an AttributeError, and a meta one
    described the bytes at address 0 (of shape [2**40, N, ...]: a loop over 2**40 segments)."""
    kind = None
    if getattr(t, "is_nested", False):
        kind = "a nested tensor"
    elif getattr(t, "layout", None) is not None and str(t.layout) != "torch.strided":
        kind = f"a tensor of layout {t.layout}"
    elif getattr(getattr(t, "device", None), "type", None) == "meta":
        kind = "a meta tensor (no memory)"
    if kind is not None:
        raise InvalidArgumentError(f"layer {name!r}: {kind}; a block layout needs a plain strided tensor in memory")


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
    outer = math.prod(shape[:d])
    block_bytes = math.prod(shape[d + 1 :]) * t.element_size()
    if block_bytes == 0 or outer == 0:
        raise InvalidArgumentError(f"layer {name!r}: KV tensor of shape {shape} holds no bytes")
    if outer > MAX_SEGMENTS:  # before one Segment is made per outer index
        raise InvalidArgumentError(f"layer {name!r}: KV tensor of shape {shape} has {outer} segments, "
                                   f"more than {MAX_SEGMENTS}")
    base = integer(t.data_ptr(), f"layer {name!r}: data_ptr()", 1)
    if outer == 1:
        return [Segment(name, base, block_bytes, block_bytes, n)]
    return [Segment(f"{name}.{o}", base + o * n * block_bytes, block_bytes, block_bytes, n) for o in range(outer)]


def _as_ids(name: str, ids: Sequence[int] | np.ndarray, limit: int, max_len: int) -> np.ndarray:
    """Block ids as int64, each in [0, limit), at most ``max_len`` of them."""
    if isinstance(ids, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    # Counted before numpy builds the array: range(10**12) was a MemoryError (numpy asked for
    # 7 TiB), range(10**9) gigabytes and seconds, for a read refused anyway.
    try:
        n: float | None = len(ids)
    except OverflowError:  # a range longer than sys.maxsize
        n = math.inf
    except TypeError:  # no length: refused below as what it is
        n = None
    if n is not None and n > max_len:
        raise InvalidArgumentError(f"{name} holds {n} ids, more than the {max_len} blocks they can go to")
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
