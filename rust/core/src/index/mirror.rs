//! Mirroring the index into a shared store (the Redis backend): the journal of changed entries,
//! and dumping / loading every entry.

use super::blocks::Holder;
use super::workers::EngineEntry;
use super::{PrefixIndex, WorkerId, NUM_TIERS};

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

impl PrefixIndex {
    pub(super) fn mark(&mut self, worker: WorkerId, engine: u64, key: u64) {
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
}
