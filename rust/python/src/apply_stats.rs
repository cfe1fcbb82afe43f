//! `kvslots._core.ApplyStats`: what one `PrefixIndex.apply` did.

use kvslots_core::index as ix;
use pyo3::prelude::*;

use crate::convert::int;

/// What one `PrefixIndex.apply` did (a plain object: a dict per batch was a visible cost).
#[pyclass(module = "kvslots._core", weakref, frozen, get_all, eq, hash)]
#[derive(PartialEq, Hash)]
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
    /// The counts given (what `pickle` rebuilds it from).
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        events: &Bound<'_, PyAny>,
        stored_blocks: &Bound<'_, PyAny>,
        removed_blocks: &Bound<'_, PyAny>,
        cleared: &Bound<'_, PyAny>,
        orphan_blocks: &Bound<'_, PyAny>,
        unresolved_blocks: &Bound<'_, PyAny>,
        invalid_events: &Bound<'_, PyAny>,
        unknown_events: &Bound<'_, PyAny>,
        unknown_medium_events: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let n = |o: &Bound<'_, PyAny>, what: &str| int::<u64>(o, what, None);
        Ok(ApplyStats {
            events: n(events, "events")?,
            stored_blocks: n(stored_blocks, "stored_blocks")?,
            removed_blocks: n(removed_blocks, "removed_blocks")?,
            cleared: n(cleared, "cleared")?,
            orphan_blocks: n(orphan_blocks, "orphan_blocks")?,
            unresolved_blocks: n(unresolved_blocks, "unresolved_blocks")?,
            invalid_events: n(invalid_events, "invalid_events")?,
            unknown_events: n(unknown_events, "unknown_events")?,
            unknown_medium_events: n(unknown_medium_events, "unknown_medium_events")?,
        })
    }

    /// A value of nine counts: `pickle`, `copy.copy` and `copy.deepcopy` give an equal one.
    #[allow(clippy::type_complexity)]
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (u64, u64, u64, u64, u64, u64, u64, u64, u64))> {
        let s = slf.get();
        Ok((
            slf.get_type().into_any(),
            (
                s.events,
                s.stored_blocks,
                s.removed_blocks,
                s.cleared,
                s.orphan_blocks,
                s.unresolved_blocks,
                s.invalid_events,
                s.unknown_events,
                s.unknown_medium_events,
            ),
        ))
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
