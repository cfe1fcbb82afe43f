//! `kvslots._core.SlotManager`: the slot manager over a block pool it owns (subclassed by
//! `kvslots.SlotManager`). Argument conversion, error mapping and GIL release only; the slot
//! rules are `kvslots_core::SlotManager`'s.

use std::collections::HashMap;

use kvslots_core as core;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{batch_meta, count, events_to_py, log_to_msgpack, IntArg};
use crate::errors::{invalid, slot_error};
use crate::slot_info::SlotInfo;

/// The slot manager over a block pool it owns. See `kvslots.SlotManager` for the documented API.
#[pyclass(module = "kvslots._core", subclass)]
pub(crate) struct SlotManager {
    inner: core::SlotManager,
    out: core::StepOutput,
    /// Scratch for msgpack event batches, reused so a warm encode allocates nothing.
    wire: Vec<u8>,
}

type StepArrays<'py> = (
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u32>>,
);

#[pymethods]
impl SlotManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, hash_seed=0, enable_prefix_caching=true, max_tokens_per_slot=None))]
    fn new(
        num_blocks: i64,
        block_size: i64,
        hash_seed: u64,
        enable_prefix_caching: bool,
        max_tokens_per_slot: Option<i64>,
    ) -> PyResult<Self> {
        let cfg = core::ManagerConfig {
            num_blocks: count(num_blocks, "num_blocks", None)?,
            block_size: count(block_size, "block_size", None)?,
            hash_seed,
            enable_prefix_caching,
            max_tokens_per_slot: max_tokens_per_slot
                .map(|m| count(m, "max_tokens_per_slot", None))
                .transpose()?,
        };
        Ok(SlotManager {
            inner: core::SlotManager::new(cfg).map_err(slot_error)?,
            out: Default::default(),
            wire: Vec::new(),
        })
    }

    #[pyo3(signature = (request_id, prompt, *, lookahead=0, match_prefix=true, lora_id=None))]
    fn create(
        &mut self,
        request_id: &str,
        prompt: &Bound<'_, PyAny>,
        lookahead: i64,
        match_prefix: bool,
        lora_id: Option<u64>,
    ) -> PyResult<usize> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        let prompt = IntArg::<u32>::extract(prompt, "prompt", Some(request_id))?;
        self.inner
            .create(request_id, prompt.as_slice(), k, match_prefix, lora_id)
            .map(|(_, m)| m)
            .map_err(slot_error)
    }

    fn slot_id(&self, request_id: &str) -> PyResult<u64> {
        self.inner.slot_id(request_id).map_err(slot_error)
    }

    fn reserve(&mut self, request_id: &str, new_tokens: i64) -> PyResult<usize> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        self.inner.reserve(request_id, n).map_err(slot_error)
    }

    fn commit(&mut self, request_id: &str, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = IntArg::<u32>::extract(tokens, "tokens", Some(request_id))?;
        self.inner
            .commit(request_id, tokens.as_slice())
            .map_err(slot_error)
    }

    fn rollback(&mut self, request_id: &str, num_tokens: i64) -> PyResult<()> {
        let n = count(num_tokens, "num_tokens", Some(request_id))?;
        self.inner.rollback(request_id, n).map_err(slot_error)
    }

    fn set_lookahead(&mut self, request_id: &str, lookahead: i64) -> PyResult<usize> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.set_lookahead(request_id, k).map_err(slot_error)
    }

    fn finish(&mut self, request_id: &str) -> PyResult<()> {
        self.inner.finish(request_id).map_err(slot_error)
    }

    fn evict(&mut self, num_blocks: i64) -> PyResult<usize> {
        Ok(self.inner.evict(count(num_blocks, "num_blocks", None)?))
    }

    fn clear_cache(&mut self) -> usize {
        self.inner.clear_cache()
    }

    #[pyo3(signature = (slot_ids, num_accepted, accepted_tokens, num_rejected, num_new_tokens, lookahead=None))]
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        slot_ids: &Bound<'py, PyAny>,
        num_accepted: &Bound<'py, PyAny>,
        accepted_tokens: &Bound<'py, PyAny>,
        num_rejected: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        lookahead: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<StepArrays<'py>> {
        let slots = IntArg::<u64>::extract(slot_ids, "slot_ids", None)?;
        let acc = IntArg::<u32>::extract(num_accepted, "num_accepted", None)?;
        let toks = IntArg::<u32>::extract(accepted_tokens, "accepted_tokens", None)?;
        let rej = IntArg::<u32>::extract(num_rejected, "num_rejected", None)?;
        let new = IntArg::<u32>::extract(num_new_tokens, "num_new_tokens", None)?;
        let look = lookahead
            .map(|l| IntArg::<u32>::extract(l, "lookahead", None))
            .transpose()?;
        let input = core::StepInput {
            slots: slots.as_slice(),
            num_accepted: acc.as_slice(),
            accepted_tokens: toks.as_slice(),
            num_rejected: rej.as_slice(),
            num_new_tokens: new.as_slice(),
            lookahead: look.as_ref().map(|l| l.as_slice()),
        };
        let (inner, out) = (&mut self.inner, &mut self.out);
        py.detach(|| inner.step(&input, out)).map_err(slot_error)?;
        Ok((
            PyArray1::from_slice(py, &self.out.num_new_blocks),
            PyArray1::from_slice(py, &self.out.new_block_ids),
            PyArray1::from_slice(py, &self.out.num_committed_blocks),
        ))
    }

    // ---- queries ----

    fn block_table(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .block_table(request_id)
            .map(<[u32]>::to_vec)
            .map_err(slot_error)
    }
    fn slot_info(&self, request_id: &str) -> PyResult<SlotInfo> {
        self.inner
            .slot_info(request_id)
            .map(Into::into)
            .map_err(slot_error)
    }
    fn committed_tokens(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .slot(request_id)
            .map(|s| s.tokens().to_vec())
            .map_err(slot_error)
    }
    fn block_hashes(&self, request_id: &str) -> PyResult<Vec<u64>> {
        self.inner
            .slot(request_id)
            .map(|s| s.hashes().to_vec())
            .map_err(slot_error)
    }
    fn request_ids(&self) -> Vec<String> {
        self.inner.request_ids().map(str::to_owned).collect()
    }
    fn registered_hashes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        v
    }
    fn lookup(&self, block_hash: u64) -> Option<u32> {
        self.inner.pool().lookup(block_hash)
    }
    fn registered_hash(&self, block_id: u32) -> PyResult<Option<u64>> {
        self.check_block(block_id)?;
        Ok(self.inner.pool().registered_hash(block_id))
    }
    fn refcount(&self, block_id: u32) -> PyResult<u32> {
        self.check_block(block_id)?;
        Ok(self.inner.pool().refcount(block_id))
    }
    fn cached_blocks(&self) -> Vec<u32> {
        self.inner.pool().lru_order()
    }
    fn stats(&self) -> HashMap<&'static str, u64> {
        let s = self.inner.stats();
        HashMap::from([
            ("requests_created", s.requests_created),
            ("requests_finished", s.requests_finished),
            ("prefix_hit_tokens", s.prefix_hit_tokens),
            ("committed_tokens", s.committed_tokens),
            ("committed_blocks", s.committed_blocks),
            ("registered_blocks", s.registered_blocks),
            ("rolled_back_tokens", s.rolled_back_tokens),
            ("allocated_blocks", s.allocated_blocks),
            ("released_blocks", s.released_blocks),
            ("evicted_blocks", s.evicted_blocks),
        ])
    }
    /// Queued events as tuples, emptying the queue.
    fn drain_raw_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = events_to_py(py, self.inner.events())?;
        self.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format), leaving the queue as is.
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
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
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
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
    fn num_pending_events(&self) -> usize {
        self.inner.events().len()
    }
    /// Drops the queued events without turning them into Python objects (an engine with no
    /// event subscriber); returns how many there were.
    fn discard_events(&mut self) -> usize {
        let n = self.inner.events().len();
        self.inner.events_mut().clear();
        n
    }
    /// None when every invariant holds, else a description of the first broken one.
    fn check_invariants(&self) -> Option<String> {
        self.inner.check_invariants().err()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn hash_seed(&self) -> u64 {
        self.inner.config().hash_seed
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    #[getter]
    fn num_held(&self) -> usize {
        self.inner.num_held()
    }
    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.num_cached()
    }
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }
    #[staticmethod]
    fn metadata_bytes_per_block() -> usize {
        core::BlockPool::bytes_per_block()
    }
    fn __len__(&self) -> usize {
        self.inner.num_slots()
    }
    fn __contains__(&self, request_id: &str) -> bool {
        self.inner.contains(request_id)
    }
}

impl SlotManager {
    fn check_block(&self, block_id: u32) -> PyResult<()> {
        let n = self.inner.config().num_blocks;
        if block_id as usize >= n {
            return Err(invalid(
                None,
                format!("block id {block_id} is outside the pool of {n} blocks"),
            ));
        }
        Ok(())
    }
}
