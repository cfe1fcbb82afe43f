//! Workers: the registry of names and ids, and per worker the map from the engine's block hash
//! to its entry (key, node, groups per tier).

use rustc_hash::FxHashMap;

use super::{IndexError, IndexResult, LastBlock, PrefixIndex, NUM_TIERS};

pub type WorkerId = u32;

#[derive(Debug, Clone, Copy)]
pub(super) struct EngineEntry {
    /// The block's key, also here (not only in the node) so resolving a parent and checking a
    /// repeated store do not touch the node: one cache miss less per block.
    pub(super) key: u64,
    pub(super) node: u32,
    pub(super) groups: [u32; NUM_TIERS],
    /// Whether it can be the last block of an EAGLE worker's hit (`last_block.rs`).
    pub(super) last: LastBlock,
}

impl EngineEntry {
    pub(super) fn tiers(&self) -> u8 {
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
pub(super) struct Worker {
    pub(super) engines: FxHashMap<u64, EngineEntry>,
    /// Runs an EAGLE-family drafter: the last-block rule applies to its scores.
    pub(super) eagle: bool,
}

impl PrefixIndex {
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
        if self.worker(id).is_some_and(|w| w.eagle) {
            self.eagle_workers -= 1;
        }
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

    /// Marks a worker as running an EAGLE-family drafter (or not): its scores then count the
    /// last block of a prefix only when its engine would serve it (see the module docs).
    pub fn set_worker_eagle(&mut self, name: &str, eagle: bool) -> IndexResult<()> {
        let id = self.worker_id(name)?;
        if let Some(w) = self.worker_mut(id) {
            if w.eagle != eagle {
                w.eagle = eagle;
                if eagle {
                    self.eagle_workers += 1;
                } else {
                    self.eagle_workers -= 1;
                }
            }
        }
        Ok(())
    }

    pub fn worker_eagle(&self, name: &str) -> IndexResult<bool> {
        let id = self.worker_id(name)?;
        Ok(self.worker(id).is_some_and(|w| w.eagle))
    }

    /// Number of engine-hash entries a worker has.
    pub fn worker_len(&self, name: &str) -> IndexResult<usize> {
        let id = self.worker_id(name)?;
        Ok(self.worker(id).map_or(0, |w| w.engines.len()))
    }

    pub(super) fn worker(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.get(id as usize).and_then(Option::as_ref)
    }

    pub(super) fn worker_mut(&mut self, id: WorkerId) -> Option<&mut Worker> {
        self.workers.get_mut(id as usize).and_then(Option::as_mut)
    }
}
