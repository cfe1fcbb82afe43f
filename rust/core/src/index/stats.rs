//! Counters: what one `apply` did, and the index's running totals and sizes.

use super::PrefixIndex;

/// What one `apply` did. Skipped events never abort the batch; they are counted here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub events: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    /// Stored blocks whose parent hash this worker does not know.
    pub orphan_blocks: u64,
    /// Token-less stored blocks (placeholders) and removals of hashes the worker's map lacks.
    pub unresolved_blocks: u64,
    /// Events with a field of the wrong type, or token count != blocks x block_size.
    pub invalid_events: u64,
    pub unknown_events: u64,
    pub unknown_medium_events: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub keys: usize,
    pub entries: usize,
    pub workers: usize,
    pub evictions: u64,
    pub totals: TotalStats,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TotalStats {
    pub events: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub orphan_blocks: u64,
    pub unresolved_blocks: u64,
    pub invalid_events: u64,
    pub unknown_events: u64,
    pub lookups: u64,
    pub lookup_blocks: u64,
}

impl PrefixIndex {
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            keys: self.blocks.keys.len(),
            entries: self.entries,
            workers: self.by_name.len(),
            evictions: self.evictions,
            totals: self.totals,
        }
    }
}
