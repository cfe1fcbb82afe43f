//! `kvslots._core.HostCache`: the host-memory tier keyed by external (vLLM) block hashes. The
//! cache rules are `kvslots_core::HostCache`'s.
//!
//! Arguments are converted before the cache is borrowed (see `slot_manager.rs`).

use std::collections::HashMap;

use kvslots_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{
    self as conv, arg, count, events_to_py, int, log_to_msgpack, opt_int, pending, IntArg, MetaArgs,
};
use crate::errors::{borrow, borrow_mut, slot_error};

/// The host-memory tier keyed by external (vLLM) block hashes. See kvslots-core's `HostCache`.
#[pyclass(module = "kvslots._core", weakref)]
pub(crate) struct HostCache {
    inner: core::HostCache,
    /// Scratch for msgpack event batches.
    wire: Vec<u8>,
}

#[pymethods]
impl HostCache {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it owns the host tier's blocks and their hashes, which a copy would hand out twice",
        )
    }

    /// `publish_successors`: `BlockStored` events carry each block's successor (vLLM 0.33's
    /// `lookahead_token_ids`; `begin_store_run`'s `successors`).
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, publish_successors=false))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::publish_successors)] publish_successors: bool,
    ) -> PyResult<Self> {
        let n = count(num_blocks, "num_blocks", None)?;
        let bs = count(block_size, "block_size", None)?;
        let mut inner = core::HostCache::new(n, bs).map_err(slot_error)?;
        inner.set_publish_successors(publish_successors);
        Ok(HostCache {
            inner,
            wire: Vec::new(),
        })
    }
    #[getter]
    fn publishes_successors(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.inner.publishes_successors())
    }
    /// The successor recorded with a cached block (None: none recorded).
    fn successor(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        let s = borrow(slf)?.inner.successor(h);
        Ok((s != core::NO_SUCCESSOR).then_some(s))
    }
    /// Number of leading hashes whose blocks are complete in the cache.
    fn match_prefix(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(borrow_mut(slf)?.inner.match_prefix(h.as_slice()))
    }
    fn contains(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.contains(h))
    }
    fn num_pending_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.events().len())
    }
    /// The host block holding a cached hash, if any.
    fn lookup(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.pool().lookup(h))
    }
    /// Pins the blocks of `block_hashes` for a load; returns their host block ids.
    fn begin_load(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .begin_load(rid, h.as_slice())
            .map_err(slot_error)
    }
    fn end_load(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = IntArg::<u32>::extract(blocks, "blocks", None)?;
        borrow_mut(slf)?
            .inner
            .end_load(b.as_slice())
            .map_err(slot_error)
    }
    /// Takes host blocks for the hashes not cached nor being stored: [(index, hash, block)].
    fn begin_store(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, u64, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(borrow_mut(slf)?
            .inner
            .begin_store(h.as_slice())
            .into_iter()
            .map(|(i, p)| (i, p.hash, p.block))
            .collect())
    }
    /// Registers copied blocks [(hash, block)] of one request run and queues BlockStored.
    #[pyo3(signature = (stores, parent_block_hash, token_ids, lora_id=None))]
    fn complete_store(
        slf: &Bound<'_, Self>,
        stores: &Bound<'_, PyAny>,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stores = pending(stores, "stores")?;
        let parent = opt_int::<u64>(parent_block_hash, "parent_block_hash", None)?;
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        let lora = opt_int::<u64>(lora_id, "lora_id", None)?;
        borrow_mut(slf)?
            .inner
            .complete_store(&stores, parent, t.as_slice(), lora)
            .map_err(slot_error)
    }
    /// Begins storing one request's blocks as part of `step`; returns [(index, host block)].
    /// `successors`: per block, the token after it recorded with it (None: none), registered
    /// (and published) when the step completes.
    #[pyo3(signature = (step, block_hashes, parent_block_hash, token_ids, lora_id=None, successors=None))]
    fn begin_store_run(
        slf: &Bound<'_, Self>,
        step: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<&Bound<'_, PyAny>>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        successors: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(usize, u32)>> {
        let step = int::<u64>(step, "step", None)?;
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        let parent = opt_int::<u64>(parent_block_hash, "parent_block_hash", None)?;
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        let lora = opt_int::<u64>(lora_id, "lora_id", None)?;
        let succ = match successors {
            Some(s) if !s.is_none() => Some(conv::successors(s, "successors")?),
            _ => None,
        };
        let mut out = Vec::new();
        borrow_mut(slf)?
            .inner
            .begin_store_run_into(
                step,
                h.as_slice(),
                parent,
                t.as_slice(),
                lora,
                succ.as_deref(),
                &mut out,
            )
            .map_err(slot_error)?;
        Ok(out)
    }
    /// Completes every store run of `step` (aborting runs with a failed block); returns the
    /// number of blocks registered.
    #[pyo3(signature = (step, failed_blocks=Vec::new()))]
    fn complete_step(
        slf: &Bound<'_, Self>,
        step: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::failed_blocks)] failed_blocks: Vec<u32>,
    ) -> PyResult<usize> {
        let step = int::<u64>(step, "step", None)?;
        borrow_mut(slf)?
            .inner
            .complete_step(step, &failed_blocks)
            .map_err(slot_error)
    }
    #[getter]
    fn pending_steps(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.pending_steps())
    }
    fn abort_store(slf: &Bound<'_, Self>, stores: &Bound<'_, PyAny>) -> PyResult<()> {
        let stores = pending(stores, "stores")?;
        borrow_mut(slf)?
            .inner
            .abort_store(&stores)
            .map_err(slot_error)
    }
    fn clear(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow_mut(slf)?.inner.clear())
    }
    fn drain_raw_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let mut this = borrow_mut(slf)?;
        let list = events_to_py(slf.py(), this.inner.events())?;
        this.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format); the queue stays.
    #[pyo3(signature = (ts, medium=Some("CPU".to_owned()), data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode(slf, ts, medium, data_parallel_rank, hashes_as_bytes, false)
    }
    /// Like `events_msgpack`, then empties the queue (only when encoding succeeded).
    #[pyo3(signature = (ts, medium=Some("CPU".to_owned()), data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode(slf, ts, medium, data_parallel_rank, hashes_as_bytes, true)
    }
    fn registered_hashes(slf: &Bound<'_, Self>) -> PyResult<Vec<u64>> {
        let mut v: Vec<u64> = borrow(slf)?.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        Ok(v)
    }
    fn stats(slf: &Bound<'_, Self>) -> PyResult<HashMap<&'static str, u64>> {
        let s = borrow(slf)?.inner.stats();
        Ok(HashMap::from([
            ("lookups", s.lookups),
            ("hit_blocks", s.hit_blocks),
            ("stores_started", s.stores_started),
            ("stores_completed", s.stores_completed),
            ("stores_aborted", s.stores_aborted),
            ("stores_skipped_full", s.stores_skipped_full),
            ("loads_started", s.loads_started),
            ("evicted_blocks", s.evicted_blocks),
        ]))
    }
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        Ok(borrow(slf)?.inner.pool().check().err())
    }
    #[getter]
    fn num_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.pool().num_blocks())
    }
    #[getter]
    fn block_size(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.block_size())
    }
    #[getter]
    fn num_free(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.pool().num_free())
    }
    #[getter]
    fn num_held(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.pool().num_held())
    }
    #[getter]
    fn num_cached(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.pool().num_cached())
    }
    #[getter]
    fn num_storing(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_storing())
    }
}

impl HostCache {
    fn encode<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        hashes_as_bytes: bool,
        drain: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let args = MetaArgs::extract(ts, medium.as_deref(), data_parallel_rank, hashes_as_bytes)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let bytes = log_to_msgpack(slf.py(), this.inner.events(), &mut this.wire, args.meta())?;
        if drain {
            this.inner.events_mut().clear();
        }
        Ok(bytes)
    }
}
