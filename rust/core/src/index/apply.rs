//! Applying events: decoded `BlockStored` / `BlockRemoved` / `AllBlocksCleared` batches update
//! the workers' engine-hash maps and the blocks' holders (the rules are in the
//! [module docs](super)).

use super::blocks::Holder;
use super::workers::EngineEntry;
use super::{
    ApplyStats, DecodedBatch, IndexError, IndexResult, LastBlock, PrefixIndex, Tier, WireKind,
    WireMedium, WorkerId, NUM_TIERS,
};
use crate::wire::Lookahead;

#[inline]
fn group_bit(group: u64) -> u32 {
    1u32 << group.min(31) // groups beyond 31 share a bit: conservative, never over-removes
}

/// Key-chain extra for a block: the LoRA identity alone (as the slot manager hashes it), or
/// mixed with the block's extra keys (multimodal hashes, cache salt) so such blocks only ever
/// match requests carrying the same extras, never a plain token lookup.
#[inline]
pub(super) fn block_extra(lora: Option<u64>, extra: Option<u64>) -> Option<u64> {
    match extra {
        None => lora,
        Some(e) => {
            let mut b = [0u8; 17];
            b[0] = 0xE5;
            b[1..9].copy_from_slice(&lora.unwrap_or(u64::MAX).to_le_bytes());
            b[9..].copy_from_slice(&e.to_le_bytes());
            Some(xxhash_rust::xxh3::xxh3_64(&b))
        }
    }
}

/// The extra of a lookahead-hashed block (vLLM 0.33, `lookahead_token_ids`): its extra keys
/// mixed with the hash of the tokens after it, so the block only matches a prompt that goes on
/// with those tokens, as the engine's own lookahead hash only matches such a request. Also
/// computed from a prompt's tokens by the lookup.
#[inline]
pub(super) fn lookahead_extra(extra: Option<u64>, la: Option<&Lookahead>) -> Option<u64> {
    match la {
        None => extra,
        Some(l) if l.len == 0 => extra,
        Some(l) => {
            let mut b = [0u8; 21];
            b[0] = 0x1A;
            b[1..9].copy_from_slice(&extra.unwrap_or(u64::MAX).to_le_bytes());
            b[9..17].copy_from_slice(&l.hash.to_le_bytes());
            b[17..].copy_from_slice(&l.len.to_le_bytes());
            Some(xxhash_rust::xxh3::xxh3_64(&b))
        }
    }
}

/// Longest lookahead the index keeps track of (the lookup tries each length it has seen).
pub const MAX_LOOKAHEAD: u32 = 64;

impl PrefixIndex {
    /// Decodes a raw msgpack payload (one `KVEventBatch`) and applies it for `worker`.
    /// A payload that does not decode changes nothing and returns [`IndexError::Decode`].
    pub fn apply_payload(
        &mut self,
        worker: WorkerId,
        payload: &[u8],
        default_tier: Tier,
    ) -> IndexResult<ApplyStats> {
        if self.worker(worker).is_none() {
            return Err(IndexError::UnknownWorker {
                name: format!("#{worker}"),
            });
        }
        let mut batch = std::mem::take(&mut self.batch);
        let res = batch.decode(payload);
        let out = match res {
            Ok(()) => Ok(self.apply_decoded(worker, &batch, default_tier)),
            Err(e) => Err(IndexError::Decode(e.0)),
        };
        self.batch = batch;
        out
    }

    /// Applies an already decoded batch.
    pub fn apply_decoded(
        &mut self,
        worker: WorkerId,
        batch: &DecodedBatch,
        default_tier: Tier,
    ) -> ApplyStats {
        let mut st = ApplyStats::default();
        if self.worker(worker).is_none() {
            return st;
        }
        for ev in &batch.events {
            st.events += 1;
            if ev.kind == WireKind::Unknown {
                st.unknown_events += 1;
                continue;
            }
            if ev.invalid.is_some() {
                st.invalid_events += 1;
                continue;
            }
            let tier = match ev.medium {
                WireMedium::Default => default_tier,
                WireMedium::Named(t) => t,
                WireMedium::Unknown => {
                    st.unknown_medium_events += 1;
                    continue;
                }
            };
            match ev.kind {
                WireKind::Stored => self.store(
                    worker,
                    tier,
                    group_bit(ev.group),
                    ev.parent,
                    batch.event_hashes(ev),
                    batch.event_tokens(ev),
                    ev.block_size,
                    ev.lora,
                    batch.event_extras(ev),
                    batch.event_lookahead(ev),
                    &mut st,
                ),
                WireKind::Removed => {
                    for &h in batch.event_hashes(ev) {
                        if self.remove(worker, h, tier, group_bit(ev.group)) {
                            st.removed_blocks += 1;
                        } else {
                            st.unresolved_blocks += 1;
                        }
                    }
                }
                WireKind::Cleared => {
                    self.clear_tier(worker, default_tier);
                    st.cleared += 1;
                }
                WireKind::Unknown => {}
            }
        }
        let t = &mut self.totals;
        t.events += st.events;
        t.stored_blocks += st.stored_blocks;
        t.removed_blocks += st.removed_blocks;
        t.orphan_blocks += st.orphan_blocks;
        t.unresolved_blocks += st.unresolved_blocks;
        t.invalid_events += st.invalid_events + st.unknown_medium_events;
        t.unknown_events += st.unknown_events;
        st
    }

    /// Stores a run of blocks (one `BlockStored`). Public for tests and for callers that build
    /// events themselves; `apply_payload` is the fast path.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        gbit: u32,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        block_size: u64,
        lora: Option<u64>,
        extras: &[Option<u64>],
        lookahead: &[Lookahead],
        st: &mut ApplyStats,
    ) {
        let n = hashes.len();
        if n == 0 {
            return;
        }
        if tokens.is_empty() {
            // Placeholder (no tokens): only blocks this worker already has a key for.
            for &h in hashes {
                match self.add_tier(worker, h, tier, gbit) {
                    Some(node) => {
                        self.blocks.touch(node);
                        st.stored_blocks += 1;
                    }
                    None => st.unresolved_blocks += 1,
                }
            }
            return;
        }
        let bs = match usize::try_from(block_size) {
            Ok(bs) if bs > 0 && n.checked_mul(bs) == Some(tokens.len()) => bs,
            _ => {
                st.invalid_events += 1;
                return;
            }
        };
        if !extras.is_empty() && extras.len() != n {
            st.invalid_events += 1;
            return;
        }
        if !lookahead.is_empty()
            && (lookahead.len() != n || lookahead.iter().any(|l| l.len > MAX_LOOKAHEAD))
        {
            st.invalid_events += 1;
            return;
        }
        // On a host or disk tier the lookahead is the block's recorded successor, not part of
        // its hash (module docs): the key stays token-only there.
        let host = tier != Tier::Gpu;
        if !host {
            for l in lookahead {
                if l.len > 0 {
                    // The lookup tries a key chain per lookahead length seen.
                    self.lookahead_lens |= 1u64 << (l.len - 1);
                }
            }
        }
        let mut parent_key = match parent {
            None => self.cfg.hash_seed,
            Some(p) => match self.resolve(worker, p) {
                Some(k) => k,
                None => {
                    st.orphan_blocks += n as u64;
                    return;
                }
            },
        };
        let mut touched = std::mem::take(&mut self.scratch_nodes);
        let mut keys = std::mem::take(&mut self.scratch_keys);
        touched.clear();
        keys.clear();
        for (i, block) in tokens.chunks_exact(bs).enumerate() {
            let keyed = if host { None } else { lookahead.get(i) };
            let extra = block_extra(
                lora,
                lookahead_extra(extras.get(i).copied().flatten(), keyed),
            );
            parent_key = self.hasher.hash(parent_key, block, extra);
            keys.push(parent_key);
        }
        // Read-only probes of every block first: they are independent, so their cache misses
        // overlap; the inserts below then find the lines in cache.
        if let Some(w) = self.worker(worker).filter(|_| keys.len() > 1) {
            let mut warm = 0u64;
            for (&h, &key) in hashes.iter().zip(&keys) {
                warm ^= w.engines.get(&h).map_or(0, |e| u64::from(e.node));
                warm ^= self.blocks.keys.get(&key).map_or(0, |&i| u64::from(i));
            }
            std::hint::black_box(warm);
        }
        for (i, (&h, &key)) in hashes.iter().zip(&keys).enumerate() {
            let last = match lookahead.get(i) {
                None => None,
                Some(l) if host && l.len > 0 => Some(LastBlock::successor(l.first)),
                Some(_) if host => Some(LastBlock::UNKNOWN), // published: no successor
                Some(l) if l.len > 0 => Some(LastBlock::KEYED_AHEAD),
                Some(_) => None,
            };
            if let Some(node) = self.insert(worker, h, key, tier, gbit, last) {
                touched.push(node);
            }
            st.stored_blocks += 1;
        }
        self.scratch_keys = keys;
        // Most recent = first block: eviction then takes a prefix's tail before its head.
        // New blocks get linked here. A block freed later in this same event (its engine hash
        // repeated with other content) has no holders and must stay out of the list.
        for &node in touched.iter().rev() {
            if !self.blocks.nodes[node as usize].holders.is_empty() {
                self.blocks.touch(node);
            }
        }
        self.scratch_nodes = touched;
        self.enforce_capacity();
    }

    /// The key an engine hash of this worker resolves to.
    pub fn resolve(&self, worker: WorkerId, engine: u64) -> Option<u64> {
        Some(self.worker(worker)?.engines.get(&engine)?.key)
    }

    /// `last`: what the event says about the block as the last block of an EAGLE hit (`None`:
    /// nothing, an existing entry keeps what it had).
    fn insert(
        &mut self,
        worker: WorkerId,
        engine: u64,
        key: u64,
        tier: Tier,
        gbit: u32,
        last: Option<LastBlock>,
    ) -> Option<u32> {
        use std::collections::hash_map::Entry;
        let w = self.workers.get_mut(worker as usize)?.as_mut()?;
        // One probe of the engine map and one of the key map for a new block (the hot path).
        match w.engines.entry(engine) {
            Entry::Vacant(v) => {
                let node = self.blocks.node_for(key);
                self.blocks.nodes[node as usize].holders.push(Holder {
                    engine,
                    worker,
                    tiers: tier.bit(),
                });
                let mut groups = [0u32; NUM_TIERS];
                groups[tier as usize] = gbit;
                v.insert(EngineEntry {
                    key,
                    node,
                    groups,
                    last: last.unwrap_or_default(),
                });
                self.entries += 1;
                self.mark(worker, engine, key);
                Some(node)
            }
            Entry::Occupied(mut o) => {
                let e = o.get_mut();
                if e.key == key {
                    // Stored again (vLLM re-reports prefix-cache hits): usually nothing changes.
                    let was = e.groups[tier as usize];
                    e.groups[tier as usize] |= gbit;
                    let grew = was != e.groups[tier as usize];
                    let mut changed = grew;
                    if let Some(l) = last.filter(|l| *l != e.last) {
                        e.last = l;
                        changed = true;
                    }
                    let node = e.node;
                    if grew && was == 0 {
                        self.blocks
                            .set_holder_tiers(node, worker, engine, |t| t | tier.bit());
                    }
                    if changed {
                        self.mark(worker, engine, key);
                    }
                    return Some(node);
                }
                // Same engine hash, different content: the newest event wins.
                self.drop_entry(worker, engine);
                self.insert(worker, engine, key, tier, gbit, last)
            }
        }
    }

    /// Adds a tier (and group) to an existing entry; `None` if the worker has no such hash.
    fn add_tier(&mut self, worker: WorkerId, engine: u64, tier: Tier, gbit: u32) -> Option<u32> {
        let e = self.worker_mut(worker)?.engines.get_mut(&engine)?;
        let was = e.groups[tier as usize];
        e.groups[tier as usize] |= gbit;
        let (node, key) = (e.node, e.key);
        if was != e.groups[tier as usize] {
            if was == 0 {
                self.blocks
                    .set_holder_tiers(node, worker, engine, |t| t | tier.bit());
            }
            self.mark(worker, engine, key);
        }
        Some(node)
    }

    /// Removes one (tier, group) presence; `false` if the worker had no such presence.
    fn remove(&mut self, worker: WorkerId, engine: u64, tier: Tier, gbit: u32) -> bool {
        let Some(e) = self
            .worker_mut(worker)
            .and_then(|w| w.engines.get_mut(&engine))
        else {
            return false;
        };
        let was = e.groups[tier as usize];
        if was & gbit == 0 {
            return false;
        }
        e.groups[tier as usize] &= !gbit;
        let (node, key, now, all_empty) = (e.node, e.key, e.groups[tier as usize], e.tiers() == 0);
        if all_empty {
            self.drop_entry(worker, engine);
        } else {
            if now == 0 {
                self.blocks
                    .set_holder_tiers(node, worker, engine, |t| t & !tier.bit());
            }
            self.mark(worker, engine, key);
        }
        true
    }

    fn clear_tier(&mut self, worker: WorkerId, tier: Tier) {
        let hashes: Vec<u64> = match self.worker(worker) {
            Some(w) => w
                .engines
                .iter()
                .filter(|(_, e)| e.groups[tier as usize] != 0)
                .map(|(h, _)| *h)
                .collect(),
            None => return,
        };
        for h in hashes {
            let Some(e) = self.worker_mut(worker).and_then(|w| w.engines.get_mut(&h)) else {
                continue;
            };
            e.groups[tier as usize] = 0;
            let (node, key, empty) = (e.node, e.key, e.tiers() == 0);
            if empty {
                self.drop_entry(worker, h);
            } else {
                self.blocks
                    .set_holder_tiers(node, worker, h, |t| t & !tier.bit());
                self.mark(worker, h, key);
            }
        }
    }

    /// Removes a worker's engine entry entirely, and the block when nobody holds it any more.
    pub(super) fn drop_entry(&mut self, worker: WorkerId, engine: u64) {
        let Some(e) = self
            .worker_mut(worker)
            .and_then(|w| w.engines.remove(&engine))
        else {
            return;
        };
        self.entries -= 1;
        let node = e.node as usize;
        let holders = &mut self.blocks.nodes[node].holders;
        if let Some(i) = holders
            .iter()
            .position(|h| h.worker == worker && h.engine == engine)
        {
            holders.swap_remove(i);
        }
        let key = self.blocks.nodes[node].key;
        self.mark(worker, engine, key);
        if self.blocks.nodes[node].holders.is_empty() {
            self.blocks.free_node(e.node);
        }
    }
}
