//! `kvslots._core.PrefixIndex`: the indexer's in-memory prefix index, and `lora_key`.
//! Conversions, exceptions and locking only; the index logic is `kvslots_core::index`.

use std::sync::{Mutex, MutexGuard};

use kvslots_core::index::{
    self as ix, lora_name_key, Change, EngineEntryView, IndexConfig, Tier, NUM_TIERS,
};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::apply_stats::ApplyStats;
use crate::convert::{block_size_arg, list_u32, lora, tier, IntArg};
use crate::errors::{index_error, index_invalid};

type Match = (String, u32, [u32; NUM_TIERS], f64);
type PyMatch<'py> = (Bound<'py, PyString>, u32, [u32; NUM_TIERS], f64);

/// In-memory prefix index: which (worker, tier) holds which block. Thread-safe: calls are
/// serialized by an internal lock, and `apply` decodes and applies without the GIL.
#[pyclass(module = "kvslots._core", frozen)]
pub(crate) struct PrefixIndex {
    inner: Mutex<Inner>,
}

struct Inner {
    ix: ix::PrefixIndex,
    /// Worker names as Python strings, by worker id: lookups return them without allocating.
    names: Vec<Option<Py<PyString>>>,
}

impl std::ops::Deref for Inner {
    type Target = ix::PrefixIndex;
    fn deref(&self) -> &ix::PrefixIndex {
        &self.ix
    }
}
impl std::ops::DerefMut for Inner {
    fn deref_mut(&mut self) -> &mut ix::PrefixIndex {
        &mut self.ix
    }
}

impl PrefixIndex {
    /// Takes the lock; waits without the GIL so a thread applying events (GIL released, lock
    /// held) can always finish.
    fn lock<'a>(&'a self, py: Python<'_>) -> MutexGuard<'a, Inner> {
        // Poisoning needs a panic inside the index, which does not happen on any input; should
        // one happen, keep serving rather than fail every later call.
        self.inner
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner())
    }

    fn matches<'py>(py: Python<'py>, inner: &Inner, res: &[ix::WorkerMatch]) -> Vec<PyMatch<'py>> {
        res.iter()
            .map(|m| {
                let name = match inner.names.get(m.worker as usize) {
                    Some(Some(n)) => n.bind(py).clone(),
                    _ => PyString::new(py, inner.worker_name(m.worker).unwrap_or("?")),
                };
                (name, m.blocks, m.tier_blocks, m.score)
            })
            .collect()
    }
}

#[pymethods]
impl PrefixIndex {
    #[new]
    #[pyo3(signature = (*, capacity=None, tier_weights=None, hash_seed=0, journal=false))]
    fn new(
        capacity: Option<i64>,
        tier_weights: Option<&Bound<'_, PyDict>>,
        hash_seed: u64,
        journal: bool,
    ) -> PyResult<Self> {
        let mut cfg = IndexConfig {
            hash_seed,
            journal,
            ..Default::default()
        };
        if let Some(c) = capacity {
            cfg.capacity = Some(
                usize::try_from(c)
                    .ok()
                    .filter(|c| *c > 0)
                    .ok_or_else(|| index_invalid(format!("capacity must be >= 1, got {c}")))?,
            );
        }
        if let Some(w) = tier_weights {
            for (k, v) in w.iter() {
                let name: String = k.extract()?;
                let weight: f64 = v.extract()?;
                cfg.tier_weights[tier(&name)? as usize] = weight;
            }
        }
        Ok(PrefixIndex {
            inner: Mutex::new(Inner {
                ix: ix::PrefixIndex::new(cfg).map_err(index_error)?,
                names: Vec::new(),
            }),
        })
    }

    fn add_worker(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let mut g = self.lock(py);
        let id = g.add_worker(name).map_err(index_error)? as usize;
        if g.names.len() <= id {
            g.names.resize_with(id + 1, || None);
        }
        g.names[id] = Some(PyString::new(py, name).unbind());
        Ok(())
    }

    /// Forgets the worker and its entries; returns how many entries were dropped.
    fn remove_worker(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        let mut g = self.lock(py);
        let id = g.worker_id(name).map_err(index_error)? as usize;
        let n = g.remove_worker(name).map_err(index_error)?;
        if let Some(slot) = g.names.get_mut(id) {
            *slot = None;
        }
        Ok(n)
    }

    /// Drops the worker's entries (publisher restart, unrecoverable gap); keeps the worker.
    fn clear_worker(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.lock(py).clear_worker(name).map_err(index_error)
    }

    fn workers(&self, py: Python<'_>) -> Vec<String> {
        self.lock(py).worker_names().map(str::to_owned).collect()
    }

    fn worker_len(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.lock(py).worker_len(name).map_err(index_error)
    }

    /// Decodes one raw msgpack `KVEventBatch` payload and applies it for `worker`. Events
    /// without a medium count for `default_tier`. Returns counters; raises `EventDecodeError`
    /// (and applies nothing) when the payload is not an event batch.
    #[pyo3(signature = (worker, payload, default_tier="GPU"))]
    fn apply(
        &self,
        py: Python<'_>,
        worker: &str,
        payload: &[u8],
        default_tier: &str,
    ) -> PyResult<ApplyStats> {
        let t = tier(default_tier)?;
        let mut g = self.lock(py);
        let id = g.worker_id(worker).map_err(index_error)?;
        let g = &mut *g;
        let st = py
            .detach(|| g.apply_payload(id, payload, t))
            .map_err(index_error)?;
        Ok(st.into())
    }

    /// Per worker holding the prompt's first block:
    /// `(worker, blocks, (gpu_blocks, cpu_blocks, storage_blocks), score)`.
    #[pyo3(signature = (token_ids, block_size, lora_id=None, lora_name=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: i64,
        lora_id: Option<u64>,
        lora_name: Option<&str>,
    ) -> PyResult<Vec<PyMatch<'py>>> {
        let bs = block_size_arg(block_size)?;
        let lora = lora(lora_id, lora_name);
        // A list (what JSON gives) is converted block by block, only as far as the walk goes.
        if let Ok(list) = token_ids.cast::<PyList>() {
            let n = list.len();
            let mut pos = 0usize;
            let mut failed: Option<PyErr> = None;
            let mut g = self.lock(py);
            let res = g
                .lookup_by(lora, |buf| {
                    if pos + bs > n {
                        return false;
                    }
                    for j in pos..pos + bs {
                        match list_u32(list, j) {
                            Ok(t) => buf.push(t),
                            Err(e) => {
                                failed = Some(e);
                                return false;
                            }
                        }
                    }
                    pos += bs;
                    true
                })
                .to_vec();
            if let Some(e) = failed {
                return Err(e);
            }
            return Ok(Self::matches(py, &g, &res));
        }
        let tokens = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        let mut g = self.lock(py);
        let res = g
            .lookup(tokens.as_slice(), bs, lora)
            .map_err(index_error)?
            .to_vec();
        Ok(Self::matches(py, &g, &res))
    }

    /// The index keys of every full block of the prompt (the Redis backend looks them up).
    #[pyo3(signature = (token_ids, block_size, lora_id=None, lora_name=None))]
    fn chain_keys(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        block_size: i64,
        lora_id: Option<u64>,
        lora_name: Option<&str>,
    ) -> PyResult<Vec<u64>> {
        let bs = block_size_arg(block_size)?;
        let tokens = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        self.lock(py)
            .chain_keys(tokens.as_slice(), bs, lora(lora_id, lora_name))
            .map_err(index_error)
    }

    /// Scores prompt blocks whose holders were fetched elsewhere: `blocks[i]` maps worker name
    /// to tier bitmask (bit 0 GPU, 1 CPU, 2 STORAGE). Same result shape as `lookup`.
    fn score_blocks(&self, py: Python<'_>, blocks: &Bound<'_, PyList>) -> PyResult<Vec<Match>> {
        let weights = self.lock(py).config().tier_weights;
        let mut names: Vec<String> = Vec::new();
        let mut ids = std::collections::HashMap::<String, u32>::new();
        let mut scorer = ix::Scorer::new(weights);
        for block in blocks.iter() {
            let d = block.cast::<PyDict>()?;
            let mut holders = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                let name: String = k.extract()?;
                let mask: u8 = v.extract()?;
                let next = names.len() as u32;
                let id = *ids.entry(name.clone()).or_insert_with(|| {
                    names.push(name);
                    next
                });
                holders.push((id, mask & 0b111));
            }
            if !scorer.block(holders) {
                break;
            }
        }
        Ok(scorer
            .results()
            .iter()
            .map(|m| {
                (
                    names[m.worker as usize].clone(),
                    m.blocks,
                    m.tier_blocks,
                    m.score,
                )
            })
            .collect())
    }

    /// Entries changed since the last call: `(engine_changes, holder_changes)` with
    /// `engine_changes = [(worker, engine_hash, key | None, (g_gpu, g_cpu, g_storage))]` and
    /// `holder_changes = [(key, worker, tier_mask)]` (mask 0 = gone). Needs `journal=True`.
    fn take_changes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let changes = self.lock(py).take_changes();
        let engines = PyList::empty(py);
        let holders = PyList::empty(py);
        for c in changes {
            match c {
                Change::Engine {
                    worker,
                    engine,
                    entry,
                } => {
                    let (key, groups) = match entry {
                        Some(e) => (Some(e.key), e.groups),
                        None => (None, [0; NUM_TIERS]),
                    };
                    engines.append((worker, engine, key, groups))?;
                }
                Change::Holder { key, worker, tiers } => holders.append((key, worker, tiers))?,
            }
        }
        PyTuple::new(py, [engines.into_any(), holders.into_any()])
    }

    /// Every entry: `[(worker, engine_hash, key, (g_gpu, g_cpu, g_storage))]`.
    fn dump(&self, py: Python<'_>) -> Vec<(String, u64, u64, [u32; NUM_TIERS])> {
        self.lock(py)
            .dump()
            .into_iter()
            .map(|(w, e, v)| (w, e, v.key, v.groups))
            .collect()
    }

    /// Restores entries of one worker, as `dump` gives them: `[(engine_hash, key, groups)]`.
    fn load(
        &self,
        py: Python<'_>,
        worker: &str,
        entries: Vec<(u64, u64, [u32; NUM_TIERS])>,
    ) -> PyResult<()> {
        let mut g = self.lock(py);
        let id = g.worker_id(worker).map_err(index_error)?;
        for (engine, key, groups) in entries {
            g.load_entry(id, engine, EngineEntryView { key, groups });
        }
        Ok(())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, cap) = {
            let g = self.lock(py);
            (g.stats(), g.config().capacity)
        };
        let d = PyDict::new(py);
        d.set_item("keys", s.keys)?;
        d.set_item("entries", s.entries)?;
        d.set_item("workers", s.workers)?;
        d.set_item("capacity", cap)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("events", s.totals.events)?;
        d.set_item("stored_blocks", s.totals.stored_blocks)?;
        d.set_item("removed_blocks", s.totals.removed_blocks)?;
        d.set_item("orphan_blocks", s.totals.orphan_blocks)?;
        d.set_item("unresolved_blocks", s.totals.unresolved_blocks)?;
        d.set_item("invalid_events", s.totals.invalid_events)?;
        d.set_item("unknown_events", s.totals.unknown_events)?;
        d.set_item("lookups", s.totals.lookups)?;
        d.set_item("lookup_blocks", s.totals.lookup_blocks)?;
        Ok(d)
    }

    #[getter]
    fn tier_weights(&self, py: Python<'_>) -> Vec<(&'static str, f64)> {
        let w = self.lock(py).config().tier_weights;
        Tier::ALL
            .iter()
            .map(|t| (t.name(), w[*t as usize]))
            .collect()
    }

    #[getter]
    fn capacity(&self, py: Python<'_>) -> Option<usize> {
        self.lock(py).config().capacity
    }

    /// None when every internal link holds, else the first broken one (tests call it).
    fn check_invariants(&self, py: Python<'_>) -> Option<String> {
        self.lock(py).check_invariants().err()
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.lock(py).len()
    }
}

/// The LoRA key a lookup uses for a LoRA given by name only.
#[pyfunction]
pub(crate) fn lora_key(name: &str) -> u64 {
    lora_name_key(name)
}
