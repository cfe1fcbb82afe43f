//! vLLM's KV event wire format: the msgpack `KVEventBatch` that vLLM's publisher sends, by
//! direction.
//!
//! - [`encode`] writes the events the engine queued (slot manager, host cache), byte for byte as
//!   vLLM's msgspec encoder would.
//! - [`decode`] reads batches from any vLLM (and from kvslots) into flat buffers for the prefix
//!   [`index`](crate::index).

pub mod decode;
pub mod encode;

pub use decode::{
    lookahead_hash, lora_name_key, DecodeError, DecodedBatch, Lookahead, WireEvent, WireKind,
    WireMedium,
};
pub use encode::{encode_batch, encode_each, encode_owned, BatchMeta, EncodeError, HashFormat};
