//! Every Python exception the extension raises, and the one mapping from engine errors to them.
//! The classes live in `kvslots.errors` (imported, not defined here), so Python code can catch
//! them without importing the extension.

use std::collections::HashMap;

use kvslots_core as core;
use kvslots_core::index::IndexError;
use pyo3::prelude::*;

pyo3::import_exception!(kvslots.errors, UnknownRequestError);
pyo3::import_exception!(kvslots.errors, DuplicateRequestError);
pyo3::import_exception!(kvslots.errors, OutOfBlocksError);
pyo3::import_exception!(kvslots.errors, InvalidRollbackError);
pyo3::import_exception!(kvslots.errors, CapacityExceededError);
pyo3::import_exception!(kvslots.errors, InvalidArgumentError);
pyo3::import_exception!(kvslots.errors, EventDecodeError);
pyo3::import_exception!(kvslots.errors, UnknownWorkerError);
pyo3::import_exception!(kvslots.errors, DuplicateWorkerError);

/// Maps an engine error to its Python class: `(message, request_id, details)`.
pub(crate) fn slot_error(e: core::SlotError) -> PyErr {
    use core::SlotError as E;
    let msg = e.to_string();
    let rid = e.request().map(str::to_owned);
    let mut d: HashMap<&'static str, u64> = HashMap::new();
    match e {
        E::UnknownRequest { .. } => UnknownRequestError::new_err((msg, rid, d)),
        E::DuplicateRequest { .. } => DuplicateRequestError::new_err((msg, rid, d)),
        E::OutOfBlocks {
            needed,
            available,
            total,
            ..
        } => {
            d.extend([
                ("needed", needed),
                ("available", available),
                ("total", total),
            ]);
            OutOfBlocksError::new_err((msg, rid, d))
        }
        E::InvalidRollback {
            requested,
            pending,
            committed,
            ..
        } => {
            d.extend([
                ("requested", requested),
                ("pending", pending),
                ("committed", committed),
            ]);
            InvalidRollbackError::new_err((msg, rid, d))
        }
        E::CapacityExceeded {
            requested, limit, ..
        } => {
            d.extend([("requested", requested), ("limit", limit)]);
            CapacityExceededError::new_err((msg, rid, d))
        }
        E::InvalidArgument { .. } => InvalidArgumentError::new_err((msg, rid, d)),
    }
}

/// An `InvalidArgumentError` for a bad argument, naming the request when there is one.
pub(crate) fn invalid(request: Option<&str>, message: String) -> PyErr {
    slot_error(core::SlotError::invalid(request, message))
}

/// An event batch that cannot be encoded (a length over msgpack's limits).
pub(crate) fn encode_error(e: core::EncodeError) -> PyErr {
    invalid(None, e.to_string())
}

/// Maps a prefix-index error to its Python class: `(message, None)`.
pub(crate) fn index_error(e: IndexError) -> PyErr {
    let msg = e.to_string();
    let none: Option<String> = None;
    match e {
        IndexError::Decode(_) => EventDecodeError::new_err((msg, none)),
        IndexError::UnknownWorker { .. } => UnknownWorkerError::new_err((msg, none)),
        IndexError::DuplicateWorker { .. } => DuplicateWorkerError::new_err((msg, none)),
        IndexError::Invalid(_) => InvalidArgumentError::new_err((msg, none)),
    }
}

/// An `InvalidArgumentError` raised by the prefix index's bindings.
pub(crate) fn index_invalid(msg: String) -> PyErr {
    index_error(IndexError::Invalid(msg))
}
