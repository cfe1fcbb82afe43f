//! Block pool: fixed block ids, reference counts, a free stack, the prefix registry and an LRU of
//! cached (registered, unreferenced) blocks.
//!
//! Every block is in exactly one state:
//! - free: on the free stack, refcount 0, not registered;
//! - held: refcount > 0 (registered or not);
//! - cached: refcount 0, registered, on the LRU (evicted lazily when the free stack runs dry).
//!
//! Metadata is struct-of-arrays, 25 bytes per block plus the registry entry of registered blocks.

use std::collections::HashMap;

pub type BlockId = u32;
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct BlockPool {
    refcount: Vec<u32>,
    hash: Vec<u64>,
    registered: Vec<bool>,
    // Intrusive doubly linked LRU over cached blocks: head is least recently used.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_cached: usize,
    // Free stack: the next block handed out is the last element.
    free: Vec<BlockId>,
    registry: HashMap<u64, BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "pool too large");
        BlockPool {
            refcount: vec![0; num_blocks],
            hash: vec![0; num_blocks],
            registered: vec![false; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            num_cached: 0,
            // Block 0 is handed out first.
            free: (0..num_blocks as u32).rev().collect(),
            registry: HashMap::new(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }
    pub fn num_held(&self) -> usize {
        self.num_blocks() - self.free.len() - self.num_cached
    }
    /// Blocks an allocation can take: free plus evictable.
    pub fn available(&self) -> usize {
        self.free.len() + self.num_cached
    }
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount[block as usize]
    }
    pub fn is_registered(&self, block: BlockId) -> bool {
        self.registered[block as usize]
    }
    /// The registered hash of a block, if it is registered.
    pub fn registered_hash(&self, block: BlockId) -> Option<u64> {
        self.registered[block as usize].then(|| self.hash[block as usize])
    }
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.registry.get(&hash).copied()
    }
    pub fn num_registered(&self) -> usize {
        self.registry.len()
    }
    pub fn registered_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.registry.keys().copied()
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
    /// Bytes of per-block metadata (excluding the registry's entries).
    pub fn bytes_per_block() -> usize {
        4 + 8 + 1 + 4 + 4 + 4
    }

    /// Takes `n` blocks (free first, then evicting least recently used cached blocks, whose
    /// hashes are pushed to `evicted`). The caller must have checked `available() >= n`.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>, evicted: &mut Vec<u64>) {
        debug_assert!(n <= self.available());
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let b = self.head;
                    debug_assert!(b != NIL);
                    self.unlink(b);
                    evicted.push(self.hash[b as usize]);
                    self.unregister(b);
                    b
                }
            };
            self.refcount[b as usize] = 1;
            out.push(b);
        }
    }

    /// Adds a holder to a block that is already held or cached (a prefix hit).
    pub fn pin(&mut self, block: BlockId) {
        let i = block as usize;
        if self.refcount[i] == 0 {
            debug_assert!(self.registered[i]);
            self.unlink(block);
        }
        self.refcount[i] += 1;
    }

    /// Drops a holder; at zero a registered block becomes cached (most recently used) and an
    /// unregistered one free.
    pub fn unpin(&mut self, block: BlockId) {
        let i = block as usize;
        debug_assert!(self.refcount[i] > 0);
        self.refcount[i] -= 1;
        if self.refcount[i] == 0 {
            if self.registered[i] {
                self.push_lru(block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Registers a held block under `hash`. Returns false (and changes nothing) when another
    /// block already holds that hash or the block is registered already.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        let i = block as usize;
        if self.registered[i] || self.registry.contains_key(&hash) {
            return false;
        }
        self.registry.insert(hash, block);
        self.registered[i] = true;
        self.hash[i] = hash;
        true
    }

    fn unregister(&mut self, block: BlockId) {
        let i = block as usize;
        if self.registered[i] {
            self.registry.remove(&self.hash[i]);
            self.registered[i] = false;
        }
    }

    /// Evicts up to `n` least recently used cached blocks to the free stack.
    pub fn evict(&mut self, n: usize, evicted: &mut Vec<u64>) -> usize {
        let mut done = 0;
        while done < n && self.head != NIL {
            let b = self.head;
            self.unlink(b);
            evicted.push(self.hash[b as usize]);
            self.unregister(b);
            self.free.push(b);
            done += 1;
        }
        done
    }

    /// Unregisters every block: cached blocks go to the free stack, held ones stay held and go
    /// to the free stack when their last holder lets go. Returns how many were registered.
    pub fn clear(&mut self) -> usize {
        let n = self.registry.len();
        while self.head != NIL {
            let b = self.head;
            self.unlink(b);
            self.free.push(b);
        }
        for (_, b) in self.registry.drain() {
            self.registered[b as usize] = false;
        }
        n
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
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.num_cached -= 1;
    }

    /// Full consistency check (tests and debugging): every block in exactly one state.
    pub fn check(&self) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        let mut on_free = vec![false; n];
        for &b in &self.free {
            let i = b as usize;
            if on_free[i] {
                return Err(format!("block {b} twice on the free stack"));
            }
            on_free[i] = true;
            if self.refcount[i] != 0 || self.registered[i] {
                return Err(format!("free block {b} is held or registered"));
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
            if on_free[i] || self.refcount[i] != 0 || !self.registered[i] {
                return Err(format!("cached block {b} is free, held or unregistered"));
            }
        }
        for i in 0..n {
            if self.refcount[i] == 0 && !on_free[i] && !self.registered[i] {
                return Err(format!(
                    "block {i} is lost: unreferenced, not free, not cached"
                ));
            }
        }
        for (&h, &b) in &self.registry {
            if !self.registered[b as usize] || self.hash[b as usize] != h {
                return Err(format!("registry entry {h:#x} -> {b} is stale"));
            }
        }
        if self.registered.iter().filter(|r| **r).count() != self.registry.len() {
            return Err("registered flags disagree with the registry".into());
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
}
