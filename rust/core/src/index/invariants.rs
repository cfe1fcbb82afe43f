//! The internal-consistency check that tests run after every operation.

use super::blocks::{NIL, UNLINKED};
use super::PrefixIndex;

impl PrefixIndex {
    /// Checks the internal links; `Err` names the first broken one (tests call it).
    pub fn check_invariants(&self) -> Result<(), String> {
        let eagle = self.workers.iter().flatten().filter(|w| w.eagle).count();
        if eagle != self.eagle_workers as usize {
            return Err(format!(
                "{eagle} workers marked EAGLE, counted {}",
                self.eagle_workers
            ));
        }
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
}
