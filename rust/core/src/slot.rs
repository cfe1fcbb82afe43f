//! One request's slot: the pure accounting shared by the owned-pool [`crate::SlotManager`] and
//! the [`crate::SlotTracker`] over externally owned (vLLM device) block ids.
//!
//! Positions `0..committed` hold verified tokens (their KV computed). The next `pending`
//! positions hold KV written for unverified speculative tokens. Capacity (`blocks * block_size`)
//! covers `committed + pending + reserved_lookahead`. Blocks `0..immutable` are full of
//! committed tokens and never change; the rest are mutable.

use crate::error::{Result, SlotError};
use crate::pool::BlockId;

#[derive(Debug, Clone, Default)]
pub struct Slot {
    pub(crate) request_id: String,
    pub(crate) extra_key: Option<u64>,
    /// Committed (verified) tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) pending: usize,
    /// The request's current K.
    pub(crate) lookahead: usize,
    /// The K the current capacity was reserved for.
    pub(crate) reserved_lookahead: usize,
    pub(crate) blocks: Vec<BlockId>,
    /// Hash of each immutable block, in order (`hashes.len()` blocks are immutable).
    pub(crate) hashes: Vec<u64>,
}

/// A read-only view of a slot's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    pub committed: usize,
    pub pending: usize,
    pub lookahead: usize,
    pub reserved_lookahead: usize,
    pub num_blocks: usize,
    pub num_immutable: usize,
    pub capacity: usize,
}

pub(crate) fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

impl Slot {
    pub fn new(request_id: &str, lookahead: usize, extra_key: Option<u64>) -> Self {
        Slot {
            request_id: request_id.to_owned(),
            extra_key,
            lookahead,
            ..Default::default()
        }
    }

    /// Makes a finished slot (or a default one) a fresh slot for another request, keeping the
    /// capacity of its buffers.
    pub(crate) fn reset(&mut self, request_id: &str, lookahead: usize, extra_key: Option<u64>) {
        self.request_id.clear();
        self.request_id.push_str(request_id);
        self.extra_key = extra_key;
        self.tokens.clear();
        self.pending = 0;
        self.lookahead = lookahead;
        self.reserved_lookahead = 0;
        self.blocks.clear();
        self.hashes.clear();
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }
    pub fn committed(&self) -> usize {
        self.tokens.len()
    }
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }
    pub fn num_immutable(&self) -> usize {
        self.hashes.len()
    }

    pub fn info(&self, block_size: usize) -> SlotInfo {
        SlotInfo {
            committed: self.committed(),
            pending: self.pending,
            lookahead: self.lookahead,
            reserved_lookahead: self.reserved_lookahead,
            num_blocks: self.blocks.len(),
            num_immutable: self.num_immutable(),
            capacity: self.blocks.len().saturating_mul(block_size),
        }
    }

    /// Tokens the slot must have room for after reserving `new_tokens` more with lookahead `k`;
    /// `None` when the count does not fit in a `usize` (no pool could hold it).
    pub fn tokens_needed(&self, new_tokens: usize, k: usize) -> Option<usize> {
        self.filled_after(new_tokens)?.checked_add(k)
    }

    /// Committed + pending + `new_tokens`, exactly (three `usize` counts cannot overflow a `u128`).
    pub fn filled_exact(&self, new_tokens: usize) -> u128 {
        self.committed() as u128 + self.pending as u128 + new_tokens as u128
    }

    /// Committed + pending tokens after `new_tokens` more are reserved (`None`: overflow).
    pub fn filled_after(&self, new_tokens: usize) -> Option<usize> {
        self.committed()
            .checked_add(self.pending)?
            .checked_add(new_tokens)
    }

    pub fn check_commit(&self, n: usize) -> Result<()> {
        if n > self.pending {
            return Err(SlotError::CapacityExceeded {
                request: self.request_id.clone(),
                what: "committed tokens exceed the pending (reserved and written) positions",
                requested: n as u128,
                limit: self.pending as u64,
            });
        }
        Ok(())
    }

    pub fn check_rollback(&self, n: usize) -> Result<()> {
        if n > self.pending {
            return Err(SlotError::InvalidRollback {
                request: self.request_id.clone(),
                requested: n as u64,
                pending: self.pending as u64,
                committed: self.committed() as u64,
            });
        }
        Ok(())
    }

    /// Appends verified tokens (already checked against `pending`) and returns the range of
    /// block indices that just became full; the caller hashes them and pushes the hashes.
    pub(crate) fn commit_tokens(
        &mut self,
        tokens: &[u32],
        block_size: usize,
    ) -> std::ops::Range<usize> {
        self.tokens.extend_from_slice(tokens);
        self.pending -= tokens.len();
        self.num_immutable()..self.committed() / block_size
    }

    /// The number of trailing mutable blocks beyond what `tokens` need.
    pub(crate) fn surplus_blocks(&self, tokens: usize, block_size: usize) -> usize {
        let keep = blocks_for(tokens, block_size).max(self.num_immutable());
        // (`tokens` saturates at usize::MAX: then no block is surplus, which is exact.)
        self.blocks.len().saturating_sub(keep)
    }
}
