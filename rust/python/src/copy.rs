//! `kvslots._core.BlockRegion` and `kvslots._core.copy_blocks`: whole-block copies between
//! registered host memory regions (the host tier's transfers).
//!
//! No address crosses a copy call. A region is registered once from the memory object itself
//! (a numpy array through `__array_interface__`, or a CPU torch tensor through its own
//! `data_ptr`, `nbytes`, `dtype` and `device`, with torch functions disabled), together with
//! its block layout; the region keeps the object alive (and a numpy array unresizable). A
//! copy names two regions and block ids, every id is checked against its region's block
//! count, and the memory is read again from the object (it must not have moved or shrunk)
//! before any byte moves.

use kvslots_core as core;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::convert::{arg, block_ids, count, int, pin_arrays, show, type_name};
use crate::errors::{invalid, reading_error, slot_error, type_error};

/// Where a memory object's bytes are, read from the object itself.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Memory {
    base: usize,
    nbytes: usize,
    writable: bool,
    dtype: String,
    device: String,
}

fn bad_memory(obj: &Bound<'_, PyAny>, why: &str) -> PyErr {
    invalid(
        None,
        format!("memory ({} {}): {why}", type_name(obj), show(obj)),
    )
}

/// torch's classes and the `TensorBase` descriptors a region's memory is read through, looked up
/// once (the first time a torch tensor is registered; numpy-only use never imports torch).
struct Torch {
    tensor: Py<PyAny>,
    parameter: Py<PyAny>,
    base_cls: Py<PyAny>,
    data_ptr: Py<PyAny>,
    nbytes: Py<PyAny>,
    untyped_storage: Py<PyAny>,
    /// `torch._C.DisableTorchFunction`: the tensor is read with it entered, so a
    /// `TorchFunctionMode` (which sees even the base class's methods on a plain tensor) cannot
    /// answer another address, size or storage.
    disable: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch_api(py: Python<'_>) -> PyResult<&'static Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let base_cls = torch.getattr("_C")?.getattr("TensorBase")?;
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.unbind(),
            parameter: torch.getattr("nn")?.getattr("Parameter")?.unbind(),
            data_ptr: base_cls.getattr("data_ptr")?.unbind(),
            nbytes: base_cls.getattr("nbytes")?.unbind(),
            untyped_storage: base_cls.getattr("untyped_storage")?.unbind(),
            disable: torch.getattr("_C")?.getattr("DisableTorchFunction")?.unbind(),
            base_cls: base_cls.unbind(),
        })
    })
}

/// Runs `f` with torch's `__torch_function__` handling (subclasses and modes) off.
fn without_torch_function<T>(
    py: Python<'_>,
    t: &Torch,
    f: impl FnOnce() -> PyResult<T>,
) -> PyResult<T> {
    let guard = t.disable.bind(py).call0()?;
    guard.call_method0(intern!(py, "__enter__"))?;
    let r = f();
    let none = py.None();
    let exit = guard.call_method1(intern!(py, "__exit__"), (&none, &none, &none));
    let v = r?;
    exit?;
    Ok(v)
}

/// A CPU torch tensor's memory (contiguous), or `None` when `obj` is not a torch tensor. Only
/// a plain `torch.Tensor` or `torch.nn.Parameter` is accepted, and it is read through the
/// tensor base class, so neither a subclass (`__torch_function__`) nor an instance attribute
/// can substitute another address.
fn torch_memory(obj: &Bound<'_, PyAny>) -> PyResult<Option<Memory>> {
    let py = obj.py();
    let ty = obj.get_type();
    let module: String = ty.module().map(|m| m.to_string()).unwrap_or_default();
    if !module.starts_with("torch") {
        return Ok(None);
    }
    let t = torch_api(py)?;
    let tensor = t.tensor.bind(py);
    if !ty.is(tensor) && !ty.is(t.parameter.bind(py)) {
        if obj.is_instance(tensor)? {
            return Err(bad_memory(
                obj,
                "a torch.Tensor subclass; register a plain tensor (t.as_subclass(torch.Tensor))",
            ));
        }
        return Ok(None);
    }
    without_torch_function(py, t, || tensor_memory(obj, t)).map(Some)
}

fn tensor_memory(obj: &Bound<'_, PyAny>, t: &Torch) -> PyResult<Memory> {
    let py = obj.py();
    let base_cls = t.base_cls.bind(py);
    let method =
        |name: &str| -> PyResult<Bound<'_, PyAny>> { base_cls.getattr(name)?.call1((obj,)) };
    let prop = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        base_cls
            .getattr(name)?
            .call_method1("__get__", (obj, &base_cls))
    };
    let device = prop("device")?;
    let device_str = device.str()?.to_string();
    let device_type: String = device.getattr("type")?.extract()?;
    if device_type != "cpu" {
        return Err(bad_memory(
            obj,
            &format!("a tensor on {device_str}; copies need host (CPU) memory"),
        ));
    }
    if !method("is_contiguous")?.is_truthy()? {
        return Err(bad_memory(obj, "the tensor is not contiguous"));
    }
    let base = int::<usize>(&method("data_ptr")?, "memory.data_ptr()", None)?;
    let nbytes = int::<usize>(&prop("nbytes")?, "memory.nbytes", None)?;
    if base == 0 && nbytes > 0 {
        return Err(bad_memory(obj, "its address is null"));
    }
    Ok(Memory {
        base,
        nbytes,
        writable: true,
        dtype: prop("dtype")?.str()?.to_string(),
        device: device_str,
    })
}

/// The storage of a CPU torch tensor whose registered memory is `base..base + nbytes`, to be
/// held across a copy with the GIL released: another thread may give the tensor another storage
/// (`set_`) meanwhile, which would free the bytes being copied; the held storage keeps them
/// alive, as torch's own ops do. Checked to be a CPU storage holding those bytes (a storage
/// swapped before it was taken is refused).
///
/// Not covered (documented in docs/design.md): torch reallocates a storage's bytes in place on
/// `Tensor.resize_` to more bytes than it holds, `UntypedStorage.resize_` and `share_memory_`,
/// freeing the old bytes whoever else holds the storage (unlike numpy's `resize`, with no
/// reference check), and exposes no way to pin them or to make a storage non-resizable.
fn held_storage<'py>(
    obj: &Bound<'py, PyAny>,
    t: &Torch,
    base: usize,
    nbytes: usize,
    which: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let storage = t.untyped_storage.bind(py).call1((obj,))?;
    let device = storage.getattr(intern!(py, "device"))?;
    let on_cpu = device.getattr(intern!(py, "type"))?.str()?.to_str()? == "cpu";
    let start = int::<usize>(
        &storage.call_method0(intern!(py, "data_ptr"))?,
        "storage.data_ptr()",
        None,
    )?;
    let len = int::<usize>(
        &storage.call_method0(intern!(py, "nbytes"))?,
        "storage.nbytes()",
        None,
    )?;
    let inside = nbytes == 0
        || (start <= base
            && base
                .checked_add(nbytes)
                .is_some_and(|end| end <= start.saturating_add(len)));
    if !on_cpu || !inside {
        return Err(invalid(
            None,
            format!("the {which} region's memory moved while the copy started; register it again"),
        ));
    }
    Ok(storage)
}

/// A C-contiguous numpy array's memory, read from the array struct itself.
fn array_memory(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    let (base, nbytes, writable) = array_raw(obj)?;
    let arr = obj.cast::<PyUntypedArray>()?;
    Ok(Memory {
        base,
        nbytes,
        writable,
        dtype: arr.dtype().str().map(|s| s.to_string()).unwrap_or_default(),
        device: "cpu".into(),
    })
}

/// A C-contiguous numpy array's address, size in bytes and writability, read from the array
/// struct itself (what a copy needs of it, nothing that costs a Python call).
fn array_raw(obj: &Bound<'_, PyAny>) -> PyResult<(usize, usize, bool)> {
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        type_error(
            None,
            format!(
                "memory must be a numpy array or a CPU torch tensor, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    })?;
    if !arr.is_c_contiguous() {
        return Err(bad_memory(obj, "the array is not C-contiguous"));
    }
    let dtype = arr.dtype();
    if dtype.has_object() {
        // Its bytes are PyObject pointers: copying them would forge references.
        return Err(bad_memory(obj, "its dtype holds Python objects; copies need plain data"));
    }
    let nbytes = arr
        .len()
        .checked_mul(dtype.itemsize())
        .ok_or_else(|| bad_memory(obj, "its size overflows"))?;
    // SAFETY: `arr` is a live ndarray (checked by the cast); we read two fields of its struct.
    let (base, flags) = unsafe {
        let a = arr.as_array_ptr();
        ((*a).fields.data as usize, (*a).fields.flags)
    };
    if base == 0 && nbytes > 0 {
        return Err(bad_memory(obj, "its address is null"));
    }
    Ok((base, nbytes, flags & numpy::npyffi::NPY_ARRAY_WRITEABLE != 0))
}

fn memory_of(obj: &Bound<'_, PyAny>) -> PyResult<Memory> {
    // A tensor torch cannot answer for (a sparse CSR or mkldnn one raises from is_contiguous
    // or data_ptr): a kvslots error naming the memory, with torch's as its cause.
    let m = match torch_memory(obj).map_err(|e| reading_error(obj.py(), e, "memory"))? {
        Some(m) => m,
        None => array_memory(obj)?,
    };
    // from_raw_parts needs the region to fit in isize and not wrap the address space.
    if m.nbytes > isize::MAX as usize || m.base.checked_add(m.nbytes).is_none() {
        return Err(bad_memory(obj, "its bytes wrap the address space"));
    }
    Ok(m)
}

/// A host memory region split into blocks: block `id` (`0 <= id < num_blocks`) is the bytes
/// `offset + id * stride .. + block_bytes` of `memory` (a numpy array or a CPU torch tensor,
/// C-contiguous), all checked to lie inside it. Registered once; copies name block ids only.
#[pyclass(module = "kvslots._core", weakref, frozen)]
pub(crate) struct BlockRegion {
    memory: Py<PyAny>,
    /// Weak references to a numpy memory and the arrays it is a view of (`convert::pin_arrays`).
    pins: Vec<Py<PyAny>>,
    mem: Memory,
    num_blocks: usize,
    block_bytes: usize,
    stride: usize,
    offset: usize,
}

#[pymethods]
impl BlockRegion {
    /// The Python objects it holds, for the cycle collector: without it a cycle through this
    /// object (a request, array or status whose attribute refers back to it) was never freed.
    fn __traverse__(&self, visit: pyo3::pyclass::PyVisit<'_>) -> Result<(), pyo3::pyclass::PyTraverseError> {
        visit.call(&self.memory)?;
        for p in &self.pins {
            visit.call(p)?;
        }
        Ok(())
    }

    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it points into the memory of the array or tensor it was built from",
        )
    }

    #[new]
    #[pyo3(signature = (memory, *, block_bytes, num_blocks, stride=None, offset=0))]
    fn new(
        memory: &Bound<'_, PyAny>,
        block_bytes: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        stride: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = arg::offset)] offset: usize,
    ) -> PyResult<Self> {
        let block_bytes = count(block_bytes, "block_bytes", None)?;
        let num_blocks = count(num_blocks, "num_blocks", None)?;
        let stride = match stride.filter(|s| !s.is_none()) {
            Some(s) => count(s, "stride", None)?,
            None => block_bytes,
        };
        if block_bytes == 0 {
            return Err(invalid(None, "block_bytes must be >= 1, got 0".into()));
        }
        if stride < block_bytes {
            return Err(invalid(
                None,
                format!("stride = {stride} is less than block_bytes = {block_bytes}: blocks would overlap"),
            ));
        }
        let mut mem = memory_of(memory)?;
        // torch keeps no read-only flag (a tensor over a read-only mmap says nothing): ask the
        // kernel's mappings, once, here.
        if mem.writable && core::mapped_writable(mem.base, mem.nbytes) == Some(false) {
            mem.writable = false;
        }
        let end = match num_blocks {
            0 => Some(offset),
            n => (n - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(offset))
                .and_then(|x| x.checked_add(block_bytes)),
        };
        if end.map_or(true, |e| e > mem.nbytes) {
            return Err(invalid(
                None,
                format!(
                    "num_blocks = {num_blocks} blocks of {block_bytes} bytes at offset {offset}, \
                     stride {stride} do not fit in the memory's {} bytes",
                    mem.nbytes
                ),
            ));
        }
        let pins = pin_arrays(memory)?;
        Ok(BlockRegion {
            memory: memory.clone().unbind(),
            pins,
            mem,
            num_blocks,
            block_bytes,
            stride,
            offset,
        })
    }

    /// The memory object (kept alive by the region).
    #[getter]
    fn memory(&self, py: Python<'_>) -> Py<PyAny> {
        self.memory.clone_ref(py)
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.mem.nbytes
    }
    #[getter]
    fn dtype(&self) -> &str {
        &self.mem.dtype
    }
    #[getter]
    fn device(&self) -> &str {
        &self.mem.device
    }
    #[getter]
    fn writable(&self) -> bool {
        self.mem.writable
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    #[getter]
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }
    #[getter]
    fn stride(&self) -> usize {
        self.stride
    }
    #[getter]
    fn offset(&self) -> usize {
        self.offset
    }
    fn __repr__(&self) -> String {
        format!(
            "BlockRegion(num_blocks={}, block_bytes={}, stride={}, offset={}, nbytes={}, dtype={:?}, device={:?})",
            self.num_blocks, self.block_bytes, self.stride, self.offset, self.mem.nbytes,
            self.mem.dtype, self.mem.device
        )
    }
}

impl BlockRegion {
    /// The region's memory as it is now: it must not have moved, shrunk or become read-only
    /// since registration (a tensor resized in place, say). For a torch tensor, also its
    /// storage, to hold while the copy runs (see `held_storage`), read in the same pass.
    fn current<'py>(&self, py: Python<'py>, which: &str) -> PyResult<Current<'py>> {
        let obj = self.memory.bind(py);
        if let Some(t) = TORCH.get(py) {
            let ty = obj.get_type();
            if ty.is(t.tensor.bind(py)) || ty.is(t.parameter.bind(py)) {
                return without_torch_function(py, t, || {
                    let base = int::<usize>(
                        &t.data_ptr.bind(py).call1((obj,))?,
                        "memory.data_ptr()",
                        None,
                    )?;
                    let nbytes = int::<usize>(
                        &t.nbytes
                            .bind(py)
                            .call_method1(intern!(py, "__get__"), (obj, t.base_cls.bind(py)))?,
                        "memory.nbytes",
                        None,
                    )?;
                    self.check_same(which, base, nbytes)?;
                    let pin = held_storage(obj, t, base, self.mem.nbytes, which)?;
                    Ok(Current {
                        base,
                        writable: self.mem.writable,
                        _pin: Some(pin),
                    })
                });
            }
        }
        // A numpy array (registered as one: its type cannot change to a tensor's).
        let (base, nbytes, writable) = array_raw(obj)?;
        self.check_same(which, base, nbytes)?;
        Ok(Current {
            base,
            writable: writable && self.mem.writable,
            _pin: None,
        })
    }

    fn check_same(&self, which: &str, base: usize, nbytes: usize) -> PyResult<()> {
        if base != self.mem.base || nbytes < self.mem.nbytes {
            return Err(invalid(
                None,
                format!(
                    "the {which} region's memory moved or shrank since it was registered \
                     ({:#x}+{} bytes, now {:#x}+{}); register it again",
                    self.mem.base, self.mem.nbytes, base, nbytes
                ),
            ));
        }
        Ok(())
    }

    fn layout(&self) -> core::BlockLayout {
        core::BlockLayout {
            offset: self.offset,
            stride: self.stride,
        }
    }
}

/// A region's memory read at the start of a copy: its address, whether it may be written, and
/// (a torch tensor's) storage, held until the copy has finished.
struct Current<'py> {
    base: usize,
    writable: bool,
    _pin: Option<Bound<'py, PyAny>>,
}

fn region<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    what: &str,
) -> PyResult<&'a Bound<'py, BlockRegion>> {
    obj.cast::<BlockRegion>().map_err(|_| {
        type_error(
            None,
            format!(
                "{what} must be a BlockRegion, got {} {}",
                type_name(obj),
                show(obj)
            ),
        )
    })
}

/// Block ids of a region, each checked against its block count.
fn ids_in(obj: &Bound<'_, PyAny>, what: &str, r: &BlockRegion, which: &str) -> PyResult<Vec<u64>> {
    let ids = block_ids(obj, what)?;
    for (i, &b) in ids.iter().enumerate() {
        if b >= r.num_blocks as u64 {
            return Err(invalid(
                None,
                format!(
                    "{what}[{i}] = {b} is outside the {which} region's {} blocks",
                    r.num_blocks
                ),
            ));
        }
    }
    Ok(ids)
}

/// Copies block `src_blocks[i]` of region `src` into block `dst_blocks[i]` of region `dst` for
/// every i; returns the bytes copied. Everything is validated before the first byte moves; the
/// GIL is released during the copy (the regions keep their memory objects alive, and a torch
/// tensor's storage is held, so a tensor given another storage meanwhile frees nothing being
/// copied; torch reallocating a storage's bytes in place while a copy runs, `resize_` to more
/// bytes, `UntypedStorage.resize_` or `share_memory_` from another thread, cannot be seen or
/// prevented from here and is the caller's to avoid, as with any torch op: docs/design.md).
#[pyfunction]
#[pyo3(signature = (src, dst, src_blocks, dst_blocks, threads=1))]
pub(crate) fn copy_blocks(
    py: Python<'_>,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    src_blocks: &Bound<'_, PyAny>,
    dst_blocks: &Bound<'_, PyAny>,
    #[pyo3(from_py_with = arg::threads)] threads: usize,
) -> PyResult<usize> {
    let src = region(src, "src")?.get();
    let dst = region(dst, "dst")?.get();
    let sb = ids_in(src_blocks, "src_blocks", src, "src")?;
    let db = ids_in(dst_blocks, "dst_blocks", dst, "dst")?;
    if threads == 0 {
        return Err(invalid(None, "threads must be at least 1, got 0".into()));
    }
    if src.block_bytes != dst.block_bytes {
        return Err(invalid(
            None,
            format!(
                "the src region's blocks are {} bytes but the dst region's are {}",
                src.block_bytes, dst.block_bytes
            ),
        ));
    }
    // Each holds its torch storage (if any) until the copy below has finished.
    let sm = src.current(py, "src")?;
    let dm = dst.current(py, "dst")?;
    if !dm.writable {
        return Err(invalid(None, "the dst region's memory is read-only".into()));
    }
    let (sa, sl, da, dl) = (sm.base, src.mem.nbytes, dm.base, dst.mem.nbytes);
    // A shared and a mutable slice over the same bytes would be undefined behaviour.
    if sl > 0 && dl > 0 && sa < da + dl && da < sa + sl {
        return Err(invalid(
            None,
            format!(
                "the src region ({sa:#x}+{sl}) and the dst region ({da:#x}+{dl}) share memory; \
                 copy_blocks needs two distinct memories"
            ),
        ));
    }
    let spec = core::CopySpec {
        block_bytes: src.block_bytes,
        src: src.layout(),
        dst: dst.layout(),
    };
    py.detach(move || {
        // SAFETY: both memories were read from their (live, kept-alive) objects just now,
        // are non-null or empty, fit in isize without wrapping, and do not overlap each other.
        // The core touches only the validated in-bounds ranges of registered blocks.
        let (s, d) = unsafe {
            let s: &[u8] = if sl == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(sa as *const u8, sl)
            };
            let d: &mut [u8] = if dl == 0 {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(da as *mut u8, dl)
            };
            (s, d)
        };
        core::copy_blocks(s, d, &spec, &sb, &db, threads)
    })
    .map_err(slot_error)
}
