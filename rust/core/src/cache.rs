//! The host-memory tier: a pool of host blocks keyed by externally computed block hashes (vLLM's
//! own, so host-tier events carry the same keys as vLLM's device-tier events).
//!
//! A store is two-phase: [`HostCache::begin_store`] takes (possibly evicting) a host block that
//! stays unregistered while the copy runs, and [`HostCache::complete_store`] registers it and
//! queues `BlockStored` once every worker has copied. A block is therefore never found by a
//! lookup before its bytes are in place. Loads pin their source blocks until they finish.
//!
//! Successors. For EAGLE-family drafters the draft KV at a block's last position depends on the
//! token that follows the block. A store run may record, per block, that following token (the
//! *successor*) when the block's stored draft KV was written with it; [`HostCache::successor`]
//! reads it back, so that the last block of a hit is served only to a request whose next token
//! is the same ([`NO_SUCCESSOR`]: unknown, never served as a last block). A cache made to
//! publish them ([`HostCache::set_publish_successors`]: the connector with the EAGLE block drop)
//! puts each block's successor in its `BlockStored` (vLLM 0.33's `lookahead_token_ids`). The
//! successor is fixed when the store completes (a store begun resets it, completing it sets it,
//! the event is queued then), so the event carries the value lookups use.

use std::collections::{BTreeMap, HashMap};

use crate::error::{Result, SlotError};
use crate::events::EventLog;
use crate::pool::{BlockId, BlockPool};

/// The successor of a block whose draft KV at its last position is unknown or was written with
/// a token that is not the block's real successor.
pub const NO_SUCCESSOR: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub lookups: u64,
    pub hit_blocks: u64,
    pub stores_started: u64,
    pub stores_completed: u64,
    pub stores_aborted: u64,
    pub stores_skipped_full: u64,
    pub loads_started: u64,
    pub evicted_blocks: u64,
}

#[derive(Debug, Clone)]
pub struct HostCache {
    pool: BlockPool,
    block_size: usize,
    events: EventLog,
    /// Stores under way: hash -> (host block, the step whose run owns it, if any). A store
    /// owned by a step run is completed or aborted by `complete_step` only.
    storing: HashMap<u64, (BlockId, Option<u64>), foldhash::fast::RandomState>,
    /// Store runs by the step that copies them, completed together by `complete_step`.
    runs: BTreeMap<u64, Vec<StoreRun>>,
    /// Completed runs whose buffers new runs reuse (at most [`SPARE_RUNS`]).
    spare_runs: Vec<StoreRun>,
    evicted: Vec<u64>,
    /// Per host block: the successor recorded when it was registered, bitwise negated so that
    /// the zeroed array is [`NO_SUCCESSOR`] everywhere (lazily zeroed pages, like the pool's:
    /// filling it made a cache of 2**31 blocks touch 8 GiB at construction). See [`Self::succ_of`].
    succ: Vec<u32>,
    stats: CacheStats,
    /// The disk tier's hook (None: off): what a block evicted from here needs to be spilled.
    spill: Option<Spill>,
}

/// Per host block, its chain parent, LoRA id and tokens (kept only with a disk tier below), and
/// the blocks evicted since the last [`HostCache::take_spills`].
#[derive(Debug, Clone, Default)]
struct Spill {
    parent: Vec<Option<u64>>,
    lora: Vec<Option<u64>>,
    tokens: Vec<u32>,
    evicted: Vec<(BlockId, crate::disk::BlockMeta)>,
    /// Hashes registered since the last [`HostCache::take_registered`]: the disk tier drops
    /// its copy of a block that entered this tier (a block lives in one tier at a time).
    registered: Vec<u64>,
}

/// Store runs up to this many blocks are checked without building hash sets.
const SMALL_RUN: usize = 8;

/// Completed store runs kept for reuse.
const SPARE_RUNS: usize = 4096;

/// Contiguous blocks of one request stored in one step, completed as one `BlockStored`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StoreRun {
    stores: Vec<PendingStore>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    lora_id: Option<u64>,
    /// Per block of `stores`: its successor, registered with it.
    succ: Vec<u32>,
}

/// A block of one request being stored: the hash it will be registered under and the host
/// block holding its copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingStore {
    pub hash: u64,
    pub block: BlockId,
}

impl HostCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 || block_size > crate::manager::MAX_BLOCK_SIZE {
            return Err(SlotError::invalid(
                None,
                format!(
                    "block_size must be in [1, {}], got {block_size}",
                    crate::manager::MAX_BLOCK_SIZE
                ),
            ));
        }
        if num_blocks >= BlockPool::MAX_BLOCKS {
            return Err(SlotError::invalid(
                None,
                format!("num_blocks must be below {}", BlockPool::MAX_BLOCKS),
            ));
        }
        let no_memory =
            || SlotError::unallocatable("num_blocks", num_blocks, "the cache's metadata");
        Ok(HostCache {
            pool: BlockPool::try_new(num_blocks)?,
            block_size,
            events: EventLog::new(block_size as u32),
            storing: HashMap::default(),
            runs: BTreeMap::new(),
            spare_runs: Vec::new(),
            evicted: Vec::new(),
            succ: crate::pool::try_zeroed(num_blocks).ok_or_else(no_memory)?,
            stats: CacheStats::default(),
            spill: None,
        })
    }

    fn succ_of(&self, block: BlockId) -> u32 {
        !self.succ[block as usize]
    }
    fn set_succ(&mut self, block: BlockId, succ: u32) {
        self.succ[block as usize] = !succ;
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn stats(&self) -> CacheStats {
        self.stats
    }
    pub fn events(&self) -> &EventLog {
        &self.events
    }
    pub fn events_mut(&mut self) -> &mut EventLog {
        &mut self.events
    }
    /// Whether `BlockStored` events carry each block's successor (see the module docs).
    pub fn set_publish_successors(&mut self, on: bool) {
        self.events.set_successors(on);
    }
    pub fn publishes_successors(&self) -> bool {
        self.events.successors()
    }
    pub fn contains(&self, hash: u64) -> bool {
        self.pool.lookup(hash).is_some()
    }
    pub fn num_storing(&self) -> usize {
        self.storing.len()
    }

    /// The successor recorded with the cached block of `hash` ([`NO_SUCCESSOR`] if none, or if
    /// the hash is not cached).
    pub fn successor(&self, hash: u64) -> u32 {
        match self.pool.lookup(hash) {
            Some(b) => self.succ_of(b),
            None => NO_SUCCESSOR,
        }
    }

    /// Number of leading `hashes` whose blocks are complete in the cache.
    pub fn match_prefix(&mut self, hashes: &[u64]) -> usize {
        self.stats.lookups += 1;
        let n = hashes
            .iter()
            .take_while(|&&h| self.pool.lookup(h).is_some())
            .count();
        self.stats.hit_blocks += n as u64;
        n
    }

    /// Pins the blocks of `hashes` for a load and returns their host block ids. Fails, changing
    /// nothing, if any of them is not cached (evicted since the match).
    pub fn begin_load(&mut self, request: &str, hashes: &[u64]) -> Result<Vec<BlockId>> {
        let mut blocks = Vec::with_capacity(hashes.len());
        for (i, &h) in hashes.iter().enumerate() {
            match self.pool.lookup(h) {
                Some(b) => blocks.push(b),
                None => {
                    return Err(SlotError::invalid(
                        Some(request),
                        format!("block {i} (hash {h:#x}) is no longer in the host cache"),
                    ))
                }
            }
        }
        for &b in &blocks {
            self.pool.pin(b);
        }
        self.stats.loads_started += 1;
        Ok(blocks)
    }

    /// Releases the pins of a finished (or abandoned) load.
    pub fn end_load(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.check_held(blocks)?;
        for &b in blocks {
            self.pool.unpin(b);
        }
        Ok(())
    }

    /// Takes host blocks for the `hashes` not cached and not already being stored, in order,
    /// evicting least recently used cached blocks when the free stack is empty. Stops (best
    /// effort) when nothing more can be taken. Returns (index into `hashes`, pending store).
    pub fn begin_store(&mut self, hashes: &[u64]) -> Vec<(usize, PendingStore)> {
        let mut out = Vec::new();
        let mut one = Vec::with_capacity(1);
        for (i, &h) in hashes.iter().enumerate() {
            if self.pool.lookup(h).is_some() || self.storing.contains_key(&h) {
                continue;
            }
            if self.pool.available() == 0 {
                self.stats.stores_skipped_full += (hashes.len() - i) as u64;
                break;
            }
            one.clear();
            let before = self.evicted.len();
            self.pool.allocate(1, &mut one, &mut self.evicted);
            if self.evicted.len() > before {
                self.note_spill(one[0], self.evicted[before]);
            }
            self.set_succ(one[0], NO_SUCCESSOR);
            self.storing.insert(h, (one[0], None));
            out.push((
                i,
                PendingStore {
                    hash: h,
                    block: one[0],
                },
            ));
        }
        // Hand the rows out in ascending order along the chain: a later load of these blocks
        // then reads runs of adjacent host rows, one copy per run (eviction leaves the rows of
        // a store scattered in LRU order).
        if out.windows(2).any(|w| w[0].1.block > w[1].1.block) {
            let mut rows: Vec<BlockId> = out.iter().map(|(_, p)| p.block).collect();
            rows.sort_unstable();
            for ((_, p), b) in out.iter_mut().zip(rows) {
                p.block = b;
                self.storing.insert(p.hash, (b, None));
            }
        }
        self.stats.stores_started += out.len() as u64;
        self.flush_evicted();
        out
    }

    /// Registers copied blocks (a contiguous run of one request's blocks, in chain order) and
    /// queues one `BlockStored`; `token_ids` holds `block_size` tokens per block.
    pub fn complete_store(
        &mut self,
        stores: &[PendingStore],
        parent: Option<u64>,
        token_ids: &[u32],
        lora_id: Option<u64>,
    ) -> Result<()> {
        self.check_tokens(token_ids.len(), stores.len())?;
        self.check_storing(stores, None)?;
        self.complete_checked(stores, parent, token_ids, lora_id, None);
        Ok(())
    }

    /// [`Self::complete_store`] with each block's successor (`successors[i]` for `stores[i]`,
    /// [`NO_SUCCESSOR`] where unknown): a block promoted from the disk tier keeps the successor
    /// its record carried, so the EAGLE last-block rule serves it as before.
    pub fn complete_store_with_successors(
        &mut self,
        stores: &[PendingStore],
        parent: Option<u64>,
        token_ids: &[u32],
        lora_id: Option<u64>,
        successors: &[u32],
    ) -> Result<()> {
        if successors.len() != stores.len() {
            return Err(SlotError::invalid(
                None,
                format!("{} successors given for {} blocks", successors.len(), stores.len()),
            ));
        }
        self.check_tokens(token_ids.len(), stores.len())?;
        self.check_storing(stores, None)?;
        self.complete_checked(stores, parent, token_ids, lora_id, Some(successors));
        Ok(())
    }

    /// `token_ids` holds `block_size` tokens per block, or the error naming the counts.
    fn check_tokens(&self, tokens: usize, blocks: usize) -> Result<()> {
        if blocks.checked_mul(self.block_size) != Some(tokens) {
            return Err(SlotError::invalid(
                None,
                format!(
                    "{tokens} tokens given for {blocks} blocks of {}",
                    self.block_size
                ),
            ));
        }
        Ok(())
    }

    /// `complete_store` once validated; `successors` (one per store, or none known) are
    /// recorded with the blocks registered, before their `BlockStored` is queued.
    fn complete_checked(
        &mut self,
        stores: &[PendingStore],
        parent: Option<u64>,
        token_ids: &[u32],
        lora_id: Option<u64>,
        successors: Option<&[u32]>,
    ) {
        let mut run_parent = None;
        for (j, s) in stores.iter().enumerate() {
            self.storing.remove(&s.hash);
            let tokens = &token_ids[j * self.block_size..(j + 1) * self.block_size];
            if self.pool.register(s.block, s.hash) {
                // Only where this store's block is the one registered under the hash.
                let succ = successors.map_or(NO_SUCCESSOR, |v| v[j]);
                self.set_succ(s.block, succ);
                if run_parent.is_none() {
                    run_parent = Some(if j == 0 {
                        parent
                    } else {
                        Some(stores[j - 1].hash)
                    });
                }
                self.events
                    .push_stored_block_with_successor(s.hash, tokens, succ);
                if let Some(sp) = &mut self.spill {
                    sp.registered.push(s.hash);
                }
            } else if let Some(p) = run_parent.take() {
                self.events.finish_stored(p, lora_id);
            }
            self.pool.unpin(s.block);
            if let Some(sp) = &mut self.spill {
                let b = s.block as usize;
                sp.parent[b] = if j == 0 { parent } else { Some(stores[j - 1].hash) };
                sp.lora[b] = lora_id;
                sp.tokens[b * self.block_size..(b + 1) * self.block_size].copy_from_slice(tokens);
            }
        }
        if let Some(p) = run_parent {
            self.events.finish_stored(p, lora_id);
        }
        self.stats.stores_completed += stores.len() as u64;
    }

    /// Begins storing a request's blocks `hashes` (chain order; `parent` is the hash before the
    /// first, `token_ids` holds `block_size` tokens per block) as part of `step`. Blocks already
    /// cached or being stored are skipped. Returns (index into `hashes`, host block) per block
    /// taken; the runs are completed or aborted with the whole step.
    pub fn begin_store_run(
        &mut self,
        step: u64,
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        lora_id: Option<u64>,
    ) -> Result<Vec<(usize, BlockId)>> {
        let mut out = Vec::new();
        self.begin_store_run_into(step, hashes, parent, token_ids, lora_id, None, &mut out)?;
        Ok(out)
    }

    /// [`Self::begin_store_run`] with each block's successor (`successors[i]` for `hashes[i]`,
    /// [`NO_SUCCESSOR`] where unknown; `None`: none known), appending (index, host block) to
    /// `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn begin_store_run_into(
        &mut self,
        step: u64,
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        lora_id: Option<u64>,
        successors: Option<&[u32]>,
        out: &mut Vec<(usize, BlockId)>,
    ) -> Result<()> {
        self.check_tokens(token_ids.len(), hashes.len())?;
        if let Some(s) = successors {
            if s.len() != hashes.len() {
                return Err(SlotError::invalid(
                    None,
                    format!("{} successors given for {} blocks", s.len(), hashes.len()),
                ));
            }
        }
        let started = self.begin_store(hashes);
        for (_, p) in &started {
            self.storing.insert(p.hash, (p.block, Some(step)));
        }
        let bs = self.block_size;
        let runs = self.runs.entry(step).or_default();
        let mut prev: Option<usize> = None;
        for &(i, p) in &started {
            if prev.map_or(true, |q| q + 1 != i) {
                let parent = if i == 0 { parent } else { Some(hashes[i - 1]) };
                // A completed run's buffers when there is one: no allocation per run.
                let run = match self.spare_runs.pop() {
                    Some(mut r) => {
                        r.stores.clear();
                        r.token_ids.clear();
                        r.succ.clear();
                        r.parent = parent;
                        r.lora_id = lora_id;
                        r
                    }
                    None => StoreRun {
                        stores: Vec::new(),
                        parent,
                        token_ids: Vec::new(),
                        lora_id,
                        succ: Vec::new(),
                    },
                };
                runs.push(run);
            }
            let run = runs.last_mut().expect("pushed above");
            run.stores.push(p);
            run.token_ids
                .extend_from_slice(&token_ids[i * bs..(i + 1) * bs]);
            run.succ.push(successors.map_or(NO_SUCCESSOR, |s| s[i]));
            prev = Some(i);
        }
        if runs.is_empty() {
            self.runs.remove(&step);
        }
        out.extend(started.into_iter().map(|(i, p)| (i, p.block)));
        Ok(())
    }

    /// Completes every store run of `step`: registers and publishes them, except runs with a
    /// block in `failed_blocks`, which are aborted. Returns the number of blocks registered.
    pub fn complete_step(&mut self, step: u64, failed_blocks: &[BlockId]) -> Result<usize> {
        let Some(runs) = self.runs.get(&step) else {
            return Ok(0);
        };
        // Validate every run before touching any (they are the cache's own, so this holds
        // unless the cache is corrupt), then apply them all.
        for run in runs {
            self.check_storing(&run.stores, Some(step))?;
        }
        let runs = self.runs.remove(&step).expect("checked above");
        let failed: std::collections::HashSet<BlockId> = failed_blocks.iter().copied().collect();
        let any_failed = !failed.is_empty();
        let mut done = 0;
        for run in &runs {
            if any_failed && run.stores.iter().any(|s| failed.contains(&s.block)) {
                self.abort_checked(&run.stores);
            } else {
                self.complete_checked(
                    &run.stores,
                    run.parent,
                    &run.token_ids,
                    run.lora_id,
                    Some(&run.succ),
                );
                done += run.stores.len();
            }
        }
        // Kept for the next steps' runs (bounded: a step rarely has more runs than requests).
        let room = SPARE_RUNS.saturating_sub(self.spare_runs.len());
        self.spare_runs.extend(runs.into_iter().take(room));
        Ok(done)
    }

    /// Steps with store runs not yet completed.
    pub fn pending_steps(&self) -> usize {
        self.runs.len()
    }

    /// Gives back the blocks of stores that failed or were cancelled.
    pub fn abort_store(&mut self, stores: &[PendingStore]) -> Result<()> {
        self.check_storing(stores, None)?;
        self.abort_checked(stores);
        Ok(())
    }

    fn abort_checked(&mut self, stores: &[PendingStore]) {
        for s in stores {
            self.storing.remove(&s.hash);
            self.pool.unpin(s.block);
        }
        self.stats.stores_aborted += stores.len() as u64;
    }

    /// Drops every cached block (held ones are unregistered and freed when released).
    pub fn clear(&mut self) -> usize {
        let n = self.pool.clear();
        self.events.push_cleared();
        n
    }

    /// Every block is held at least as many times as it is listed (so releasing them all
    /// cannot drop a refcount below zero).
    fn check_held(&self, blocks: &[BlockId]) -> Result<()> {
        let n = self.pool.num_blocks();
        let mut listed: HashMap<BlockId, u32> = HashMap::with_capacity(blocks.len());
        for (i, &b) in blocks.iter().enumerate() {
            if b as usize >= n {
                return Err(SlotError::invalid(
                    None,
                    format!("blocks[{i}] = {b} is outside the host pool of {n} blocks"),
                ));
            }
            let times = listed.entry(b).or_insert(0);
            *times += 1;
            if *times > self.pool.refcount(b) {
                return Err(SlotError::invalid(
                    None,
                    format!(
                        "blocks[{i}] = {b}: host block {b} is listed {times} time(s) but held {}",
                        self.pool.refcount(b)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every store is under way with exactly this host block, owned by `step`'s run (or by no
    /// run), and no hash or block is listed twice.
    fn check_storing(&self, stores: &[PendingStore], step: Option<u64>) -> Result<()> {
        // A step's runs are mostly one or two blocks: those are checked by scanning, without
        // building sets (complete_step checks every run of every step).
        let small = stores.len() <= SMALL_RUN;
        let cap = if small { 0 } else { stores.len() };
        let mut hashes = std::collections::HashSet::with_capacity(cap);
        let mut blocks = std::collections::HashSet::with_capacity(cap);
        for (i, s) in stores.iter().enumerate() {
            match self.storing.get(&s.hash) {
                None => {
                    return Err(SlotError::invalid(
                        None,
                        format!("stores[{i}]: no store of hash {:#x} is under way", s.hash),
                    ))
                }
                Some(&(b, _)) if b != s.block => {
                    return Err(SlotError::invalid(
                        None,
                        format!(
                            "stores[{i}]: hash {:#x} is being stored in host block {b}, not {}",
                            s.hash, s.block
                        ),
                    ))
                }
                Some(&(_, owner)) if owner != step => {
                    return Err(SlotError::invalid(
                        None,
                        format!(
                            "stores[{i}]: hash {:#x} belongs to the store runs of step {}; \
                             complete_step completes or aborts it",
                            s.hash,
                            owner.map_or("?".into(), |o| o.to_string())
                        ),
                    ))
                }
                Some(_) => {}
            }
            let repeated = if small {
                stores[..i].iter().any(|p| p.hash == s.hash || p.block == s.block)
            } else {
                !hashes.insert(s.hash) || !blocks.insert(s.block)
            };
            if repeated {
                return Err(SlotError::invalid(
                    None,
                    format!(
                        "stores[{i}] = (hash {:#x}, block {}) repeats an earlier store",
                        s.hash, s.block
                    ),
                ));
            }
        }
        if small {
            // Distinct blocks (checked above): each must be in the pool and held.
            let n = self.pool.num_blocks();
            for (i, s) in stores.iter().enumerate() {
                let b = s.block;
                if b as usize >= n {
                    return Err(SlotError::invalid(
                        None,
                        format!("blocks[{i}] = {b} is outside the host pool of {n} blocks"),
                    ));
                }
                if self.pool.refcount(b) == 0 {
                    return Err(SlotError::invalid(
                        None,
                        format!("blocks[{i}] = {b}: host block {b} is listed 1 time(s) but held 0"),
                    ));
                }
            }
            return Ok(());
        }
        self.check_held(&stores.iter().map(|s| s.block).collect::<Vec<_>>())
    }

    /// Keeps, from now on, what a disk tier needs of each evicted block (its tokens, parent,
    /// LoRA id and successor): see [`Self::take_spills`].
    pub fn enable_spill(&mut self) {
        if self.spill.is_none() {
            let n = self.pool.num_blocks();
            self.spill = Some(Spill {
                parent: vec![None; n],
                lora: vec![None; n],
                tokens: vec![0; n * self.block_size],
                evicted: Vec::new(),
                registered: Vec::new(),
            });
        }
    }

    /// Blocks evicted since the last call (spill enabled): (host block, what it held). The host
    /// block's bytes stay valid until the copies of the step that reuses it run.
    pub fn take_spills(&mut self) -> Vec<(BlockId, crate::disk::BlockMeta)> {
        self.spill
            .as_mut()
            .map_or_else(Vec::new, |s| std::mem::take(&mut s.evicted))
    }

    /// Hashes registered since the last call (spill enabled; see `Spill::registered`).
    pub fn take_registered(&mut self) -> Vec<u64> {
        self.spill
            .as_mut()
            .map_or_else(Vec::new, |s| std::mem::take(&mut s.registered))
    }

    fn note_spill(&mut self, block: BlockId, hash: u64) {
        let bs = self.block_size;
        let succ = self.succ_of(block);
        if let Some(sp) = &mut self.spill {
            let b = block as usize;
            sp.evicted.push((
                block,
                crate::disk::BlockMeta {
                    hash,
                    parent: sp.parent[b],
                    lora: sp.lora[b],
                    successor: succ,
                    tokens: sp.tokens[b * bs..(b + 1) * bs].to_vec(),
                },
            ));
        }
    }

    fn flush_evicted(&mut self) {
        if !self.evicted.is_empty() {
            self.stats.evicted_blocks += self.evicted.len() as u64;
            self.events.push_removed(&self.evicted);
            self.evicted.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEvent;

    #[test]
    fn store_is_invisible_until_complete_then_evicted_lru() {
        let mut c = HostCache::new(2, 2).unwrap();
        let s = c.begin_store(&[10, 20, 30]);
        assert_eq!(s.len(), 2, "only two host blocks");
        assert_eq!(c.match_prefix(&[10]), 0, "not visible while copying");
        assert!(
            c.begin_store(&[10]).is_empty(),
            "no double store of one hash"
        );
        let stores: Vec<_> = s.iter().map(|(_, p)| *p).collect();
        c.complete_store(&stores, Some(5), &[1, 2, 3, 4], None)
            .unwrap();
        assert_eq!(c.match_prefix(&[10, 20, 30]), 2);
        let ev = c.events_mut().drain();
        assert_eq!(
            ev,
            vec![KvEvent::BlockStored {
                block_hashes: vec![10, 20],
                parent_block_hash: Some(5),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                successors: None,
            }]
        );
        let loaded = c.begin_load("r", &[10]).unwrap();
        let s = c.begin_store(&[30]);
        assert_eq!(s.len(), 1);
        assert_eq!(
            c.events_mut().drain(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![20]
            }],
            "pinned 10 survives"
        );
        c.end_load(&loaded).unwrap();
        c.abort_store(&[s[0].1]).unwrap();
        assert!(c.begin_load("r", &[30]).is_err());
        c.pool().check().unwrap();
    }

    #[test]
    fn evicted_blocks_are_handed_to_the_disk_tier_with_tokens_parent_and_successor() {
        let mut c = HostCache::new(2, 2).unwrap();
        c.enable_spill();
        c.begin_store_run_into(1, &[10, 20], Some(5), &[1, 2, 3, 4], Some(9), Some(&[3, 77]), &mut Vec::new())
            .unwrap();
        c.complete_step(1, &[]).unwrap();
        assert!(c.take_spills().is_empty());
        let got = c.begin_store(&[30]);
        let spills = c.take_spills();
        assert_eq!(spills.len(), 1);
        let (b, m) = &spills[0];
        assert_eq!(*b, got[0].1.block, "the evicted block is the one reused");
        assert_eq!(
            m,
            &crate::disk::BlockMeta { hash: 10, parent: Some(5), lora: Some(9), successor: 3, tokens: vec![1, 2] }
        );
    }

    #[test]
    fn promoted_blocks_keep_their_successor_and_are_reported_registered() {
        let mut c = HostCache::new(2, 2).unwrap();
        c.enable_spill();
        let got = c.begin_store(&[10, 20]);
        let stores: Vec<_> = got.iter().map(|g| g.1).collect();
        assert!(c.complete_store_with_successors(&stores, Some(5), &[1, 2, 3, 4], None, &[3]).is_err(), "one per block");
        assert_eq!(c.match_prefix(&[10]), 0, "nothing registered by the refused call");
        c.complete_store_with_successors(&stores, Some(5), &[1, 2, 3, 4], None, &[3, NO_SUCCESSOR]).unwrap();
        assert_eq!((c.successor(10), c.successor(20)), (3, NO_SUCCESSOR));
        assert_eq!(c.take_registered(), vec![10, 20]);
        assert!(c.take_registered().is_empty());
        // An aborted promotion registers nothing and frees its block.
        let got = c.begin_store(&[30]);
        c.abort_store(&[got[0].1]).unwrap();
        assert!(c.take_registered().is_empty() && !c.contains(30));
    }

    fn stored_successors(c: &mut HostCache) -> Vec<(Vec<u64>, Option<Vec<u32>>)> {
        c.events_mut()
            .drain()
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    successors,
                    ..
                } => Some((block_hashes, successors)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn published_successors_are_the_ones_fixed_when_the_store_completes() {
        let mut c = HostCache::new(2, 1).unwrap();
        c.set_publish_successors(true);
        assert!(c.publishes_successors());
        // A step run with successors: its event carries them, as lookups see them.
        c.begin_store_run_into(1, &[10, 20], None, &[1, 2], None, Some(&[2, NO_SUCCESSOR]), &mut Vec::new())
            .unwrap();
        assert!(stored_successors(&mut c).is_empty(), "nothing before the store completes");
        c.complete_step(1, &[]).unwrap();
        assert_eq!((c.successor(10), c.successor(20)), (2, NO_SUCCESSOR));
        assert_eq!(stored_successors(&mut c), vec![(vec![10, 20], Some(vec![2, NO_SUCCESSOR]))]);
        // 10 is evicted and stored again without a successor: the new event says none.
        let got = c.begin_store(&[30]);
        c.complete_store(&[got[0].1], Some(20), &[3], None).unwrap();
        let ev = c.begin_store(&[10]);
        assert_eq!(c.successor(10), NO_SUCCESSOR);
        c.complete_store(&[ev[0].1], None, &[1], None).unwrap();
        assert_eq!(c.successor(10), NO_SUCCESSOR);
        assert_eq!(
            stored_successors(&mut c),
            vec![(vec![30], Some(vec![NO_SUCCESSOR])), (vec![10], Some(vec![NO_SUCCESSOR]))]
        );
        // Promoted blocks: the successors given, published with them.
        let mut c = HostCache::new(3, 1).unwrap();
        c.set_publish_successors(true);
        let got = c.begin_store(&[1, 2, 3]);
        let stores: Vec<_> = got.iter().map(|g| g.1).collect();
        assert!(c.complete_store_with_successors(&stores, None, &[5, 6, 7], None, &[6]).is_err());
        assert!(stored_successors(&mut c).is_empty(), "a refused call queues nothing");
        c.complete_store_with_successors(&stores, None, &[5, 6, 7], None, &[6, NO_SUCCESSOR, 0])
            .unwrap();
        assert_eq!(stored_successors(&mut c), vec![(vec![1, 2, 3], Some(vec![6, NO_SUCCESSOR, 0]))]);
        assert_eq!(c.successor(3), 0);
        // Off (the default): no successors in the events, the successors still recorded.
        let mut c = HostCache::new(2, 1).unwrap();
        c.begin_store_run_into(1, &[10], None, &[1], None, Some(&[2]), &mut Vec::new())
            .unwrap();
        c.complete_step(1, &[]).unwrap();
        assert_eq!(c.successor(10), 2);
        assert_eq!(stored_successors(&mut c), vec![(vec![10], None)]);
    }

    #[test]
    fn step_runs_complete_together_and_failed_runs_abort() {
        let mut c = HostCache::new(8, 1).unwrap();
        assert!(
            c.begin_store_run(1, &[1, 2], None, &[7], None).is_err(),
            "token count checked"
        );
        let a = c
            .begin_store_run(1, &[1, 2, 3], None, &[10, 20, 30], None)
            .unwrap();
        assert_eq!(a.len(), 3);
        // Block 2 is already being stored: this run splits around it.
        let b = c
            .begin_store_run(1, &[4, 2, 5], Some(9), &[40, 20, 50], Some(3))
            .unwrap();
        assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 2]);
        let failed = b[1].1;
        assert_eq!(c.match_prefix(&[1]), 0);
        assert_eq!(c.complete_step(1, &[failed]).unwrap(), 4);
        assert_eq!(c.match_prefix(&[1, 2, 3]), 3);
        assert!(c.contains(4) && !c.contains(5));
        let ev = c.events_mut().drain();
        assert_eq!(ev.len(), 2);
        assert_eq!(
            ev[1],
            KvEvent::BlockStored {
                block_hashes: vec![4],
                parent_block_hash: Some(9),
                token_ids: vec![40],
                block_size: 1,
                lora_id: Some(3),
                successors: None,
            }
        );
        assert_eq!(c.pending_steps(), 0);
        assert_eq!(c.num_storing(), 0);
        c.pool().check().unwrap();
    }

    #[test]
    fn a_store_takes_its_rows_in_ascending_order_along_the_chain() {
        // A store that takes free rows and evicted ones (in LRU order) still gives the chain
        // ascending rows.
        let mut c = HostCache::new(6, 1).unwrap();
        c.begin_store_run(1, &[1, 2, 3, 4], None, &[0; 4], None).unwrap();
        c.complete_step(1, &[]).unwrap();
        let rows = c.begin_load("r", &[1, 2]).unwrap();
        c.end_load(&rows).unwrap();
        // Free rows 4, 5; LRU 2, 3 (hashes 3, 4), then 0, 1.
        let got = c.begin_store(&[7, 8, 9, 10]);
        let rows: Vec<BlockId> = got.iter().map(|(_, p)| p.block).collect();
        assert_eq!(rows, vec![2, 3, 4, 5]);
        assert_eq!(got.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        for (_, p) in &got {
            assert_eq!(c.storing[&p.hash].0, p.block, "the pending store follows the row");
        }
        c.complete_store(&got.iter().map(|(_, p)| *p).collect::<Vec<_>>(), None, &[0; 4], None)
            .unwrap();
        assert_eq!(c.begin_load("s", &[7, 8, 9, 10]).unwrap(), vec![2, 3, 4, 5]);
        c.pool().check().unwrap();
    }
}
