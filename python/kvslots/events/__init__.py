"""KV events in vLLM's wire format: the structs and codec (:mod:`.codec`, whose ``from_raw`` is
the one reader of the Rust core's event tuples), the ZMQ framing and bind rule
(:mod:`.protocol`), the publisher (:mod:`.publisher`) and the subscriber (:mod:`.subscriber`).
Every ZMQ / replay rule lives here once; the indexer subscribes through :mod:`.subscriber`."""

from .codec import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    from_raw,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
    "from_raw",
]
