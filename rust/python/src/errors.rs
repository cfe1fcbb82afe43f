//! Every Python exception the extension raises, and the one mapping from engine errors to them.
//! The classes live in `kvslots.errors` (imported, not defined here), so Python code can catch
//! them without importing the extension.

use std::collections::HashMap;

use kvslots_core as core;
use kvslots_core::index::IndexError;
use pyo3::prelude::*;

pyo3::import_exception!(kvslots.errors, KVSlotsError);
pyo3::import_exception!(kvslots.errors, ArgumentTypeError);
pyo3::import_exception!(kvslots.errors, ConcurrentUseError);
pyo3::import_exception!(kvslots.errors, UnknownRequestError);
pyo3::import_exception!(kvslots.errors, DuplicateRequestError);
pyo3::import_exception!(kvslots.errors, OutOfBlocksError);
pyo3::import_exception!(kvslots.errors, InvalidRollbackError);
pyo3::import_exception!(kvslots.errors, CapacityExceededError);
pyo3::import_exception!(kvslots.errors, InvalidArgumentError);
pyo3::import_exception!(kvslots.errors, EventDecodeError);
pyo3::import_exception!(kvslots.errors, UnknownWorkerError);
pyo3::import_exception!(kvslots.errors, DuplicateWorkerError);
pyo3::import_exception!(kvslots.errors, NotCopyableError);

/// Maps an engine error to its Python class: `(message, request_id, details)`.
pub(crate) fn slot_error(e: core::SlotError) -> PyErr {
    use core::SlotError as E;
    let msg = e.to_string();
    let rid = e.request().map(str::to_owned);
    // u128: `needed` and `requested` are exact past u64::MAX (a Python int either way).
    let mut d: HashMap<&'static str, u128> = HashMap::new();
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
                ("available", available.into()),
                ("total", total.into()),
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
                ("requested", requested.into()),
                ("pending", pending.into()),
                ("committed", committed.into()),
            ]);
            InvalidRollbackError::new_err((msg, rid, d))
        }
        E::CapacityExceeded {
            requested, limit, ..
        } => {
            d.extend([("requested", requested), ("limit", limit.into())]);
            CapacityExceededError::new_err((msg, rid, d))
        }
        E::InvalidArgument { .. } => InvalidArgumentError::new_err((msg, rid, d)),
    }
}

/// An `InvalidArgumentError` for a bad argument, naming the request when there is one.
pub(crate) fn invalid(request: Option<&str>, message: String) -> PyErr {
    slot_error(core::SlotError::invalid(request, message))
}

/// An `ArgumentTypeError` for an argument of the wrong type, naming the request when there is
/// one.
pub(crate) fn type_error(request: Option<&str>, message: String) -> PyErr {
    let d: HashMap<&'static str, u64> = HashMap::new();
    ArgumentTypeError::new_err((
        format!("invalid argument{}: {message}", request_suffix(request)),
        request.map(str::to_owned),
        d,
    ))
}

fn request_suffix(request: Option<&str>) -> String {
    request.map_or(String::new(), |r| format!(" for request {}", core::error::shown(r)))
}

/// A `ConcurrentUseError`: `what` is in the middle of another call (a re-entrant call from an
/// argument's Python code, or a call from another thread that the object does not wait for).
pub(crate) fn busy(what: &str) -> PyErr {
    let none: Option<String> = None;
    ConcurrentUseError::new_err((
        format!(
            "{what} is in use by another call (re-entrant, from an argument's __index__, \
             __iter__ or __repr__, or from another thread); nothing was changed"
        ),
        none,
    ))
}

/// A `ConcurrentUseError` for a call whose object was changed by Python code it ran before
/// changing anything itself (an argument's attribute, a hook, another thread).
pub(crate) fn changed_meanwhile(message: String) -> PyErr {
    let none: Option<String> = None;
    ConcurrentUseError::new_err((message, none))
}

/// Borrows a pyclass for a call, refusing with `ConcurrentUseError` (not pyo3's RuntimeError)
/// when another call holds it.
pub(crate) fn borrow<'py, T: pyo3::PyClass>(slf: &Bound<'py, T>) -> PyResult<PyRef<'py, T>> {
    slf.try_borrow().map_err(|_| busy(T::NAME))
}

/// Mutably borrows a pyclass for a call; see [`borrow`].
pub(crate) fn borrow_mut<'py, T: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::False>>(
    slf: &Bound<'py, T>,
) -> PyResult<PyRefMut<'py, T>> {
    slf.try_borrow_mut().map_err(|_| busy(T::NAME))
}

/// The one rule for pickling and copying the extension's objects. Every stateful class's `__reduce__`
/// is `errors::refuse_copy(slf, why)`: `pickle.dumps`, `copy.copy` and `copy.deepcopy` all
/// reach `__reduce__` (through `object.__reduce_ex__`), so each raises `NotCopyableError` (a
/// kvslots error and a `TypeError`) naming the object's class (a Python subclass's own name)
/// and `why`, having touched nothing. The objects hold native state (memory, locks, files,
/// threads, the Python objects they were built from) that a copy would silently duplicate or
/// detach; the plain values (`SlotInfo`, `ApplyStats`, `KVBlocks`) rebuild instead.
/// `tests/test_bindings_robust.py` checks every other class of the module has it.
pub(crate) fn refuse_copy<T>(slf: &Bound<'_, T>, why: &str) -> PyResult<()> {
    let ty = slf.as_any().get_type();
    let name = ty
        .fully_qualified_name()
        .map_or_else(|_| "this object".to_owned(), |n| n.to_string());
    let none: Option<String> = None;
    Err(NotCopyableError::new_err((
        format!("cannot pickle or copy {name}: {why}"),
        none,
    )))
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

/// `e` as a kvslots error: an exception raised while reading an argument (a builtin one, or one
/// an argument's own Python code raised) becomes an `ArgumentTypeError` (from a `TypeError`)
/// or an `InvalidArgumentError` naming `what`, with `e` as its cause. kvslots errors and
/// non-`Exception`s (KeyboardInterrupt, SystemExit) pass through.
pub(crate) fn reading_error(py: Python<'_>, e: PyErr, what: &str) -> PyErr {
    if e.is_instance_of::<KVSlotsError>(py) || !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
        return e;
    }
    let msg = format!("cannot read {what}: {e}");
    let new = if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
        type_error(None, msg)
    } else {
        invalid(None, msg)
    };
    new.set_cause(py, Some(e));
    new
}
