//! Block pool: fixed block ids, reference counts, a free stack, the prefix registry and an LRU of
//! cached (registered, unreferenced) blocks.
//!
//! Every block is in exactly one state:
//! - free: on the free stack, refcount 0, not registered;
//! - held: refcount > 0 (registered or not);
//! - cached: refcount 0, registered, on the LRU (evicted lazily when the free stack runs dry).
//!
//! Metadata is struct-of-arrays, fixed at construction, 28 bytes per block in all, registry
//! included: a refcount with the registered flag in its top bit (4), the block's hash (8), two
//! links (4 + 4: the LRU's for a cached block, the free stack's for a free one) and two slots of
//! the prefix index (2 x 4). Nothing is allocated after construction (but a small scratch list
//! of eviction victims), and every array starts zeroed, so building a pool of a million blocks
//! costs a few zeroed pages until blocks are used.

use std::hash::{BuildHasher, RandomState};

use crate::error::{Result, SlotError};

/// Integer types whose all-zero bytes are the value 0.
pub(crate) trait ZeroInt: Copy {}
impl ZeroInt for u8 {}
impl ZeroInt for u32 {}
impl ZeroInt for u64 {}

/// `n` zeros, lazily zeroed by the OS as `vec![0; n]` is, or `None` when they cannot be
/// allocated: `vec!` would abort the process, and `n` comes from a caller's block count.
pub(crate) fn try_zeroed<T: ZeroInt>(n: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `layout` has a nonzero size; a non-null result is `n` zeroed `T`s (zero bytes
    // are the integer 0) from the global allocator with the layout `Vec<T>` of capacity `n`
    // frees with.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout);
        if p.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(p.cast::<T>(), n, n))
    }
}

/// `n` copies of `v`, or `None` when they cannot be allocated (see [`try_zeroed`]).
pub(crate) fn try_filled<T: Clone>(v: T, n: usize) -> Option<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).ok()?;
    out.resize(n, v);
    Some(out)
}

pub type BlockId = u32;
const NIL: u32 = u32::MAX;
/// Top bit of `meta`: the block is registered (in the prefix index).
const REGISTERED: u32 = 1 << 31;
const REFCOUNT: u32 = REGISTERED - 1;

#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Refcount (low 31 bits) and the registered flag (top bit).
    meta: Vec<u32>,
    /// The registered hash of a registered block (stale otherwise).
    hash: Vec<u64>,
    // Intrusive doubly linked LRU over cached blocks: head is least recently used. A free
    // block's `next` links the free stack instead.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_cached: usize,
    // Free stack: blocks pushed back (linked through `next`, top first) above the blocks
    // `fresh..num_blocks` that were never handed out (handed out in increasing order).
    free_top: u32,
    num_pushed: usize,
    fresh: u32,
    index: PrefixIndex,
    /// Scratch: the blocks one allocation evicts.
    victims: Vec<u32>,
    /// Duplicate chains (pools built with [`BlockPool::with_duplicates`], empty otherwise):
    /// `dup[b]` is 1 + the next block registered under the same hash as `b`, 0 at a chain's
    /// end. The index holds a chain's first block (the oldest registration); the others are
    /// registered (flagged, cached when unreferenced, evicted one by one) but found only once
    /// the blocks ahead of them leave the registry.
    dup: Vec<u32>,
    /// Registered blocks that are not first in their chain.
    num_dups: usize,
}

/// splitmix64's finaliser: a bijection that spreads every input bit over the output.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Starts loading the cache line at `p` (a hint: never faults, never reads into the program).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch instruction has no architectural effect; any address is allowed.
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The prefix registry: an open-addressing table (linear probing, backward-shift deletion,
/// load at most 1/2) of block ids, keyed by the hash the pool stores for each block.
///
/// A slot is `tag | displacement << id_bits | (block id + 1)`, 0 when empty. The block id takes
/// the bits `num_blocks` needs; of the rest, up to 4 hold the entry's distance from its home
/// slot (saturated: the top value means "at least that far, ask the hash"), and the remaining
/// high bits a fingerprint of the hash (11 bits for a pool of 100k blocks, 8 for 1M). So a
/// probe reads a block's hash only when the fingerprint matches, and a deletion shifts the
/// entries after it without reading theirs. Home slots come from the hash mixed with a per-pool
/// random key, so chosen token sequences cannot pile their blocks into one probe run.
#[derive(Debug, Clone)]
struct PrefixIndex {
    slots: Vec<u32>,
    key: u64,
    id_bits: u32,
    dist_bits: u32,
    len: usize,
}

/// Where a probe for a hash ended.
enum Probe {
    Found(BlockId),
    /// Not present: the empty slot it would go in, and that slot's distance from home.
    Vacant(usize, usize),
}

impl PrefixIndex {
    fn new(num_blocks: usize, max_dist_bits: u32) -> Option<Self> {
        // Enough bits for `num_blocks` (the largest id + 1); at least one is left over.
        let id_bits = u32::BITS - (num_blocks as u32).leading_zeros();
        Some(PrefixIndex {
            slots: try_zeroed((2 * num_blocks).max(8))?,
            key: RandomState::new().hash_one(0x006b_7673_6c6f_7473_u64),
            id_bits,
            dist_bits: (u32::BITS - id_bits).min(max_dist_bits),
            len: 0,
        })
    }

    #[inline]
    fn mixed(&self, hash: u64) -> u64 {
        mix64(hash ^ self.key)
    }
    /// Home slot: multiply-shift range reduction of the mix's high bits onto the table.
    #[inline]
    fn home_of(&self, mixed: u64) -> usize {
        ((mixed as u128 * self.slots.len() as u128) >> 64) as usize
    }
    #[inline]
    fn home(&self, hash: u64) -> usize {
        self.home_of(self.mixed(hash))
    }
    #[inline]
    fn tag_shift(&self) -> u32 {
        self.id_bits + self.dist_bits
    }
    /// The fingerprint bits of a slot (none when the id and distance take all 32).
    #[inline]
    fn tag_mask(&self) -> u32 {
        u32::MAX.checked_shl(self.tag_shift()).unwrap_or(0)
    }
    #[inline]
    fn tag_of(&self, mixed: u64) -> u32 {
        (mixed as u32) & self.tag_mask()
    }
    #[inline]
    fn dist_max(&self) -> usize {
        (1usize << self.dist_bits) - 1
    }
    /// The block id + 1 of a slot (0: empty).
    #[inline]
    fn id(&self, v: u32) -> u32 {
        v & ((1u32 << self.id_bits) - 1)
    }
    #[inline]
    fn encode(&self, tag: u32, dist: usize, block: BlockId) -> u32 {
        tag | ((dist.min(self.dist_max()) as u32) << self.id_bits) | (block + 1)
    }
    /// Distance from home of the entry `v` in slot `j`.
    #[inline]
    fn dist(&self, v: u32, j: usize, hashes: &[u64]) -> usize {
        let d = ((v >> self.id_bits) as usize) & self.dist_max();
        if d < self.dist_max() {
            return d;
        }
        let home = self.home(hashes[(self.id(v) - 1) as usize]);
        (j + self.slots.len() - home) % self.slots.len()
    }
    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    #[inline]
    fn probe(&self, hash: u64, hashes: &[u64]) -> Probe {
        let m = self.mixed(hash);
        let (tag, tag_mask) = (self.tag_of(m), self.tag_mask());
        let (mut i, mut d) = (self.home_of(m), 0);
        loop {
            let v = self.slots[i];
            if v == 0 {
                return Probe::Vacant(i, d);
            }
            if v & tag_mask == tag {
                let b = self.id(v) - 1;
                if hashes[b as usize] == hash {
                    return Probe::Found(b);
                }
            }
            i = self.next(i);
            d += 1;
        }
    }

    fn lookup(&self, hash: u64, hashes: &[u64]) -> Option<BlockId> {
        match self.probe(hash, hashes) {
            Probe::Found(b) => Some(b),
            Probe::Vacant(..) => None,
        }
    }

    #[inline]
    fn prefetch(&self, hash: u64) {
        prefetch(self.slots.as_ptr().wrapping_add(self.home(hash)));
    }

    /// Points the entry of `old` (registered under `hash`) at `new`, registered under the same
    /// hash: same home, same fingerprint, same distance.
    fn replace(&mut self, old: BlockId, new: BlockId, hash: u64) {
        let mut j = self.home(hash);
        while self.id(self.slots[j]) != old + 1 {
            j = self.next(j);
        }
        let id_mask = (1u32 << self.id_bits) - 1;
        self.slots[j] = (self.slots[j] & !id_mask) | (new + 1);
    }

    /// Removes `block`, registered under `hash`.
    fn remove(&mut self, block: BlockId, hash: u64, hashes: &[u64]) {
        let mut hole = self.home(hash);
        while self.id(self.slots[hole]) != block + 1 {
            hole = self.next(hole);
        }
        // Backward-shift deletion: an entry after the hole moves into it when its home is not
        // (cyclically) after the hole, i.e. when it sits at least as far from home as from
        // the hole.
        let n = self.slots.len();
        let mut j = hole;
        loop {
            j = self.next(j);
            let v = self.slots[j];
            if v == 0 {
                break;
            }
            let d = self.dist(v, j, hashes);
            let gap = (j + n - hole) % n;
            if d >= gap {
                self.slots[hole] = self.encode(v & self.tag_mask(), d - gap, self.id(v) - 1);
                hole = j;
            }
        }
        self.slots[hole] = 0;
        self.len -= 1;
    }

    fn blocks(&self) -> impl Iterator<Item = (usize, BlockId)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, &v)| v != 0)
            .map(|(j, &v)| (j, self.id(v) - 1))
    }
}

impl BlockPool {
    /// Pools hold fewer blocks than this (the refcount word keeps one bit for the flag).
    pub const MAX_BLOCKS: usize = REGISTERED as usize;

    pub fn new(num_blocks: usize) -> Self {
        Self::try_new(num_blocks).expect("pool metadata allocation")
    }

    /// As [`BlockPool::new`], an error when the pool's metadata cannot be allocated.
    pub fn try_new(num_blocks: usize) -> Result<Self> {
        Self::with_index_dist_bits(num_blocks, 4).ok_or_else(|| Self::no_memory(num_blocks))
    }

    fn no_memory(num_blocks: usize) -> SlotError {
        SlotError::unallocatable("num_blocks", num_blocks, "the pool's metadata")
    }

    /// A pool whose registry keeps several blocks under one hash, as vLLM's does: a block
    /// filled with the same tokens as a registered one is registered too ([`register_or_chain`])
    /// instead of staying private, and becomes the one hits find when the blocks registered
    /// before it are evicted. Costs 4 bytes per block more.
    ///
    /// [`register_or_chain`]: BlockPool::register_or_chain
    pub fn with_duplicates(num_blocks: usize) -> Self {
        Self::try_with_duplicates(num_blocks).expect("pool metadata allocation")
    }

    /// As [`BlockPool::with_duplicates`], an error when the metadata cannot be allocated.
    pub fn try_with_duplicates(num_blocks: usize) -> Result<Self> {
        let mut p = Self::try_new(num_blocks)?;
        p.dup = try_zeroed(num_blocks).ok_or_else(|| Self::no_memory(num_blocks))?;
        Ok(p)
    }

    fn with_index_dist_bits(num_blocks: usize, dist_bits: u32) -> Option<Self> {
        assert!(num_blocks < Self::MAX_BLOCKS, "pool too large");
        Some(BlockPool {
            meta: try_zeroed(num_blocks)?,
            hash: try_zeroed(num_blocks)?,
            prev: try_zeroed(num_blocks)?,
            next: try_zeroed(num_blocks)?,
            head: NIL,
            tail: NIL,
            num_cached: 0,
            free_top: NIL,
            num_pushed: 0,
            fresh: 0,
            index: PrefixIndex::new(num_blocks, dist_bits)?,
            victims: Vec::new(),
            dup: Vec::new(),
            num_dups: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }
    pub fn num_free(&self) -> usize {
        self.num_pushed + (self.num_blocks() - self.fresh as usize)
    }
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }
    pub fn num_held(&self) -> usize {
        self.num_blocks() - self.num_free() - self.num_cached
    }
    /// Blocks an allocation can take: free plus evictable.
    pub fn available(&self) -> usize {
        self.num_free() + self.num_cached
    }
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.meta[block as usize] & REFCOUNT
    }
    pub fn is_registered(&self, block: BlockId) -> bool {
        self.meta[block as usize] & REGISTERED != 0
    }
    /// The registered hash of a block, if it is registered.
    pub fn registered_hash(&self, block: BlockId) -> Option<u64> {
        self.is_registered(block).then(|| self.hash[block as usize])
    }
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.index.lookup(hash, &self.hash)
    }
    /// Distinct registered hashes.
    pub fn num_registered(&self) -> usize {
        self.index.len
    }
    /// Registered blocks, duplicates included.
    pub fn num_registered_blocks(&self) -> usize {
        self.index.len + self.num_dups
    }
    pub fn registered_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.blocks().map(|(_, b)| self.hash[b as usize])
    }
    /// Cached blocks from least to most recently used.
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_cached);
        let mut b = self.head;
        while b != NIL {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }
    /// Bytes of metadata per block, the prefix registry included (see the module docs).
    pub fn bytes_per_block() -> usize {
        4 + 8 + 4 + 4 + 2 * 4
    }

    /// Hints that `hash` is about to be looked up or registered: starts loading its index slot
    /// (a commit hashes its full blocks first, then registers them, so these loads overlap).
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        self.index.prefetch(hash);
    }

    /// Takes `n` blocks (free first, then evicting least recently used cached blocks, whose
    /// hashes are pushed to `evicted`). The caller must have checked `available() >= n`.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>, evicted: &mut Vec<u64>) {
        debug_assert!(n <= self.available());
        out.reserve(n);
        let mut left = n;
        while left > 0 {
            let Some(b) = self.pop_free() else { break };
            self.meta[b as usize] = 1;
            out.push(b);
            left -= 1;
        }
        if left == 0 {
            return;
        }
        // Evict the `left` least recently used blocks, in LRU order: walk the run from the
        // head starting the loads of their hashes, detach it in one go, start the loads of
        // their index slots, then unregister them.
        self.victims.clear();
        let mut b = self.head;
        for _ in 0..left {
            debug_assert!(b != NIL);
            self.victims.push(b);
            prefetch(&self.hash[b as usize]);
            b = self.next[b as usize];
        }
        self.head = b;
        if b != NIL {
            self.prev[b as usize] = NIL;
        } else {
            self.tail = NIL;
        }
        self.num_cached -= left;
        for &v in &self.victims {
            self.index.prefetch(self.hash[v as usize]);
        }
        for j in 0..self.victims.len() {
            let v = self.victims[j];
            evicted.push(self.hash[v as usize]);
            self.unregister(v);
            self.meta[v as usize] = 1;
            out.push(v);
        }
    }

    /// Adds a holder to a block that is already held or cached (a prefix hit).
    pub fn pin(&mut self, block: BlockId) {
        let i = block as usize;
        if self.meta[i] & REFCOUNT == 0 {
            debug_assert!(self.is_registered(block));
            self.unlink(block);
        }
        self.meta[i] += 1;
    }

    /// Drops a holder; at zero a registered block becomes cached (most recently used) and an
    /// unregistered one free.
    pub fn unpin(&mut self, block: BlockId) {
        let i = block as usize;
        debug_assert!(self.meta[i] & REFCOUNT > 0);
        self.meta[i] -= 1;
        match self.meta[i] {
            REGISTERED => self.push_lru(block),
            0 => self.push_free(block),
            _ => {}
        }
    }

    /// Registers a held block under `hash`. Returns false (and changes nothing) when another
    /// block already holds that hash or the block is registered already.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        let i = block as usize;
        if self.meta[i] & REGISTERED != 0 {
            return false;
        }
        match self.index.probe(hash, &self.hash) {
            Probe::Found(_) => false,
            Probe::Vacant(slot, dist) => {
                let tag = self.index.tag_of(self.index.mixed(hash));
                self.index.slots[slot] = self.index.encode(tag, dist, block);
                self.index.len += 1;
                self.meta[i] |= REGISTERED;
                self.hash[i] = hash;
                true
            }
        }
    }

    /// Registers a held block under `hash`, after the blocks already registered under it when
    /// the pool keeps duplicates ([`BlockPool::with_duplicates`]; otherwise as
    /// [`BlockPool::register`]). Returns false (and changes nothing) when the block is
    /// registered already.
    pub fn register_or_chain(&mut self, block: BlockId, hash: u64) -> bool {
        let i = block as usize;
        if self.meta[i] & REGISTERED != 0 {
            return false;
        }
        if self.dup.is_empty() {
            return self.register(block, hash);
        }
        match self.index.probe(hash, &self.hash) {
            Probe::Vacant(slot, dist) => {
                let tag = self.index.tag_of(self.index.mixed(hash));
                self.index.slots[slot] = self.index.encode(tag, dist, block);
                self.index.len += 1;
                self.meta[i] |= REGISTERED;
                self.hash[i] = hash;
                true
            }
            Probe::Found(first) => {
                let mut last = first;
                while self.dup[last as usize] != 0 {
                    last = self.dup[last as usize] - 1;
                }
                self.dup[last as usize] = block + 1;
                self.dup[i] = 0;
                self.meta[i] |= REGISTERED;
                self.hash[i] = hash;
                self.num_dups += 1;
                true
            }
        }
    }

    /// The block registered under the same hash after `block` (pools with duplicates).
    pub fn next_duplicate(&self, block: BlockId) -> Option<BlockId> {
        match self.dup.get(block as usize) {
            Some(&d) if d != 0 => Some(d - 1),
            _ => None,
        }
    }

    /// Takes one block out of the registry (held blocks stay held, a cached one becomes free).
    /// Returns the hash it was registered under, `None` when it was not registered.
    pub fn unregister_block(&mut self, block: BlockId) -> Option<u64> {
        let i = block as usize;
        if i >= self.num_blocks() || self.meta[i] & REGISTERED == 0 {
            return None;
        }
        let hash = self.hash[i];
        let cached = self.meta[i] & REFCOUNT == 0;
        if cached {
            self.unlink(block);
        }
        self.unregister(block);
        if cached {
            self.push_free(block);
        }
        Some(hash)
    }

    fn unregister(&mut self, block: BlockId) {
        let i = block as usize;
        if self.meta[i] & REGISTERED == 0 {
            return;
        }
        self.meta[i] &= REFCOUNT;
        let hash = self.hash[i];
        if !self.dup.is_empty() {
            let next = std::mem::take(&mut self.dup[i]);
            match self.index.lookup(hash, &self.hash) {
                Some(first) if first == block => {
                    if next != 0 {
                        // The next duplicate takes the chain's place in the index.
                        self.index.replace(block, next - 1, hash);
                        self.num_dups -= 1;
                        return;
                    }
                }
                Some(first) => {
                    // A duplicate: unlink it from its chain.
                    let mut c = first;
                    while self.dup[c as usize] != 0 && self.dup[c as usize] != block + 1 {
                        c = self.dup[c as usize] - 1;
                    }
                    if self.dup[c as usize] == block + 1 {
                        self.dup[c as usize] = next;
                        self.num_dups -= 1;
                    }
                    return;
                }
                None => return,
            }
        }
        self.index.remove(block, hash, &self.hash);
    }

    /// Evicts up to `n` least recently used cached blocks to the free stack.
    pub fn evict(&mut self, n: usize, evicted: &mut Vec<u64>) -> usize {
        let mut done = 0;
        while done < n && self.head != NIL {
            let b = self.head;
            self.unlink(b);
            evicted.push(self.hash[b as usize]);
            self.unregister(b);
            self.push_free(b);
            done += 1;
        }
        done
    }

    /// Unregisters every block: cached blocks go to the free stack, held ones stay held and go
    /// to the free stack when their last holder lets go. Returns how many were registered.
    pub fn clear(&mut self) -> usize {
        let n = self.index.len;
        while self.head != NIL {
            let b = self.head;
            self.unlink(b);
            self.push_free(b);
        }
        for j in 0..self.index.slots.len() {
            let v = self.index.slots[j];
            if v != 0 {
                let mut b = (self.index.id(v) - 1) as usize;
                self.meta[b] &= REFCOUNT;
                if !self.dup.is_empty() {
                    while self.dup[b] != 0 {
                        let next = (std::mem::take(&mut self.dup[b]) - 1) as usize;
                        self.meta[next] &= REFCOUNT;
                        b = next;
                    }
                }
                self.index.slots[j] = 0;
            }
        }
        self.index.len = 0;
        self.num_dups = 0;
        n
    }

    fn pop_free(&mut self) -> Option<BlockId> {
        if self.free_top != NIL {
            let b = self.free_top;
            self.free_top = self.next[b as usize];
            self.num_pushed -= 1;
            Some(b)
        } else if (self.fresh as usize) < self.num_blocks() {
            self.fresh += 1;
            Some(self.fresh - 1)
        } else {
            None
        }
    }

    fn push_free(&mut self, b: BlockId) {
        self.next[b as usize] = self.free_top;
        self.free_top = b;
        self.num_pushed += 1;
    }

    fn push_lru(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail != NIL {
            self.next[self.tail as usize] = b;
        } else {
            self.head = b;
        }
        self.tail = b;
        self.num_cached += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.num_cached -= 1;
    }

    /// Full consistency check (tests and debugging): every block in exactly one state.
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        let mut on_free = vec![false; n];
        let mut pushed = 0;
        let mut b = self.free_top;
        while b != NIL {
            let i = b as usize;
            if i >= self.fresh as usize || on_free[i] {
                return Err(format!("block {b} twice on the free stack"));
            }
            on_free[i] = true;
            pushed += 1;
            b = self.next[i];
        }
        if pushed != self.num_pushed {
            return Err(format!(
                "free stack holds {pushed} pushed blocks, counted {}",
                self.num_pushed
            ));
        }
        for f in &mut on_free[self.fresh as usize..] {
            *f = true;
        }
        for (i, (&free, &meta)) in on_free.iter().zip(&self.meta).enumerate() {
            if free && meta != 0 {
                return Err(format!("free block {i} is held or registered"));
            }
        }
        let lru = self.lru_order();
        if lru.len() != self.num_cached {
            return Err(format!(
                "LRU length {} != cached count {}",
                lru.len(),
                self.num_cached
            ));
        }
        for &b in &lru {
            let i = b as usize;
            if on_free[i] || self.meta[i] != REGISTERED {
                return Err(format!("cached block {b} is free, held or unregistered"));
            }
        }
        for (i, (&free, &meta)) in on_free.iter().zip(&self.meta).enumerate() {
            if meta == 0 && !free {
                return Err(format!(
                    "block {i} is lost: unreferenced, not free, not cached"
                ));
            }
        }
        let ix = &self.index;
        let mut indexed = vec![false; n];
        let mut entries = 0;
        for (j, b) in ix.blocks() {
            let b = b as usize;
            if b >= n || indexed[b] || self.meta[b] & REGISTERED == 0 {
                return Err(format!("index slot {j} -> {b} is stale"));
            }
            indexed[b] = true;
            entries += 1;
            let v = ix.slots[j];
            let home = ix.home(self.hash[b]);
            let dist = (j + ix.slots.len() - home) % ix.slots.len();
            if v & ix.tag_mask() != ix.tag_of(ix.mixed(self.hash[b]))
                || ((v >> ix.id_bits) as usize & ix.dist_max()) != dist.min(ix.dist_max())
            {
                return Err(format!(
                    "index slot {j} -> {b}: fingerprint or distance is wrong"
                ));
            }
            let mut k = home;
            while k != j {
                if ix.slots[k] == 0 {
                    return Err(format!(
                        "block {b} sits past an empty slot of its probe run"
                    ));
                }
                k = ix.next(k);
            }
        }
        // Duplicate chains: every member registered under its first block's hash, once.
        let mut chained = 0;
        if !self.dup.is_empty() {
            for (_, first) in ix.blocks() {
                let h = self.hash[first as usize];
                let mut b = first as usize;
                while self.dup[b] != 0 {
                    let next = (self.dup[b] - 1) as usize;
                    if next >= n
                        || indexed[next]
                        || self.meta[next] & REGISTERED == 0
                        || self.hash[next] != h
                    {
                        return Err(format!(
                            "duplicate chain of block {first} is broken at {next}"
                        ));
                    }
                    indexed[next] = true;
                    chained += 1;
                    b = next;
                }
            }
            for (b, &d) in self.dup.iter().enumerate() {
                if d != 0 && !indexed[b] {
                    return Err(format!("block {b} links a chain it is not in"));
                }
            }
        }
        if chained != self.num_dups {
            return Err(format!(
                "{chained} chained duplicates, counted {}",
                self.num_dups
            ));
        }
        let flagged = self.meta.iter().filter(|&&m| m & REGISTERED != 0).count();
        if flagged != entries + chained || entries != ix.len {
            return Err(format!(
                "registered flags ({flagged}), index entries ({entries}) + duplicates ({chained}) and count ({}) disagree",
                ix.len
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_cache_evict() {
        let mut p = BlockPool::new(3);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        p.allocate(3, &mut out, &mut ev);
        assert_eq!(out, vec![0, 1, 2]);
        assert!(p.register(0, 10));
        assert!(!p.register(1, 10), "a hash maps to one block");
        p.unpin(0); // cached
        p.unpin(1); // free
        assert_eq!((p.num_free(), p.num_cached(), p.num_held()), (1, 1, 1));
        out.clear();
        p.allocate(2, &mut out, &mut ev);
        assert_eq!(out, vec![1, 0]);
        assert_eq!(ev, vec![10]);
        assert_eq!(p.lookup(10), None);
        p.check().unwrap();
    }

    #[test]
    fn pin_takes_a_block_off_the_lru() {
        let mut p = BlockPool::new(2);
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        p.allocate(2, &mut out, &mut ev);
        p.register(0, 1);
        p.register(1, 2);
        p.unpin(1);
        p.unpin(0);
        assert_eq!(p.lru_order(), vec![1, 0]);
        p.pin(1);
        assert_eq!(p.lru_order(), vec![0]);
        assert_eq!(p.refcount(1), 1);
        assert_eq!(p.clear(), 2);
        assert_eq!(p.num_free(), 1);
        p.unpin(1);
        assert_eq!(p.num_free(), 2);
        p.check().unwrap();
    }

    /// Random operations against a plain model: the index (collisions, backward-shift
    /// deletion, wrap-around), the free stack order and the LRU agree with it throughout.
    #[test]
    fn random_operations_match_a_model() {
        use std::collections::{HashMap, VecDeque};
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for (size, dist_bits) in [
            (1usize, 4),
            (2, 4),
            (3, 1),
            (7, 4),
            (16, 1),
            (16, 2),
            (33, 4),
        ] {
            let mut p = BlockPool::with_index_dist_bits(size, dist_bits).unwrap();
            // Model: free stack, held refcounts, registry, LRU order.
            let mut free: Vec<u32> = (0..size as u32).rev().collect();
            let mut refs = vec![0u32; size];
            let mut reg: HashMap<u64, u32> = HashMap::new();
            let mut hash_of: HashMap<u32, u64> = HashMap::new();
            let mut lru: VecDeque<u32> = VecDeque::new();
            let mut held: Vec<u32> = Vec::new();
            for _ in 0..4000 {
                match rnd(6) {
                    0 | 1 if p.available() > 0 => {
                        let (mut out, mut ev) = (Vec::new(), Vec::new());
                        p.allocate(1, &mut out, &mut ev);
                        let b = match free.pop() {
                            Some(b) => b,
                            None => {
                                let b = lru.pop_front().unwrap();
                                let h = hash_of.remove(&b).unwrap();
                                reg.remove(&h);
                                assert_eq!(ev, vec![h]);
                                b
                            }
                        };
                        assert_eq!(out, vec![b]);
                        refs[b as usize] = 1;
                        held.push(b);
                    }
                    2 if !held.is_empty() => {
                        // Few distinct hashes, so registrations collide often.
                        let b = held[rnd(held.len() as u64) as usize];
                        let h = rnd(3 * size as u64 + 1);
                        let ok = !hash_of.contains_key(&b) && !reg.contains_key(&h);
                        assert_eq!(p.register(b, h), ok);
                        if ok {
                            reg.insert(h, b);
                            hash_of.insert(b, h);
                        }
                    }
                    3 if !held.is_empty() => {
                        let j = rnd(held.len() as u64) as usize;
                        let b = held.swap_remove(j);
                        p.unpin(b);
                        refs[b as usize] -= 1;
                        if refs[b as usize] == 0 {
                            if hash_of.contains_key(&b) {
                                lru.push_back(b);
                            } else {
                                free.push(b);
                            }
                        }
                    }
                    4 => {
                        // A prefix hit on some registered block.
                        let h = rnd(3 * size as u64 + 1);
                        assert_eq!(p.lookup(h), reg.get(&h).copied());
                        if let Some(&b) = reg.get(&h) {
                            p.pin(b);
                            if refs[b as usize] == 0 {
                                lru.retain(|&c| c != b);
                            }
                            refs[b as usize] += 1;
                            held.push(b);
                        }
                    }
                    5 if rnd(50) == 0 => {
                        assert_eq!(p.clear(), reg.len());
                        free.extend(lru.drain(..));
                        reg.clear();
                        hash_of.clear();
                    }
                    _ => {}
                }
                p.check().unwrap();
                assert_eq!(p.lru_order(), lru.iter().copied().collect::<Vec<_>>());
                assert_eq!(p.num_free(), free.len());
                assert_eq!(p.num_registered(), reg.len());
                for (&h, &b) in &reg {
                    assert_eq!(p.lookup(h), Some(b));
                }
            }
        }
    }

    /// Duplicate chains against a model: a hash maps to the blocks registered under it in
    /// registration order, hits find the first, evictions (LRU, explicit, clear) keep the rest.
    #[test]
    fn duplicate_chains_match_a_model() {
        use std::collections::{HashMap, VecDeque};
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for size in [1usize, 2, 5, 17, 40] {
            let mut p = BlockPool::with_duplicates(size);
            let mut chains: HashMap<u64, Vec<u32>> = HashMap::new();
            let mut hash_of: HashMap<u32, u64> = HashMap::new();
            let mut refs = vec![0u32; size];
            let mut lru: VecDeque<u32> = VecDeque::new();
            let mut held: Vec<u32> = Vec::new();
            let forget =
                |b: u32, chains: &mut HashMap<u64, Vec<u32>>, hash_of: &mut HashMap<u32, u64>| {
                    if let Some(h) = hash_of.remove(&b) {
                        let c = chains.get_mut(&h).unwrap();
                        c.retain(|&y| y != b);
                        if c.is_empty() {
                            chains.remove(&h);
                        }
                    }
                };
            for _ in 0..5000 {
                match rnd(7) {
                    0 | 1 if p.available() > 0 => {
                        let (mut out, mut ev) = (Vec::new(), Vec::new());
                        let free_before = p.num_free();
                        p.allocate(1, &mut out, &mut ev);
                        let b = out[0];
                        if free_before == 0 {
                            let v = lru.pop_front().unwrap();
                            assert_eq!(v, b, "the least recently used block is evicted");
                            assert_eq!(ev, vec![hash_of[&v]]);
                            forget(v, &mut chains, &mut hash_of);
                        }
                        refs[b as usize] = 1;
                        held.push(b);
                    }
                    2 if !held.is_empty() => {
                        let b = held[rnd(held.len() as u64) as usize];
                        let h = rnd(4);
                        let ok = !hash_of.contains_key(&b);
                        assert_eq!(p.register_or_chain(b, h), ok);
                        if ok {
                            chains.entry(h).or_default().push(b);
                            hash_of.insert(b, h);
                        }
                    }
                    3 if !held.is_empty() => {
                        let b = held.swap_remove(rnd(held.len() as u64) as usize);
                        p.unpin(b);
                        refs[b as usize] -= 1;
                        if refs[b as usize] == 0 && hash_of.contains_key(&b) {
                            lru.push_back(b);
                        }
                    }
                    4 => {
                        let h = rnd(4);
                        let first = chains.get(&h).map(|c| c[0]);
                        assert_eq!(p.lookup(h), first);
                        if let Some(b) = first {
                            p.pin(b);
                            if refs[b as usize] == 0 {
                                lru.retain(|&c| c != b);
                            }
                            refs[b as usize] += 1;
                            held.push(b);
                        }
                    }
                    5 => {
                        let b = rnd(size as u64) as u32;
                        let h = hash_of.get(&b).copied();
                        assert_eq!(p.unregister_block(b), h);
                        if h.is_some() {
                            lru.retain(|&c| c != b);
                            forget(b, &mut chains, &mut hash_of);
                        }
                    }
                    6 if rnd(40) == 0 => {
                        assert_eq!(p.clear(), chains.len());
                        lru.clear();
                        chains.clear();
                        hash_of.clear();
                    }
                    _ => {}
                }
                p.check().unwrap();
                assert_eq!(p.lru_order(), lru.iter().copied().collect::<Vec<_>>());
                assert_eq!(p.num_registered(), chains.len());
                assert_eq!(p.num_registered_blocks(), hash_of.len());
                for (h, c) in &chains {
                    assert_eq!(p.lookup(*h), Some(c[0]));
                }
            }
        }
    }
}
