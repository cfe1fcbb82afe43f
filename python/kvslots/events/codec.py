"""KV cache events, field for field as vLLM's ``vllm.distributed.kv_events`` (vLLM 0.32 and 0.33).

vLLM 0.33 added ``BlockStored.lookahead_token_ids`` (the tokens after each block that its hash
covers, one list per block, for EAGLE engines with lookahead block hashes). Decoding reads both
layouts. Encoding follows the event: a ``BlockStored`` without lookahead tokens is written byte
for byte as vLLM 0.32 writes it (a fixmap header); one with them as vLLM 0.33 writes it (0.33's
struct has 15 fields plus the tag, so msgspec gives every ``BlockStored`` a map16 header, with or
without lookahead tokens; a byte comparison against 0.33's encoder must allow for that). A router that decodes vLLM's events decodes ours with the same decoder, and these structs decode
vLLM's. Block hashes are unsigned 64-bit integers by default (vLLM's external form); bytes are
accepted too.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .. import _args
from ..errors import ArgumentTypeError, EventDecodeError, InvalidArgumentError, KVSlotsError, short_repr

ExternalBlockHash = Union[bytes, int]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """Encoded as the msgpack array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the three events; tagged by class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _BlockStored032(KVCacheEvent, tag="BlockStored"):  # type: ignore[call-arg]
    """vLLM 0.32's layout (14 fields: msgspec writes a fixmap header), for events without
    lookahead tokens."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


_FIELDS_032 = _BlockStored032.__struct_fields__


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


def from_raw(
    raw: tuple[Any, ...],
    medium: str | None,
    *,
    hashes_as_bytes: bool = False,
    structs: Any = None,
) -> KVEvent:
    """Turns one event tuple from the Rust core into its struct. This is the one place that
    reads those tuples: ``("BlockStored", hashes, parent, tokens, block_size, lora_id)``,
    ``("BlockRemoved", hashes)``, ``("AllBlocksCleared",)``. A ``BlockStored`` of a tier that
    publishes successors (the connector's EAGLE rule) has a seventh item, its
    ``lookahead_token_ids`` (``[successor]`` or ``[]`` per block); ``structs`` must then have
    that field (vLLM 0.33 or this module).

    ``hashes_as_bytes`` writes block hashes as 8 big-endian bytes (as the Rust encoder's
    ``hashes_as_bytes``). ``structs`` is where the classes come from: any namespace with
    ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` of vLLM's fields, in vLLM's
    order (``vllm.distributed.kv_events`` itself); by default the ones of this module.

    The items are checked as the Rust core's ``encode_event_batch`` checks them: block hashes,
    a parent and a LoRA id ints in [0, 2**64), token ids and the block size in [0, 2**32), one
    ``lookahead_token_ids`` entry per block holding no token or one below 2**32 - 1. Any other
    item is an :class:`EventDecodeError` naming it; no struct is made. (The Rust core's own
    tuples need no checks: a caller converting those in bulk uses ``_from_raw``.)
    """
    if not isinstance(raw, (tuple, list)):
        raise ArgumentTypeError(f"an event tuple is a tuple, got {type(raw).__name__}")
    # Checked as drain_events checks them: a medium of another type went into the struct,
    # which then encoded into a batch no subscriber could decode.
    if medium is not None:
        medium = _args.text(medium, "medium")
    hashes_as_bytes = bool(_args.flag(hashes_as_bytes, "hashes_as_bytes"))
    # Checked here, at the public door, not in _from_raw: a string token or a negative hash went
    # into the struct and out in a batch no subscriber could decode. The per-item pass costs
    # 2-3 times the conversion itself, which the Rust core's own tuples do not need.
    try:
        why = _raw_fault(raw)
        if why is not None:
            raise EventDecodeError(f"malformed event tuple {short_repr(raw)}: {why}")
        return _from_raw(raw, medium, hashes_as_bytes, structs)
    except KVSlotsError:
        raise
    except Exception as e:  # short tuples, hashes that are not u64, a structs without the classes
        raise EventDecodeError(f"malformed event tuple {short_repr(raw)}: {e}") from e


_U64 = 1 << 64
_U32 = 1 << 32
_NO_SUCCESSOR = _U32 - 1  # the Rust core's "none recorded"


def _int_fault(x: Any, what: str, lo: int, hi: int) -> str | None:
    if type(x) is not int and (not isinstance(x, int) or isinstance(x, bool)):
        return f"{what} must be an int, got {type(x).__name__} {short_repr(x)}"
    if not lo <= x < hi:
        return f"{what} must be in [{lo}, {_bound(hi)}), got {x}"
    return None


def _bound(hi: int) -> str:
    return {_U64: "2**64", _U32: "2**32", _NO_SUCCESSOR: "2**32 - 1"}.get(hi, str(hi))


def _ints_fault(v: Any, what: str, hi: int) -> str | None:
    if not isinstance(v, (list, tuple)):
        return f"{what} must be a list of ints, got {type(v).__name__} {short_repr(v)}"
    for x in v:  # the common case in one pass; the index only once something is wrong
        if type(x) is not int or not 0 <= x < hi:
            break
    else:
        return None
    for i, x in enumerate(v):
        why = _int_fault(x, f"{what}[{i}]", 0, hi)
        if why is not None:
            return why
    return None


def _raw_fault(raw: tuple[Any, ...] | list[Any]) -> str | None:
    """What is wrong with an event tuple's items (None: nothing); the arity and kind are left to
    _from_raw, which names them."""
    kind = raw[0] if raw else None
    if kind == "BlockStored" and len(raw) in (6, 7):
        why = (_ints_fault(raw[1], "block_hashes", _U64)
               or (None if raw[2] is None else _int_fault(raw[2], "parent_block_hash", 0, _U64))
               or _ints_fault(raw[3], "token_ids", _U32)
               or _int_fault(raw[4], "block_size", 0, _U32)
               or (None if raw[5] is None else _int_fault(raw[5], "lora_id", 0, _U64)))
        if why is not None or len(raw) == 6 or raw[6] is None:
            return why
        lookahead = raw[6]
        if not isinstance(lookahead, (list, tuple)):
            return f"lookahead_token_ids must be a list, got {type(lookahead).__name__} {short_repr(lookahead)}"
        if len(lookahead) != len(raw[1]):
            return f"lookahead_token_ids has {len(lookahead)} entries for {len(raw[1])} block hashes (one per block)"
        for i, entry in enumerate(lookahead):
            what = f"lookahead_token_ids[{i}]"
            if not isinstance(entry, (list, tuple)) or len(entry) > 1:
                return f"{what} must be [] or [token], got {short_repr(entry)}"
            why = _ints_fault(entry, what, _NO_SUCCESSOR)
            if why is not None:
                return why
        return None
    if kind == "BlockRemoved" and len(raw) == 2:
        return _ints_fault(raw[1], "block_hashes", _U64)
    return None


def _from_raw(raw: tuple[Any, ...] | list[Any], medium: str | None, hashes_as_bytes: bool,
              structs: Any) -> KVEvent:
    """:func:`from_raw` without its checks: for the Rust core's own tuples (well-formed by
    construction), where the per-item pass would cost more than the conversion."""
    kind = raw[0] if raw else None
    if kind == "BlockStored":
        _, hashes, parent, tokens, block_size, lora_id, *rest = raw
        if hashes_as_bytes:
            hashes = [h.to_bytes(8, "big") for h in hashes]
            parent = None if parent is None else parent.to_bytes(8, "big")
        cls = BlockStored if structs is None else structs.BlockStored
        if rest and rest[0] is not None:
            (lookahead,) = rest
            return cls(hashes, parent, tokens, block_size, lora_id, medium, None,
                       lookahead_token_ids=lookahead)
        return cls(hashes, parent, tokens, block_size, lora_id, medium, None)
    if kind == "BlockRemoved":
        _, hashes = raw
        if hashes_as_bytes:
            hashes = [h.to_bytes(8, "big") for h in hashes]
        return (BlockRemoved if structs is None else structs.BlockRemoved)(hashes, medium)
    if kind == "AllBlocksCleared" and len(raw) == 1:
        return (AllBlocksCleared if structs is None else structs.AllBlocksCleared)()
    raise EventDecodeError(f"unknown event kind {kind!r} ({len(raw)} items)")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)

#: What msgspec raises for bytes that are not a batch. Besides DecodeError (ValidationError is
#: one): UnicodeDecodeError (a ValueError) for a string that is not UTF-8, RecursionError for
#: nesting deeper than the interpreter's limit (an ``extra_keys`` item may hold anything). Both
#: come from a peer's frames, so every decode of a payload catches all three.
DECODE_ERRORS = (msgspec.DecodeError, ValueError, RecursionError)


def _wire_event(ev: Any) -> Any:
    if type(ev) is BlockStored and ev.lookahead_token_ids is None:
        return _BlockStored032(*(getattr(ev, f) for f in _FIELDS_032))
    return ev


def encode_batch(batch: EventBatch) -> bytes:
    """The batch's msgpack; each ``BlockStored`` in the layout of the vLLM that could have
    written it (see the module docs). A field msgpack cannot hold raises
    :class:`ArgumentTypeError` (a type) or :class:`InvalidArgumentError` (an int past 64 bits,
    nesting past the recursion limit or a circular one)."""
    if not isinstance(batch, EventBatch):
        raise ArgumentTypeError(f"encode_batch() takes a KVEventBatch, got {type(batch).__name__}")
    return encode_struct(batch)


def encode_struct(batch: msgspec.Struct) -> bytes:
    """What :meth:`EventPublisher.publish <kvslots.events.publisher.EventPublisher.publish>`
    sends for a struct: kvslots' batch as :func:`encode_batch` writes it, any other struct
    (vLLM's own ``KVEventBatch``) as msgspec writes it; the errors of :func:`encode_batch`."""
    if not isinstance(batch, msgspec.Struct):
        raise ArgumentTypeError(f"encode_struct() takes a msgspec.Struct, got {type(batch).__name__}")
    try:
        if isinstance(batch, EventBatch):
            events = batch.events
            if not isinstance(events, (list, tuple)):
                # msgspec encodes no iterator, but the scan below took events off one and the
                # rest went out as the batch (3 events sent as 2); a str or dict is no list either.
                raise ArgumentTypeError(f"the batch cannot be encoded: events must be a list, got "
                                        f"{type(events).__name__}")
            if any(type(ev) is BlockStored and ev.lookahead_token_ids is None for ev in events):
                batch = msgspec.structs.replace(batch, events=[_wire_event(ev) for ev in events])
        return _encoder.encode(batch)
    except KVSlotsError:  # first: an ArgumentTypeError is a TypeError too
        raise
    except TypeError as e:
        raise ArgumentTypeError(f"the batch cannot be encoded: {e}") from None
    except (msgspec.EncodeError, OverflowError, ValueError, RecursionError) as e:  # deep or circular
        raise InvalidArgumentError(f"the batch cannot be encoded: {e}") from None
    except Exception as e:  # an events object whose __iter__ raises
        raise ArgumentTypeError(f"the batch cannot be encoded: reading its events raised {type(e).__name__}") from e


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch a msgpack payload holds; :class:`EventDecodeError` when it is not a
    ``KVEventBatch`` (a string that is not UTF-8 and nesting past the recursion limit
    included), :class:`ArgumentTypeError` when ``payload`` is not contiguous bytes,
    :class:`InvalidArgumentError` for a released memoryview."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"payload must be bytes, got {type(payload).__name__}")
    _check_view(payload, "payload")
    n = len(payload)  # read now: a memoryview released meanwhile has no length
    try:
        return _decoder.decode(payload)
    except BufferError as e:  # a memoryview that is not C-contiguous
        raise ArgumentTypeError(f"payload must be contiguous bytes: {e}") from None
    except DECODE_ERRORS as e:
        raise EventDecodeError(f"payload of {n} bytes is not a KVEventBatch: {e}") from None


def _check_view(data: bytes | bytearray | memoryview, what: str) -> None:
    # A released memoryview: every use raised ValueError, the error's own message included.
    if isinstance(data, memoryview):
        try:
            data.nbytes
        except ValueError:
            raise InvalidArgumentError(f"{what} is a released memoryview") from None


def external_block_hash(block_hash: bytes | int) -> int:
    """vLLM's int form of a block hash (``maybe_convert_block_hash``): the low 64 bits of the
    hash bytes read big-endian."""
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"a block hash is an int or bytes, got {type(block_hash).__name__}")
    _check_view(block_hash, "the block hash")
    if not isinstance(block_hash, memoryview):
        block_hash = block_hash[-8:]  # the low 64 bits: a 100 MB hash was read whole (0.2 s)
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
