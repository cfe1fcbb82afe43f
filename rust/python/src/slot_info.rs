//! `kvslots._core.SlotInfo`: a slot's counters, as `SlotManager.slot_info` and
//! `SlotTracker.slot_info` return them.

use kvslots_core as core;
use pyo3::prelude::*;

/// A slot's counters.
#[pyclass(module = "kvslots._core", weakref, frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
pub(crate) struct SlotInfo {
    committed: usize,
    pending: usize,
    lookahead: usize,
    reserved_lookahead: usize,
    num_blocks: usize,
    num_immutable: usize,
    capacity: usize,
}

#[pymethods]
impl SlotInfo {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it is a snapshot the engine returned, not a value to rebuild; read its attributes instead",
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "SlotInfo(committed={}, pending={}, lookahead={}, reserved_lookahead={}, num_blocks={}, num_immutable={}, capacity={})",
            self.committed, self.pending, self.lookahead, self.reserved_lookahead, self.num_blocks, self.num_immutable, self.capacity
        )
    }
}

impl From<core::SlotInfo> for SlotInfo {
    fn from(i: core::SlotInfo) -> Self {
        SlotInfo {
            committed: i.committed,
            pending: i.pending,
            lookahead: i.lookahead,
            reserved_lookahead: i.reserved_lookahead,
            num_blocks: i.num_blocks,
            num_immutable: i.num_immutable,
            capacity: i.capacity,
        }
    }
}
