//! The index's configuration: capacity, tier weights, key-chain seed, journal.

use super::NUM_TIERS;

#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Most (block, worker) entries kept; `None` = unbounded.
    pub capacity: Option<usize>,
    pub tier_weights: [f64; NUM_TIERS],
    /// Seed of the key chain (the parent of every first block).
    pub hash_seed: u64,
    /// Track changed entries for [`PrefixIndex::take_changes`](super::PrefixIndex::take_changes) (the Redis mirror needs it).
    pub journal: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            capacity: None,
            tier_weights: [1.0, 0.8, 0.5],
            hash_seed: 0,
            journal: false,
        }
    }
}
