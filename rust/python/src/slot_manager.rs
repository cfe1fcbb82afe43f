//! `kvslots._core.SlotManager`: the slot manager over a block pool it owns (subclassed by
//! `kvslots.SlotManager`). Argument conversion, error mapping and GIL release only; the slot
//! rules are `kvslots_core::SlotManager`'s.

use std::collections::HashMap;

use kvslots_core as core;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::convert::{
    self as conv, arg, count, events_to_py, int, log_to_msgpack, opt_int, opt_ints, IntArg,
    MetaArgs,
};
use crate::errors::{borrow, borrow_mut, invalid, slot_error};
use crate::slot_info::SlotInfo;

/// The slot manager over a block pool it owns. See `kvslots.SlotManager` for the documented API.
#[pyclass(module = "kvslots._core", weakref, subclass)]
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

/// Every method converts its arguments first (which may run Python code) and only then borrows
/// the manager, so a re-entrant or concurrent call gets `ConcurrentUseError`, never pyo3's
/// "Already borrowed". The GIL is held throughout: nothing another thread can run sees a call
/// half done.
#[pymethods]
impl SlotManager {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it owns a block pool and its requests' slots, which a copy would hand out twice",
        )
    }

    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, hash_seed=0, enable_prefix_caching=true, max_tokens_per_slot=None))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::hash_seed)] hash_seed: u64,
        #[pyo3(from_py_with = arg::enable_prefix_caching)] enable_prefix_caching: bool,
        max_tokens_per_slot: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let cfg = core::ManagerConfig {
            num_blocks: count(num_blocks, "num_blocks", None)?,
            block_size: count(block_size, "block_size", None)?,
            hash_seed,
            enable_prefix_caching,
            max_tokens_per_slot: opt_int::<usize>(
                max_tokens_per_slot,
                "max_tokens_per_slot",
                None,
            )?,
        };
        Ok(SlotManager {
            inner: core::SlotManager::new(cfg).map_err(slot_error)?,
            out: Default::default(),
            wire: Vec::new(),
        })
    }

    #[pyo3(signature = (request_id, prompt, *, lookahead=0, match_prefix=true, lora_id=None))]
    fn create(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        prompt: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::lookahead)] lookahead: usize,
        #[pyo3(from_py_with = arg::match_prefix)] match_prefix: bool,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let rid = conv::request_id(request_id)?;
        let r = Some(rid);
        let prompt = IntArg::<u32>::extract(prompt, "prompt", r)?;
        let (k, mp) = (lookahead, match_prefix);
        let lora = opt_int::<u64>(lora_id, "lora_id", r)?;
        borrow_mut(slf)?
            .inner
            .create(rid, prompt.as_slice(), k, mp, lora)
            .map(|(_, m)| m)
            .map_err(slot_error)
    }

    fn slot_id(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<u64> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?.inner.slot_id(rid).map_err(slot_error)
    }

    fn reserve(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = conv::request_id(request_id)?;
        let n = count(new_tokens, "new_tokens", Some(rid))?;
        borrow_mut(slf)?.inner.reserve(rid, n).map_err(slot_error)
    }

    fn commit(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = conv::request_id(request_id)?;
        let tokens = IntArg::<u32>::extract(tokens, "tokens", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .commit(rid, tokens.as_slice())
            .map_err(slot_error)
    }

    fn rollback(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let rid = conv::request_id(request_id)?;
        let n = count(num_tokens, "num_tokens", Some(rid))?;
        borrow_mut(slf)?.inner.rollback(rid, n).map_err(slot_error)
    }

    fn set_lookahead(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        lookahead: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = conv::request_id(request_id)?;
        let k = count(lookahead, "lookahead", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .set_lookahead(rid, k)
            .map_err(slot_error)
    }

    fn finish(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let rid = conv::request_id(request_id)?;
        borrow_mut(slf)?.inner.finish(rid).map_err(slot_error)
    }

    fn evict(slf: &Bound<'_, Self>, num_blocks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n = count(num_blocks, "num_blocks", None)?;
        Ok(borrow_mut(slf)?.inner.evict(n))
    }

    fn clear_cache(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow_mut(slf)?.inner.clear_cache())
    }

    /// The arrays are copied before the step runs (another thread may write a numpy array
    /// while this call reads it), then the step runs with the GIL held.
    #[pyo3(signature = (slot_ids, num_accepted, accepted_tokens, num_rejected, num_new_tokens, lookahead=None))]
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        slf: &Bound<'py, Self>,
        slot_ids: &Bound<'py, PyAny>,
        num_accepted: &Bound<'py, PyAny>,
        accepted_tokens: &Bound<'py, PyAny>,
        num_rejected: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        lookahead: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<StepArrays<'py>> {
        let py = slf.py();
        let slots = IntArg::<u64>::extract(slot_ids, "slot_ids", None)?;
        let acc = IntArg::<u32>::extract(num_accepted, "num_accepted", None)?;
        let toks = IntArg::<u32>::extract(accepted_tokens, "accepted_tokens", None)?;
        let rej = IntArg::<u32>::extract(num_rejected, "num_rejected", None)?;
        let new = IntArg::<u32>::extract(num_new_tokens, "num_new_tokens", None)?;
        let look = opt_ints::<u32>(lookahead, "lookahead", None)?;
        let input = core::StepInput {
            slots: slots.as_slice(),
            num_accepted: acc.as_slice(),
            accepted_tokens: toks.as_slice(),
            num_rejected: rej.as_slice(),
            num_new_tokens: new.as_slice(),
            lookahead: look.as_ref().map(|l| l.as_slice()),
        };
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        this.inner.step(&input, &mut this.out).map_err(slot_error)?;
        Ok((
            PyArray1::from_slice(py, &this.out.num_new_blocks),
            PyArray1::from_slice(py, &this.out.new_block_ids),
            PyArray1::from_slice(py, &this.out.num_committed_blocks),
        ))
    }

    // ---- queries ----

    fn block_table(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .block_table(rid)
            .map(<[u32]>::to_vec)
            .map_err(slot_error)
    }
    fn slot_info(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<SlotInfo> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .slot_info(rid)
            .map(Into::into)
            .map_err(slot_error)
    }
    fn committed_tokens(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .slot(rid)
            .map(|s| s.tokens().to_vec())
            .map_err(slot_error)
    }
    fn block_hashes(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .slot(rid)
            .map(|s| s.hashes().to_vec())
            .map_err(slot_error)
    }
    fn request_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        Ok(borrow(slf)?
            .inner
            .request_ids()
            .map(str::to_owned)
            .collect())
    }
    fn registered_hashes(slf: &Bound<'_, Self>) -> PyResult<Vec<u64>> {
        let mut v: Vec<u64> = borrow(slf)?.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        Ok(v)
    }
    fn lookup(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.pool().lookup(h))
    }
    fn registered_hash(
        slf: &Bound<'_, Self>,
        block_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u64>> {
        let b = int::<u32>(block_id, "block_id", None)?;
        let this = borrow(slf)?;
        this.check_block(b)?;
        Ok(this.inner.pool().registered_hash(b))
    }
    fn refcount(slf: &Bound<'_, Self>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = int::<u32>(block_id, "block_id", None)?;
        let this = borrow(slf)?;
        this.check_block(b)?;
        Ok(this.inner.pool().refcount(b))
    }
    fn cached_blocks(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        Ok(borrow(slf)?.inner.pool().lru_order())
    }
    fn stats(slf: &Bound<'_, Self>) -> PyResult<HashMap<&'static str, u64>> {
        let s = borrow(slf)?.inner.stats();
        Ok(HashMap::from([
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
        ]))
    }
    /// Queued events as tuples, emptying the queue.
    fn drain_raw_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let mut this = borrow_mut(slf)?;
        let list = events_to_py(slf.py(), this.inner.events())?;
        this.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format), leaving the queue as is.
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        medium: Option<&Bound<'py, PyAny>>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode(slf, ts, medium, data_parallel_rank, hashes_as_bytes, false)
    }
    /// Like `events_msgpack`, then empties the queue (only when encoding succeeded).
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        medium: Option<&Bound<'py, PyAny>>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode(slf, ts, medium, data_parallel_rank, hashes_as_bytes, true)
    }
    fn num_pending_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.events().len())
    }
    /// Drops the queued events without turning them into Python objects (an engine with no
    /// event subscriber); returns how many there were.
    fn discard_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let mut this = borrow_mut(slf)?;
        let n = this.inner.events().len();
        this.inner.events_mut().clear();
        Ok(n)
    }
    /// None when every invariant holds, else a description of the first broken one.
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        Ok(borrow(slf)?.inner.check_invariants().err())
    }

    #[getter]
    fn num_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.config().num_blocks)
    }
    #[getter]
    fn block_size(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.block_size())
    }
    #[getter]
    fn hash_seed(slf: &Bound<'_, Self>) -> PyResult<u64> {
        Ok(borrow(slf)?.inner.config().hash_seed)
    }
    #[getter]
    fn num_free(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_free())
    }
    #[getter]
    fn num_held(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_held())
    }
    #[getter]
    fn num_cached(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_cached())
    }
    #[getter]
    fn usage(slf: &Bound<'_, Self>) -> PyResult<f64> {
        Ok(borrow(slf)?.inner.usage())
    }
    #[staticmethod]
    fn metadata_bytes_per_block() -> usize {
        core::BlockPool::bytes_per_block()
    }
    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_slots())
    }
    fn __contains__(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = conv::request_id(request_id)?;
        Ok(borrow(slf)?.inner.contains(rid))
    }
}

impl SlotManager {
    fn encode<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        medium: Option<&Bound<'py, PyAny>>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        hashes_as_bytes: bool,
        drain: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let medium = conv::opt_text(medium, "medium")?;
        let args = MetaArgs::extract(ts, medium, data_parallel_rank, hashes_as_bytes)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let bytes = log_to_msgpack(slf.py(), this.inner.events(), &mut this.wire, args.meta())?;
        if drain {
            this.inner.events_mut().clear();
        }
        Ok(bytes)
    }

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
