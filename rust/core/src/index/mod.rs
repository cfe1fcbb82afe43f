//! The prefix index of the `kvslots indexer` service: which (worker, tier) holds which block.
//!
//! Keys are the index's own chained hash over token ids ([`BlockHasher`]: parent key, the block's
//! tokens, the LoRA identity), so the index works whatever hash algorithm or seed each engine
//! uses. Every worker also has a map from the engine's block hash to that key, because
//! `BlockRemoved` carries hashes only, and `BlockStored` names its parent by engine hash.
//!
//! Rules (each one is tested):
//! - A `BlockStored` whose parent engine hash the worker's map does not know is an *orphan*: its
//!   blocks are skipped and counted. Any block it would create is unreachable by a lookup (which
//!   starts at the root), so skipping loses no score and keeps memory for reachable blocks.
//! - A `BlockStored` without tokens (vLLM's offloading connector sends such placeholders) adds
//!   its tier to blocks the worker's map already knows; unknown ones are skipped and counted.
//! - Storing the same hash twice, or removing an unknown hash, is harmless (vLLM does both).
//!   Presence is tracked per tier and per KV-cache group (`group_idx`), so a block stays held on
//!   a tier until every group that stored it has removed it.
//! - An engine hash stored again with different content (different key) replaces the old entry.
//! - `AllBlocksCleared` carries no medium: it clears the stream's default tier for that worker.
//! - Memory is bounded: at most `capacity` (block, worker) entries; beyond that the least
//!   recently stored-or-looked-up block is evicted with all its entries.
//!
//! - Lookahead tokens (`lookahead_token_ids`, vLLM 0.33) on a device block (medium GPU) are
//!   covered by the engine's hash, so they go into the key. On a host or disk block (medium CPU
//!   / STORAGE) they are the block's recorded successor (kvslots' connector; vLLM turns lookahead
//!   hashes off whenever a KV connector is configured, so those hashes are token-only): the key
//!   stays token-only and the successor is kept for the EAGLE last-block rule (`last_block.rs`).
//!
//! Score of a worker for a prompt: walk the prompt's blocks from the first; at each block the
//! worker holds on some tier add the highest weight among the tiers it holds it on; stop at the
//! first block it holds on no tier. `blocks` is that prefix length; `tier_blocks[t]` is the
//! longest prefix held entirely on tier `t`. For a worker marked EAGLE
//! ([`PrefixIndex::set_worker_eagle`]) the last block of that prefix counts only when the engine
//! would serve it (`last_block.rs`); otherwise it leaves `blocks`, `tier_blocks` and the score.
//!
//! Layout: the [`PrefixIndex`] type and its construction are here; the rest is one concept per
//! file: `apply.rs` applies decoded events (the rules above), `lookup.rs` walks a prompt and
//! `score.rs` scores it ([`Scorer`]), `workers.rs` keeps the workers and their engine-hash maps,
//! `blocks.rs` the block slab, its LRU list and eviction to capacity, `mirror.rs` the change
//! journal and dump / load, `stats.rs` the counters, `invariants.rs` the consistency check;
//! `last_block.rs` the EAGLE last-block rule; `tier.rs`, `config.rs` and `error.rs` the small
//! public types. The events themselves are
//! decoded by [`crate::wire::decode`].

mod apply;
mod blocks;
mod config;
mod error;
mod invariants;
mod last_block;
mod lookup;
mod mirror;
mod score;
mod stats;
mod tier;
mod workers;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::hash::BlockHasher;
pub use crate::wire::decode::{lora_name_key, DecodeError, DecodedBatch, WireKind, WireMedium};
pub use config::IndexConfig;
pub use error::{IndexError, IndexResult};
pub use last_block::{holder_tiers, holder_value, serves_last, LastBlock};
pub use mirror::{Change, EngineEntryView};
pub use score::{Scorer, WorkerMatch};
pub use stats::{ApplyStats, IndexStats, TotalStats};
pub use tier::{Tier, NUM_TIERS};
pub use workers::WorkerId;

use blocks::Blocks;
use workers::Worker;

/// The in-memory prefix index. Single-threaded; callers serialize access.
#[derive(Debug)]
pub struct PrefixIndex {
    cfg: IndexConfig,
    hasher: BlockHasher,
    blocks: Blocks,
    entries: usize,
    workers: Vec<Option<Worker>>,
    names: Vec<String>, // by id, kept after removal so journal entries can name the worker
    by_name: FxHashMap<String, WorkerId>,
    batch: DecodedBatch,
    scratch_nodes: Vec<u32>,
    scratch_tokens: Vec<u32>,
    scratch_keys: Vec<u64>,
    /// Per block of the last lookahead walk: where its nodes start in `scratch_nodes`.
    scratch_starts: Vec<u32>,
    scorer: Scorer,
    dirty_engines: FxHashSet<(WorkerId, u64)>,
    dirty_holders: FxHashSet<(u64, WorkerId)>,
    evictions: u64,
    totals: TotalStats,
    /// Bit `L - 1` set once a block hashed with `L` lookahead tokens was stored (vLLM 0.33);
    /// zero keeps lookups on the plain key chain only.
    lookahead_lens: u64,
    /// Workers marked EAGLE: a lookup applies the last-block rule only when there are any.
    eagle_workers: u32,
}

impl PrefixIndex {
    pub fn new(cfg: IndexConfig) -> IndexResult<Self> {
        if cfg.capacity == Some(0) {
            return Err(IndexError::Invalid("capacity must be at least 1".into()));
        }
        if let Some(w) = cfg
            .tier_weights
            .iter()
            .find(|w| !w.is_finite() || **w < 0.0)
        {
            return Err(IndexError::Invalid(format!(
                "tier weights must be finite and >= 0, got {w}"
            )));
        }
        Ok(PrefixIndex {
            scorer: Scorer::new(cfg.tier_weights),
            blocks: Blocks::new(cfg.capacity.is_some()),
            cfg,
            hasher: BlockHasher::new(),
            entries: 0,
            workers: Vec::new(),
            names: Vec::new(),
            by_name: FxHashMap::default(),
            batch: DecodedBatch::new(),
            scratch_nodes: Vec::new(),
            scratch_tokens: Vec::new(),
            scratch_keys: Vec::new(),
            scratch_starts: Vec::new(),
            dirty_engines: FxHashSet::default(),
            dirty_holders: FxHashSet::default(),
            evictions: 0,
            totals: TotalStats::default(),
            lookahead_lens: 0,
            eagle_workers: 0,
        })
    }

    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    pub fn len(&self) -> usize {
        self.blocks.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.keys.is_empty()
    }
}

#[cfg(test)]
mod tests;
