//! Argument and result conversions between Python objects and kvslots-core types: integer
//! sequences (borrowed numpy arrays or copied sequences), counts, event tuples and msgpack event
//! batches, the prefix index's tier / LoRA / token arguments. Bad arguments raise
//! `InvalidArgumentError` naming the argument.

use kvslots_core as core;
use kvslots_core::index::{lora_name_key, Tier};
use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::{encode_error, index_invalid, invalid};

/// An integer sequence argument: a contiguous numpy array of the right dtype is borrowed as is;
/// anything else (lists, other integer dtypes) is range-checked and copied.
pub(crate) enum IntArg<'py, T: numpy::Element> {
    Borrowed(PyReadonlyArray1<'py, T>),
    Owned(Vec<T>),
}

impl<'py, T> IntArg<'py, T>
where
    T: numpy::Element + Copy + TryFrom<i128> + for<'a> FromPyObject<'a, 'py>,
{
    pub(crate) fn extract(
        obj: &Bound<'py, PyAny>,
        what: &str,
        request: Option<&str>,
    ) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, T>>() {
            if a.is_contiguous() {
                return Ok(IntArg::Borrowed(a));
            }
        }
        // Generic path: numpy arrays of other dtypes and Python sequences, element by element.
        let seq = obj.try_iter().map_err(|_| {
            invalid(
                request,
                format!(
                    "{what} must be a sequence of integers, got {}",
                    type_name(obj)
                ),
            )
        })?;
        let mut out = Vec::new();
        for (i, item) in seq.enumerate() {
            let item = item?;
            let v: i128 = item.extract().map_err(|_| {
                invalid(
                    request,
                    format!("{what}[{i}] must be an integer, got {}", type_name(&item)),
                )
            })?;
            let t = T::try_from(v).map_err(|_| {
                invalid(
                    request,
                    format!(
                        "{what}[{i}] = {v} is out of range for {}",
                        std::any::type_name::<T>()
                    ),
                )
            })?;
            out.push(t);
        }
        Ok(IntArg::Owned(out))
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            IntArg::Borrowed(a) => a.as_slice().expect("checked contiguous"),
            IntArg::Owned(v) => v,
        }
    }
}

/// The name of an object's type, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A non-negative count argument as `usize`.
pub(crate) fn count(v: i64, what: &str, request: Option<&str>) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(request, format!("{what} must be >= 0, got {v}")))
}

/// Block ids as u64; negative ids are typed errors naming the index.
pub(crate) fn block_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let ids = IntArg::<i64>::extract(obj, what, None)?;
    ids.as_slice()
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u64::try_from(v)
                .map_err(|_| invalid(None, format!("{what}[{i}] = {v} is a negative block id")))
        })
        .collect()
}

/// `[(hash, block)]` pairs as the host cache's pending stores.
pub(crate) fn pending(stores: Vec<(u64, u32)>) -> Vec<core::PendingStore> {
    stores
        .into_iter()
        .map(|(hash, block)| core::PendingStore { hash, block })
        .collect()
}

// ---- events ----

/// Queued events as the tuples `drain_raw_events` returns.
pub(crate) fn events_to_py<'py>(
    py: Python<'py>,
    log: &core::EventLog,
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for ev in log.iter() {
        let t = match ev {
            core::KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => PyTuple::new(
                py,
                [
                    "BlockStored".into_pyobject(py)?.into_any(),
                    block_hashes.into_pyobject(py)?,
                    parent_block_hash.into_pyobject(py)?,
                    token_ids.into_pyobject(py)?,
                    block_size.into_pyobject(py)?.into_any(),
                    lora_id.into_pyobject(py)?,
                ],
            )?,
            core::KvEventRef::BlockRemoved { block_hashes } => PyTuple::new(
                py,
                [
                    "BlockRemoved".into_pyobject(py)?.into_any(),
                    block_hashes.into_pyobject(py)?,
                ],
            )?,
            core::KvEventRef::AllBlocksCleared => PyTuple::new(py, ["AllBlocksCleared"])?,
        };
        list.append(t)?;
    }
    Ok(list)
}

/// One raw event tuple (the shape `drain_raw_events` returns) as an owned event.
pub(crate) fn event_from_py(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<core::KvEvent> {
    let bad = |what: String| invalid(None, format!("events[{i}]: {what}"));
    let t = obj
        .cast::<PyTuple>()
        .map_err(|_| bad(format!("must be a tuple, got {}", type_name(obj))))?;
    let kind: String = t
        .get_item(0)
        .and_then(|k| k.extract())
        .map_err(|_| bad("must start with the event kind (a str)".into()))?;
    let field = |j: usize, name: &str| -> PyResult<Bound<'_, PyAny>> {
        t.get_item(j)
            .map_err(|_| bad(format!("{kind} tuple has no {name} (item {j})")))
    };
    let u64s = |j: usize, name: &str| -> PyResult<Vec<u64>> {
        let v = field(j, name)?;
        IntArg::<u64>::extract(&v, name, None).map(|a| a.as_slice().to_vec())
    };
    let opt_u64 = |j: usize, name: &str| -> PyResult<Option<u64>> {
        field(j, name)?
            .extract::<Option<u64>>()
            .map_err(|_| bad(format!("{name} must be None or an int in [0, 2**64)")))
    };
    let expect_len = |n: usize| -> PyResult<()> {
        if t.len() != n {
            return Err(bad(format!(
                "{kind} tuple must have {n} items, got {}",
                t.len()
            )));
        }
        Ok(())
    };
    match kind.as_str() {
        "BlockStored" => {
            expect_len(6)?;
            let tokens = field(3, "token_ids")?;
            Ok(core::KvEvent::BlockStored {
                block_hashes: u64s(1, "block_hashes")?,
                parent_block_hash: opt_u64(2, "parent_block_hash")?,
                token_ids: IntArg::<u32>::extract(&tokens, "token_ids", None)?
                    .as_slice()
                    .to_vec(),
                block_size: field(4, "block_size")?
                    .extract::<u32>()
                    .map_err(|_| bad("block_size must be an int in [0, 2**32)".into()))?,
                lora_id: opt_u64(5, "lora_id")?,
            })
        }
        "BlockRemoved" => {
            expect_len(2)?;
            Ok(core::KvEvent::BlockRemoved {
                block_hashes: u64s(1, "block_hashes")?,
            })
        }
        "AllBlocksCleared" => {
            expect_len(1)?;
            Ok(core::KvEvent::AllBlocksCleared)
        }
        other => Err(bad(format!("unknown event kind {other:?}"))),
    }
}

/// The batch-level values of an encoded event batch, from the Python arguments.
pub(crate) fn batch_meta<'a>(
    ts: f64,
    medium: Option<&'a str>,
    data_parallel_rank: Option<i64>,
    hashes_as_bytes: bool,
) -> core::BatchMeta<'a> {
    core::BatchMeta {
        ts,
        data_parallel_rank,
        medium,
        hash_format: if hashes_as_bytes {
            core::HashFormat::Bytes
        } else {
            core::HashFormat::U64
        },
    }
}

/// Encodes a queued log into `buf` (reused scratch) with the GIL released; the log is unchanged.
pub(crate) fn log_to_msgpack<'py>(
    py: Python<'py>,
    log: &core::EventLog,
    buf: &mut Vec<u8>,
    meta: core::BatchMeta<'_>,
) -> PyResult<Bound<'py, PyBytes>> {
    buf.clear();
    py.detach(|| log.encode_msgpack(&meta, buf))
        .map_err(encode_error)?;
    Ok(PyBytes::new(py, buf))
}

// ---- prefix index arguments ----

/// A tier name, as `Tier::parse` reads it (`GPU`, `CPU`, `STORAGE`; any case).
pub(crate) fn tier(name: &str) -> PyResult<Tier> {
    Tier::parse(name)
        .ok_or_else(|| index_invalid(format!("unknown tier {name:?} (GPU, CPU or STORAGE)")))
}

/// The LoRA identity of a lookup: `lora_id`, else the key of `lora_name`.
pub(crate) fn lora(lora_id: Option<u64>, lora_name: Option<&str>) -> Option<u64> {
    lora_id.or_else(|| lora_name.map(lora_name_key))
}

/// Item `j` of a list as a token id. Reads the item as a borrowed reference: the per-token
/// incref/decref of a safe `get_item` was a visible share of a lookup.
pub(crate) fn list_u32(list: &Bound<'_, PyList>, j: usize) -> PyResult<u32> {
    let py = list.py();
    // SAFETY: `list` is a live list and the GIL is held for the whole call; `j` is checked by
    // PyList_GetItem (NULL + IndexError when out of range). The borrowed item stays alive while
    // the list does, and we only read it.
    let v = unsafe {
        let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), j as pyo3::ffi::Py_ssize_t);
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        pyo3::ffi::PyLong_AsLongLong(item)
    };
    if v == -1 {
        if let Some(e) = PyErr::take(py) {
            return Err(index_invalid(format!("token_ids[{j}] must be an int: {e}")));
        }
    }
    u32::try_from(v).map_err(|_| {
        index_invalid(format!(
            "token_ids[{j}] = {v} is out of range for a token id"
        ))
    })
}

/// A block size argument: at least 1.
pub(crate) fn block_size_arg(block_size: i64) -> PyResult<usize> {
    usize::try_from(block_size)
        .ok()
        .filter(|b| *b > 0)
        .ok_or_else(|| index_invalid(format!("block_size must be >= 1, got {block_size}")))
}
