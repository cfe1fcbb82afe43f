//! The allocator of an engine's device KV blocks (vLLM's `KVCacheManager`, one full-attention
//! KV cache group), keyed by the engine's own block hashes.
//!
//! Every block id the engine's workers write into comes from here. Block 0 is the null block
//! (held for ever, never handed out). The rules are vLLM's, so that a scheduler driving this
//! allocator schedules exactly what it schedules over vLLM's manager:
//!
//! - a request's blocks are a table that only grows while it runs (the workers' block tables
//!   are append-only); [`DeviceAllocator::allocate`] tops it up to `computed + new + lookahead`
//!   tokens, or says "does not fit" and changes nothing;
//! - a block is registered (immutable, prefix-cacheable) once every position in it holds a
//!   verified token, under the engine's hash of that block (`request.block_hashes[i]`). Several
//!   blocks may hold the same hash (two requests filled the same prefix): they are all
//!   registered, hits find the oldest, and each is evicted on its own (see
//!   [`BlockPool::with_duplicates`]);
//! - a finished request gives its blocks back tail first: unregistered ones become free,
//!   registered ones cached, least recently freed evicted first, and only once no free block is
//!   left;
//! - speculative lookahead: with a dynamic speculative-decoding schedule the lookahead can be
//!   reserved at allocation and materialised at the end of the step for the K of that step
//!   ([`DeviceAllocator::materialize_lookahead`]), so a step never fails to place a draft token
//!   and never holds slots for drafts it does not make.
//!
//! Registry keys are the low 64 bits of the engine's hash read big-endian (vLLM's external
//! form, the key of its KV events and of the kvslots host tier); the full hash (up to 32 bytes)
//! is kept per block and compared on every hit, so a 64-bit collision is a miss, never a
//! wrong hit (the older holder of a colliding key is evicted when the newer one registers).
//!
//! Every operation validates its input and returns a typed error before changing anything.

use std::ops::Range;

use rustc_hash::FxHashMap;

use crate::error::{Result, SlotError};
use crate::pool::{BlockId, BlockPool};

/// The null block: a placeholder id that is never allocated.
pub const NULL_BLOCK: BlockId = 0;

/// An engine block hash (vLLM's `BlockHash`, e.g. 32 bytes of SHA-256), stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FullHash {
    bytes: [u8; FullHash::MAX_LEN],
    len: u8,
}

impl std::fmt::Debug for FullHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FullHash(")?;
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

impl FullHash {
    pub const MAX_LEN: usize = 32;
    #[cfg(test)]
    const EMPTY: FullHash = FullHash {
        bytes: [0; FullHash::MAX_LEN],
        len: 0,
    };

    /// A hash of 1 to 32 bytes; `None` otherwise.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.is_empty() || b.len() > Self::MAX_LEN {
            return None;
        }
        let mut bytes = [0; Self::MAX_LEN];
        bytes[..b.len()].copy_from_slice(b);
        Some(FullHash {
            bytes,
            len: b.len() as u8,
        })
    }

    /// An integer hash, as its 8 bytes big-endian.
    pub fn from_u64(v: u64) -> Self {
        Self::from_bytes(&v.to_be_bytes()).expect("8 bytes")
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The registry key: the low 64 bits of the hash read big-endian (vLLM's
    /// `maybe_convert_block_hash` with integer block hashes).
    #[inline]
    pub fn key(&self) -> u64 {
        let b = self.as_bytes();
        let tail = &b[b.len().saturating_sub(8)..];
        tail.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64)
    }
}

/// One full hash per block, as plain zeroed arrays (so a pool of a million blocks costs no
/// memory until its blocks are registered). The bytes are one flat `Vec<u8>`: `vec![0u8; n]`
/// is a zeroed allocation the OS fills lazily, where a `Vec` of arrays was written at start-up
/// (32 MB touched for 1M blocks).
#[derive(Debug)]
struct FullHashes {
    bytes: Vec<u8>,
    lens: Vec<u8>,
}

impl FullHashes {
    fn new(n: usize) -> Option<Self> {
        Some(FullHashes {
            bytes: crate::pool::try_zeroed(n.checked_mul(FullHash::MAX_LEN)?)?,
            lens: crate::pool::try_zeroed(n)?,
        })
    }
    #[inline]
    fn get(&self, b: BlockId) -> FullHash {
        let at = b as usize * FullHash::MAX_LEN;
        let mut bytes = [0u8; FullHash::MAX_LEN];
        bytes.copy_from_slice(&self.bytes[at..at + FullHash::MAX_LEN]);
        FullHash {
            bytes,
            len: self.lens[b as usize],
        }
    }
    #[inline]
    fn set(&mut self, b: BlockId, h: &FullHash) {
        let at = b as usize * FullHash::MAX_LEN;
        self.bytes[at..at + FullHash::MAX_LEN].copy_from_slice(&h.bytes);
        self.lens[b as usize] = h.len;
    }
}

/// A request's block hashes (vLLM's `request.block_hashes`), read by index. Reading may fail
/// (a malformed element); the allocator reads everything it needs before it changes anything.
pub trait HashSource {
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> Result<FullHash>;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HashSource for [FullHash] {
    fn len(&self) -> usize {
        <[FullHash]>::len(self)
    }
    fn get(&self, i: usize) -> Result<FullHash> {
        self.as_ref()
            .get(i)
            .copied()
            .ok_or_else(|| SlotError::invalid(None, format!("block hash {i} is missing")))
    }
}

impl HashSource for Vec<FullHash> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }
    fn get(&self, i: usize) -> Result<FullHash> {
        HashSource::get(self.as_slice(), i)
    }
}

#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Blocks in the pool, the null block included (vLLM's `num_gpu_blocks`).
    pub num_blocks: usize,
    pub block_size: usize,
    pub enable_caching: bool,
    /// Keep the hashes of evicted blocks for BlockRemoved events ([`DeviceAllocator::drain_evicted`]).
    pub record_evictions: bool,
    /// Keep the ids of newly allocated blocks for the workers to zero
    /// ([`DeviceAllocator::take_new_block_ids`]).
    pub record_new_blocks: bool,
    /// A hit on a hash several blocks hold takes one a request already holds, when there is
    /// one, rather than the oldest (vLLM's choice, which may pin a cached block and cost a free
    /// one). Off: exactly vLLM's choice.
    pub prefer_held_duplicates: bool,
}

/// One `allocate_slots` call, in vLLM's terms.
#[derive(Debug, Clone, Default)]
pub struct AllocArgs {
    /// `request.num_computed_tokens`.
    pub num_computed_tokens: usize,
    /// `request.num_tokens` (verified tokens: prompt and output, no drafts).
    pub num_tokens: usize,
    /// Tokens to compute this step (drafts included).
    pub num_new_tokens: usize,
    /// Local prefix-hit blocks (the first blocks of the request's hashes), new this call.
    pub num_hit_blocks: usize,
    /// Tokens the KV connector loads after the local hit.
    pub num_external_tokens: usize,
    pub num_lookahead_tokens: usize,
    /// Reserve the lookahead blocks instead of allocating them; see
    /// [`DeviceAllocator::materialize_lookahead`].
    pub defer_lookahead: bool,
    pub max_model_len: usize,
    /// Blocks to leave free for others (vLLM's `reserved_blocks`).
    pub reserved_blocks: usize,
    /// Headroom to keep (vLLM's watermark, for waiting and preempted requests).
    pub watermark_blocks: usize,
    /// `Some(min(num_tokens, max_model_len))`: only allocate if the whole sequence fits.
    pub full_sequence_tokens: Option<usize>,
    /// Do not register blocks yet (an asynchronous KV load fills them later).
    pub delay_cache_blocks: bool,
    /// Tokens at the end that may still be re-prefilled (multi-module MTP), never registered.
    pub num_reprefillable_tokens: usize,
    /// Whether the blocks for external tokens are recorded for zeroing.
    pub zero_external_blocks: bool,
}

/// What an allocation did: the table positions it added, the blocks it registered and how many
/// cached blocks it evicted (their hashes wait in [`DeviceAllocator::drain_evicted`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allocated {
    /// Positions in the request's table allocated by `allocate_new_blocks` (vLLM's return value).
    pub new_blocks: Range<usize>,
    /// The request's slot (see [`DeviceAllocator::slot_blocks`]).
    pub slot: usize,
    /// Positions newly registered (their hashes are `request.block_hashes[commit]`).
    pub commit: Range<usize>,
    pub evicted: usize,
}

/// How an allocation fits, from [`DeviceAllocator::plan_allocation`]: made without changing
/// anything, and carried out as it is by [`DeviceAllocator::allocate_planned`] (the one fit
/// check; an allocation plans and carries out in one go).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FitPlan {
    slot: Option<usize>,
    held: usize,
    /// The request adopts the hit and external blocks (its first allocation with them).
    adopt: bool,
    hits: Vec<BlockId>,
    evictable: usize,
    ext_blocks: usize,
    new_blocks: usize,
    /// Table length with the lookahead.
    need_blocks: usize,
    defer_lookahead: bool,
    zero_external_blocks: bool,
    commit_start: usize,
    /// `None`: nothing registered (caching off or delayed).
    commit_end: Option<usize>,
    /// [`DeviceAllocator::changes`] when planned.
    changes: u64,
    /// The allocator that planned it ([`DeviceAllocator`]'s `id`): another one's counter may
    /// stand at the same count.
    allocator: u64,
}

impl FitPlan {
    /// The table positions the allocation registers (their hashes are the request's
    /// `block_hashes[commit]`); empty: none. Equal to [`Allocated::commit`].
    pub fn commit(&self) -> Range<usize> {
        match self.commit_end {
            Some(end) => self.commit_start..end.max(self.commit_start),
            None => 0..0,
        }
    }

    /// Blocks the allocation takes from the pool (prefix hits from the cache included).
    pub fn num_blocks_taken(&self) -> usize {
        self.ext_blocks + self.new_blocks + self.evictable
    }
}

#[derive(Debug, Default)]
struct Req {
    blocks: Vec<BlockId>,
    /// Blocks at the front that are registered or were hits (vLLM's `num_cached_block`).
    num_cached: usize,
    /// vLLM tracks `num_cached_block` for this request (it had hits, external tokens or a commit).
    tracked: bool,
    /// Lookahead blocks reserved this step, not yet materialised.
    reserved: usize,
    /// The table length vLLM's manager would have (it allocates the largest lookahead every
    /// step and never shrinks a table); `shadow - blocks.len()` is this request's debt.
    shadow: usize,
    /// The caller's handle for this slot (0: none), so a per-step call can find the slot
    /// without hashing and comparing the request's name; cleared when the slot is released.
    tag: u64,
}

/// Counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocated_blocks: u64,
    pub registered_blocks: u64,
    pub evicted_blocks: u64,
    pub hit_blocks: u64,
    pub freed_requests: u64,
}

/// The next [`DeviceAllocator`]'s id (a u64 never wraps in practice).
static NEXT_ALLOCATOR_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[derive(Debug)]
pub struct DeviceAllocator {
    pool: BlockPool,
    block_size: usize,
    enable_caching: bool,
    record_evictions: bool,
    record_new_blocks: bool,
    prefer_held: bool,
    /// The full hash each registered block holds (stale otherwise). Zero pages until used.
    full: FullHashes,
    reqs: FxHashMap<Box<str>, u32>,
    slots: Vec<Req>,
    free_slots: Vec<u32>,
    /// Lookahead blocks reserved by requests this step.
    step_reserved: usize,
    /// Blocks vLLM would hold and this allocator does not (deferred lookahead for a smaller K):
    /// the sum of the requests' `shadow - blocks.len()`. Every fit check counts the other
    /// requests' debt as held (see [`DeviceAllocator::allocate`]).
    debt: usize,
    /// Holds handed out by [`DeviceAllocator::pop_blocks`] and not released yet.
    parked: FxHashMap<BlockId, u32>,
    evicted: Vec<FullHash>,
    new_block_ids: Vec<BlockId>,
    stats: DeviceStats,
    /// Counts the calls that may change what an allocation does (see [`Self::changes`]).
    changes: u64,
    /// Unique in the process (from `NEXT_ALLOCATOR_ID`): a plan names the allocator it is for.
    id: u64,
    // Scratch.
    scratch_ids: Vec<BlockId>,
    scratch_hashes: Vec<FullHash>,
    scratch_keys: Vec<u64>,
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl DeviceAllocator {
    pub fn new(cfg: DeviceConfig) -> Result<Self> {
        if cfg.num_blocks == 0 || cfg.num_blocks >= BlockPool::MAX_BLOCKS {
            return Err(SlotError::invalid(
                None,
                format!(
                    "num_blocks must be in [1, {}) (block 0 is the null block), got {}",
                    BlockPool::MAX_BLOCKS,
                    cfg.num_blocks
                ),
            ));
        }
        if cfg.block_size == 0 || cfg.block_size > u32::MAX as usize {
            return Err(SlotError::invalid(
                None,
                format!(
                    "block_size must be in [1, {}], got {}",
                    u32::MAX,
                    cfg.block_size
                ),
            ));
        }
        let full = FullHashes::new(cfg.num_blocks).ok_or_else(|| {
            let bytes = cfg.num_blocks.saturating_mul(FullHash::MAX_LEN + 1);
            SlotError::unallocatable(
                "num_blocks",
                cfg.num_blocks,
                &format!("the block hashes' {bytes} bytes"),
            )
        })?;
        let mut pool = BlockPool::try_with_duplicates(cfg.num_blocks)?;
        let (mut out, mut ev) = (Vec::with_capacity(1), Vec::new());
        pool.allocate(1, &mut out, &mut ev);
        debug_assert_eq!(out, vec![NULL_BLOCK]);
        Ok(DeviceAllocator {
            pool,
            block_size: cfg.block_size,
            enable_caching: cfg.enable_caching,
            record_evictions: cfg.record_evictions,
            record_new_blocks: cfg.record_new_blocks,
            prefer_held: cfg.prefer_held_duplicates,
            full,
            reqs: FxHashMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            step_reserved: 0,
            debt: 0,
            parked: FxHashMap::default(),
            evicted: Vec::new(),
            new_block_ids: Vec::new(),
            stats: DeviceStats::default(),
            changes: 0,
            id: NEXT_ALLOCATOR_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            scratch_ids: Vec::new(),
            scratch_hashes: Vec::new(),
            scratch_keys: Vec::new(),
        })
    }

    // ---- queries ----

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }
    /// Blocks an allocation may take: free plus cached (vLLM's `get_num_free_blocks`).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.available()
    }
    /// Free blocks never registered, or unregistered.
    pub fn num_uncached_free_blocks(&self) -> usize {
        self.pool.num_free()
    }
    /// Registered blocks nobody holds (evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.pool.num_cached()
    }
    /// Blocks held by requests, the null block included.
    pub fn num_held_blocks(&self) -> usize {
        self.pool.num_held()
    }
    /// Lookahead blocks reserved this step and not materialised.
    pub fn num_reserved_blocks(&self) -> usize {
        self.step_reserved
    }
    /// Blocks vLLM's manager would hold on top of these (deferred lookahead for a smaller K).
    pub fn num_debt_blocks(&self) -> usize {
        self.debt
    }
    /// vLLM's `get_usage`: the used share of the pool, the null block left out.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks() - 1;
        if total == 0 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / total as f64
    }
    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }
    pub fn contains(&self, request: &str) -> bool {
        self.reqs.contains_key(request)
    }
    pub fn request_ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.reqs.keys().map(|k| &**k)
    }
    /// A count of the calls that may have changed the allocator (every `&mut` call but the
    /// drains and `record_for_zeroing`, which change nothing an allocation reads): a
    /// [`FitPlan`] made at one count holds while the count stays the same.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn stats(&self) -> DeviceStats {
        self.stats
    }
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// The request's block table (empty when it holds none).
    pub fn blocks(&self, request: &str) -> &[BlockId] {
        match self.reqs.get(request) {
            Some(&s) => &self.slots[s as usize].blocks,
            None => &[],
        }
    }
    /// The block table of the slot an allocation reported ([`Allocated::slot`]), valid until
    /// the next call that frees a request.
    pub fn slot_blocks(&self, slot: usize) -> &[BlockId] {
        self.slots.get(slot).map_or(&[], |r| r.blocks.as_slice())
    }

    /// vLLM's `num_cached_block[request]` (0 when untracked).
    pub fn num_cached_in(&self, request: &str) -> usize {
        self.reqs
            .get(request)
            .map_or(0, |&s| self.slots[s as usize].num_cached)
    }
    /// The full hash a block is registered under.
    pub fn registered_hash(&self, block: BlockId) -> Option<FullHash> {
        if block as usize >= self.num_blocks() {
            return None;
        }
        self.pool.is_registered(block).then(|| self.full.get(block))
    }
    pub fn refcount(&self, block: BlockId) -> Option<u32> {
        ((block as usize) < self.num_blocks()).then(|| self.pool.refcount(block))
    }

    /// The block registered under `h` that a hit would take.
    #[inline]
    fn find(&self, h: &FullHash) -> Option<BlockId> {
        let first = self.pool.lookup(h.key())?;
        if self.full.get(first) != *h {
            return None;
        }
        if self.prefer_held && self.pool.refcount(first) == 0 {
            let mut b = first;
            while let Some(next) = self.pool.next_duplicate(b) {
                if self.pool.refcount(next) > 0 {
                    return Some(next);
                }
                b = next;
            }
        }
        Some(first)
    }

    /// The longest run of registered blocks from the start of `hashes`, at most `max_blocks`
    /// (vLLM's `find_longest_cache_hit` for one full-attention group, before any EAGLE drop).
    pub fn find_prefix<H: HashSource + ?Sized>(
        &self,
        hashes: &H,
        max_blocks: usize,
    ) -> Result<usize> {
        if !self.enable_caching {
            return Ok(0);
        }
        let n = max_blocks.min(hashes.len());
        for i in 0..n {
            let h = hashes.get(i)?;
            if self.find(&h).is_none() {
                return Ok(i);
            }
        }
        Ok(n)
    }

    /// The ids of the first `n` blocks of a prefix hit (see [`DeviceAllocator::find_prefix`]).
    pub fn prefix_block_ids<H: HashSource + ?Sized>(
        &self,
        hashes: &H,
        n: usize,
        out: &mut Vec<BlockId>,
    ) -> Result<()> {
        if n > hashes.len() {
            return Err(SlotError::invalid(
                None,
                format!(
                    "{n} hit blocks asked, the request has {} hashes",
                    hashes.len()
                ),
            ));
        }
        let start = out.len();
        for i in 0..n {
            let h = hashes.get(i)?;
            match self.find(&h) {
                Some(b) => out.push(b),
                None => {
                    out.truncate(start);
                    return Err(SlotError::invalid(
                        None,
                        format!("prefix block {i} is no longer cached"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Blocks the request still needs to hold `num_tokens` tokens (vLLM's
    /// `coordinator.get_num_blocks_to_allocate` with no new hits).
    pub fn num_blocks_to_allocate(&self, request: &str, num_tokens: usize) -> usize {
        let held = self.blocks(request).len();
        cdiv(num_tokens, self.block_size).saturating_sub(held)
    }

    /// vLLM's `estimate_cached_tokens`: tokens covered by the request's last registered block.
    pub fn estimate_cached_tokens(&self, request: &str) -> usize {
        let blocks = self.blocks(request);
        blocks
            .iter()
            .rposition(|&b| b != NULL_BLOCK && self.pool.is_registered(b))
            .map_or(0, |i| (i + 1) * self.block_size)
    }

    // ---- allocation ----

    fn slot_of(&self, request: &str) -> Option<usize> {
        self.reqs.get(request).map(|&s| s as usize)
    }

    fn slot_or_insert(&mut self, request: &str) -> usize {
        if let Some(s) = self.slot_of(request) {
            return s;
        }
        let s = match self.free_slots.pop() {
            Some(s) => s as usize,
            None => {
                self.slots.push(Req::default());
                self.slots.len() - 1
            }
        };
        self.reqs.insert(request.into(), s as u32);
        s
    }

    /// Takes `n` blocks for the request (the caller checked they are available), recording
    /// evictions and, when asked, the new ids for zeroing.
    fn take_blocks(&mut self, slot: usize, n: usize, zero: bool) -> Range<usize> {
        let start = self.slots[slot].blocks.len();
        if n == 0 {
            return start..start;
        }
        self.scratch_keys.clear();
        let mut blocks = std::mem::take(&mut self.slots[slot].blocks);
        self.pool.allocate(n, &mut blocks, &mut self.scratch_keys);
        let k = self.scratch_keys.len();
        if k > 0 {
            self.stats.evicted_blocks += k as u64;
            if self.record_evictions {
                // The victims are the last `k` blocks taken, in eviction order.
                for &v in &blocks[blocks.len() - k..] {
                    self.evicted.push(self.full.get(v));
                }
            }
        }
        if zero && self.record_new_blocks {
            self.new_block_ids.extend_from_slice(&blocks[start..]);
        }
        self.stats.allocated_blocks += n as u64;
        self.slots[slot].blocks = blocks;
        start..start + n
    }

    /// The caller's handle on `slot` (0: none or released).
    pub fn slot_tag(&self, slot: usize) -> u64 {
        self.slots.get(slot).map_or(0, |r| r.tag)
    }

    /// Gives the request's slot the caller's handle `tag` (not 0), for [`Self::allocate_tagged`];
    /// returns the slot (`None`: the request holds none). A caller gives one tag to one live
    /// request at a time.
    pub fn tag_slot(&mut self, request: &str, tag: u64) -> Option<usize> {
        self.changes = self.changes.wrapping_add(1);
        let s = self.slot_of(request)?;
        self.slots[s].tag = tag;
        Some(s)
    }

    /// The table positions [`Self::cache`] with these arguments would register, read without
    /// changing anything (see [`FitPlan::commit`]).
    pub fn planned_cache(
        &self,
        request: &str,
        num_tokens: usize,
        num_reprefillable_tokens: usize,
    ) -> Range<usize> {
        let Some(s) = self.slot_of(request) else {
            return 0..0;
        };
        if !self.enable_caching {
            return 0..0;
        }
        let end = num_tokens.saturating_sub(num_reprefillable_tokens) / self.block_size;
        let start = self.slots[s].num_cached;
        start..end.max(start)
    }

    /// vLLM's `allocate_slots`. `Ok(None)`: it does not fit, nothing changed.
    ///
    /// `hashes` is the request's block hashes: the first `num_hit_blocks` name the prefix hit,
    /// and the ones of the blocks this call registers are read too.
    pub fn allocate<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        a: &AllocArgs,
        hashes: &H,
    ) -> Result<Option<Allocated>> {
        let slot = self.slot_of(request);
        self.allocate_at(request, slot, a, hashes)
    }

    /// [`Self::allocate`] for a request the caller tagged `slot` for ([`Self::tag_slot`]):
    /// the slot is taken when it still carries `tag`, with no lookup by name; otherwise
    /// (released, retagged) the name decides, as in `allocate`.
    // Inlined (with `allocate_at`) into callers with constant arguments, such as the binding's
    // per-step call for a running request, where the hit and adoption branches fold away.
    #[inline(always)]
    pub fn allocate_tagged<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        slot: usize,
        tag: u64,
        a: &AllocArgs,
        hashes: &H,
    ) -> Result<Option<Allocated>> {
        if tag == 0 || self.slots.get(slot).map_or(true, |r| r.tag != tag) {
            return self.allocate(request, a, hashes);
        }
        self.allocate_at(request, Some(slot), a, hashes)
    }

    /// How an allocation of `request` with `a` would go from the current state, read without
    /// changing anything: `Ok(None)` when it does not fit, the argument errors the allocation
    /// would give, else the [`FitPlan`] [`Self::allocate_planned`] carries out. A caller builds
    /// what it emits for the blocks the allocation registers ([`FitPlan::commit`]) only once it
    /// knows the allocation fits, and before anything changes (an error there then leaves the
    /// allocator as it was). `tagged`: the slot and tag of an [`Self::allocate_tagged`], found
    /// as it finds them.
    #[inline(always)]
    pub fn plan_allocation<H: HashSource + ?Sized>(
        &self,
        request: &str,
        tagged: Option<(usize, u64)>,
        a: &AllocArgs,
        hashes: &H,
    ) -> Result<Option<FitPlan>> {
        let slot = match tagged {
            Some((s, t)) if t != 0 && self.slots.get(s).is_some_and(|r| r.tag == t) => Some(s),
            _ => self.slot_of(request),
        };
        self.fit(request, slot, a, hashes, &mut Vec::new())
    }

    /// Carries out an allocation [`Self::plan_allocation`] planned. The plan must come from
    /// this allocator with nothing changed since (a caller that let go of it meanwhile plans
    /// again and compares): a plan from another allocator, or a stale one, is an error and
    /// nothing changes.
    #[inline(always)]
    pub fn allocate_planned<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        plan: FitPlan,
        hashes: &H,
    ) -> Result<Allocated> {
        if plan.allocator != self.id {
            return Err(SlotError::invalid(
                Some(request),
                "the allocation was planned by another allocator",
            ));
        }
        if plan.changes != self.changes {
            return Err(SlotError::invalid(
                Some(request),
                "the allocator was changed since the allocation was planned",
            ));
        }
        self.apply(request, plan, hashes)
    }

    #[inline(always)]
    fn allocate_at<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        slot: Option<usize>,
        a: &AllocArgs,
        hashes: &H,
    ) -> Result<Option<Allocated>> {
        // The hit's ids go in the scratch vector (no allocation per call); the plan hands it
        // back through `apply`, or here.
        let mut hits = std::mem::take(&mut self.scratch_ids);
        match self.fit(request, slot, a, hashes, &mut hits) {
            Ok(Some(plan)) => self.apply(request, plan, hashes).map(Some),
            r => {
                self.scratch_ids = hits;
                r.map(|_| None)
            }
        }
    }

    /// The one fit check: every read-only step of an allocation (arguments, the prefix hit, the
    /// fit, what it takes and registers), for [`Self::plan_allocation`] and [`Self::allocate`].
    /// `hits`: a vector for the hit's ids (its buffer is reused), moved into the plan.
    #[inline(always)]
    fn fit<H: HashSource + ?Sized>(
        &self,
        request: &str,
        slot: Option<usize>,
        a: &AllocArgs,
        hashes: &H,
        hits: &mut Vec<BlockId>,
    ) -> Result<Option<FitPlan>> {
        let bs = self.block_size;
        let rid = Some(request);
        if a.num_new_tokens == 0 && a.num_external_tokens == 0 && a.num_hit_blocks == 0 {
            return Err(SlotError::invalid(
                rid,
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
            ));
        }
        if a.num_hit_blocks > 0 && !self.enable_caching {
            return Err(SlotError::invalid(
                rid,
                "prefix-hit blocks given while prefix caching is disabled",
            ));
        }
        let (held, tracked) = slot.map_or((0, false), |s| {
            (self.slots[s].blocks.len(), self.slots[s].tracked)
        });
        let adopt = a.num_hit_blocks > 0 || a.num_external_tokens > 0;
        if adopt && tracked && a.num_hit_blocks > 0 {
            return Err(SlotError::invalid(
                rid,
                format!(
                    "{} new prefix-hit blocks for a request that already holds {held} blocks",
                    a.num_hit_blocks
                ),
            ));
        }
        if adopt && !tracked && held > 0 {
            return Err(SlotError::invalid(
                rid,
                format!("computed blocks to adopt for a request that already holds {held} blocks"),
            ));
        }
        // Resolve the hit.
        hits.clear();
        if a.num_hit_blocks > 0 {
            if let Err(e) = self.prefix_block_ids(hashes, a.num_hit_blocks, hits) {
                return Err(match e {
                    SlotError::InvalidArgument { message, .. } => SlotError::invalid(rid, message),
                    e => e,
                });
            }
        }
        let hit_ids: &[BlockId] = hits;
        let evictable = hit_ids.iter().filter(|&&b| self.pool.refcount(b) == 0).count();
        let to_allocate = |num_tokens: usize| -> usize {
            let required = cdiv(num_tokens, bs);
            if tracked {
                required.saturating_sub(held)
            } else {
                required.saturating_sub(hit_ids.len() + held) + evictable
            }
        };
        // Saturating: counts come from the caller (up to 2**63 each); a sum past usize is
        // past max_model_len anyway.
        let num_local = a
            .num_computed_tokens
            .saturating_add(a.num_hit_blocks.saturating_mul(bs));
        let total_computed = num_local
            .saturating_add(a.num_external_tokens)
            .min(a.max_model_len);
        // The lookahead other requests hold in vLLM's manager and not here (their debt) is held
        // for this fit check, as it is in vLLM: a request grows into its own debt only (vLLM's
        // table already has those blocks). So a request fits exactly where it would fit over
        // vLLM's manager from the same state, admissions and running requests alike. Letting
        // running requests grow into the others' debt avoids a preemption at that step, but
        // changes the schedule's shape (a smaller batch gets a larger K, an async step runs
        // where vLLM's waits for deferred frees), and summed over workloads that preempted
        // more often than vLLM (tests/test_scheduler_mode_differential.py).
        let (own_debt, own_reserved) = slot.map_or((0, 0), |s| {
            let r = &self.slots[s];
            (r.shadow.saturating_sub(r.blocks.len()), r.reserved)
        });
        let held_back = (self.debt - own_debt).max(self.step_reserved - own_reserved);
        let free = self.pool.available().saturating_sub(held_back);
        if let Some(full_tokens) = a.full_sequence_tokens {
            if to_allocate(full_tokens) + a.watermark_blocks > free {
                return Ok(None);
            }
        }
        let main_tokens = total_computed.saturating_add(a.num_new_tokens);
        let need_slot = main_tokens
            .saturating_add(a.num_lookahead_tokens)
            .min(a.max_model_len);
        let n = to_allocate(need_slot);
        if n.saturating_add(a.watermark_blocks).saturating_add(a.reserved_blocks) > free {
            return Ok(None);
        }
        // What this call registers.
        let commit_end = if a.delay_cache_blocks || !self.enable_caching {
            None
        } else {
            let to_cache = main_tokens.min(a.num_tokens);
            Some(to_cache.saturating_sub(a.num_reprefillable_tokens) / bs)
        };
        let commit_start = if adopt && !tracked {
            hit_ids.len()
        } else {
            slot.map_or(0, |s| self.slots[s].num_cached)
        };
        // Blocks this call takes, by construction at most `n` (checked again when it is done).
        let ext_blocks = if adopt && !tracked && a.num_external_tokens > 0 {
            cdiv(num_local.saturating_add(a.num_external_tokens), bs).saturating_sub(hit_ids.len())
        } else {
            0
        };
        let main_target = if a.defer_lookahead {
            main_tokens.min(a.max_model_len)
        } else {
            need_slot
        };
        let new_blocks = cdiv(main_target, bs).saturating_sub(held + hit_ids.len() + ext_blocks);
        Ok(Some(FitPlan {
            slot,
            held,
            adopt: adopt && !tracked,
            hits: std::mem::take(hits),
            evictable,
            ext_blocks,
            new_blocks,
            need_blocks: cdiv(need_slot, bs),
            defer_lookahead: a.defer_lookahead,
            zero_external_blocks: a.zero_external_blocks,
            commit_start,
            commit_end,
            changes: self.changes,
            allocator: self.id,
        }))
    }

    /// Keeps the larger of the hit vectors as the scratch (a plan made by
    /// [`Self::plan_allocation`] brings its own, often without a buffer).
    #[inline(always)]
    fn keep_scratch_ids(&mut self, hits: Vec<BlockId>) {
        if hits.capacity() >= self.scratch_ids.capacity() {
            self.scratch_ids = hits;
        }
    }

    /// Carries out a plan from [`Self::fit`] made from the current state; gives its hit vector
    /// back to the scratch.
    #[inline(always)]
    fn apply<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        plan: FitPlan,
        hashes: &H,
    ) -> Result<Allocated> {
        let rid = Some(request);
        let FitPlan { slot, held, adopt, hits, evictable, ext_blocks, new_blocks, .. } = plan;
        // The hashes of what this call registers, read before anything changes.
        let mut commit_hashes = std::mem::take(&mut self.scratch_hashes);
        commit_hashes.clear();
        if let Some(end) = plan.commit_end {
            for i in plan.commit_start..end {
                match hashes.get(i) {
                    Ok(h) => commit_hashes.push(h),
                    Err(e) => {
                        self.keep_scratch_ids(hits);
                        self.scratch_hashes = commit_hashes;
                        return Err(match e {
                            SlotError::InvalidArgument { message, .. } => {
                                SlotError::invalid(rid, message)
                            }
                            e => e,
                        });
                    }
                }
            }
        }
        // At most what the fit check counted: a hard check all the same, so a wrong argument
        // (or a stale plan) can never reach the pool.
        if ext_blocks + new_blocks + evictable > self.pool.available() {
            self.keep_scratch_ids(hits);
            self.scratch_hashes = commit_hashes;
            return Err(SlotError::OutOfBlocks {
                request: request.to_owned(),
                needed: (ext_blocks + new_blocks + evictable) as u128,
                available: self.pool.available() as u64,
                total: self.num_blocks() as u64,
            });
        }
        let table_after_adopt = held + hits.len() + ext_blocks;
        if let Some(end) = plan.commit_end {
            let table = table_after_adopt + new_blocks;
            if end > table {
                self.keep_scratch_ids(hits);
                self.scratch_hashes = commit_hashes;
                return Err(SlotError::invalid(
                    rid,
                    format!("{end} blocks to register, the request holds {table}"),
                ));
            }
        }

        // ---- from here on nothing fails ----
        self.changes = self.changes.wrapping_add(1);
        let evicted_before = self.stats.evicted_blocks;
        let s = match slot {
            Some(s) => s,
            None => self.slot_or_insert(request),
        };
        if adopt {
            for &b in &hits {
                self.pool.pin(b);
            }
            self.stats.hit_blocks += hits.len() as u64;
            self.slots[s].blocks.extend_from_slice(&hits);
            self.slots[s].num_cached = hits.len();
            self.slots[s].tracked = true;
            self.take_blocks(s, ext_blocks, plan.zero_external_blocks);
        }
        self.keep_scratch_ids(hits);
        let new_range = self.take_blocks(s, new_blocks, true);
        {
            let len = self.slots[s].blocks.len();
            let r = &mut self.slots[s];
            let before = r.shadow.saturating_sub(held);
            r.shadow = r.shadow.max(len);
            if plan.defer_lookahead {
                r.shadow = r.shadow.max(plan.need_blocks);
                let res = plan.need_blocks.saturating_sub(len);
                self.step_reserved = self.step_reserved - r.reserved + res;
                r.reserved = res;
            }
            self.debt = self.debt - before + (r.shadow - len);
        }
        let commit = match plan.commit_end {
            Some(end) => self.register(s, end, &commit_hashes),
            None => 0..0,
        };
        self.scratch_hashes = commit_hashes;
        Ok(Allocated {
            slot: s,
            new_blocks: new_range,
            commit,
            evicted: (self.stats.evicted_blocks - evicted_before) as usize,
        })
    }

    /// Registers the request's blocks `num_cached..end` under `hashes` (one per block).
    fn register(&mut self, s: usize, end: usize, hashes: &[FullHash]) -> Range<usize> {
        let start = self.slots[s].num_cached;
        if start >= end {
            return start..start;
        }
        debug_assert_eq!(hashes.len(), end - start);
        for h in hashes {
            self.pool.prefetch(h.key());
        }
        for (i, h) in (start..end).zip(hashes) {
            let b = self.slots[s].blocks[i];
            if b == NULL_BLOCK || self.pool.is_registered(b) {
                continue;
            }
            let key = h.key();
            if let Some(first) = self.pool.lookup(key) {
                if self.full.get(first) != *h {
                    // A 64-bit key collision between different hashes: the older holders
                    // leave the registry (BlockRemoved), so no hit can ever find the wrong one.
                    while let Some(old) = self.pool.lookup(key) {
                        let fh = self.full.get(old);
                        self.pool.unregister_block(old);
                        self.stats.evicted_blocks += 1;
                        if self.record_evictions {
                            self.evicted.push(fh);
                        }
                    }
                }
            }
            self.full.set(b, h);
            self.pool.register_or_chain(b, key);
            self.stats.registered_blocks += 1;
        }
        self.slots[s].num_cached = end;
        self.slots[s].tracked = true;
        start..end
    }

    /// vLLM's `cache_blocks(request, num_tokens)`: registers the request's blocks up to
    /// `num_tokens` tokens (less the re-prefillable tail). Returns the positions registered.
    pub fn cache<H: HashSource + ?Sized>(
        &mut self,
        request: &str,
        num_tokens: usize,
        num_reprefillable_tokens: usize,
        hashes: &H,
    ) -> Result<Range<usize>> {
        self.changes = self.changes.wrapping_add(1);
        let Some(s) = self.slot_of(request) else {
            return Ok(0..0);
        };
        if !self.enable_caching {
            return Ok(0..0);
        }
        let end = num_tokens.saturating_sub(num_reprefillable_tokens) / self.block_size;
        let start = self.slots[s].num_cached;
        if start >= end {
            return Ok(start..start);
        }
        if end > self.slots[s].blocks.len() {
            return Err(SlotError::invalid(
                Some(request),
                format!(
                    "{end} blocks to register, the request holds {}",
                    self.slots[s].blocks.len()
                ),
            ));
        }
        let mut hs = std::mem::take(&mut self.scratch_hashes);
        hs.clear();
        for i in start..end {
            match hashes.get(i) {
                Ok(h) => hs.push(h),
                Err(e) => {
                    self.scratch_hashes = hs;
                    return Err(e);
                }
            }
        }
        let r = self.register(s, end, &hs);
        self.scratch_hashes = hs;
        Ok(r)
    }

    /// Allocates the lookahead a deferred allocation reserved, up to `num_tokens` slots in all
    /// (at most what it reserved), and gives back the rest of its reservation. Returns the
    /// positions added to the request's table.
    pub fn materialize_lookahead(
        &mut self,
        request: &str,
        num_tokens: usize,
    ) -> Result<Range<usize>> {
        self.changes = self.changes.wrapping_add(1);
        let Some(s) = self.slot_of(request) else {
            return Err(SlotError::UnknownRequest {
                request: request.to_owned(),
            });
        };
        let held = self.slots[s].blocks.len();
        let reserved = self.slots[s].reserved;
        let n = cdiv(num_tokens, self.block_size).saturating_sub(held);
        if n > reserved {
            return Err(SlotError::CapacityExceeded {
                request: request.to_owned(),
                what: "lookahead blocks beyond the reservation",
                requested: n as u128,
                limit: reserved as u64,
            });
        }
        if n > self.pool.available() {
            return Err(SlotError::OutOfBlocks {
                request: request.to_owned(),
                needed: n as u128,
                available: self.pool.available() as u64,
                total: self.num_blocks() as u64,
            });
        }
        self.step_reserved -= reserved;
        self.slots[s].reserved = 0;
        // Reserved blocks were kept out of every fit check since: they are there.
        let r = self.take_blocks(s, n, true);
        let slot = &mut self.slots[s];
        let debt_before = slot.shadow.saturating_sub(held);
        slot.shadow = slot.shadow.max(slot.blocks.len());
        self.debt = self.debt - debt_before + (slot.shadow - slot.blocks.len());
        Ok(r)
    }

    /// Gives back every reservation not materialised (the end of a step).
    pub fn release_reservations(&mut self) {
        self.changes = self.changes.wrapping_add(1);
        if self.step_reserved == 0 {
            return;
        }
        for r in &mut self.slots {
            r.reserved = 0;
        }
        self.step_reserved = 0;
    }

    // ---- release ----

    fn remove_slot(&mut self, request: &str) -> Option<usize> {
        let s = self.reqs.remove(request)? as usize;
        self.free_slots.push(s as u32);
        let r = &mut self.slots[s];
        self.step_reserved -= r.reserved;
        self.debt -= r.shadow.saturating_sub(r.blocks.len());
        r.reserved = 0;
        r.shadow = 0;
        r.num_cached = 0;
        r.tracked = false;
        r.tag = 0;
        Some(s)
    }

    /// vLLM's `free`: the request's blocks go back tail first (so its tail is evicted first).
    /// Returns whether the request held a table.
    pub fn free(&mut self, request: &str) -> bool {
        self.changes = self.changes.wrapping_add(1);
        let Some(s) = self.remove_slot(request) else {
            return false;
        };
        let mut blocks = std::mem::take(&mut self.slots[s].blocks);
        for &b in blocks.iter().rev() {
            if b != NULL_BLOCK {
                self.pool.unpin(b);
            }
        }
        blocks.clear();
        self.slots[s].blocks = blocks;
        self.stats.freed_requests += 1;
        true
    }

    /// vLLM's `pop_blocks_for_free`: forgets the request and hands its blocks (in table order)
    /// to the caller, still held; give them back with [`DeviceAllocator::release`].
    pub fn pop_blocks(&mut self, request: &str, out: &mut Vec<BlockId>) -> bool {
        self.changes = self.changes.wrapping_add(1);
        let Some(s) = self.remove_slot(request) else {
            return false;
        };
        for &b in &self.slots[s].blocks {
            *self.parked.entry(b).or_default() += 1;
        }
        out.append(&mut self.slots[s].blocks);
        self.stats.freed_requests += 1;
        true
    }

    /// Blocks popped and not released yet (holds counted once each).
    pub fn num_parked_holds(&self) -> usize {
        self.parked.values().map(|&k| k as usize).sum()
    }

    /// Releases holds handed out by [`DeviceAllocator::pop_blocks`], in the order given (the
    /// first is evicted first; the null block is skipped). Every block must have been popped
    /// as many times as it is released; nothing changes otherwise.
    pub fn release(&mut self, blocks: &[BlockId]) -> Result<()> {
        self.changes = self.changes.wrapping_add(1);
        let mut need: FxHashMap<BlockId, u32> = FxHashMap::default();
        for &b in blocks {
            if b as usize >= self.num_blocks() {
                return Err(SlotError::invalid(
                    None,
                    format!("block {b} is out of range (pool of {})", self.num_blocks()),
                ));
            }
            if b != NULL_BLOCK {
                *need.entry(b).or_default() += 1;
            }
        }
        for (&b, &k) in &need {
            let popped = self.parked.get(&b).copied().unwrap_or(0);
            if popped < k {
                return Err(SlotError::invalid(
                    None,
                    format!("block {b} released {k} time(s), popped {popped} time(s)"),
                ));
            }
        }
        for &b in blocks {
            if b != NULL_BLOCK {
                let k = self.parked.get_mut(&b).expect("validated");
                *k -= 1;
                if *k == 0 {
                    self.parked.remove(&b);
                }
                self.pool.unpin(b);
            }
        }
        Ok(())
    }

    /// vLLM's `evict_blocks`: takes these blocks out of the prefix registry (held ones stay
    /// held). Returns how many were registered.
    pub fn evict_blocks(&mut self, blocks: &[BlockId]) -> Result<usize> {
        self.changes = self.changes.wrapping_add(1);
        if let Some(&b) = blocks.iter().find(|&&b| b as usize >= self.num_blocks()) {
            return Err(SlotError::invalid(
                None,
                format!("block {b} is out of range (pool of {})", self.num_blocks()),
            ));
        }
        let mut n = 0;
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            let fh = self.full.get(b);
            if self.pool.unregister_block(b).is_some() {
                n += 1;
                self.stats.evicted_blocks += 1;
                if self.record_evictions {
                    self.evicted.push(fh);
                }
            }
        }
        Ok(n)
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds a block (the null block aside);
    /// then every registration goes. Returns whether it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.changes = self.changes.wrapping_add(1);
        if self.pool.num_held() != 1 {
            return false;
        }
        self.pool.clear();
        true
    }

    /// Hashes of the blocks evicted since the last call, in eviction order.
    pub fn drain_evicted(&mut self, out: &mut Vec<FullHash>) {
        out.append(&mut self.evicted);
    }
    pub fn num_evicted_pending(&self) -> usize {
        self.evicted.len()
    }

    pub fn take_new_block_ids(&mut self, out: &mut Vec<BlockId>) {
        out.append(&mut self.new_block_ids);
    }
    /// Records the request's blocks from table position `start` for zeroing again.
    pub fn record_for_zeroing(&mut self, request: &str, start: usize) {
        if !self.record_new_blocks {
            return;
        }
        if let Some(s) = self.slot_of(request) {
            let blocks = &self.slots[s].blocks;
            let from = start.min(blocks.len());
            self.new_block_ids.extend_from_slice(&blocks[from..]);
        }
    }

    /// Full consistency check (tests): the pool's own invariants, every holder accounted for,
    /// every registered block under the key of its full hash, and free + cached + held == pool.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        let n = self.num_blocks();
        let mut holders = vec![0u32; n];
        holders[NULL_BLOCK as usize] = 1;
        for (&b, &k) in &self.parked {
            if b as usize >= n || b == NULL_BLOCK || k == 0 {
                return Err(format!("parked hold on block {b} ({k})"));
            }
            holders[b as usize] += k;
        }
        let mut reserved = 0;
        for (rid, &s) in &self.reqs {
            let r = &self.slots[s as usize];
            reserved += r.reserved;
            if r.num_cached > r.blocks.len() {
                return Err(format!(
                    "request {rid:?}: {} cached blocks of {}",
                    r.num_cached,
                    r.blocks.len()
                ));
            }
            let mut seen = rustc_hash::FxHashSet::default();
            for (i, &b) in r.blocks.iter().enumerate() {
                if b as usize >= n {
                    return Err(format!("request {rid:?} holds block {b} out of range"));
                }
                if b == NULL_BLOCK {
                    return Err(format!("request {rid:?} holds the null block"));
                }
                if !seen.insert(b) {
                    return Err(format!("request {rid:?} holds block {b} twice"));
                }
                holders[b as usize] += 1;
                if i >= r.num_cached && self.pool.is_registered(b) {
                    return Err(format!(
                        "request {rid:?}: block {b} at {i}, past its {} cached blocks, is registered",
                        r.num_cached
                    ));
                }
            }
        }
        if reserved != self.step_reserved {
            return Err(format!(
                "requests reserve {reserved} lookahead blocks, counted {}",
                self.step_reserved
            ));
        }
        let debt: usize = self
            .reqs
            .values()
            .map(|&s| {
                let r = &self.slots[s as usize];
                r.shadow.saturating_sub(r.blocks.len())
            })
            .sum();
        if debt != self.debt || self.step_reserved > self.debt {
            return Err(format!(
                "lookahead debt {debt}, counted {} (reserved {})",
                self.debt, self.step_reserved
            ));
        }
        for (b, &k) in holders.iter().enumerate() {
            let rc = self.pool.refcount(b as BlockId);
            if rc < k {
                return Err(format!("block {b}: {k} holders, refcount {rc}"));
            }
            if rc > k {
                return Err(format!(
                    "block {b}: refcount {rc} but {k} holder(s): a leaked hold"
                ));
            }
            if self.pool.is_registered(b as BlockId)
                && self.full.get(b as BlockId).key()
                    != self.pool.registered_hash(b as BlockId).unwrap_or(0)
            {
                return Err(format!("block {b}: registry key is not its full hash's"));
            }
        }
        let (free, cached, held) = (
            self.pool.num_free(),
            self.pool.num_cached(),
            self.pool.num_held(),
        );
        if free + cached + held != n {
            return Err(format!(
                "free {free} + cached {cached} + held {held} != {n}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
