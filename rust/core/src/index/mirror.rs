//! Mirroring the index into a shared store (the Redis backend): the journal of changed entries,
//! and dumping / loading every entry.

use super::blocks::Holder;
use super::workers::EngineEntry;
use super::{holder_value, LastBlock, PrefixIndex, Tier, WorkerId, NUM_TIERS};

/// The state of one engine-hash entry: the key it resolves to, per tier the bitmask of KV-cache
/// groups that hold it, and what it says for the EAGLE last-block rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineEntryView {
    pub key: u64,
    pub groups: [u32; NUM_TIERS],
    pub last: LastBlock,
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
    /// How a worker holds a key ([`holder_value`]: tier mask and last-block facts); 0 = deleted.
    Holder {
        key: u64,
        worker: String,
        value: u64,
    },
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
                    last: e.last,
                });
            out.push(Change::Engine {
                worker: self.names[w as usize].clone(),
                engine,
                entry,
            });
        }
        for (key, w) in std::mem::take(&mut self.dirty_holders) {
            let value = self.holder_value(key, w);
            out.push(Change::Holder {
                key,
                worker: self.names[w as usize].clone(),
                value,
            });
        }
        out
    }

    /// How `worker` holds `key`, as one [`holder_value`].
    pub(super) fn holder_value(&self, key: u64, worker: WorkerId) -> u64 {
        self.blocks
            .keys
            .get(&key)
            .map_or(0, |&i| self.holder_value_at(i, worker))
    }

    /// How `worker` holds the block in slab slot `node`, as one [`holder_value`]: what the
    /// Redis mirror stores and what the lookup's last-block rule reads, so both decide alike.
    /// Two engine hashes of one worker with the same content share the node: their tiers add
    /// up, and the last-block facts of one held on a host tier (else of any) stand for both.
    pub(super) fn holder_value_at(&self, node: u32, worker: WorkerId) -> u64 {
        let engines = self.worker(worker).map(|w| &w.engines);
        let (mut tiers, mut last, mut last_on_host) = (0u8, LastBlock::UNKNOWN, false);
        for h in self.blocks.nodes[node as usize]
            .holders
            .iter()
            .filter(|h| h.worker == worker)
        {
            tiers |= h.tiers;
            let on_host = h.tiers & !Tier::Gpu.bit() != 0;
            if last_on_host || (last != LastBlock::UNKNOWN && !on_host) {
                continue;
            }
            if let Some(e) = engines.and_then(|m| m.get(&h.engine)) {
                if e.last != LastBlock::UNKNOWN {
                    last = e.last;
                    last_on_host = on_host;
                }
            }
        }
        holder_value(tiers, last)
    }

    /// Every (key, worker) holding as a [`holder_value`], for rewriting a shared store.
    pub fn dump_holders(&self) -> Vec<(u64, String, u64)> {
        let mut seen = rustc_hash::FxHashSet::default();
        let mut out = Vec::new();
        for (id, w) in self.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            for e in w.engines.values() {
                if seen.insert((e.key, id as WorkerId)) {
                    let v = self.holder_value(e.key, id as WorkerId);
                    if v != 0 {
                        out.push((e.key, self.names[id].clone(), v));
                    }
                }
            }
        }
        out
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
                        last: e.last,
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
                    last: entry.last,
                },
            );
        }
        self.entries += 1;
        self.mark(worker, engine, entry.key);
        self.enforce_capacity();
    }
}
