//! `kvslots._core.SlotInfo`: a slot's counters, as `SlotManager.slot_info` and
//! `SlotTracker.slot_info` return them.

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::count;

/// A slot's counters.
#[pyclass(module = "kvslots._core", weakref, frozen, get_all, eq, hash)]
#[derive(Clone, PartialEq, Hash)]
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
    /// The counters given (what `pickle` rebuilds it from).
    #[new]
    fn new(
        committed: &Bound<'_, PyAny>,
        pending: &Bound<'_, PyAny>,
        lookahead: &Bound<'_, PyAny>,
        reserved_lookahead: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        num_immutable: &Bound<'_, PyAny>,
        capacity: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(SlotInfo {
            committed: count(committed, "committed", None)?,
            pending: count(pending, "pending", None)?,
            lookahead: count(lookahead, "lookahead", None)?,
            reserved_lookahead: count(reserved_lookahead, "reserved_lookahead", None)?,
            num_blocks: count(num_blocks, "num_blocks", None)?,
            num_immutable: count(num_immutable, "num_immutable", None)?,
            capacity: count(capacity, "capacity", None)?,
        })
    }

    /// A value of seven counters: `pickle`, `copy.copy` and `copy.deepcopy` give an equal one
    /// (the reference model's SlotInfo, a frozen dataclass, does the same).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (usize, usize, usize, usize, usize, usize, usize))> {
        let s = slf.get();
        Ok((
            slf.get_type().into_any(),
            (s.committed, s.pending, s.lookahead, s.reserved_lookahead, s.num_blocks, s.num_immutable, s.capacity),
        ))
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
