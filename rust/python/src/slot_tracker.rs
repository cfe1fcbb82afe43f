//! `kvslots._core.SlotTracker`: slots over block ids owned elsewhere (vLLM's device blocks).
//! The slot rules are `kvslots_core::SlotTracker`'s.

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::{count, IntArg};
use crate::errors::slot_error;
use crate::slot_info::SlotInfo;

/// Slots over block ids owned elsewhere (vLLM's device blocks).
#[pyclass(module = "kvslots._core")]
pub(crate) struct SlotTracker {
    inner: core::SlotTracker,
}

#[pymethods]
impl SlotTracker {
    #[new]
    #[pyo3(signature = (block_size, *, hash_seed=0))]
    fn new(block_size: i64, hash_seed: u64) -> PyResult<Self> {
        Ok(SlotTracker {
            inner: core::SlotTracker::new(count(block_size, "block_size", None)?, hash_seed)
                .map_err(slot_error)?,
        })
    }
    #[pyo3(signature = (request_id, *, lookahead=0, lora_id=None))]
    fn add(&mut self, request_id: &str, lookahead: i64, lora_id: Option<u64>) -> PyResult<()> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.add(request_id, k, lora_id).map_err(slot_error)
    }
    fn blocks_needed(&self, request_id: &str, new_tokens: i64) -> PyResult<usize> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        self.inner.blocks_needed(request_id, n).map_err(slot_error)
    }
    fn reserve(
        &mut self,
        request_id: &str,
        new_tokens: i64,
        new_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        let b = IntArg::<u32>::extract(new_blocks, "new_blocks", Some(request_id))?;
        self.inner
            .reserve(request_id, n, b.as_slice())
            .map_err(slot_error)
    }
    /// Returns the blocks that became immutable as (index, block_id, hash) tuples.
    #[pyo3(signature = (request_id, tokens, block_hashes=None))]
    fn commit(
        &mut self,
        request_id: &str,
        tokens: &Bound<'_, PyAny>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(usize, u32, u64)>> {
        let t = IntArg::<u32>::extract(tokens, "tokens", Some(request_id))?;
        let h = block_hashes
            .map(|h| IntArg::<u64>::extract(h, "block_hashes", Some(request_id)))
            .transpose()?;
        let done = self
            .inner
            .commit(request_id, t.as_slice(), h.as_ref().map(|h| h.as_slice()))
            .map_err(slot_error)?;
        Ok(done
            .into_iter()
            .map(|c| (c.index, c.block, c.hash))
            .collect())
    }
    fn rollback(&mut self, request_id: &str, num_tokens: i64) -> PyResult<()> {
        let n = count(num_tokens, "num_tokens", Some(request_id))?;
        self.inner.rollback(request_id, n).map_err(slot_error)
    }
    fn set_lookahead(&mut self, request_id: &str, lookahead: i64) -> PyResult<Vec<u32>> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.set_lookahead(request_id, k).map_err(slot_error)
    }
    /// Forgets the request; returns its block ids.
    fn finish(&mut self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .finish(request_id)
            .map(|s| s.blocks().to_vec())
            .map_err(slot_error)
    }
    fn slot_info(&self, request_id: &str) -> PyResult<SlotInfo> {
        self.inner
            .info(request_id)
            .map(Into::into)
            .map_err(slot_error)
    }
    fn block_table(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .slot(request_id)
            .map(|s| s.blocks().to_vec())
            .map_err(slot_error)
    }
    fn block_hashes(&self, request_id: &str) -> PyResult<Vec<u64>> {
        self.inner
            .slot(request_id)
            .map(|s| s.hashes().to_vec())
            .map_err(slot_error)
    }
    fn __len__(&self) -> usize {
        self.inner.len()
    }
}
