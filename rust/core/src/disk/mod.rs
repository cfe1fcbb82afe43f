//! The disk tier under the host tier: bookkeeping ([`DiskIndex`]) and storage ([`file`]).
//!
//! [`DiskIndex`] is pure bookkeeping, like [`crate::HostCache`]: `num_slots` fixed-size block
//! slots of one preallocated file, keyed by the same external (vLLM) block hashes, with an LRU
//! of stored slots, pins for reads under way, the successor token of each block (the EAGLE
//! last-block rule, see `cache.rs`) and the block's tokens and parent, so that a `BlockStored`
//! event (medium `STORAGE`) can be published when it lands on disk and again when the index is
//! rebuilt from the file after a restart. An index made to publish successors
//! ([`DiskIndex::set_publish_successors`]: the connector with the EAGLE block drop) puts each
//! block's recorded successor in those events (vLLM 0.33's `lookahead_token_ids`); a block's
//! successor is given with its write and never changes while it is on disk.
//!
//! A write is two-phase, as a host store: [`DiskIndex::begin_write`] takes a slot (evicting the
//! least recently used unpinned block: `BlockRemoved`) that is not found by lookups until
//! [`DiskIndex::complete_write`] says the background writer put the record on disk. A block
//! found on disk is read with [`DiskIndex::begin_read`] (pins) and [`DiskIndex::end_read`].
//! Moving a block up to the host tier ends with [`DiskIndex::remove`], so outside a copy a block
//! is in at most one tier.

pub mod file;
pub mod reader;

use std::collections::{BTreeMap, HashMap};

use crate::cache::NO_SUCCESSOR;
use crate::error::{Result, SlotError};
use crate::events::EventLog;

/// Everything a disk record keeps besides the block's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockMeta {
    pub hash: u64,
    pub parent: Option<u64>,
    pub lora: Option<u64>,
    /// The token after the block when its draft KV was written ([`NO_SUCCESSOR`]: unknown).
    pub successor: u32,
    /// `block_size` tokens.
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub lookups: u64,
    pub hit_blocks: u64,
    pub writes_started: u64,
    pub writes_completed: u64,
    pub writes_failed: u64,
    /// Spills not taken: every slot writing or pinned.
    pub writes_skipped_full: u64,
    pub reads_started: u64,
    pub read_blocks: u64,
    pub evicted_blocks: u64,
    pub removed_blocks: u64,
    pub restored_blocks: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Writing,
    Stored,
}

#[derive(Debug, Clone)]
pub struct DiskIndex {
    block_size: usize,
    state: Vec<State>,
    meta: Vec<Option<BlockMeta>>,
    /// hash -> slot, for slots writing or stored.
    map: HashMap<u64, u32>,
    pins: Vec<u32>,
    /// Stored slots by last use (tick -> slot); pinned ones stay listed and are skipped.
    lru: BTreeMap<u64, u32>,
    tick_of: Vec<u64>,
    next_tick: u64,
    /// Free slots, lowest last (so a fresh file fills from slot 0 up).
    free: Vec<u32>,
    events: EventLog,
    stats: DiskStats,
}

impl DiskIndex {
    /// The largest number of slots (slot ids are u32).
    pub const MAX_SLOTS: usize = u32::MAX as usize;

    pub fn new(num_slots: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 || block_size > file::MAX_BLOCK_TOKENS {
            return Err(SlotError::invalid(
                None,
                format!(
                    "block_size must be in [1, {}], got {block_size}",
                    file::MAX_BLOCK_TOKENS
                ),
            ));
        }
        if num_slots >= Self::MAX_SLOTS {
            return Err(SlotError::invalid(
                None,
                format!("num_slots must be below {}", Self::MAX_SLOTS),
            ));
        }
        // Allocated fallibly (`vec!` would abort the process): `num_slots` is the caller's.
        let no_memory = || SlotError::unallocatable("num_slots", num_slots, "the index's metadata");
        let mut free = crate::pool::try_filled(0u32, num_slots).ok_or_else(no_memory)?;
        for (i, f) in free.iter_mut().enumerate() {
            *f = (num_slots - 1 - i) as u32;
        }
        Ok(DiskIndex {
            block_size,
            state: crate::pool::try_filled(State::Free, num_slots).ok_or_else(no_memory)?,
            meta: crate::pool::try_filled(None, num_slots).ok_or_else(no_memory)?,
            map: HashMap::new(),
            pins: crate::pool::try_filled(0, num_slots).ok_or_else(no_memory)?,
            lru: BTreeMap::new(),
            tick_of: crate::pool::try_filled(0, num_slots).ok_or_else(no_memory)?,
            next_tick: 1,
            free,
            events: EventLog::new(block_size as u32),
            stats: DiskStats::default(),
        })
    }

    pub fn num_slots(&self) -> usize {
        self.state.len()
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Slots holding a stored block.
    pub fn num_stored(&self) -> usize {
        self.lru.len()
    }
    /// Slots being written.
    pub fn num_writing(&self) -> usize {
        self.map.len() - self.lru.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn stats(&self) -> DiskStats {
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

    fn stored_slot(&self, hash: u64) -> Option<u32> {
        self.map
            .get(&hash)
            .copied()
            .filter(|&s| self.state[s as usize] == State::Stored)
    }
    /// Whether `hash` is stored (a write under way does not count).
    pub fn contains(&self, hash: u64) -> bool {
        self.stored_slot(hash).is_some()
    }
    /// Whether `hash` is stored or being written.
    pub fn holds(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }
    /// The slot of a stored hash.
    pub fn lookup(&self, hash: u64) -> Option<u32> {
        self.stored_slot(hash)
    }
    /// The successor recorded with a stored block ([`NO_SUCCESSOR`] if none or not stored).
    pub fn successor(&self, hash: u64) -> u32 {
        self.stored_slot(hash)
            .and_then(|s| self.meta[s as usize].as_ref())
            .map_or(NO_SUCCESSOR, |m| m.successor)
    }
    pub fn meta(&self, slot: u32) -> Option<&BlockMeta> {
        self.meta.get(slot as usize).and_then(|m| m.as_ref())
    }

    /// Number of leading `hashes` stored on disk.
    pub fn match_prefix(&mut self, hashes: &[u64]) -> usize {
        self.stats.lookups += 1;
        let n = hashes.iter().take_while(|&&h| self.contains(h)).count();
        self.stats.hit_blocks += n as u64;
        n
    }

    fn touch(&mut self, slot: u32) {
        let s = slot as usize;
        // Tick 0: not listed (ticks given out start at 1).
        if self.tick_of[s] != 0 {
            self.lru.remove(&self.tick_of[s]);
        }
        self.tick_of[s] = self.next_tick;
        self.lru.insert(self.next_tick, slot);
        self.next_tick += 1;
    }

    fn check_meta(&self, m: &BlockMeta) -> Result<()> {
        if m.tokens.len() != self.block_size {
            return Err(SlotError::invalid(
                None,
                format!(
                    "block {:#x}: {} tokens given for a block of {}",
                    m.hash,
                    m.tokens.len(),
                    self.block_size
                ),
            ));
        }
        Ok(())
    }

    /// Takes a slot for writing `meta`'s block, evicting the least recently used unpinned block
    /// when no slot is free. None (nothing changed) when the hash is already stored or being
    /// written, or when every slot is writing or pinned.
    pub fn begin_write(&mut self, meta: BlockMeta) -> Result<Option<u32>> {
        self.check_meta(&meta)?;
        if self.map.contains_key(&meta.hash) {
            return Ok(None);
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let victim = self
                    .lru
                    .iter()
                    .find(|(_, &s)| self.pins[s as usize] == 0)
                    .map(|(&t, &s)| (t, s));
                let Some((tick, s)) = victim else {
                    self.stats.writes_skipped_full += 1;
                    return Ok(None);
                };
                self.lru.remove(&tick);
                self.tick_of[s as usize] = 0;
                let old = self.meta[s as usize].take().expect("a stored slot has meta");
                self.map.remove(&old.hash);
                self.events.push_removed(&[old.hash]);
                self.stats.evicted_blocks += 1;
                s
            }
        };
        self.state[slot as usize] = State::Writing;
        self.map.insert(meta.hash, slot);
        self.meta[slot as usize] = Some(meta);
        self.stats.writes_started += 1;
        Ok(Some(slot))
    }

    /// The writer's verdict on a slot taken by [`Self::begin_write`]: `ok` registers it (found
    /// by lookups, `BlockStored`), otherwise the slot is freed.
    pub fn complete_write(&mut self, slot: u32, ok: bool) -> Result<()> {
        if self.state.get(slot as usize) != Some(&State::Writing) {
            return Err(SlotError::invalid(
                None,
                format!("disk slot {slot} is not being written"),
            ));
        }
        if ok {
            self.state[slot as usize] = State::Stored;
            self.touch(slot);
            let m = self.meta[slot as usize].as_ref().expect("writing has meta");
            self.events
                .push_stored_block_with_successor(m.hash, &m.tokens, m.successor);
            self.events.finish_stored(m.parent, m.lora);
            self.stats.writes_completed += 1;
        } else {
            let m = self.meta[slot as usize].take().expect("writing has meta");
            self.map.remove(&m.hash);
            self.state[slot as usize] = State::Free;
            self.free.push(slot);
            self.stats.writes_failed += 1;
        }
        Ok(())
    }

    /// Pins the stored blocks of `hashes` for a read and returns their slots (most recently
    /// used now). Fails, changing nothing, if one is not stored.
    pub fn begin_read(&mut self, hashes: &[u64]) -> Result<Vec<u32>> {
        let mut slots = Vec::with_capacity(hashes.len());
        for (i, &h) in hashes.iter().enumerate() {
            match self.stored_slot(h) {
                Some(s) => slots.push(s),
                None => {
                    return Err(SlotError::invalid(
                        None,
                        format!("block {i} (hash {h:#x}) is not on disk"),
                    ))
                }
            }
        }
        for &s in &slots {
            self.pins[s as usize] += 1;
            self.touch(s);
        }
        self.stats.reads_started += 1;
        self.stats.read_blocks += slots.len() as u64;
        Ok(slots)
    }

    /// Releases the pins of a finished (or abandoned) read.
    pub fn end_read(&mut self, slots: &[u32]) -> Result<()> {
        let mut listed: HashMap<u32, u32> = HashMap::with_capacity(slots.len());
        for (i, &s) in slots.iter().enumerate() {
            let n = listed.entry(s).or_insert(0);
            *n += 1;
            if self.pins.get(s as usize).map_or(true, |&p| p < *n) {
                return Err(SlotError::invalid(
                    None,
                    format!("slots[{i}] = {s} is not pinned by a read"),
                ));
            }
        }
        for &s in slots {
            self.pins[s as usize] -= 1;
        }
        Ok(())
    }

    /// Drops a stored, unpinned block (it moved up to the host tier, or its record is corrupt):
    /// `BlockRemoved`. False, changing nothing, if it is not stored or is pinned.
    pub fn remove(&mut self, hash: u64) -> bool {
        let Some(s) = self.stored_slot(hash) else {
            return false;
        };
        if self.pins[s as usize] > 0 {
            return false;
        }
        self.free_stored(s);
        self.events.push_removed(&[hash]);
        self.stats.removed_blocks += 1;
        true
    }

    fn free_stored(&mut self, s: u32) {
        let m = self.meta[s as usize].take().expect("stored has meta");
        self.map.remove(&m.hash);
        self.lru.remove(&self.tick_of[s as usize]);
        self.tick_of[s as usize] = 0;
        self.state[s as usize] = State::Free;
        self.free.push(s);
    }

    /// Rebuilds the index from the records found in the file: `(slot, meta, seq)` with `seq`
    /// the write order. Only on an empty index. Of two records of one hash the later wins. LRU
    /// order follows the write order; each restored block is published (`BlockStored`). Returns
    /// the slots whose records were not taken (duplicates, bad slot or token count).
    pub fn restore(&mut self, mut records: Vec<(u32, BlockMeta, u64)>) -> Result<Vec<u32>> {
        if !self.map.is_empty() {
            return Err(SlotError::invalid(
                None,
                "restore needs an empty disk index",
            ));
        }
        records.sort_by_key(|r| std::cmp::Reverse(r.2));
        let mut dropped = Vec::new();
        let mut taken = Vec::new();
        for (slot, meta, seq) in records {
            let ok = (slot as usize) < self.state.len()
                && self.state[slot as usize] == State::Free
                && meta.tokens.len() == self.block_size
                && !self.map.contains_key(&meta.hash);
            if !ok {
                dropped.push(slot);
                continue;
            }
            self.state[slot as usize] = State::Stored;
            self.map.insert(meta.hash, slot);
            self.meta[slot as usize] = Some(meta);
            taken.push((seq, slot));
        }
        taken.sort_unstable();
        for &(_, slot) in &taken {
            self.touch(slot);
            let m = self.meta[slot as usize].as_ref().expect("just set");
            self.events
                .push_stored_block_with_successor(m.hash, &m.tokens, m.successor);
            self.events.finish_stored(m.parent, m.lora);
        }
        self.free = (0..self.state.len() as u32)
            .rev()
            .filter(|&s| self.state[s as usize] == State::Free)
            .collect();
        self.stats.restored_blocks += taken.len() as u64;
        Ok(dropped)
    }

    /// Drops every stored unpinned block. Returns how many. Published as one `BlockRemoved`
    /// naming them, not `AllBlocksCleared`: that event carries no medium, and a subscriber
    /// reading the host and disk tiers from one stream would clear the wrong tier.
    pub fn clear(&mut self) -> usize {
        let victims: Vec<u32> = self
            .lru
            .values()
            .copied()
            .filter(|&s| self.pins[s as usize] == 0)
            .collect();
        let mut hashes = Vec::with_capacity(victims.len());
        for &s in &victims {
            hashes.push(self.meta[s as usize].as_ref().expect("stored has meta").hash);
            self.free_stored(s);
        }
        if !hashes.is_empty() {
            self.events.push_removed(&hashes);
            self.stats.removed_blocks += hashes.len() as u64;
        }
        victims.len()
    }

    /// The invariants: every slot is free, writing or stored exactly once; the hash map, LRU and
    /// free list agree with the slot states.
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.state.len();
        let free = self.state.iter().filter(|&&s| s == State::Free).count();
        let stored = self.state.iter().filter(|&&s| s == State::Stored).count();
        if free != self.free.len() {
            return Err(format!("{free} free slots, {} listed free", self.free.len()));
        }
        if stored != self.lru.len() {
            return Err(format!("{stored} stored slots, {} in the LRU", self.lru.len()));
        }
        if n - free != self.map.len() {
            return Err(format!("{} busy slots, {} hashes", n - free, self.map.len()));
        }
        for (&h, &s) in &self.map {
            let m = self.meta[s as usize].as_ref().ok_or("busy slot without meta")?;
            if m.hash != h {
                return Err(format!("slot {s} maps {h:#x} but holds {:#x}", m.hash));
            }
        }
        for &s in &self.free {
            if self.state[s as usize] != State::Free || self.pins[s as usize] != 0 {
                return Err(format!("slot {s} listed free but busy or pinned"));
            }
        }
        for (&t, &s) in &self.lru {
            if self.tick_of[s as usize] != t || self.state[s as usize] != State::Stored {
                return Err(format!("LRU entry {t} -> {s} is stale"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
