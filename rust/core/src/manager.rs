//! The slot manager over a pool it owns: per-request calls and one batch call per engine step.
//!
//! Every public method either succeeds or returns a [`SlotError`] having changed nothing: each
//! one validates its whole input (and, for allocations, the pool's room) before it mutates.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::error::{Result, SlotError};
use crate::events::EventLog;
use crate::hash::BlockHasher;
use crate::pool::{BlockId, BlockPool};
use crate::slot::{Slot, SlotInfo};

/// A finished slot whose token buffer is larger than this is dropped rather than kept for reuse.
const MAX_SPARE_TOKENS: usize = 1 << 18;

/// The largest block size (events carry it as a u32).
pub const MAX_BLOCK_SIZE: usize = u32::MAX as usize;

/// Opaque handle of a live slot: generation in the high 32 bits, slab index in the low 32, so a
/// handle kept past `finish` is rejected instead of silently naming a newer request.
pub type SlotId = u64;

#[derive(Debug, Clone)]
pub struct ManagerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Parent hash of every request's first block.
    pub hash_seed: u64,
    pub enable_prefix_caching: bool,
    /// Limit on a slot's committed + pending tokens (vLLM's max_model_len); `None`: no limit.
    pub max_tokens_per_slot: Option<usize>,
}

impl ManagerConfig {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        ManagerConfig {
            num_blocks,
            block_size,
            hash_seed: 0,
            enable_prefix_caching: true,
            max_tokens_per_slot: None,
        }
    }
}

/// Cumulative counters (never reset).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub requests_created: u64,
    pub requests_finished: u64,
    pub prefix_hit_tokens: u64,
    pub committed_tokens: u64,
    pub committed_blocks: u64,
    pub registered_blocks: u64,
    pub rolled_back_tokens: u64,
    pub allocated_blocks: u64,
    pub released_blocks: u64,
    pub evicted_blocks: u64,
}

/// One engine step for a batch of slots: for slot `j`, commit `num_accepted[j]` tokens (taken in
/// order from `accepted_tokens`), roll back `num_rejected[j]`, optionally set the lookahead to
/// `lookahead[j]`, then reserve `num_new_tokens[j]` positions plus the lookahead.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    pub slots: &'a [SlotId],
    pub num_accepted: &'a [u32],
    pub accepted_tokens: &'a [u32],
    pub num_rejected: &'a [u32],
    pub num_new_tokens: &'a [u32],
    pub lookahead: Option<&'a [u32]>,
}

/// What a step did, per slot in input order; reused across steps to avoid allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepOutput {
    pub num_new_blocks: Vec<u32>,
    /// The newly allocated block ids of every slot, concatenated in input order.
    pub new_block_ids: Vec<BlockId>,
    pub num_committed_blocks: Vec<u32>,
}

impl StepOutput {
    pub fn clear(&mut self) {
        self.num_new_blocks.clear();
        self.new_block_ids.clear();
        self.num_committed_blocks.clear();
    }
}

#[derive(Debug, Clone)]
pub struct SlotManager {
    cfg: ManagerConfig,
    pool: BlockPool,
    slots: Vec<Option<Slot>>,
    generation: Vec<u32>,
    free_slots: Vec<u32>,
    /// Finished slots kept for their buffers, so creating a slot allocates nothing once warm.
    spare: Vec<Slot>,
    index: HashMap<String, u32, RandomState>,
    hasher: BlockHasher,
    events: EventLog,
    stats: Stats,
    // Scratch reused by every call.
    evicted: Vec<u64>,
    seen: Vec<u32>,
    epoch: u32,
    targets: Vec<usize>,
}

impl SlotManager {
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        if cfg.block_size == 0 || cfg.block_size > MAX_BLOCK_SIZE {
            return Err(SlotError::invalid(
                None,
                format!(
                    "block_size must be in [1, {MAX_BLOCK_SIZE}], got {}",
                    cfg.block_size
                ),
            ));
        }
        if cfg.num_blocks >= BlockPool::MAX_BLOCKS {
            return Err(SlotError::invalid(
                None,
                format!(
                    "num_blocks must be below {} (got {})",
                    BlockPool::MAX_BLOCKS,
                    cfg.num_blocks
                ),
            ));
        }
        if cfg.max_tokens_per_slot == Some(0) {
            return Err(SlotError::invalid(
                None,
                "max_tokens_per_slot must be at least 1",
            ));
        }
        // The pool's metadata, allocated fallibly: `num_blocks` is the caller's number.
        let pool = BlockPool::try_new(cfg.num_blocks)?;
        Ok(SlotManager {
            pool,
            events: EventLog::new(cfg.block_size as u32),
            cfg,
            slots: Vec::new(),
            generation: Vec::new(),
            free_slots: Vec::new(),
            spare: Vec::new(),
            index: HashMap::default(),
            hasher: BlockHasher::new(),
            stats: Stats::default(),
            evicted: Vec::new(),
            seen: Vec::new(),
            epoch: 0,
            targets: Vec::new(),
        })
    }

    // ---- queries -------------------------------------------------------------------------

    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    pub fn stats(&self) -> Stats {
        self.stats
    }
    pub fn num_slots(&self) -> usize {
        self.index.len()
    }
    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }
    pub fn num_held(&self) -> usize {
        self.pool.num_held()
    }
    pub fn num_cached(&self) -> usize {
        self.pool.num_cached()
    }
    /// Fraction of the pool held by slots (cached blocks count as reclaimable).
    pub fn usage(&self) -> f64 {
        if self.cfg.num_blocks == 0 {
            0.0
        } else {
            self.pool.num_held() as f64 / self.cfg.num_blocks as f64
        }
    }
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
    pub fn contains(&self, request_id: &str) -> bool {
        self.index.contains_key(request_id)
    }
    pub fn slot(&self, request_id: &str) -> Result<&Slot> {
        let i = self.index_of(request_id)?;
        Ok(self.slots[i as usize]
            .as_ref()
            .expect("indexed slot is live"))
    }
    pub fn slot_id(&self, request_id: &str) -> Result<SlotId> {
        let i = self.index_of(request_id)?;
        Ok(((self.generation[i as usize] as u64) << 32) | i as u64)
    }
    pub fn slot_info(&self, request_id: &str) -> Result<SlotInfo> {
        Ok(self.slot(request_id)?.info(self.cfg.block_size))
    }
    pub fn block_table(&self, request_id: &str) -> Result<&[BlockId]> {
        Ok(self.slot(request_id)?.blocks())
    }
    pub fn events(&self) -> &EventLog {
        &self.events
    }
    pub fn events_mut(&mut self) -> &mut EventLog {
        &mut self.events
    }

    fn index_of(&self, request_id: &str) -> Result<u32> {
        self.index
            .get(request_id)
            .copied()
            .ok_or_else(|| SlotError::UnknownRequest {
                request: request_id.to_owned(),
            })
    }

    fn resolve(&self, id: SlotId) -> Result<u32> {
        let (gen, i) = ((id >> 32) as u32, id as u32);
        match self.slots.get(i as usize) {
            Some(Some(_)) if self.generation[i as usize] == gen => Ok(i),
            _ => Err(SlotError::invalid(
                None,
                format!("slot id {id} does not name a live slot"),
            )),
        }
    }

    fn live(&mut self, i: u32) -> &mut Slot {
        self.slots[i as usize]
            .as_mut()
            .expect("resolved slot is live")
    }

    /// `tokens` is exact (a sum of three `usize` counts fits a `u128`), so a count just past
    /// `usize::MAX` is still over a limit of `usize::MAX`; a saturated sum would equal it.
    fn check_len(&self, slot: &Slot, tokens: u128) -> Result<()> {
        match self.cfg.max_tokens_per_slot {
            Some(limit) if tokens > limit as u128 => Err(SlotError::CapacityExceeded {
                request: slot.request_id.clone(),
                what: "tokens (committed + pending + new) exceed max_tokens_per_slot",
                requested: tokens,
                limit: limit as u64,
            }),
            _ => Ok(()),
        }
    }

    fn out_of_blocks(&self, request: &str, needed: u128, available: usize) -> SlotError {
        SlotError::OutOfBlocks {
            request: request.to_owned(),
            needed,
            available: available as u64,
            total: self.cfg.num_blocks as u64,
        }
    }

    // ---- per-request operations -------------------------------------------------------------

    /// Creates a slot for `prompt`. With `match_prefix`, pins the longest registered prefix of
    /// full blocks (never the whole prompt: at least one token is left to compute) and returns
    /// the matched token count; those tokens are committed, the rest of the prompt is committed
    /// by the caller after its prefill (reserve, then commit).
    pub fn create(
        &mut self,
        request_id: &str,
        prompt: &[u32],
        lookahead: usize,
        match_prefix: bool,
        extra_key: Option<u64>,
    ) -> Result<(SlotId, usize)> {
        if self.index.contains_key(request_id) {
            return Err(SlotError::DuplicateRequest {
                request: request_id.to_owned(),
            });
        }
        let mut slot = self.spare.pop().unwrap_or_default();
        slot.reset(request_id, lookahead, extra_key);
        if let Err(e) = self.check_len(&slot, prompt.len() as u128) {
            self.spare.push(slot);
            return Err(e);
        }
        let bs = self.cfg.block_size;
        if match_prefix && self.cfg.enable_prefix_caching {
            let max_blocks = prompt.len().saturating_sub(1) / bs;
            let mut parent = self.cfg.hash_seed;
            for block in prompt.chunks_exact(bs).take(max_blocks) {
                let h = self.hasher.hash(parent, block, extra_key);
                let Some(b) = self.pool.lookup(h) else { break };
                slot.blocks.push(b);
                slot.hashes.push(h);
                parent = h;
            }
            for &b in &slot.blocks {
                self.pool.pin(b);
            }
            slot.tokens
                .extend_from_slice(&prompt[..slot.blocks.len() * bs]);
        }
        let matched = slot.tokens.len();
        let i = match self.free_slots.pop() {
            Some(i) => {
                self.generation[i as usize] = self.generation[i as usize].wrapping_add(1);
                self.slots[i as usize] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.generation.push(0);
                self.seen.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(request_id.to_owned(), i);
        self.stats.requests_created += 1;
        self.stats.prefix_hit_tokens += matched as u64;
        Ok((
            ((self.generation[i as usize] as u64) << 32) | i as u64,
            matched,
        ))
    }

    /// Makes room for `new_tokens` more positions (marked pending) plus the slot's lookahead.
    /// Returns the number of blocks allocated.
    pub fn reserve(&mut self, request_id: &str, new_tokens: usize) -> Result<usize> {
        let i = self.index_of(request_id)?;
        let slot = self.slots[i as usize].as_ref().expect("live");
        // Exact counts: past usize::MAX they are still over any limit and any pool, and the
        // error reports them as the reference model does.
        let filled = slot.filled_exact(new_tokens);
        self.check_len(slot, filled)?;
        let k = slot.lookahead;
        let extra = (filled + k as u128)
            .div_ceil(self.cfg.block_size as u128)
            .saturating_sub(slot.blocks.len() as u128);
        if extra > self.pool.available() as u128 {
            return Err(self.out_of_blocks(request_id, extra, self.pool.available()));
        }
        let extra = extra as usize; // at most the pool's available count
        self.grow(i, extra);
        let slot = self.live(i);
        slot.pending += new_tokens;
        slot.reserved_lookahead = k;
        Ok(extra)
    }

    /// Commits verified tokens (at most the pending count), registering every block they fill.
    /// Returns the number of blocks that became immutable.
    pub fn commit(&mut self, request_id: &str, tokens: &[u32]) -> Result<usize> {
        let i = self.index_of(request_id)?;
        self.slots[i as usize]
            .as_ref()
            .expect("live")
            .check_commit(tokens.len())?;
        Ok(self.commit_unchecked(i, tokens))
    }

    /// Rolls back `n` rejected speculative tokens; the blocks stay as mutable capacity.
    pub fn rollback(&mut self, request_id: &str, n: usize) -> Result<()> {
        let i = self.index_of(request_id)?;
        let slot = self.live(i);
        slot.check_rollback(n)?;
        slot.pending -= n;
        self.stats.rolled_back_tokens = self.stats.rolled_back_tokens.saturating_add(n as u64);
        Ok(())
    }

    /// Sets the request's K. Growing takes effect at the next reserve; shrinking below the
    /// reserved K returns surplus mutable blocks to the free stack at once (their count).
    pub fn set_lookahead(&mut self, request_id: &str, k: usize) -> Result<usize> {
        let i = self.index_of(request_id)?;
        let bs = self.cfg.block_size;
        let slot = self.live(i);
        slot.lookahead = k;
        if k >= slot.reserved_lookahead {
            return Ok(0);
        }
        slot.reserved_lookahead = k;
        // Capacity beyond committed + pending + k is no longer promised.
        let surplus = slot.surplus_blocks(slot.tokens_needed(0, k).unwrap_or(usize::MAX), bs);
        self.shrink(i, surplus);
        Ok(surplus)
    }

    /// Ends a request: mutable blocks go to the free stack, registered immutable ones to the
    /// cache (the request's tail first, so it is evicted first).
    pub fn finish(&mut self, request_id: &str) -> Result<()> {
        let i = self.index_of(request_id)?;
        self.index.remove(request_id);
        let slot = self.slots[i as usize].take().expect("live");
        for &b in slot.blocks.iter().rev() {
            self.pool.unpin(b);
        }
        self.stats.released_blocks += slot.blocks.len() as u64;
        self.stats.requests_finished += 1;
        self.free_slots.push(i);
        if slot.tokens.capacity() <= MAX_SPARE_TOKENS {
            self.spare.push(slot);
        }
        Ok(())
    }

    /// Evicts up to `n` cached blocks (least recently used first); returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        self.evicted.clear();
        let done = self.pool.evict(n, &mut self.evicted);
        self.flush_evicted();
        done
    }

    /// Unregisters every block (cached ones become free) and queues AllBlocksCleared.
    /// Returns how many blocks were registered.
    pub fn clear_cache(&mut self) -> usize {
        let n = self.pool.clear();
        self.events.push_cleared();
        n
    }

    // ---- batch step ---------------------------------------------------------------------------

    /// Applies one engine step to many slots in one call; see [`StepInput`]. Validates the whole
    /// batch first, so a failing step changes nothing.
    pub fn step(&mut self, input: &StepInput<'_>, out: &mut StepOutput) -> Result<()> {
        out.clear();
        let n = input.slots.len();
        let lens_ok = input.num_accepted.len() == n
            && input.num_rejected.len() == n
            && input.num_new_tokens.len() == n
            && input.lookahead.map_or(true, |l| l.len() == n);
        if !lens_ok {
            return Err(SlotError::invalid(
                None,
                format!(
                    "step arrays differ in length: slots {}, num_accepted {}, num_rejected {}, \
                     num_new_tokens {}, lookahead {:?}",
                    n,
                    input.num_accepted.len(),
                    input.num_rejected.len(),
                    input.num_new_tokens.len(),
                    input.lookahead.map(<[u32]>::len)
                ),
            ));
        }
        let total_accepted: u64 = input.num_accepted.iter().map(|&a| a as u64).sum();
        if total_accepted != input.accepted_tokens.len() as u64 {
            return Err(SlotError::invalid(
                None,
                format!(
                    "num_accepted sums to {total_accepted} but accepted_tokens has {} tokens",
                    input.accepted_tokens.len()
                ),
            ));
        }

        // Pass 0: validate everything and compute each slot's block target.
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.epoch = 1;
        }
        let bs = self.cfg.block_size;
        self.targets.clear();
        let mut freed = 0usize;
        let mut needed = 0u128;
        for j in 0..n {
            let i = self.resolve(input.slots[j])? as usize;
            let slot = self.slots[i].as_ref().expect("live");
            if self.seen[i] == self.epoch {
                return Err(SlotError::invalid(
                    Some(&slot.request_id),
                    format!("slot appears twice in one step (position {j})"),
                ));
            }
            self.seen[i] = self.epoch;
            let (a, r, new) = (
                input.num_accepted[j] as usize,
                input.num_rejected[j] as usize,
                input.num_new_tokens[j] as usize,
            );
            slot.check_commit(a)?;
            if r > slot.pending - a {
                return Err(SlotError::InvalidRollback {
                    request: slot.request_id.clone(),
                    requested: r as u64,
                    pending: (slot.pending - a) as u64,
                    committed: (slot.committed() + a) as u64,
                });
            }
            let k = input.lookahead.map_or(slot.lookahead, |l| l[j] as usize);
            // r <= pending - a <= pending, so only the additions can pass usize::MAX; counted
            // exactly, such a slot is over any limit and any pool (and is never grown).
            let filled = (slot.committed() + (slot.pending - r)) as u128 + new as u128;
            self.check_len(slot, filled)?;
            let target = (filled + k as u128).div_ceil(bs as u128);
            if target < slot.blocks.len() as u128 && k < slot.reserved_lookahead {
                freed += slot.blocks.len() - target as usize;
            }
            needed += target.saturating_sub(slot.blocks.len() as u128);
            self.targets.push(usize::try_from(target).unwrap_or(usize::MAX));
        }
        // Room: shrinks happen before any allocation, so their blocks count as available.
        // When the batch does not fit, the error names the first request that overflows.
        let available = self.pool.available() + freed;
        if needed > available as u128 {
            let mut needed = 0u128;
            for j in 0..n {
                let slot = self.slots[input.slots[j] as u32 as usize]
                    .as_ref()
                    .expect("live");
                needed += self.targets[j].saturating_sub(slot.blocks.len()) as u128;
                if needed > available as u128 {
                    let request = slot.request_id.clone();
                    return Err(self.out_of_blocks(&request, needed, available));
                }
            }
        }

        // Pass 1: commit and roll back.
        let mut offset = 0;
        for j in 0..n {
            let i = input.slots[j] as u32;
            let a = input.num_accepted[j] as usize;
            let c = self.commit_unchecked(i, &input.accepted_tokens[offset..offset + a]);
            offset += a;
            out.num_committed_blocks.push(c as u32);
            let r = input.num_rejected[j] as usize;
            self.live(i).pending -= r;
            self.stats.rolled_back_tokens = self.stats.rolled_back_tokens.saturating_add(r as u64);
        }
        // Pass 2: lookahead changes and shrinks. Without new lookaheads nothing can shrink: a
        // slot's K is never below the K its capacity was reserved for outside a step.
        if let Some(l) = input.lookahead {
            for (j, &k) in l.iter().enumerate() {
                let i = input.slots[j] as u32;
                let target = self.targets[j];
                let slot = self.live(i);
                slot.lookahead = k as usize;
                if target < slot.blocks.len() && slot.lookahead < slot.reserved_lookahead {
                    let surplus = slot.blocks.len() - target;
                    self.shrink(i, surplus);
                }
            }
        } else {
            debug_assert!(input.slots.iter().all(|&id| {
                let s = self.slots[id as u32 as usize].as_ref().expect("live");
                s.lookahead >= s.reserved_lookahead
            }));
        }
        // Pass 3: reserve.
        for j in 0..n {
            let i = input.slots[j] as u32;
            let extra = self.targets[j].saturating_sub(self.live(i).blocks.len());
            self.grow(i, extra);
            let slot = self.live(i);
            // filled = committed + pending + new fitted in pass 0.
            slot.pending += input.num_new_tokens[j] as usize;
            slot.reserved_lookahead = slot.lookahead;
            out.new_block_ids
                .extend_from_slice(&slot.blocks[slot.blocks.len() - extra..]);
            out.num_new_blocks.push(extra as u32);
        }
        Ok(())
    }

    // ---- internals ----------------------------------------------------------------------------

    fn grow(&mut self, i: u32, extra: usize) {
        if extra == 0 {
            return;
        }
        self.evicted.clear();
        let slot = self.slots[i as usize].as_mut().expect("live");
        self.pool
            .allocate(extra, &mut slot.blocks, &mut self.evicted);
        self.stats.allocated_blocks += extra as u64;
        self.flush_evicted();
    }

    fn shrink(&mut self, i: u32, surplus: usize) {
        let slot = self.slots[i as usize].as_mut().expect("live");
        for _ in 0..surplus {
            let b = slot.blocks.pop().expect("surplus within block table");
            self.pool.unpin(b);
        }
        self.stats.released_blocks += surplus as u64;
    }

    fn flush_evicted(&mut self) {
        if !self.evicted.is_empty() {
            self.stats.evicted_blocks += self.evicted.len() as u64;
            self.events.push_removed(&self.evicted);
            self.evicted.clear();
        }
    }

    /// Appends tokens and registers the blocks they fill, queueing one BlockStored per run of
    /// newly registered blocks. A block whose hash another block already holds stays immutable
    /// in this slot but is not registered again (and queues no event).
    fn commit_unchecked(&mut self, i: u32, tokens: &[u32]) -> usize {
        let bs = self.cfg.block_size;
        let seed = self.cfg.hash_seed;
        let caching = self.cfg.enable_prefix_caching;
        let slot = self.slots[i as usize].as_mut().expect("live");
        let full = slot.commit_tokens(tokens, bs);
        let count = full.len();
        // Hash the chain first, starting to load each hash's index slot, then register: the
        // index is much larger than the caches, and a prompt fills dozens of blocks at once.
        for b in full.clone() {
            let parent = if b == 0 { seed } else { slot.hashes[b - 1] };
            let h = self
                .hasher
                .hash(parent, &slot.tokens[b * bs..(b + 1) * bs], slot.extra_key);
            slot.hashes.push(h);
            if caching {
                self.pool.prefetch(h);
            }
        }
        let mut run_parent: Option<Option<u64>> = None;
        for b in full {
            let h = slot.hashes[b];
            if caching && self.pool.register(slot.blocks[b], h) {
                if run_parent.is_none() {
                    run_parent = Some((b > 0).then(|| slot.hashes[b - 1]));
                }
                self.events
                    .push_stored_block(h, &slot.tokens[b * bs..(b + 1) * bs]);
                self.stats.registered_blocks += 1;
            } else if let Some(p) = run_parent.take() {
                self.events.finish_stored(p, slot.extra_key);
            }
        }
        if let Some(p) = run_parent {
            self.events.finish_stored(p, slot.extra_key);
        }
        self.stats.committed_tokens = self
            .stats
            .committed_tokens
            .saturating_add(tokens.len() as u64);
        self.stats.committed_blocks += count as u64;
        count
    }

    /// Checks every invariant of the design against the whole state (tests and debugging).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        let bs = self.cfg.block_size;
        let mut holders = vec![0u32; self.cfg.num_blocks];
        let mut hasher = BlockHasher::new();
        for slot in self.slots.iter().flatten() {
            let rid = &slot.request_id;
            for &b in &slot.blocks {
                match holders.get_mut(b as usize) {
                    Some(h) => *h = h.saturating_add(1),
                    None => return Err(format!("{rid:?}: block {b} is outside the pool")),
                }
            }
            let info = slot.info(bs);
            let promised = info
                .committed
                .checked_add(info.pending)
                .and_then(|t| t.checked_add(info.reserved_lookahead));
            let Some(promised) = promised else {
                return Err(format!(
                    "{rid:?}: committed {} + pending {} + lookahead {} overflows",
                    info.committed, info.pending, info.reserved_lookahead
                ));
            };
            if info.capacity < promised {
                return Err(format!(
                    "{rid:?}: capacity {} < committed {} + pending {} + lookahead {}",
                    info.capacity, info.committed, info.pending, info.reserved_lookahead
                ));
            }
            if slot.hashes.len() != slot.committed() / bs {
                return Err(format!(
                    "{rid:?}: {} immutable blocks for {} committed tokens",
                    slot.hashes.len(),
                    slot.committed()
                ));
            }
            let expect = hasher.chain(self.cfg.hash_seed, &slot.tokens, bs, slot.extra_key);
            if expect != slot.hashes {
                return Err(format!(
                    "{rid:?}: immutable block hashes differ from their tokens"
                ));
            }
            for (j, &b) in slot.blocks.iter().enumerate() {
                if let Some(h) = self.pool.registered_hash(b) {
                    if j >= slot.hashes.len() || slot.hashes[j] != h {
                        return Err(format!("{rid:?}: block {b} at {j} is registered but not full of its committed tokens"));
                    }
                }
            }
            if slot.blocks[slot.hashes.len()..]
                .iter()
                .any(|&b| self.pool.refcount(b) != 1)
            {
                return Err(format!("{rid:?}: a mutable block is shared"));
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            if self.pool.refcount(b as u32) != h {
                return Err(format!(
                    "block {b}: refcount {} but {h} holders",
                    self.pool.refcount(b as u32)
                ));
            }
        }
        Ok(())
    }
}
