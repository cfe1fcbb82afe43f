//! kvslots-core: a KV-cache block slot manager for speculative decoding.
//!
//! Pure Rust, no Python. [`SlotManager`] owns a [`BlockPool`] (block ids, reference counts,
//! free stack, prefix registry, LRU of cached blocks) and one [`Slot`] per request;
//! [`SlotTracker`] applies the same slot rules over block ids owned by someone else (vLLM's
//! device blocks). Both preallocate for the speculative lookahead, commit verified tokens into
//! immutable hashed blocks, and roll back rejected draft tokens. [`wire`] is vLLM's KV event
//! wire format (msgpack), by direction: [`wire::encode`] writes queued events, [`wire::decode`]
//! reads them for the prefix [`index`] of the `kvslots indexer` service. [`copy_blocks`] moves
//! whole KV blocks between a layer and the host tier. [`DeviceAllocator`] is the allocator of an
//! engine's device blocks (vLLM's KV cache manager in scheduler mode), keyed by the engine's own
//! block hashes.

pub mod cache;
pub mod connector;
pub mod copy;
pub mod device;
pub mod disk;
pub mod error;
pub mod events;
pub mod hash;
pub mod index;
pub mod manager;
pub mod pool;
pub mod slot;
pub mod tracker;
pub mod wire;

pub use cache::{CacheStats, HostCache, PendingStore, NO_SUCCESSOR};
pub use connector::{ConnectorPlanner, PlannerConfig, PlannerStats, ReqSlot, StepPlan};
pub use copy::{copy_blocks, mapped_writable, BlockLayout, CopySpec};
pub use device::{
    AllocArgs, Allocated, DeviceAllocator, DeviceConfig, DeviceStats, FullHash, HashSource,
};
pub use disk::file::{DiskError, DiskFile, DiskWriter, Layout as DiskLayout, Opened};
pub use disk::{BlockMeta, DiskIndex, DiskStats};
pub use error::{Result, SlotError};
pub use events::{EventLog, KvEvent, KvEventRef};
pub use hash::{block_hash, BlockHasher};
pub use index::{IndexConfig, IndexError, PrefixIndex, Tier};
pub use manager::{ManagerConfig, SlotId, SlotManager, Stats, StepInput, StepOutput};
pub use pool::{BlockId, BlockPool};
pub use slot::{Slot, SlotInfo};
pub use tracker::{CommittedBlock, SlotTracker};
pub use wire::{encode_batch, encode_each, encode_owned, BatchMeta, EncodeError, HashFormat};
