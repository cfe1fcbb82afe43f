//! `kvslots._core.encode_event_batch`: raw event tuples as one msgpack `KVEventBatch`.

use kvslots_core as core;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::{arg, event_from_py, next_item, opt_text, show, type_name, MetaArgs};
use crate::errors::{encode_error, type_error, KVSlotsError};

/// Encodes raw event tuples (as `SlotManager.drain_raw_events` returns them) as one msgpack
/// `KVEventBatch` in vLLM's wire format. Every event is converted (copied) first.
#[pyfunction]
#[pyo3(signature = (events, ts, *, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
pub(crate) fn encode_event_batch<'py>(
    py: Python<'py>,
    events: &Bound<'py, PyAny>,
    ts: &Bound<'py, PyAny>,
    medium: Option<&Bound<'py, PyAny>>,
    data_parallel_rank: Option<&Bound<'py, PyAny>>,
    #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let not_seq = || {
        type_error(
            None,
            format!(
                "events must be a sequence of tuples, got {} {}",
                type_name(events),
                show(events)
            ),
        )
    };
    let items = match events.try_iter() {
        Ok(it) => it,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => return Err(not_seq()),
        Err(e) if e.is_instance_of::<KVSlotsError>(py) => return Err(e),
        Err(e) => {
            let w = not_seq();
            w.set_cause(py, Some(e));
            return Err(w);
        }
    };
    let mut owned = Vec::new();
    for (i, item) in items.enumerate() {
        next_item(py, i, "events", None)?;
        let item = item.map_err(|e| {
            if e.is_instance_of::<KVSlotsError>(py) {
                return e;
            }
            let w = not_seq();
            w.set_cause(py, Some(e));
            w
        })?;
        owned.push(event_from_py(&item, i)?);
    }
    let medium = opt_text(medium, "medium")?;
    let args = MetaArgs::extract(ts, medium, data_parallel_rank, hashes_as_bytes)?;
    let mut buf = Vec::new();
    let meta = args.meta();
    py.detach(|| core::encode_owned(&owned, &meta, &mut buf))
        .map_err(encode_error)?;
    Ok(PyBytes::new(py, &buf))
}
