//! `kvslots._core.SlotTracker`: slots over block ids owned elsewhere (vLLM's device blocks).
//! The slot rules are `kvslots_core::SlotTracker`'s.
//!
//! Arguments are converted before the tracker is borrowed (see `slot_manager.rs`).

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::{self as conv, arg, count, opt_int, opt_ints, IntArg};
use crate::errors::{borrow, borrow_mut, slot_error};
use crate::slot_info::SlotInfo;

/// Slots over block ids owned elsewhere (vLLM's device blocks).
#[pyclass(module = "kvslots._core", weakref)]
pub(crate) struct SlotTracker {
    inner: core::SlotTracker,
}

#[pymethods]
impl SlotTracker {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it tracks slots over block ids owned elsewhere (vLLM's device blocks), which a copy would hand out twice",
        )
    }

    #[new]
    #[pyo3(signature = (block_size, *, hash_seed=0))]
    fn new(
        block_size: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::hash_seed)] hash_seed: u64,
    ) -> PyResult<Self> {
        Ok(SlotTracker {
            inner: core::SlotTracker::new(count(block_size, "block_size", None)?, hash_seed)
                .map_err(slot_error)?,
        })
    }
    #[pyo3(signature = (request_id, *, lookahead=0, lora_id=None))]
    fn add(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::lookahead)] lookahead: usize,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let rid = conv::request_id(request_id)?;
        let lora = opt_int::<u64>(lora_id, "lora_id", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .add(rid, lookahead, lora)
            .map_err(slot_error)
    }
    fn blocks_needed(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = conv::request_id(request_id)?;
        let n = count(new_tokens, "new_tokens", Some(rid))?;
        borrow(slf)?.inner.blocks_needed(rid, n).map_err(slot_error)
    }
    fn reserve(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        new_tokens: &Bound<'_, PyAny>,
        new_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let rid = conv::request_id(request_id)?;
        let n = count(new_tokens, "new_tokens", Some(rid))?;
        let b = IntArg::<u32>::extract(new_blocks, "new_blocks", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .reserve(rid, n, b.as_slice())
            .map_err(slot_error)
    }
    /// Returns the blocks that became immutable as (index, block_id, hash) tuples.
    #[pyo3(signature = (request_id, tokens, block_hashes=None))]
    fn commit(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(usize, u32, u64)>> {
        let rid = conv::request_id(request_id)?;
        let t = IntArg::<u32>::extract(tokens, "tokens", Some(rid))?;
        let h = opt_ints::<u64>(block_hashes, "block_hashes", Some(rid))?;
        let done = borrow_mut(slf)?
            .inner
            .commit(rid, t.as_slice(), h.as_ref().map(|h| h.as_slice()))
            .map_err(slot_error)?;
        Ok(done
            .into_iter()
            .map(|c| (c.index, c.block, c.hash))
            .collect())
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
    ) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        let k = count(lookahead, "lookahead", Some(rid))?;
        borrow_mut(slf)?
            .inner
            .set_lookahead(rid, k)
            .map_err(slot_error)
    }
    /// Forgets the request; returns its block ids.
    fn finish(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        borrow_mut(slf)?
            .inner
            .finish(rid)
            .map(|s| s.blocks().to_vec())
            .map_err(slot_error)
    }
    fn slot_info(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<SlotInfo> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .info(rid)
            .map(Into::into)
            .map_err(slot_error)
    }
    fn block_table(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let rid = conv::request_id(request_id)?;
        borrow(slf)?
            .inner
            .slot(rid)
            .map(|s| s.blocks().to_vec())
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
    /// None when every slot's accounting holds, else a description of the first broken one.
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        Ok(borrow(slf)?.inner.check_invariants().err())
    }
    fn __len__(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.len())
    }
}
