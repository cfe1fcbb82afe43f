//! Argument and result conversions between Python objects and kvslots-core types.
//!
//! Every public argument arrives as a plain Python object and is converted here, before the
//! object it is for is borrowed or locked: converting may run Python code (`__index__`,
//! `__iter__`, `__repr__`), and that code may call back into the same object. A bad argument
//! raises `ArgumentTypeError` (wrong type) or `InvalidArgumentError` (a value out of range),
//! naming the argument and the value; nothing builtin (`TypeError`, `OverflowError`,
//! `UnicodeEncodeError`) escapes.
//!
//! The rules, which the pure-Python reference model (`kvslots.slots.reference`) applies too:
//! - an integer is an `int` (not a `bool`) or an object with `__index__` (numpy integers); a
//!   float, even integral, is refused; the value must lie in the argument's range;
//! - a flag is a `bool`;
//! - a text argument is a `str` that encodes as UTF-8 (no lone surrogates);
//! - an integer sequence is a 1-D numpy array of an integer dtype (any layout; copied) or any
//!   iterable of integers; its items follow the integer rule;
//! - an iterator (or a list that grows while it is read) gives at most `MAX_ITER_ITEMS` items:
//!   an endless one is an error, not a process killed for its memory.

use kvslots_core as core;
use numpy::{
    PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray2,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
    PyWeakrefReference,
};

use crate::errors::{encode_error, invalid, type_error, KVSlotsError};

/// At most this many characters of an argument's repr go into an error message.
const SHOW_CHARS: usize = 80;

/// Most items read from one iterator argument: 2**24, more token ids than any context (10M) and
/// more block ids than any pool, at most 128 MiB copied. Numpy arrays, whose length is known,
/// are bounded by memory alone.
pub(crate) const MAX_ITER_ITEMS: usize = 1 << 24;

/// Called before item `i` of an iterator argument is used: refuses the item past
/// `MAX_ITER_ITEMS`, and lets a pending signal (Ctrl-C) through every 65,536 items.
pub(crate) fn next_item(
    py: Python<'_>,
    i: usize,
    what: &str,
    request: Option<&str>,
) -> PyResult<()> {
    if i & 0xFFFF == 0xFFFF {
        py.check_signals()?;
    }
    if i >= MAX_ITER_ITEMS {
        return Err(invalid(
            request,
            format!(
                "{what} gives more than {MAX_ITER_ITEMS} items (an endless iterator?); pass a list \
                 or a numpy array"
            ),
        ));
    }
    Ok(())
}

/// An argument's repr for an error message, shortened (`<T object>` if repr fails). Made by
/// `kvslots.errors.short_repr`, which does not print the whole of a huge argument: the full
/// repr of 10**8 bytes passed as a request id cost 760 MB and 1.4 s before it was cut here.
pub(crate) fn show(obj: &Bound<'_, PyAny>) -> String {
    static SHORT_REPR: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    let r = SHORT_REPR
        .import(obj.py(), "kvslots.errors", "short_repr")
        .and_then(|f| f.call1((obj,)));
    let s = match r.as_ref().map(|r| r.cast::<PyString>()) {
        Ok(Ok(r)) => r.to_string_lossy().into_owned(),
        _ => format!("<{} object>", type_name(obj)),
    };
    if s.chars().count() > SHOW_CHARS {
        let mut t: String = s.chars().take(SHOW_CHARS).collect();
        t.push_str("...");
        t
    } else {
        s
    }
}

/// The name of an object's type, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Weak references to a numpy array and to each array it is a view of, to hold while its
/// memory is used without the GIL (a copy, a disk read, a read in flight): numpy refuses to
/// resize an array that has a weak reference, even with `refcheck=False`, which otherwise
/// reallocates the bytes in place, freeing them under the copy or read (a segfault, or a read
/// landing in whatever memory came next: heap corruption). Empty for anything but an ndarray
/// (a torch tensor: see `copy::held_storage`). Not covered: `ndarray.__setstate__` replaces an
/// array's buffer whatever refers to it (numpy's own views of it dangle too).
pub(crate) fn pin_arrays(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Py<PyAny>>> {
    let py = obj.py();
    let mut pins = Vec::new();
    let mut cur = obj.clone();
    // numpy collapses a view's bases to the array owning the bytes; the bound is only a guard.
    for _ in 0..64 {
        if cur.is_instance_of::<pyo3::types::PyMemoryView>() {
            // np.frombuffer(memoryview(a)): the array's base is the memoryview, and numpy
            // resizes `a` whatever buffers it has exported.
            match cur.getattr(pyo3::intern!(py, "obj")) {
                Ok(o) => cur = o,
                Err(_) => break,
            }
            continue;
        }
        let Ok(arr) = cur.cast::<PyUntypedArray>() else {
            // as_strided's (and sliding_window_view's) views have numpy's DummyArray as their
            // base, an interface holder whose `base` is the array with the bytes.
            if cur.get_type().name().is_ok_and(|n| n == "DummyArray") {
                match cur.getattr(pyo3::intern!(py, "base")) {
                    Ok(b) if !b.is_none() => {
                        cur = b;
                        continue;
                    }
                    _ => {}
                }
            }
            break;
        };
        pins.push(PyWeakrefReference::new(arr)?.into_any().unbind());
        // SAFETY: a live ndarray; its base field is null or a strong reference it holds
        // (read from the struct: a subclass may override the `base` attribute).
        let base = unsafe { (*arr.as_array_ptr()).fields.base };
        if base.is_null() {
            break;
        }
        cur = unsafe { Bound::from_borrowed_ptr(py, base) };
    }
    Ok(pins)
}

/// An error raised by Python code an argument ran (`__index__`, `__iter__`, ...): a kvslots
/// error passes through (say, a re-entrant call refused), anything else becomes `wrap`'s
/// kvslots error with the original as its cause.
fn from_callback(py: Python<'_>, e: PyErr, wrap: PyErr) -> PyErr {
    if e.is_instance_of::<KVSlotsError>(py) {
        return e;
    }
    wrap.set_cause(py, Some(e));
    wrap
}

// ---- integers ----

/// An integer type an argument converts to, with its range for messages.
pub(crate) trait IntRange: Copy + TryFrom<i128> {
    const MIN: i128;
    const MAX: i128;
    const RANGE: &'static str;
}
macro_rules! int_range {
    ($($t:ty => $r:expr),*) => {$(
        impl IntRange for $t {
            const MIN: i128 = <$t>::MIN as i128;
            const MAX: i128 = <$t>::MAX as i128;
            const RANGE: &'static str = $r;
        }
    )*};
}
int_range!(u8 => "[0, 2**8)", u32 => "[0, 2**32)", u64 => "[0, 2**64)", i64 => "[-2**63, 2**63)",
           usize => "[0, 2**64)");

/// The error for an integer argument out of its range.
fn out_of_range<T: IntRange>(what: &str, shown: &str, request: Option<&str>) -> PyErr {
    if T::MIN == 0 && shown.starts_with('-') {
        invalid(
            request,
            format!(
                "{what} must be >= 0, got {shown} (out of range {})",
                T::RANGE
            ),
        )
    } else {
        invalid(
            request,
            format!("{what} = {shown} is out of range {}", T::RANGE),
        )
    }
}

/// `obj` as an i64 when it is an exact `int` (not a `bool`, not a subclass) that fits one: one
/// C call, no Python code; `None` (nothing raised) for anything else. Under abi3 pyo3 reads an
/// i128 with PyLong_AsUnsignedLongLongMask and a Python `>>` call: through that every block id
/// of a planner step cost 2-2.7x the old i64 read.
#[inline]
fn exact_i64(obj: *mut pyo3::ffi::PyObject) -> Option<i64> {
    // SAFETY: a live object with the GIL held; PyLong_AsLongLong on an exact int runs no Python
    // code and fails only on overflow (cleared here: the wide path reads it).
    unsafe {
        if pyo3::ffi::PyLong_CheckExact(obj) == 0 {
            return None;
        }
        let v = pyo3::ffi::PyLong_AsLongLong(obj);
        if v == -1 && !pyo3::ffi::PyErr_Occurred().is_null() {
            pyo3::ffi::PyErr_Clear();
            return None;
        }
        Some(v)
    }
}

/// An exact `int` (not a `bool`) as i128, `None` when it does not fit one.
fn small_int(i: &Bound<'_, PyInt>) -> Option<i128> {
    match exact_i64(i.as_ptr()) {
        Some(v) => Some(v as i128),
        None => i.extract::<i128>().ok(),
    }
}

/// What `obj`'s type's `__index__` returns, as it returns it; `None` when it has none.
fn index_slot<'py>(obj: &Bound<'py, PyAny>) -> Option<PyResult<Bound<'py, PyAny>>> {
    // SAFETY: the type is alive while `obj` is; PyType_GetSlot returns the nb_index slot
    // function of any type (static ones too, since 3.10) or NULL, and the slot returns a new
    // reference or NULL with an exception set.
    unsafe {
        let tp = pyo3::ffi::Py_TYPE(obj.as_ptr());
        let slot = pyo3::ffi::PyType_GetSlot(tp, pyo3::ffi::Py_nb_index);
        if slot.is_null() {
            return None;
        }
        let f: pyo3::ffi::unaryfunc = std::mem::transmute(slot);
        Some(Bound::from_owned_ptr_or_err(obj.py(), f(obj.as_ptr())))
    }
}

/// An integer argument: an `int` or an object with `__index__`, never a `bool` or a float.
pub(crate) fn int<T: IntRange>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    request: Option<&str>,
) -> PyResult<T> {
    // The common case first: an exact int that fits an i64, no type checks.
    if let Some(v) = exact_i64(obj.as_ptr()) {
        return T::try_from(v as i128)
            .map_err(|_| out_of_range::<T>(what, &v.to_string(), request));
    }
    let owned = exact_int(obj, what, request)?;
    let i = owned.cast::<PyInt>().map_err(|_| wrong_int(obj, what, request))?;
    let shown = || i.to_string();
    match small_int(i) {
        Some(v) if (T::MIN..=T::MAX).contains(&v) => {
            T::try_from(v).map_err(|_| out_of_range::<T>(what, &shown(), request))
        }
        _ => Err(out_of_range::<T>(what, &shown(), request)),
    }
}

/// The low 64 bits of an integer argument (two's complement, as Python's `x & (2**64 - 1)`),
/// read as `int` reads one: a bool, a float or anything without `__index__` is refused, and no
/// method of the object but `__index__` runs.
pub(crate) fn int_low64(obj: &Bound<'_, PyAny>, what: &str, request: Option<&str>) -> PyResult<u64> {
    if let Some(v) = exact_i64(obj.as_ptr()) {
        return Ok(v as u64);
    }
    let i = exact_int(obj, what, request)?;
    // SAFETY: an exact int: PyLong_AsUnsignedLongLongMask runs no Python code and cannot fail.
    let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLongLongMask(i.as_ptr()) };
    if v as u64 == u64::MAX {
        if let Some(e) = PyErr::take(obj.py()) {
            return Err(from_callback(obj.py(), e, wrong_int(obj, what, request)));
        }
    }
    Ok(v as u64)
}

#[cold]
fn wrong_int(obj: &Bound<'_, PyAny>, what: &str, request: Option<&str>) -> PyErr {
    type_error(
        request,
        format!("{what} must be an int, got {} {}", type_name(obj), show(obj)),
    )
}

/// `obj` as an exact `int` (itself, what its `__index__` returns, or an int subclass's value):
/// never a `bool` or a float.
fn exact_int<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    request: Option<&str>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let wrong = || {
        type_error(
            request,
            format!(
                "{what} must be an int, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    };
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(wrong());
    }
    let owned;
    // An exact int only: an int subclass goes through PyNumber_Index too, which copies its
    // value into an exact int without running its Python code. The abi3 128-bit extraction
    // below calls `>>` on the object, and a subclass's own `__rshift__` made Odd(-1) read as
    // 2**64-1 and Odd(2**70) as 0.
    let i = match obj.cast_exact::<PyInt>() {
        Ok(i) => i,
        Err(_) => {
            // __index__ (numpy integers): Python code, run before any borrow or lock. Called
            // through the type's slot, not PyNumber_Index, which copies what it returns into an
            // exact int: an __index__ returning True was read as 1 (Python only warns).
            // (An int subclass: its value, as PyNumber_Index reads it, never its __index__.)
            let returned = match if obj.is_instance_of::<PyInt>() {
                Some(Ok(obj.clone()))
            } else {
                index_slot(obj)
            } {
                None => return Err(wrong()),
                Some(Ok(v)) => v,
                Some(Err(e)) if e.is_instance_of::<PyTypeError>(py) => return Err(wrong()),
                Some(Err(e)) => return Err(from_callback(py, e, wrong())),
            };
            if returned.is_instance_of::<PyBool>() || !returned.is_instance_of::<PyInt>() {
                return Err(wrong());
            }
            owned = if returned.is_exact_instance_of::<PyInt>() {
                returned
            } else {
                // An int subclass: PyNumber_Index copies its value into an exact int without
                // running its Python code.
                // SAFETY: PyNumber_Index returns a new reference or NULL with an exception set.
                unsafe {
                    Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyNumber_Index(returned.as_ptr()))
                }
                .map_err(|_| wrong())?
            };
            owned.cast::<PyInt>().map_err(|_| wrong())?
        }
    };
    Ok(i.clone().into_any())
}

/// Item `i` of a list when it is an exact `int` (not a `bool`, not a subclass) that fits an
/// i64, read through the C API with the item borrowed; `None` (nothing raised) for any other
/// item or index, which the general path then reads and names. No Python code runs. A token
/// list's items are such ints: through the general path (a reference taken and dropped, the
/// type checks and the limited API's 128-bit extraction per item) a list cost 14-22 ns a token
/// against about 1 ns for a numpy array, most of an indexer lookup.
#[inline]
pub(crate) fn list_small_int(list: &Bound<'_, PyList>, i: usize) -> Option<i64> {
    // SAFETY: the list is alive and the GIL held; PyList_GetItem checks the index (NULL and an
    // IndexError, cleared here); the item is borrowed, only read, and no Python code runs
    // before the read ends (an exact int's PyLong_AsLongLong calls none).
    unsafe {
        let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
        if item.is_null() {
            pyo3::ffi::PyErr_Clear();
            return None;
        }
        exact_i64(item) // past 64 bits: None, the general path names it
    }
}

/// `int` for item `i` of a sequence `what`, its name `what[i]` made only for an item refused:
/// making it for every item was most of the time of reading a long iterator.
fn int_item<T: IntRange>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    i: usize,
    request: Option<&str>,
) -> PyResult<T> {
    if let Some(v) = exact_i64(obj.as_ptr()) {
        if let Ok(t) = T::try_from(v as i128) {
            return Ok(t);
        }
    }
    int::<T>(obj, &format!("{what}[{i}]"), request)
}

/// A non-negative count as `usize`.
pub(crate) fn count(obj: &Bound<'_, PyAny>, what: &str, request: Option<&str>) -> PyResult<usize> {
    int::<usize>(obj, what, request)
}

/// An optional integer: `None` stays `None`.
pub(crate) fn opt_int<T: IntRange>(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
    request: Option<&str>,
) -> PyResult<Option<T>> {
    match obj {
        Some(o) if !o.is_none() => int::<T>(o, what, request).map(Some),
        _ => Ok(None),
    }
}

/// A flag: a `bool`, nothing else.
pub(crate) fn flag(obj: &Bound<'_, PyAny>, what: &str, request: Option<&str>) -> PyResult<bool> {
    obj.cast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
        type_error(
            request,
            format!(
                "{what} must be a bool, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    })
}

/// A float (an `int` is taken as its value; a `bool` is refused). NaN and infinities are
/// floats too: the wire format carries them as they are.
pub(crate) fn float_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<f64> {
    let wrong = || {
        type_error(
            None,
            format!(
                "{what} must be a float, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    };
    if obj.is_instance_of::<PyBool>() {
        return Err(wrong());
    }
    let v = if let Ok(f) = obj.cast::<PyFloat>() {
        f.value()
    } else if obj.is_instance_of::<PyInt>() {
        obj.extract::<f64>()
            .map_err(|_| invalid(None, format!("{what} = {} is too large", show(obj))))?
    } else {
        return Err(wrong());
    };
    Ok(v)
}

// ---- text ----

/// A text argument: a `str` that encodes as UTF-8.
pub(crate) fn text<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<&'a str> {
    let s = obj.cast::<PyString>().map_err(|_| {
        type_error(
            None,
            format!("{what} must be a str, got {} {}", type_name(obj), show(obj)),
        )
    })?;
    s.to_str().map_err(|_| {
        invalid(
            None,
            format!(
                "{what} must be valid Unicode text (no lone surrogates), got {}",
                show(obj)
            ),
        )
    })
}

/// An optional text argument.
pub(crate) fn opt_text<'a>(
    obj: Option<&'a Bound<'_, PyAny>>,
    what: &str,
) -> PyResult<Option<&'a str>> {
    match obj {
        Some(o) if !o.is_none() => text(o, what).map(Some),
        _ => Ok(None),
    }
}

/// A request id: a text argument named `request_id`.
pub(crate) fn request_id<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<&'a str> {
    text(obj, "request_id")
}

/// A bytes payload: `bytes` (borrowed, immutable) or `bytearray` (copied: another thread may
/// change it).
pub(crate) enum Payload<'a> {
    Bytes(&'a [u8]),
    Owned(Vec<u8>),
}
impl Payload<'_> {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Bytes(b) => b,
            Payload::Owned(v) => v,
        }
    }
}
pub(crate) fn payload<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<Payload<'a>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Payload::Bytes(b.as_bytes()));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Payload::Owned(b.to_vec()));
    }
    Err(type_error(
        None,
        format!(
            "{what} must be bytes or bytearray, got {} {}",
            type_name(obj),
            show(obj)
        ),
    ))
}

// ---- integer sequences ----

/// An integer sequence argument, always copied: the engine never reads memory another thread
/// can change under it (a numpy array stays writable by others while a call runs).
pub(crate) struct IntArg<T>(pub(crate) Vec<T>);

/// An empty Vec with room for `n` items. A numpy array can be far larger than its memory (a
/// broadcast one has stride 0): `Vec::with_capacity` aborted the process when the copy could
/// not be allocated; that is an error now.
fn vec_for<T>(n: usize, what: &str, request: Option<&str>) -> PyResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_long::<T>(n, what, request))?;
    Ok(v)
}

/// Doubles `v`'s room (an iterator of unknown length), an error instead of an abort when that
/// cannot be allocated.
fn grow<T>(v: &mut Vec<T>, what: &str, request: Option<&str>) -> PyResult<()> {
    let n = v.len().max(4);
    v.try_reserve(n)
        .map_err(|_| too_long::<T>(v.len().saturating_add(n), what, request))
}

#[cold]
fn too_long<T>(n: usize, what: &str, request: Option<&str>) -> PyErr {
    invalid(
        request,
        format!(
            "{what} has {n} items, too many to copy ({} bytes could not be allocated)",
            n.saturating_mul(std::mem::size_of::<T>())
        ),
    )
}

/// Copies a 1-D numpy array of element type `$src` into `T`, range-checking each element.
macro_rules! try_numpy {
    ($arr:expr, $what:expr, $request:expr, $($src:ty),*) => {$(
        if let Ok(a) = $arr.extract::<PyReadonlyArray1<'_, $src>>() {
            let view = a.as_array();
            let mut out = vec_for::<T>(view.len(), $what, $request)?;
            for (i, &v) in view.iter().enumerate() {
                match T::try_from(v as i128) {
                    Ok(t) if (v as i128) >= T::MIN && (v as i128) <= T::MAX => out.push(t),
                    _ => return Err(out_of_range::<T>(&format!("{}[{i}]", $what), &v.to_string(), $request)),
                }
            }
            return Ok(IntArg(out));
        }
    )*};
}

impl<T: IntRange> IntArg<T> {
    pub(crate) fn extract(
        obj: &Bound<'_, PyAny>,
        what: &str,
        request: Option<&str>,
    ) -> PyResult<Self> {
        let py = obj.py();
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            let dtype = arr.dtype();
            let kind = dtype.kind();
            if arr.ndim() != 1 {
                return Err(type_error(
                    request,
                    format!(
                        "{what} must be a 1-D array of integers, got shape {:?}",
                        arr.shape()
                    ),
                ));
            }
            match kind {
                b'i' | b'u' => {
                    try_numpy!(arr, what, request, i64, u64, i32, u32, i16, u16, i8, u8);
                    // A non-native byte order: read element by element below.
                }
                b'O' => {}
                _ => {
                    return Err(type_error(
                        request,
                        format!(
                            "{what} must be integers, got a numpy array of dtype {}",
                            dtype.str().map(|s| s.to_string()).unwrap_or_default()
                        ),
                    ))
                }
            }
        }
        let not_seq = || {
            type_error(
                request,
                format!(
                    "{what} must be a sequence of integers, got {} {}",
                    type_name(obj),
                    show(obj)
                ),
            )
        };
        if obj.is_instance_of::<PyString>() {
            return Err(not_seq());
        }
        // Lists and tuples: read in place (no iterator protocol, no Python code but __index__).
        if let Ok(list) = obj.cast::<PyList>() {
            let mut out = vec_for::<T>(list.len(), what, request)?;
            let mut i = 0;
            // The list may change length while an item's __index__ or a signal handler (run by
            // next_item's check) runs: re-read the length each item.
            while i < list.len() {
                next_item(py, i, what, request)?;
                if let Some(t) = list_small_int(&list, i).and_then(|v| T::try_from(v as i128).ok()) {
                    out.push(t);
                } else if i < list.len() {
                    let item = list.get_item(i)?;
                    out.push(int_item::<T>(&item, what, i, request)?);
                } // else: a signal handler cut the list short; it ends here
                i += 1;
            }
            return Ok(IntArg(out));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            let mut out = vec_for::<T>(t.len(), what, request)?;
            for (i, item) in t.iter().enumerate() {
                out.push(int_item::<T>(&item, what, i, request)?);
            }
            return Ok(IntArg(out));
        }
        let seq = match obj.try_iter() {
            Ok(s) => s,
            Err(e) if e.is_instance_of::<PyTypeError>(py) => return Err(not_seq()),
            Err(e) => return Err(from_callback(py, e, not_seq())),
        };
        let mut out = Vec::new();
        for (i, item) in seq.enumerate() {
            next_item(py, i, what, request)?;
            let item = item.map_err(|e| {
                from_callback(
                    py,
                    e,
                    invalid(request, format!("{what}: iterating it raised an error")),
                )
            })?;
            if out.len() == out.capacity() {
                grow(&mut out, what, request)?;
            }
            out.push(int_item::<T>(&item, what, i, request)?);
        }
        Ok(IntArg(out))
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        &self.0
    }
}

/// An optional integer sequence.
pub(crate) fn opt_ints<T: IntRange>(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
    request: Option<&str>,
) -> PyResult<Option<IntArg<T>>> {
    match obj {
        Some(o) if !o.is_none() => IntArg::<T>::extract(o, what, request).map(Some),
        _ => Ok(None),
    }
}

/// Block ids as u64; negative ids are errors naming the index.
pub(crate) fn block_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    IntArg::<u64>::extract(obj, what, None).map(|a| a.0)
}

/// A sequence of fixed-arity tuples (`[(hash, block)]`, `[(engine, key, groups)]`), each item
/// converted by `item`.
pub(crate) fn tuples<R>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    arity: usize,
    mut item: impl FnMut(&[Bound<'_, PyAny>], &str) -> PyResult<R>,
) -> PyResult<Vec<R>> {
    let py = obj.py();
    let not_seq = || {
        type_error(
            None,
            format!(
                "{what} must be a sequence of {arity}-tuples, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    };
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(not_seq());
    }
    // Each item is converted as it comes, not all collected first: a numpy array of 2**40
    // integers (a broadcast one needs no memory) was iterated to its end before its first
    // item was refused.
    let items = match obj.try_iter() {
        Ok(it) => it,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => return Err(not_seq()),
        Err(e) => return Err(from_callback(py, e, not_seq())),
    };
    let mut out = Vec::new();
    for (i, it) in items.enumerate() {
        next_item(py, i, what, None)?;
        let it = it.map_err(|e| from_callback(py, e, not_seq()))?;
        let it = &it;
        let name = format!("{what}[{i}]");
        let Some(fields) = list_or_tuple_items(it) else {
            return Err(type_error(
                None,
                format!(
                    "{name} must be a tuple of {arity}, got {} {}",
                    type_name(it),
                    show(it)
                ),
            ));
        };
        if fields.len() != arity {
            return Err(invalid(
                None,
                format!(
                    "{name} must have {arity} items, got {} ({})",
                    fields.len(),
                    show(it)
                ),
            ));
        }
        let v = item(&fields, &name)?;
        if out.len() == out.capacity() {
            grow(&mut out, what, None)?;
        }
        out.push(v);
    }
    Ok(out)
}

/// A dict's `(key, value)` pairs, copied before any is converted: converting a value may run
/// Python code (`__index__`, `__float__`) that changes the dict, and pyo3's dict iterator
/// panics when the dict changes size under it. Taking them runs no Python code.
pub(crate) fn dict_items<'py>(d: &Bound<'py, PyDict>) -> Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    d.iter().collect()
}

/// The items of a list or tuple, read in place (no iterator protocol); `None` for anything else.
pub(crate) fn list_or_tuple_items<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(t) = obj.cast::<PyTuple>() {
        Some(t.iter().collect())
    } else if let Ok(l) = obj.cast::<PyList>() {
        Some(l.iter().collect())
    } else {
        None
    }
}

/// `[(hash, block)]` pairs as the host cache's pending stores.
pub(crate) fn pending(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<core::PendingStore>> {
    tuples(obj, what, 2, |f, name| {
        Ok(core::PendingStore {
            hash: int::<u64>(&f[0], &format!("{name}[0] (hash)"), None)?,
            block: int::<u32>(&f[1], &format!("{name}[1] (block)"), None)?,
        })
    })
}

// ---- events ----

/// A `BlockStored`'s successors as vLLM 0.33's `lookahead_token_ids`: `[s]` per block, `[]`
/// where none is recorded.
fn lookahead_to_py<'py>(py: Python<'py>, successors: &[u32]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for &s in successors {
        if s == core::NO_SUCCESSOR {
            out.append(PyList::empty(py))?;
        } else {
            out.append(PyList::new(py, [s])?)?;
        }
    }
    Ok(out)
}

/// Queued events as the tuples `drain_raw_events` returns; a `BlockStored` with successors has
/// a seventh item, its `lookahead_token_ids`.
///
/// Callers hold their object's borrow meanwhile. Allocating the tuples and lists may run
/// Python's cyclic GC, whose finalizers run Python code: one calling back into the object, or
/// releasing the GIL to another thread that did, got `ConcurrentUseError`. The GC is paused
/// until the list is built (nothing here drops a reference to a foreign object).
pub(crate) fn events_to_py<'py>(
    py: Python<'py>,
    log: &core::EventLog,
) -> PyResult<Bound<'py, PyList>> {
    // SAFETY: both need only the GIL, which `py` proves held; PyGC_Disable returns whether
    // the GC was enabled, so a GC the caller had turned off stays off.
    let was_enabled = unsafe { pyo3::ffi::PyGC_Disable() } != 0;
    let out = events_list(py, log);
    if was_enabled {
        // SAFETY: as above.
        unsafe { pyo3::ffi::PyGC_Enable() };
    }
    out
}

fn events_list<'py>(py: Python<'py>, log: &core::EventLog) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for ev in log.iter() {
        let t = match ev {
            core::KvEventRef::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                successors,
            } => {
                let mut items = vec![
                    "BlockStored".into_pyobject(py)?.into_any(),
                    block_hashes.into_pyobject(py)?,
                    parent_block_hash.into_pyobject(py)?,
                    token_ids.into_pyobject(py)?,
                    block_size.into_pyobject(py)?.into_any(),
                    lora_id.into_pyobject(py)?,
                ];
                if let Some(s) = successors {
                    items.push(lookahead_to_py(py, s)?.into_any());
                }
                PyTuple::new(py, items)?
            }
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
    let t = obj.cast::<PyTuple>().map_err(|_| {
        type_error(
            None,
            format!(
                "events[{i}] must be a tuple, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    })?;
    let kind = match t.get_item(0) {
        Ok(k) => text(&k, &format!("events[{i}][0] (the event kind)"))?.to_owned(),
        Err(_) => return Err(bad("must start with the event kind (a str)".into())),
    };
    let field = |j: usize, name: &str| -> PyResult<Bound<'_, PyAny>> {
        t.get_item(j)
            .map_err(|_| bad(format!("{kind} tuple has no {name} (item {j})")))
    };
    let u64s = |j: usize, name: &str| -> PyResult<Vec<u64>> {
        let v = field(j, name)?;
        IntArg::<u64>::extract(&v, &format!("events[{i}].{name}"), None).map(|a| a.0)
    };
    let opt_u64 = |j: usize, name: &str| -> PyResult<Option<u64>> {
        let v = field(j, name)?;
        opt_int::<u64>(Some(&v), &format!("events[{i}].{name}"), None)
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
            if t.len() != 6 && t.len() != 7 {
                return Err(bad(format!(
                    "BlockStored tuple must have 6 items (7 with lookahead_token_ids), got {}",
                    t.len()
                )));
            }
            let tokens = field(3, "token_ids")?;
            let block_hashes = u64s(1, "block_hashes")?;
            let successors = match t.get_item(6) {
                Ok(v) if !v.is_none() => Some(lookahead_from_py(&v, i, block_hashes.len())?),
                _ => None,
            };
            Ok(core::KvEvent::BlockStored {
                block_hashes,
                parent_block_hash: opt_u64(2, "parent_block_hash")?,
                token_ids: IntArg::<u32>::extract(
                    &tokens,
                    &format!("events[{i}].token_ids"),
                    None,
                )?
                .0,
                block_size: int::<u32>(
                    &field(4, "block_size")?,
                    &format!("events[{i}].block_size"),
                    None,
                )?,
                lora_id: opt_u64(5, "lora_id")?,
                successors,
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

/// A sequence of per-block successors: each a token id below 2**32 - 1, or None (none).
pub(crate) fn successors(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(type_error(
            None,
            format!(
                "{what} must be a list or tuple of int or None, got {} {}",
                type_name(obj),
                show(obj)
            ),
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        if x.is_none() {
            out.push(core::NO_SUCCESSOR);
            continue;
        }
        let v = int::<u32>(x, &format!("{what}[{i}]"), None)?;
        if v == core::NO_SUCCESSOR {
            return Err(invalid(
                None,
                format!("{what}[{i}] must be below {}, got {v}", core::NO_SUCCESSOR),
            ));
        }
        out.push(v);
    }
    Ok(out)
}

/// A raw `BlockStored`'s seventh item, `lookahead_token_ids`: one list per block, each empty
/// (no successor) or holding one token id below 2**32 - 1 (the core records one successor per
/// block).
fn lookahead_from_py(obj: &Bound<'_, PyAny>, i: usize, blocks: usize) -> PyResult<Vec<u32>> {
    let what = format!("events[{i}].lookahead_token_ids");
    let wrong = |o: &Bound<'_, PyAny>, w: &str| {
        type_error(
            None,
            format!(
                "{w} must be a list or tuple, got {} {}",
                type_name(o),
                show(o)
            ),
        )
    };
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Err(wrong(obj, &what));
    };
    if items.len() != blocks {
        return Err(invalid(
            None,
            format!(
                "{what} has {} entries for {blocks} block hashes (one per block)",
                items.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(blocks);
    for (j, e) in items.iter().enumerate() {
        let w = format!("{what}[{j}]");
        let toks: Vec<Bound<'_, PyAny>> = if let Ok(l) = e.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(t) = e.cast::<PyTuple>() {
            t.iter().collect()
        } else {
            return Err(wrong(e, &w));
        };
        match toks.as_slice() {
            [] => out.push(core::NO_SUCCESSOR),
            [x] => {
                let v = int::<u32>(x, &format!("{w}[0]"), None)?;
                if v == core::NO_SUCCESSOR {
                    return Err(invalid(
                        None,
                        format!("{w}[0] must be below {}, got {v}", core::NO_SUCCESSOR),
                    ));
                }
                out.push(v);
            }
            _ => {
                return Err(invalid(
                    None,
                    format!("{w} must hold at most one token id, got {}", toks.len()),
                ))
            }
        }
    }
    Ok(out)
}

/// The batch-level arguments of an encoded event batch, converted.
pub(crate) struct MetaArgs<'a> {
    ts: f64,
    medium: Option<&'a str>,
    data_parallel_rank: Option<i64>,
    hashes_as_bytes: bool,
}

impl<'a> MetaArgs<'a> {
    pub(crate) fn extract(
        ts: &Bound<'_, PyAny>,
        medium: Option<&'a str>,
        data_parallel_rank: Option<&Bound<'_, PyAny>>,
        hashes_as_bytes: bool,
    ) -> PyResult<Self> {
        Ok(MetaArgs {
            ts: float_arg(ts, "ts")?,
            medium,
            data_parallel_rank: opt_int::<i64>(data_parallel_rank, "data_parallel_rank", None)?,
            hashes_as_bytes,
        })
    }

    pub(crate) fn meta(&self) -> core::BatchMeta<'a> {
        core::BatchMeta {
            ts: self.ts,
            data_parallel_rank: self.data_parallel_rank,
            medium: self.medium,
            hash_format: if self.hashes_as_bytes {
                core::HashFormat::Bytes
            } else {
                core::HashFormat::U64
            },
        }
    }
}

/// Encodes a queued log into `buf` (reused scratch); the log is unchanged. The GIL stays held:
/// the log belongs to an object other threads may call.
pub(crate) fn log_to_msgpack<'py>(
    py: Python<'py>,
    log: &core::EventLog,
    buf: &mut Vec<u8>,
    meta: core::BatchMeta<'_>,
) -> PyResult<Bound<'py, PyBytes>> {
    buf.clear();
    log.encode_msgpack(&meta, buf).map_err(encode_error)?;
    Ok(PyBytes::new(py, buf))
}

/// Encodes each queued event of `log` (see `kvslots_core::encode_each`) and returns them as a
/// list of `raw(bytes)`, one per event (`raw` is msgspec's `Raw`: vLLM's publisher writes them
/// verbatim). `wire` and `ends` are reused scratch; the log is unchanged.
pub(crate) fn log_to_raw_list<'py>(
    py: Python<'py>,
    log: &core::EventLog,
    raw: &Bound<'py, PyAny>,
    medium: Option<&str>,
    hashes_as_bytes: bool,
    wire: &mut Vec<u8>,
    ends: &mut Vec<usize>,
) -> PyResult<Bound<'py, PyList>> {
    if !raw.is_callable() {
        return Err(invalid(
            None,
            format!("raw must be callable (msgspec.Raw), got {}", type_name(raw)),
        ));
    }
    let meta = core::BatchMeta {
        ts: 0.0,
        data_parallel_rank: None,
        medium,
        hash_format: if hashes_as_bytes {
            core::HashFormat::Bytes
        } else {
            core::HashFormat::U64
        },
    };
    wire.clear();
    ends.clear();
    log.encode_each(&meta, wire, ends).map_err(encode_error)?;
    let out = PyList::empty(py);
    let mut start = 0;
    for &end in ends.iter() {
        // `raw` is the caller's: an error it raises is a kvslots error (the queue stays).
        let item = raw
            .call1((PyBytes::new(py, &wire[start..end]),))
            .map_err(|e| crate::errors::reading_error(py, e, "raw(event bytes)"))?;
        out.append(item)?;
        start = end;
    }
    Ok(out)
}

/// Converters for arguments that have a default other than `None` (`#[pyo3(from_py_with)]`:
/// the runtime signature keeps its defaults, and a given value gets the same rules and errors
/// as every other argument).
pub(crate) mod arg {
    use super::*;

    pub(crate) fn hash_seed(o: &Bound<'_, PyAny>) -> PyResult<u64> {
        int::<u64>(o, "hash_seed", None)
    }
    pub(crate) fn lookahead(o: &Bound<'_, PyAny>) -> PyResult<usize> {
        count(o, "lookahead", None)
    }
    pub(crate) fn offset(o: &Bound<'_, PyAny>) -> PyResult<usize> {
        count(o, "offset", None)
    }
    pub(crate) fn threads(o: &Bound<'_, PyAny>) -> PyResult<usize> {
        count(o, "threads", None)
    }
    pub(crate) fn match_prefix(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "match_prefix", None)
    }
    pub(crate) fn enable_prefix_caching(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "enable_prefix_caching", None)
    }
    pub(crate) fn hashes_as_bytes(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "hashes_as_bytes", None)
    }
    pub(crate) fn drain(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "drain", None)
    }
    pub(crate) fn publish_successors(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "publish_successors", None)
    }
    pub(crate) fn journal(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "journal", None)
    }
    pub(crate) fn medium(o: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
        opt_text(Some(o), "medium").map(|m| m.map(str::to_owned))
    }
    pub(crate) fn default_tier(o: &Bound<'_, PyAny>) -> PyResult<String> {
        text(o, "default_tier").map(str::to_owned)
    }
    pub(crate) fn failed_blocks(o: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        IntArg::<u32>::extract(o, "failed_blocks", None).map(|a| a.0)
    }
    pub(crate) fn block_ids(o: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        IntArg::<u32>::extract(o, "block_ids", None).map(|a| a.0)
    }
    pub(crate) fn allow_none(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "allow_none", None)
    }
    pub(crate) fn ok(o: &Bound<'_, PyAny>) -> PyResult<bool> {
        flag(o, "ok", None)
    }
    pub(crate) fn timeout_s(o: &Bound<'_, PyAny>) -> PyResult<f64> {
        float_arg(o, "timeout_s")
    }
    /// A block's bytes: a 1-D uint8 numpy array.
    pub(crate) fn data<'py>(o: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArray1<'py, u8>> {
        let arr = o.cast::<PyArray1<u8>>().map_err(|_| {
            type_error(None, format!("data must be a 1-D uint8 numpy array, got {}", array_kind(o)))
        })?;
        arr.try_readonly()
            .map_err(|e| invalid(None, format!("data cannot be read now: {e}")))
    }
    /// Rows to read blocks into: a writable 2-D uint8 numpy array.
    pub(crate) fn out<'py>(o: &Bound<'py, PyAny>) -> PyResult<PyReadwriteArray2<'py, u8>> {
        let arr = o.cast::<PyArray2<u8>>().map_err(|_| {
            type_error(None, format!("out must be a 2-D uint8 numpy array, got {}", array_kind(o)))
        })?;
        arr.try_readwrite()
            .map_err(|e| invalid(None, format!("out is read-only or in use by another call: {e}")))
    }

    fn array_kind(o: &Bound<'_, PyAny>) -> String {
        match o.cast::<PyUntypedArray>() {
            Ok(a) => format!("an array of dtype {} and {} dimension(s)", a.dtype(), a.ndim()),
            Err(_) => format!("{} {}", type_name(o), show(o)),
        }
    }
}
