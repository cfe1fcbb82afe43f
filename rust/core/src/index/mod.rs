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
//! Score of a worker for a prompt: walk the prompt's blocks from the first; at each block the
//! worker holds on some tier add the highest weight among the tiers it holds it on; stop at the
//! first block it holds on no tier. `blocks` is that prefix length; `tier_blocks[t]` is the
//! longest prefix held entirely on tier `t`.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;
use thiserror::Error;

use crate::hash::BlockHasher;
pub use crate::wire::decode::{lora_name_key, DecodeError, DecodedBatch, WireKind, WireMedium};

/// A storage tier, as named by the events' `medium` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}

pub const NUM_TIERS: usize = 3;

impl Tier {
    pub const ALL: [Tier; NUM_TIERS] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// vLLM's medium names (`GPU`, `CPU`, `STORAGE`), case-insensitively; `DISK` is STORAGE.
    pub fn parse(s: &str) -> Option<Tier> {
        if s.eq_ignore_ascii_case("GPU") {
            Some(Tier::Gpu)
        } else if s.eq_ignore_ascii_case("CPU") {
            Some(Tier::Cpu)
        } else if s.eq_ignore_ascii_case("STORAGE") || s.eq_ignore_ascii_case("DISK") {
            Some(Tier::Storage)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Storage => "STORAGE",
        }
    }

    #[inline]
    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

pub type WorkerId = u32;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum IndexError {
    /// The payload is not a KV event batch; nothing was applied.
    #[error("{0}")]
    Decode(String),
    #[error("unknown worker {name:?}")]
    UnknownWorker { name: String },
    #[error("worker {name:?} is already registered")]
    DuplicateWorker { name: String },
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub type IndexResult<T> = std::result::Result<T, IndexError>;

#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Most (block, worker) entries kept; `None` = unbounded.
    pub capacity: Option<usize>,
    pub tier_weights: [f64; NUM_TIERS],
    /// Seed of the key chain (the parent of every first block).
    pub hash_seed: u64,
    /// Track changed entries for [`PrefixIndex::take_changes`] (the Redis mirror needs it).
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

/// One worker's match for a prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerMatch {
    pub worker: WorkerId,
    /// Longest prefix (in blocks) the worker holds on any tier.
    pub blocks: u32,
    /// Longest prefix held entirely on each tier.
    pub tier_blocks: [u32; NUM_TIERS],
    pub score: f64,
}

/// The state of one engine-hash entry: the key it resolves to and, per tier, the bitmask of
/// KV-cache groups that hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineEntryView {
    pub key: u64,
    pub groups: [u32; NUM_TIERS],
}

/// A changed entry, for mirroring the index into a shared store.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// Engine hash -> key entry of a worker; `None` = deleted.
    Engine {
        worker: String,
        engine: u64,
        entry: Option<EngineEntryView>,
    },
    /// Tiers (bitmask) on which a worker holds a key; 0 = deleted.
    Holder { key: u64, worker: String, tiers: u8 },
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

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Holder {
    engine: u64,
    worker: WorkerId,
    tiers: u8,
}

/// Most blocks are held by one or two workers: keeping those holders inside the node saves a
/// pointer chase (a cache miss) per block on every lookup.
type Holders = SmallVec<[Holder; 2]>;

#[derive(Debug, Clone)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
    /// Value of `Blocks::clock` when last moved to the front; `UNLINKED` when not in the list.
    stamp: u64,
    holders: Holders,
}

const UNLINKED: u64 = u64::MAX;

#[derive(Debug, Clone, Copy)]
struct EngineEntry {
    /// The block's key, also here (not only in the node) so resolving a parent and checking a
    /// repeated store do not touch the node: one cache miss less per block.
    key: u64,
    node: u32,
    groups: [u32; NUM_TIERS],
}

impl EngineEntry {
    fn tiers(&self) -> u8 {
        let mut m = 0;
        for (t, g) in self.groups.iter().enumerate() {
            if *g != 0 {
                m |= 1 << t;
            }
        }
        m
    }
}

#[derive(Debug, Default)]
struct Worker {
    engines: FxHashMap<u64, EngineEntry>,
}

#[inline]
fn group_bit(group: u64) -> u32 {
    1u32 << group.min(31) // groups beyond 31 share a bit: conservative, never over-removes
}

/// Key-chain extra for a block: the LoRA identity alone (as the slot manager hashes it), or
/// mixed with the block's extra keys (multimodal hashes, cache salt) so such blocks only ever
/// match requests carrying the same extras, never a plain token lookup.
#[inline]
fn block_extra(lora: Option<u64>, extra: Option<u64>) -> Option<u64> {
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

/// The scoring walk, shared by the in-memory lookup and by callers that fetch holders
/// elsewhere (the Redis backend): feed the holders of each prompt block in order.
#[derive(Debug, Default, Clone)]
pub struct Scorer {
    weights: [f64; 8],
    out: Vec<WorkerMatch>,
    alive: Vec<u8>, // per entry of `out`: tiers still unbroken; 0 = the worker's prefix ended
    slot_of: FxHashMap<WorkerId, u32>,
    cur: Vec<u8>,
    started: bool,
    any_alive: bool,
}

impl Scorer {
    pub fn new(tier_weights: [f64; NUM_TIERS]) -> Self {
        let mut weights = [0.0; 8];
        for (m, w) in weights.iter_mut().enumerate() {
            *w = (0..NUM_TIERS)
                .filter(|t| m & (1 << t) != 0)
                .map(|t| tier_weights[t])
                .fold(0.0, f64::max);
        }
        Scorer {
            weights,
            ..Default::default()
        }
    }

    pub fn reset(&mut self) {
        self.out.clear();
        self.alive.clear();
        self.slot_of.clear();
        self.cur.clear();
        self.started = false;
        self.any_alive = false;
    }

    /// Whether another block can still extend some worker's prefix.
    pub fn wants_more(&self) -> bool {
        !self.started || self.any_alive
    }

    /// Feeds the holders `(worker, tiers)` of the next block (duplicates are OR-ed).
    /// Returns whether some worker's prefix still continues.
    pub fn block<I: IntoIterator<Item = (WorkerId, u8)>>(&mut self, holders: I) -> bool {
        if !self.started {
            self.started = true;
            for (w, tiers) in holders {
                if tiers == 0 {
                    continue;
                }
                match self.slot_of.get(&w) {
                    Some(&s) => self.cur[s as usize] |= tiers,
                    None => {
                        self.slot_of.insert(w, self.out.len() as u32);
                        self.out.push(WorkerMatch {
                            worker: w,
                            blocks: 0,
                            tier_blocks: [0; NUM_TIERS],
                            score: 0.0,
                        });
                        self.alive.push(0b111);
                        self.cur.push(tiers);
                    }
                }
            }
        } else {
            if !self.any_alive {
                return false;
            }
            for (w, tiers) in holders {
                if let Some(&s) = self.slot_of.get(&w) {
                    self.cur[s as usize] |= tiers;
                }
            }
        }
        let mut any = false;
        for i in 0..self.out.len() {
            let m = std::mem::take(&mut self.cur[i]) & 0b111;
            if self.alive[i] == 0 {
                continue;
            }
            if m == 0 {
                self.alive[i] = 0;
                continue;
            }
            let o = &mut self.out[i];
            o.blocks += 1;
            o.score += self.weights[m as usize];
            let still = self.alive[i] & m;
            for t in 0..NUM_TIERS {
                if still & (1 << t) != 0 {
                    o.tier_blocks[t] += 1;
                }
            }
            // Keep a nonzero marker while the any-tier prefix continues.
            self.alive[i] = still | 0b1000;
            any = true;
        }
        self.any_alive = any;
        any
    }

    pub fn results(&self) -> &[WorkerMatch] {
        &self.out
    }
}

/// The blocks: key -> slab slot, the slab, and the LRU list through it.
#[derive(Debug, Default)]
struct Blocks {
    keys: FxHashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32, // most recently used
    tail: u32,
    /// Counts moves to the front. A node moved fewer than `len / 4` moves ago is within the
    /// most recent quarter of the list and is not moved again (memcached-style bump limiting):
    /// popular blocks would otherwise pay two random neighbour writes on every store and
    /// lookup. Eviction order is thus LRU to within a quarter of the list.
    clock: u64,
    /// Keep the LRU list at all: only an index with a capacity ever evicts, and keeping the
    /// list costs several random memory writes per stored, looked-up or removed block.
    lru: bool,
}

impl Blocks {
    fn new(lru: bool) -> Self {
        Blocks {
            head: NIL,
            tail: NIL,
            lru,
            ..Default::default()
        }
    }

    /// The slot of `key`, created if missing (not yet in the LRU list: the caller links it
    /// with `touch`, once, in the order it wants). One hash probe.
    fn node_for(&mut self, key: u64) -> u32 {
        use std::collections::hash_map::Entry;
        match self.keys.entry(key) {
            Entry::Occupied(o) => *o.get(),
            Entry::Vacant(v) => {
                let i = match self.free.pop() {
                    Some(i) => {
                        let n = &mut self.nodes[i as usize];
                        n.key = key;
                        n.stamp = UNLINKED;
                        n.holders.clear();
                        i
                    }
                    None => {
                        self.nodes.push(Node {
                            key,
                            prev: NIL,
                            next: NIL,
                            stamp: UNLINKED,
                            holders: Holders::new(),
                        });
                        (self.nodes.len() - 1) as u32
                    }
                };
                v.insert(i);
                i
            }
        }
    }

    fn free_node(&mut self, i: u32) {
        if self.lru {
            self.unlink(i);
        }
        self.nodes[i as usize].stamp = UNLINKED;
        let key = self.nodes[i as usize].key;
        self.keys.remove(&key);
        self.free.push(i);
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else if self.head == i {
            self.head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else if self.tail == i {
            self.tail = prev;
        }
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = NIL;
    }

    fn link_front(nodes: &mut [Node], head: &mut u32, tail: &mut u32, i: u32) {
        let old = *head;
        {
            let n = &mut nodes[i as usize];
            n.prev = NIL;
            n.next = old;
        }
        if old != NIL {
            nodes[old as usize].prev = i;
        } else {
            *tail = i;
        }
        *head = i;
    }

    fn touch(&mut self, i: u32) {
        if !self.lru {
            return;
        }
        let stamp = self.nodes[i as usize].stamp;
        if self.head == i
            || (stamp != UNLINKED && self.clock - stamp < (self.keys.len() / 4) as u64)
        {
            return;
        }
        self.unlink(i);
        Self::link_front(&mut self.nodes, &mut self.head, &mut self.tail, i);
        self.nodes[i as usize].stamp = self.clock;
        self.clock += 1;
    }

    /// Sets the tiers of the holder `(worker, engine)` of block `i`.
    fn set_holder_tiers(&mut self, i: u32, worker: WorkerId, engine: u64, f: impl Fn(u8) -> u8) {
        if let Some(h) = self.nodes[i as usize]
            .holders
            .iter_mut()
            .find(|h| h.worker == worker && h.engine == engine)
        {
            h.tiers = f(h.tiers);
        }
    }
}

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
    scorer: Scorer,
    dirty_engines: FxHashSet<(WorkerId, u64)>,
    dirty_holders: FxHashSet<(u64, WorkerId)>,
    evictions: u64,
    totals: TotalStats,
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
            dirty_engines: FxHashSet::default(),
            dirty_holders: FxHashSet::default(),
            evictions: 0,
            totals: TotalStats::default(),
        })
    }

    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    // ---- workers ----

    pub fn add_worker(&mut self, name: &str) -> IndexResult<WorkerId> {
        if self.by_name.contains_key(name) {
            return Err(IndexError::DuplicateWorker { name: name.into() });
        }
        let id = WorkerId::try_from(self.workers.len())
            .map_err(|_| IndexError::Invalid("too many workers".into()))?;
        self.workers.push(Some(Worker::default()));
        self.names.push(name.to_owned());
        self.by_name.insert(name.to_owned(), id);
        Ok(id)
    }

    pub fn worker_id(&self, name: &str) -> IndexResult<WorkerId> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| IndexError::UnknownWorker { name: name.into() })
    }

    pub fn worker_name(&self, id: WorkerId) -> Option<&str> {
        self.names.get(id as usize).map(String::as_str)
    }

    pub fn worker_names(&self) -> impl Iterator<Item = &str> {
        self.workers
            .iter()
            .zip(&self.names)
            .filter(|(w, _)| w.is_some())
            .map(|(_, n)| n.as_str())
    }

    /// Drops every entry of the worker and forgets it.
    pub fn remove_worker(&mut self, name: &str) -> IndexResult<usize> {
        let id = self.worker_id(name)?;
        let n = self.clear_worker_id(id);
        self.workers[id as usize] = None;
        self.by_name.remove(name);
        Ok(n)
    }

    /// Drops every entry of the worker (a publisher restart, an unrecoverable gap).
    pub fn clear_worker(&mut self, name: &str) -> IndexResult<usize> {
        let id = self.worker_id(name)?;
        Ok(self.clear_worker_id(id))
    }

    fn clear_worker_id(&mut self, id: WorkerId) -> usize {
        let hashes: Vec<u64> = match self.worker(id) {
            Some(w) => w.engines.keys().copied().collect(),
            None => return 0,
        };
        for h in &hashes {
            self.drop_entry(id, *h);
        }
        hashes.len()
    }

    /// Number of engine-hash entries a worker has.
    pub fn worker_len(&self, name: &str) -> IndexResult<usize> {
        let id = self.worker_id(name)?;
        Ok(self.worker(id).map_or(0, |w| w.engines.len()))
    }

    fn worker(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.get(id as usize).and_then(Option::as_ref)
    }

    fn worker_mut(&mut self, id: WorkerId) -> Option<&mut Worker> {
        self.workers.get_mut(id as usize).and_then(Option::as_mut)
    }

    // ---- applying events ----

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
            let extra = block_extra(lora, extras.get(i).copied().flatten());
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
        for (&h, &key) in hashes.iter().zip(&keys) {
            if let Some(node) = self.insert(worker, h, key, tier, gbit) {
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

    fn insert(
        &mut self,
        worker: WorkerId,
        engine: u64,
        key: u64,
        tier: Tier,
        gbit: u32,
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
                v.insert(EngineEntry { key, node, groups });
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
                    let node = e.node;
                    if was != e.groups[tier as usize] {
                        if was == 0 {
                            self.blocks
                                .set_holder_tiers(node, worker, engine, |t| t | tier.bit());
                        }
                        self.mark(worker, engine, key);
                    }
                    return Some(node);
                }
                // Same engine hash, different content: the newest event wins.
                self.drop_entry(worker, engine);
                self.insert(worker, engine, key, tier, gbit)
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
    fn drop_entry(&mut self, worker: WorkerId, engine: u64) {
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

    // ---- nodes and LRU ----

    fn enforce_capacity(&mut self) {
        let Some(cap) = self.cfg.capacity else { return };
        // Never evict the most recent block: it is the one just stored.
        while self.entries > cap && self.blocks.tail != NIL && self.blocks.tail != self.blocks.head
        {
            self.evict(self.blocks.tail);
        }
    }

    fn evict(&mut self, i: u32) {
        let mut holders = std::mem::take(&mut self.blocks.nodes[i as usize].holders);
        let key = self.blocks.nodes[i as usize].key;
        for h in holders.drain(..) {
            if let Some(w) = self.worker_mut(h.worker) {
                if w.engines.remove(&h.engine).is_some() {
                    self.entries -= 1;
                }
            }
            self.mark(h.worker, h.engine, key);
        }
        self.blocks.nodes[i as usize].holders = holders; // keep the allocation for reuse
        self.blocks.free_node(i);
        self.evictions += 1;
    }

    // ---- journal ----

    fn mark(&mut self, worker: WorkerId, engine: u64, key: u64) {
        if self.cfg.journal {
            self.dirty_engines.insert((worker, engine));
            self.dirty_holders.insert((key, worker));
        }
    }

    /// The current state of every entry changed since the last call (last write wins).
    pub fn take_changes(&mut self) -> Vec<Change> {
        let mut out = Vec::with_capacity(self.dirty_engines.len() + self.dirty_holders.len());
        for (w, engine) in std::mem::take(&mut self.dirty_engines) {
            let entry = self
                .worker(w)
                .and_then(|wk| wk.engines.get(&engine))
                .map(|e| EngineEntryView {
                    key: e.key,
                    groups: e.groups,
                });
            out.push(Change::Engine {
                worker: self.names[w as usize].clone(),
                engine,
                entry,
            });
        }
        for (key, w) in std::mem::take(&mut self.dirty_holders) {
            let tiers = self.holder_tiers(key, w);
            out.push(Change::Holder {
                key,
                worker: self.names[w as usize].clone(),
                tiers,
            });
        }
        out
    }

    fn holder_tiers(&self, key: u64, worker: WorkerId) -> u8 {
        self.blocks.keys.get(&key).map_or(0, |&i| {
            self.blocks.nodes[i as usize]
                .holders
                .iter()
                .filter(|h| h.worker == worker)
                .fold(0, |m, h| m | h.tiers)
        })
    }

    /// Every engine entry of every worker: `(worker, engine hash, entry)`.
    pub fn dump(&self) -> Vec<(String, u64, EngineEntryView)> {
        let mut out = Vec::with_capacity(self.entries);
        for (id, w) in self.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            for (&engine, e) in &w.engines {
                out.push((
                    self.names[id].clone(),
                    engine,
                    EngineEntryView {
                        key: e.key,
                        groups: e.groups,
                    },
                ));
            }
        }
        out
    }

    /// Restores one entry (as produced by [`dump`](Self::dump)); replaces any existing one.
    pub fn load_entry(&mut self, worker: WorkerId, engine: u64, entry: EngineEntryView) {
        if self.worker(worker).is_none() {
            return;
        }
        self.drop_entry(worker, engine);
        let mut tiers = 0u8;
        for (t, g) in entry.groups.iter().enumerate() {
            if *g != 0 {
                tiers |= 1 << t;
            }
        }
        if tiers == 0 {
            return;
        }
        let node = self.blocks.node_for(entry.key);
        self.blocks.touch(node);
        self.blocks.nodes[node as usize].holders.push(Holder {
            engine,
            worker,
            tiers,
        });
        if let Some(w) = self.worker_mut(worker) {
            w.engines.insert(
                engine,
                EngineEntry {
                    key: entry.key,
                    node,
                    groups: entry.groups,
                },
            );
        }
        self.entries += 1;
        self.mark(worker, engine, entry.key);
        self.enforce_capacity();
    }

    // ---- lookups ----

    /// The chained keys of every full block of `tokens`.
    pub fn chain_keys(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<u64>,
    ) -> IndexResult<Vec<u64>> {
        if block_size == 0 {
            return Err(IndexError::Invalid("block_size must be > 0".into()));
        }
        Ok(self
            .hasher
            .chain(self.cfg.hash_seed, tokens, block_size, lora))
    }

    /// Per worker holding at least the first block: the matched prefix and the score.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<u64>,
    ) -> IndexResult<&[WorkerMatch]> {
        if block_size == 0 {
            return Err(IndexError::Invalid("block_size must be > 0".into()));
        }
        let mut blocks = tokens.chunks_exact(block_size);
        Ok(self.lookup_by(lora, |buf| match blocks.next() {
            Some(b) => {
                buf.extend_from_slice(b);
                true
            }
            None => false,
        }))
    }

    /// [`lookup`](Self::lookup) with the prompt's blocks produced on demand: `next_block`
    /// appends the next full block's tokens to the (cleared) buffer, or returns false when
    /// there is none. The walk stops at the first block no worker holds, so a caller converting
    /// tokens from elsewhere (Python) converts only the blocks that matter.
    pub fn lookup_by(
        &mut self,
        lora: Option<u64>,
        mut next_block: impl FnMut(&mut Vec<u32>) -> bool,
    ) -> &[WorkerMatch] {
        let mut scorer = std::mem::take(&mut self.scorer);
        let mut touched = std::mem::take(&mut self.scratch_nodes);
        let mut buf = std::mem::take(&mut self.scratch_tokens);
        scorer.reset();
        touched.clear();
        let mut parent = self.cfg.hash_seed;
        let mut blocks = 0u64;
        // Keys chain, but probing consecutive keys is independent work: hash a run of blocks,
        // then probe the run, so the CPU overlaps the cache misses. The run grows 1, 2, 4, 8 so
        // a prompt that misses at its first block hashes nothing extra.
        let mut run = [0u64; 8];
        let mut slots = [None::<u32>; 8];
        let mut want = 1usize;
        'walk: loop {
            let mut n = 0;
            while n < want {
                buf.clear();
                if !next_block(&mut buf) {
                    break;
                }
                parent = self.hasher.hash(parent, &buf, lora);
                run[n] = parent;
                n += 1;
            }
            if n == 0 {
                break;
            }
            for j in 0..n {
                slots[j] = self.blocks.keys.get(&run[j]).copied();
            }
            for &slot in &slots[..n] {
                blocks += 1;
                let Some(i) = slot else { break 'walk };
                let holders = &self.blocks.nodes[i as usize].holders;
                if !scorer.block(holders.iter().map(|h| (h.worker, h.tiers))) {
                    break 'walk;
                }
                touched.push(i);
            }
            want = (want * 2).min(run.len());
        }
        // Most recent = first block, as when storing.
        for &i in touched.iter().rev() {
            self.blocks.touch(i);
        }
        self.totals.lookups += 1;
        self.totals.lookup_blocks += blocks;
        self.scratch_nodes = touched;
        self.scratch_tokens = buf;
        self.scorer = scorer;
        self.scorer.results()
    }

    /// Checks the internal links; `Err` names the first broken one (tests call it).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut entries = 0;
        for (id, w) in self.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            for (&engine, e) in &w.engines {
                entries += 1;
                let node = self
                    .blocks
                    .nodes
                    .get(e.node as usize)
                    .ok_or_else(|| format!("entry {engine:#x} points past the slab"))?;
                if self.blocks.keys.get(&node.key) != Some(&e.node) {
                    return Err(format!("entry {engine:#x} points at a freed node"));
                }
                if node.key != e.key {
                    return Err(format!("entry {engine:#x} key differs from its node's"));
                }
                let h = node
                    .holders
                    .iter()
                    .find(|h| h.worker as usize == id && h.engine == engine)
                    .ok_or_else(|| format!("entry {engine:#x} of worker {id} has no holder"))?;
                if h.tiers != e.tiers() || h.tiers == 0 {
                    return Err(format!(
                        "holder tiers {:#b} != entry tiers {:#b}",
                        h.tiers,
                        e.tiers()
                    ));
                }
            }
        }
        if entries != self.entries {
            return Err(format!("entry count {} != {}", self.entries, entries));
        }
        let mut holders = 0;
        for (&key, &i) in &self.blocks.keys {
            let n = self
                .blocks
                .nodes
                .get(i as usize)
                .ok_or_else(|| format!("key {key:#x} points past the slab"))?;
            if n.key != key || n.holders.is_empty() {
                return Err(format!("key {key:#x}: slot {i} is stale or has no holders"));
            }
            holders += n.holders.len();
        }
        if holders != self.entries {
            return Err(format!("{holders} holders != {} entries", self.entries));
        }
        let mut seen = 0;
        let mut i = self.blocks.head;
        let mut prev = NIL;
        while i != NIL {
            let n = &self.blocks.nodes[i as usize];
            if n.prev != prev {
                return Err(format!("LRU back link broken at node {i}"));
            }
            if n.holders.is_empty() || n.stamp == UNLINKED {
                return Err(format!("node {i} is linked but free"));
            }
            seen += 1;
            if seen > self.blocks.keys.len() {
                return Err("LRU list has a cycle".into());
            }
            prev = i;
            i = n.next;
        }
        if prev != self.blocks.tail {
            return Err("LRU tail is not the last node".into());
        }
        let expect = if self.blocks.lru {
            self.blocks.keys.len()
        } else {
            0
        };
        if seen != expect {
            return Err(format!("LRU list has {seen} nodes, expected {expect}"));
        }
        if let Some(cap) = self.cfg.capacity {
            if self.entries > cap && self.blocks.keys.len() > 1 {
                return Err(format!("{} entries over capacity {cap}", self.entries));
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            keys: self.blocks.keys.len(),
            entries: self.entries,
            workers: self.by_name.len(),
            evictions: self.evictions,
            totals: self.totals,
        }
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
