"""KV cache events, field for field as vLLM's ``vllm.distributed.kv_events`` (vLLM 0.32).

A router that decodes vLLM's events decodes ours with the same decoder, and these structs decode
vLLM's. Block hashes are unsigned 64-bit integers by default (vLLM's external form); bytes are
accepted too.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

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
    ``("BlockRemoved", hashes)``, ``("AllBlocksCleared",)``.

    ``hashes_as_bytes`` writes block hashes as 8 big-endian bytes (as the Rust encoder's
    ``hashes_as_bytes``). ``structs`` is where the classes come from: any namespace with
    ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` of vLLM's fields, in vLLM's
    order (``vllm.distributed.kv_events`` itself); by default the ones of this module.
    """
    kind = raw[0]
    if kind == "BlockStored":
        _, hashes, parent, tokens, block_size, lora_id = raw
        if hashes_as_bytes:
            hashes = [h.to_bytes(8, "big") for h in hashes]
            parent = None if parent is None else parent.to_bytes(8, "big")
        cls = BlockStored if structs is None else structs.BlockStored
        return cls(hashes, parent, tokens, block_size, lora_id, medium, None)
    if kind == "BlockRemoved":
        hashes = raw[1]
        if hashes_as_bytes:
            hashes = [h.to_bytes(8, "big") for h in hashes]
        return (BlockRemoved if structs is None else structs.BlockRemoved)(hashes, medium)
    if kind == "AllBlocksCleared":
        return (AllBlocksCleared if structs is None else structs.AllBlocksCleared)()
    raise ValueError(f"unknown event kind {kind!r}")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def external_block_hash(block_hash: bytes | int) -> int:
    """vLLM's int form of a block hash (``maybe_convert_block_hash``): the low 64 bits of the
    hash bytes read big-endian."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
