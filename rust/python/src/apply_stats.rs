//! `kvslots._core.ApplyStats`: what one `PrefixIndex.apply` did.

use kvslots_core::index as ix;
use pyo3::prelude::*;

/// What one `PrefixIndex.apply` did (a plain object: a dict per batch was a visible cost).
#[pyclass(module = "kvslots._core", weakref, frozen, get_all)]
pub(crate) struct ApplyStats {
    events: u64,
    stored_blocks: u64,
    removed_blocks: u64,
    cleared: u64,
    /// Stored blocks whose parent hash the worker's map does not know (skipped).
    orphan_blocks: u64,
    /// Token-less stores and removals of hashes the worker's map lacks (skipped).
    unresolved_blocks: u64,
    /// Events with a field of the wrong type or inconsistent lengths (skipped).
    invalid_events: u64,
    /// Events of a type this version does not know (skipped).
    unknown_events: u64,
    /// Events naming a medium with no tier (skipped).
    unknown_medium_events: u64,
}

#[pymethods]
impl ApplyStats {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it is a report the engine returned, not a value to rebuild; read its attributes instead",
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "ApplyStats(events={}, stored_blocks={}, removed_blocks={}, cleared={}, orphan_blocks={}, \
             unresolved_blocks={}, invalid_events={}, unknown_events={}, unknown_medium_events={})",
            self.events,
            self.stored_blocks,
            self.removed_blocks,
            self.cleared,
            self.orphan_blocks,
            self.unresolved_blocks,
            self.invalid_events,
            self.unknown_events,
            self.unknown_medium_events
        )
    }
}

impl From<ix::ApplyStats> for ApplyStats {
    fn from(st: ix::ApplyStats) -> Self {
        ApplyStats {
            events: st.events,
            stored_blocks: st.stored_blocks,
            removed_blocks: st.removed_blocks,
            cleared: st.cleared,
            orphan_blocks: st.orphan_blocks,
            unresolved_blocks: st.unresolved_blocks,
            invalid_events: st.invalid_events,
            unknown_events: st.unknown_events,
            unknown_medium_events: st.unknown_medium_events,
        }
    }
}
