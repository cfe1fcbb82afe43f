"""KV events in vLLM's wire format: the structs and codec (:mod:`.codec`), the ZMQ publisher
(:mod:`.publisher`) and the subscriber (:mod:`.subscriber`). Every ZMQ / replay rule lives here
once; the indexer subscribes through :mod:`.subscriber`."""

from .codec import (
    MEDIUM_CPU,
    MEDIUM_GPU,
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
