//! The blocks: key -> slab slot, the slab of nodes (each with its holders), the LRU list
//! through it, and eviction down to the configured capacity.

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::{PrefixIndex, WorkerId};

pub(super) const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
pub(super) struct Holder {
    pub(super) engine: u64,
    pub(super) worker: WorkerId,
    pub(super) tiers: u8,
}

/// Most blocks are held by one or two workers: keeping those holders inside the node saves a
/// pointer chase (a cache miss) per block on every lookup.
pub(super) type Holders = SmallVec<[Holder; 2]>;

#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) key: u64,
    pub(super) prev: u32,
    pub(super) next: u32,
    /// Value of `Blocks::clock` when last moved to the front; `UNLINKED` when not in the list.
    pub(super) stamp: u64,
    pub(super) holders: Holders,
}

pub(super) const UNLINKED: u64 = u64::MAX;

/// The blocks: key -> slab slot, the slab, and the LRU list through it.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    pub(super) keys: FxHashMap<u64, u32>,
    pub(super) nodes: Vec<Node>,
    pub(super) free: Vec<u32>,
    pub(super) head: u32, // most recently used
    pub(super) tail: u32,
    /// Counts moves to the front. A node moved fewer than `len / 4` moves ago is within the
    /// most recent quarter of the list and is not moved again (memcached-style bump limiting):
    /// popular blocks would otherwise pay two random neighbour writes on every store and
    /// lookup. Eviction order is thus LRU to within a quarter of the list.
    pub(super) clock: u64,
    /// Keep the LRU list at all: only an index with a capacity ever evicts, and keeping the
    /// list costs several random memory writes per stored, looked-up or removed block.
    pub(super) lru: bool,
}

impl Blocks {
    pub(super) fn new(lru: bool) -> Self {
        Blocks {
            head: NIL,
            tail: NIL,
            lru,
            ..Default::default()
        }
    }

    /// The slot of `key`, created if missing (not yet in the LRU list: the caller links it
    /// with `touch`, once, in the order it wants). One hash probe.
    pub(super) fn node_for(&mut self, key: u64) -> u32 {
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

    pub(super) fn free_node(&mut self, i: u32) {
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

    pub(super) fn touch(&mut self, i: u32) {
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
    pub(super) fn set_holder_tiers(
        &mut self,
        i: u32,
        worker: WorkerId,
        engine: u64,
        f: impl Fn(u8) -> u8,
    ) {
        if let Some(h) = self.nodes[i as usize]
            .holders
            .iter_mut()
            .find(|h| h.worker == worker && h.engine == engine)
        {
            h.tiers = f(h.tiers);
        }
    }
}

impl PrefixIndex {
    pub(super) fn enforce_capacity(&mut self) {
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
}
