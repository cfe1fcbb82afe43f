//! `kvslots._core.HostCache`: the host-memory tier keyed by external (vLLM) block hashes. The
//! cache rules are `kvslots_core::HostCache`'s.

use std::collections::HashMap;

use kvslots_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{batch_meta, count, events_to_py, log_to_msgpack, pending, IntArg};
use crate::errors::slot_error;

/// The host-memory tier keyed by external (vLLM) block hashes. See kvslots-core's `HostCache`.
#[pyclass(module = "kvslots._core")]
pub(crate) struct HostCache {
    inner: core::HostCache,
    /// Scratch for msgpack event batches.
    wire: Vec<u8>,
}

#[pymethods]
impl HostCache {
    #[new]
    fn new(num_blocks: i64, block_size: i64) -> PyResult<Self> {
        let n = count(num_blocks, "num_blocks", None)?;
        let bs = count(block_size, "block_size", None)?;
        Ok(HostCache {
            inner: core::HostCache::new(n, bs).map_err(slot_error)?,
            wire: Vec::new(),
        })
    }
    /// Number of leading hashes whose blocks are complete in the cache.
    fn match_prefix(&mut self, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(self.inner.match_prefix(h.as_slice()))
    }
    fn contains(&self, block_hash: u64) -> bool {
        self.inner.contains(block_hash)
    }
    fn num_pending_events(&self) -> usize {
        self.inner.events().len()
    }
    /// The host block holding a cached hash, if any.
    fn lookup(&self, block_hash: u64) -> Option<u32> {
        self.inner.pool().lookup(block_hash)
    }
    /// Pins the blocks of `block_hashes` for a load; returns their host block ids.
    fn begin_load(
        &mut self,
        request_id: &str,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", Some(request_id))?;
        self.inner
            .begin_load(request_id, h.as_slice())
            .map_err(slot_error)
    }
    fn end_load(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = IntArg::<u32>::extract(blocks, "blocks", None)?;
        self.inner.end_load(b.as_slice()).map_err(slot_error)
    }
    /// Takes host blocks for the hashes not cached nor being stored: [(index, hash, block)].
    fn begin_store(&mut self, block_hashes: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u64, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(self
            .inner
            .begin_store(h.as_slice())
            .into_iter()
            .map(|(i, p)| (i, p.hash, p.block))
            .collect())
    }
    /// Registers copied blocks [(hash, block)] of one request run and queues BlockStored.
    #[pyo3(signature = (stores, parent_block_hash, token_ids, lora_id=None))]
    fn complete_store(
        &mut self,
        stores: Vec<(u64, u32)>,
        parent_block_hash: Option<u64>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<u64>,
    ) -> PyResult<()> {
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        self.inner
            .complete_store(&pending(stores), parent_block_hash, t.as_slice(), lora_id)
            .map_err(slot_error)
    }
    /// Begins storing one request's blocks as part of `step`; returns [(index, host block)].
    #[pyo3(signature = (step, block_hashes, parent_block_hash, token_ids, lora_id=None))]
    fn begin_store_run(
        &mut self,
        step: u64,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<u64>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<u64>,
    ) -> PyResult<Vec<(usize, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        self.inner
            .begin_store_run(step, h.as_slice(), parent_block_hash, t.as_slice(), lora_id)
            .map_err(slot_error)
    }
    /// Completes every store run of `step` (aborting runs with a failed block); returns the
    /// number of blocks registered.
    #[pyo3(signature = (step, failed_blocks=Vec::new()))]
    fn complete_step(&mut self, step: u64, failed_blocks: Vec<u32>) -> PyResult<usize> {
        self.inner
            .complete_step(step, &failed_blocks)
            .map_err(slot_error)
    }
    #[getter]
    fn pending_steps(&self) -> usize {
        self.inner.pending_steps()
    }
    fn abort_store(&mut self, stores: Vec<(u64, u32)>) -> PyResult<()> {
        self.inner.abort_store(&pending(stores)).map_err(slot_error)
    }
    fn clear(&mut self) -> usize {
        self.inner.clear()
    }
    fn drain_raw_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = events_to_py(py, self.inner.events())?;
        self.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format); the queue stays.
    #[pyo3(signature = (ts, medium=Some("CPU"), data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let meta = batch_meta(ts, medium, data_parallel_rank, hashes_as_bytes);
        log_to_msgpack(py, self.inner.events(), &mut self.wire, meta)
    }
    /// Like `events_msgpack`, then empties the queue (only when encoding succeeded).
    #[pyo3(signature = (ts, medium=Some("CPU"), data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.events_msgpack(py, ts, medium, data_parallel_rank, hashes_as_bytes)?;
        self.inner.events_mut().clear();
        Ok(bytes)
    }
    fn registered_hashes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        v
    }
    fn stats(&self) -> HashMap<&'static str, u64> {
        let s = self.inner.stats();
        HashMap::from([
            ("lookups", s.lookups),
            ("hit_blocks", s.hit_blocks),
            ("stores_started", s.stores_started),
            ("stores_completed", s.stores_completed),
            ("stores_aborted", s.stores_aborted),
            ("stores_skipped_full", s.stores_skipped_full),
            ("loads_started", s.loads_started),
            ("evicted_blocks", s.evicted_blocks),
        ])
    }
    fn check_invariants(&self) -> Option<String> {
        self.inner.pool().check().err()
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.pool().num_blocks()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.pool().num_free()
    }
    #[getter]
    fn num_held(&self) -> usize {
        self.inner.pool().num_held()
    }
    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.pool().num_cached()
    }
    #[getter]
    fn num_storing(&self) -> usize {
        self.inner.num_storing()
    }
}
