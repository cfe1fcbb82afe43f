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
from ..errors import ArgumentTypeError, EventDecodeError, InvalidArgumentError, KVSlotsError

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
    """
    if not isinstance(raw, (tuple, list)):
        raise ArgumentTypeError(f"an event tuple is a tuple, got {type(raw).__name__}")
    # Checked as drain_events checks them: a medium of another type went into the struct,
    # which then encoded into a batch no subscriber could decode.
    if medium is not None:
        medium = _args.text(medium, "medium")
    hashes_as_bytes = bool(_args.flag(hashes_as_bytes, "hashes_as_bytes"))
    try:
        return _from_raw(raw, medium, hashes_as_bytes, structs)
    except KVSlotsError:
        raise
    except Exception as e:  # short tuples, hashes that are not u64, a structs without the classes
        raise EventDecodeError(f"malformed event tuple {_short(raw)}: {e}") from e


def _from_raw(raw: tuple[Any, ...] | list[Any], medium: str | None, hashes_as_bytes: bool,
              structs: Any) -> KVEvent:
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


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


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
    included), :class:`ArgumentTypeError` when ``payload`` is not contiguous bytes."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        return _decoder.decode(payload)
    except BufferError as e:  # a memoryview that is not C-contiguous
        raise ArgumentTypeError(f"payload must be contiguous bytes: {e}") from None
    except DECODE_ERRORS as e:
        raise EventDecodeError(f"payload of {len(payload)} bytes is not a KVEventBatch: {e}") from None


def external_block_hash(block_hash: bytes | int) -> int:
    """vLLM's int form of a block hash (``maybe_convert_block_hash``): the low 64 bits of the
    hash bytes read big-endian."""
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"a block hash is an int or bytes, got {type(block_hash).__name__}")
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
