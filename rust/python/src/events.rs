//! `kvslots._core.encode_event_batch`: raw event tuples as one msgpack `KVEventBatch`.

use kvslots_core as core;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::{batch_meta, event_from_py, type_name};
use crate::errors::{encode_error, invalid};

/// Encodes raw event tuples (as `SlotManager.drain_raw_events` returns them) as one msgpack
/// `KVEventBatch` in vLLM's wire format.
#[pyfunction]
#[pyo3(signature = (events, ts, *, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
pub(crate) fn encode_event_batch<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    ts: f64,
    medium: Option<&str>,
    data_parallel_rank: Option<i64>,
    hashes_as_bytes: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let items = events.try_iter().map_err(|_| {
        invalid(
            None,
            format!(
                "events must be a sequence of tuples, got {}",
                type_name(events)
            ),
        )
    })?;
    let mut owned = Vec::new();
    for (i, item) in items.enumerate() {
        owned.push(event_from_py(&item?, i)?);
    }
    let meta = batch_meta(ts, medium, data_parallel_rank, hashes_as_bytes);
    let mut buf = Vec::new();
    py.detach(|| core::encode_owned(&owned, &meta, &mut buf))
        .map_err(encode_error)?;
    Ok(PyBytes::new(py, &buf))
}
