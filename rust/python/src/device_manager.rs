//! `kvslots._core.DeviceKVManager` and `KVBlocks`: the device-block allocator of scheduler mode
//! (`kvslots_core::device`). Conversions only: a vLLM `Request` is read for the numbers and the
//! block hashes an operation needs, the allocation rules are the core's.
//!
//! Arguments, and the request's fields, are converted before the manager is borrowed (see
//! `slot_manager.rs`); the block hashes of a request are read from its `block_hashes` list
//! while the core works (a list of `bytes`: no Python code runs).
//!
//! The hot calls vLLM's scheduler makes per request (`allocate_slots`, `get_blocks`,
//! `get_block_ids`, `free`) are implemented here directly, so a call costs one Rust call and
//! no Python frame; the rest of the manager interface is the Python subclass
//! (`kvslots.vllm.scheduler.KVSlotsKVCacheManager`).

use kvslots_core as core;
use kvslots_core::device::{AllocArgs, DeviceAllocator, DeviceConfig, FullHash, HashSource};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::convert::{
    arg, count, flag, list_or_tuple_items, next_item, opt_ints, show, text, type_name, IntArg,
};
use crate::errors::{
    borrow, borrow_mut, busy, changed_meanwhile, invalid, reading_error, KVSlotsError, slot_error as err,
    type_error,
    ArgumentTypeError,
};

/// A request's `block_hashes` list, read on first use (most decode steps read none). On a vLLM
/// `Request` that is a plain attribute holding a list of `bytes`: no Python code runs.
///
/// Anything else (a property, a sequence that is not a list) runs Python code while the core
/// works and the manager is borrowed: an error it raises (say, `ConcurrentUseError` from a call
/// back into the manager) is kept, and is what the failed call raises ([`Self::error`]).
struct RequestHashes<'a, 'py> {
    request: &'a Bound<'py, PyAny>,
    list: std::cell::OnceCell<Bound<'py, PyAny>>,
    raised: std::cell::RefCell<Option<(PyErr, String)>>,
}

impl<'a, 'py> RequestHashes<'a, 'py> {
    fn of(request: &'a Bound<'py, PyAny>, _rid: &str) -> PyResult<Self> {
        Ok(RequestHashes {
            request,
            list: std::cell::OnceCell::new(),
            raised: std::cell::RefCell::new(None),
        })
    }
    fn list(&self) -> core::Result<&Bound<'py, PyAny>> {
        if let Some(l) = self.list.get() {
            return Ok(l);
        }
        let l = self
            .request
            .getattr(intern!(self.request.py(), "block_hashes"))
            .map_err(|e| {
                self.keep(e, "request.block_hashes");
                core::SlotError::invalid(None, "request.block_hashes is missing")
            })?;
        Ok(self.list.get_or_init(|| l))
    }
    /// Keeps the first error Python code raised while the hashes were read.
    fn keep(&self, e: PyErr, what: &str) {
        let mut r = self.raised.borrow_mut();
        if r.is_none() {
            *r = Some((e, what.to_owned()));
        }
    }
    /// The error of a call the core refused: the one the request's Python code raised, if any
    /// (as a kvslots error naming what was read), else the core's.
    fn error(&self, e: core::SlotError) -> PyErr {
        match self.raised.borrow_mut().take() {
            Some((py_err, what)) => reading_error(self.request.py(), py_err, &what),
            None => err(e),
        }
    }
}

/// One engine block hash: `bytes` (vLLM's `BlockHash`) or an `int` (taken modulo 2**64).
fn full_hash(item: &Bound<'_, PyAny>, i: usize) -> core::Result<FullHash> {
    if let Ok(b) = item.cast::<PyBytes>() {
        return FullHash::from_bytes(b.as_bytes()).ok_or_else(|| {
            core::SlotError::invalid(
                None,
                format!(
                    "block_hashes[{i}] must be 1 to {} bytes, got {}",
                    FullHash::MAX_LEN,
                    b.as_bytes().len()
                ),
            )
        });
    }
    if item.is_instance_of::<pyo3::types::PyInt>() && !item.is_instance_of::<pyo3::types::PyBool>()
    {
        if let Ok(v) = item.extract::<i128>() {
            return Ok(FullHash::from_u64(v as u64));
        }
    }
    Err(core::SlotError::invalid(
        None,
        format!(
            "block_hashes[{i}] must be bytes or an int, got {}",
            type_name(item)
        ),
    ))
}

impl HashSource for RequestHashes<'_, '_> {
    fn len(&self) -> usize {
        let Ok(l) = self.list() else { return 0 };
        match l.cast::<PyList>() {
            Ok(l) => l.len(),
            Err(_) => l.len().unwrap_or_else(|e| {
                self.keep(e, "len(request.block_hashes)");
                0
            }),
        }
    }
    fn get(&self, i: usize) -> core::Result<FullHash> {
        let l = self.list()?;
        let item = match l.cast::<PyList>() {
            Ok(list) => list.get_item(i),
            Err(_) => l.get_item(i),
        }
        .map_err(|e| {
            self.keep(e, &format!("request.block_hashes[{i}]"));
            core::SlotError::invalid(None, format!("block hash {i} is missing"))
        })?;
        full_hash(&item, i)
    }
}

/// `request.request_id` (the request may be a duck-typed object): the str object, kept alive
/// for the call, so that its text is borrowed rather than copied.
fn request_id_obj<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let r = request
        .getattr(intern!(request.py(), "request_id"))
        .map_err(|_| {
            type_error(
                None,
                format!("request must have a request_id, got {}", show(request)),
            )
        })?;
    text(&r, "request.request_id")?;
    Ok(r.cast_into::<PyString>().expect("checked by text()"))
}

/// The attribute `allocate_slots` notes a request's slot in; the slot's tag (the object's
/// address) confirms it, so a stale or copied note only costs a lookup by name.
const SLOT_ATTR: &str = "_kvslots_slot";

/// The slot noted on the request, if any.
fn noted_slot(request: &Bound<'_, PyAny>) -> Option<usize> {
    let v = request
        .getattr_opt(intern!(request.py(), SLOT_ATTR))
        .ok()
        .flatten()?;
    if !v.is_exact_instance_of::<pyo3::types::PyInt>() {
        return None;
    }
    v.extract::<usize>().ok()
}

/// `request.request_id` as an owned string.
fn request_id_of(request: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(request_id_obj(request)?.to_str()?.to_owned())
}

/// A count, with a fast path for an exact `int` (the usual case); anything else goes through
/// the project's conversion rules (and their errors).
#[inline]
fn fast_count(obj: &Bound<'_, PyAny>, what: &str, rid: Option<&str>) -> PyResult<usize> {
    if obj.is_exact_instance_of::<pyo3::types::PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            if v >= 0 {
                return Ok(v as usize);
            }
        }
    }
    slow_count(obj, what, rid)
}

// Out of line: the per-step call stays small whatever else inlines `count`.
#[cold]
#[inline(never)]
fn slow_count(obj: &Bound<'_, PyAny>, what: &str, rid: Option<&str>) -> PyResult<usize> {
    count(obj, what, rid)
}

fn count_attr(
    obj: &Bound<'_, PyAny>,
    name: &Bound<'_, PyString>,
    what: &str,
    rid: &str,
) -> PyResult<usize> {
    let v = obj
        .getattr(name)
        .map_err(|_| type_error(Some(rid), format!("{what} is missing")))?;
    fast_count(&v, what, Some(rid))
}

/// `request.num_tokens`, read from the list behind it when there is one.
fn num_tokens(request: &Bound<'_, PyAny>, rid: &str) -> PyResult<usize> {
    let py = request.py();
    if let Ok(t) = request.getattr(intern!(py, "_all_token_ids")) {
        if let Ok(l) = t.cast::<PyList>() {
            return Ok(l.len());
        }
    }
    count_attr(
        request,
        intern!(py, "num_tokens"),
        "request.num_tokens",
        rid,
    )
}

fn opt_count(obj: Option<&Bound<'_, PyAny>>, what: &str, rid: Option<&str>) -> PyResult<usize> {
    match obj {
        Some(o) if !o.is_none() => fast_count(o, what, rid),
        _ => Ok(0),
    }
}

fn opt_flag(
    obj: Option<&Bound<'_, PyAny>>,
    what: &str,
    rid: Option<&str>,
    default: bool,
) -> PyResult<bool> {
    match obj {
        Some(o) if !o.is_none() => flag(o, what, rid),
        _ => Ok(default),
    }
}

/// Block ids of one KV cache group, as vLLM's `KVCacheBlocks` hands them to the scheduler.
/// Built in Rust from a request's table; a view, never a block object per id.
#[pyclass(module = "kvslots._core", weakref, frozen)]
pub(crate) struct KVBlocks {
    ids: Vec<u32>,
}

#[pymethods]
impl KVBlocks {
    /// A list of block ids: `pickle`, `copy.copy` and `copy.deepcopy` give the same ids.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Vec<u32>,))> {
        Ok((slf.get_type().into_any(), (slf.get().ids.clone(),)))
    }

    #[new]
    #[pyo3(signature = (block_ids=Vec::new()))]
    fn py_new(#[pyo3(from_py_with = arg::block_ids)] block_ids: Vec<u32>) -> Self {
        KVBlocks { ids: block_ids }
    }

    /// `(ids,)`, one list per KV cache group (there is one); `None` with `allow_none` when empty.
    #[pyo3(signature = (allow_none=false, *, group_ids=None))]
    fn get_block_ids<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = arg::allow_none)] allow_none: bool,
        group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let group_ids = opt_ints::<usize>(group_ids, "group_ids", None)?.map(|g| g.as_slice().to_vec());
        if let Some(g) = &group_ids {
            if g.iter().any(|&i| i != 0) {
                return Err(invalid(
                    None,
                    format!("KV cache group ids {g:?}: there is one group, 0"),
                ));
            }
        }
        let groups = group_ids.map_or(1, |g| g.len());
        if allow_none && (self.ids.is_empty() || groups == 0) {
            return Ok(None);
        }
        let lists: Vec<Bound<'py, PyList>> = (0..groups)
            .map(|_| PyList::new(py, &self.ids))
            .collect::<PyResult<_>>()?;
        Ok(Some(PyTuple::new(py, lists)?))
    }

    /// Number of blocks (vLLM's `len(blocks.blocks[0])`).
    #[getter]
    fn num_blocks(&self) -> usize {
        self.ids.len()
    }

    /// `self + other`: the blocks of both, in order.
    fn __add__(&self, other: PyRef<'_, KVBlocks>) -> KVBlocks {
        let mut ids = self.ids.clone();
        ids.extend_from_slice(&other.ids);
        KVBlocks { ids }
    }

    fn new_empty(&self) -> KVBlocks {
        KVBlocks { ids: Vec::new() }
    }

    fn __repr__(&self) -> String {
        format!("KVBlocks({:?})", self.ids)
    }
}

impl KVBlocks {
    #[allow(dead_code)]
    pub(crate) fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// The device KV block allocator; `kvslots.vllm.scheduler.KVSlotsKVCacheManager` is its
/// vLLM-facing subclass.
#[pyclass(module = "kvslots._core", weakref, subclass)]
pub(crate) struct DeviceKVManager {
    inner: DeviceAllocator,
    max_model_len: usize,
    num_reprefillable: usize,
    watermark_blocks: usize,
    /// Request statuses the watermark applies to (WAITING, PREEMPTED).
    watermark_statuses: Vec<Py<PyAny>>,
    /// Call `self._prepare_stored(request, start, end)` before an allocation registers blocks
    /// and `self._on_alloc(request, start, end, stored)` after one registered or evicted.
    hook: bool,
    /// Reserve the lookahead and materialise it at the end of the step.
    defer_lookahead: bool,
    /// This step's deferred allocations: (request id, main tokens, lookahead tokens).
    deferred: Vec<(String, usize, usize)>,
    /// The request ids in `deferred`: whether one has an entry, without a scan of the list
    /// (every deferred allocation asks; a scan made a step quadratic in its batch).
    deferred_ids: std::collections::HashSet<String>,
    empty: Py<KVBlocks>,
    last_commit: (usize, usize),
    scratch: Vec<u32>,
}

impl DeviceKVManager {
    /// A freed request's deferred lookahead goes with it: the same id allocated again within
    /// the step would otherwise get the old allocation's lookahead at `finish_step` too.
    fn forget_deferred(&mut self, rid: &str) {
        if self.deferred_ids.remove(rid) {
            self.deferred.retain(|d| d.0 != rid);
        }
    }

    /// `allocate_slots` for a request with a noted slot and a running request's arguments (the
    /// call vLLM makes for every running request every step), without reading the request's
    /// name. `None`: take the general path, which then gives the result or the error (an error
    /// here left the manager unchanged, so the general path meets the same state and names the
    /// request in its error).
    fn allocate_running(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        slot: usize,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: Option<&Bound<'_, PyAny>>,
        has_scheduled_reqs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Option<Py<KVBlocks>>>> {
        let py = slf.py();
        let Some(new) = exact_count(Some(num_new_tokens)) else {
            return Ok(None);
        };
        let Some(lookahead) = exact_count(num_lookahead_tokens) else {
            return Ok(None);
        };
        let scheduled = match has_scheduled_reqs {
            None => true,
            Some(o) if o.is_none() => true,
            Some(o) => match o.cast::<pyo3::types::PyBool>() {
                Ok(b) => b.is_true(),
                Err(_) => return Ok(None),
            },
        };
        let Ok(num_tokens) = num_tokens(request, "") else {
            return Ok(None);
        };
        let Ok(computed) = count_attr(request, intern!(py, "num_computed_tokens"), "", "") else {
            return Ok(None);
        };
        let hashes = RequestHashes::of(request, "")?;
        let tag = request.as_ptr() as u64;
        let mut this = borrow_mut(slf)?;
        // A watermark (it needs the request's status) and deferred lookahead: the general path.
        if this.inner.slot_tag(slot) != tag
            || this.defer_lookahead
            || (this.watermark_blocks > 0 && scheduled)
        {
            return Ok(None);
        }
        let a = AllocArgs {
            num_computed_tokens: computed,
            num_tokens,
            num_new_tokens: new,
            num_hit_blocks: 0,
            num_external_tokens: 0,
            num_lookahead_tokens: lookahead,
            defer_lookahead: false,
            max_model_len: this.max_model_len,
            reserved_blocks: 0,
            watermark_blocks: 0,
            full_sequence_tokens: None,
            delay_cache_blocks: false,
            num_reprefillable_tokens: this.num_reprefillable,
            zero_external_blocks: true,
        };
        let plan = match this.inner.plan_allocation("", Some((slot, tag)), &a, &hashes) {
            Ok(Some(plan)) => plan,
            Ok(None) => return Ok(Some(None)),
            Err(_) => return Ok(None),
        };
        // An allocation that registers blocks builds its event first: the general path.
        if this.hook && !plan.commit().is_empty() {
            return Ok(None);
        }
        let done = match this.inner.allocate_planned("", plan, &hashes) {
            Ok(done) => done,
            Err(_) => return Ok(None),
        };
        let (out, hook) = this.allocated(py, &done);
        drop(this);
        let out = out.into_py(py)?;
        if hook {
            call_hook(slf, request, done.commit.start, done.commit.end, None)?;
        }
        Ok(Some(Some(out)))
    }

    /// `allocate_slots` with every argument read and checked, the request found by its noted
    /// slot (`known`) or by its id. Out of line: the per-step call of a running request
    /// ([`Self::allocate_running`]) stays small and in cache.
    #[cold]
    #[inline(never)]
    fn allocate_general<'py>(
        slf: &Bound<'py, Self>,
        known: Option<usize>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        kw: AllocKwargs<'_, 'py>,
    ) -> PyResult<Option<Py<KVBlocks>>> {
        let py = slf.py();
        // Every argument and request field first, then the manager.
        let rid_obj = request_id_obj(request)?;
        let rid = rid_obj.to_str()?;
        let r = Some(rid);
        let new = fast_count(num_new_tokens, "num_new_tokens", r)?;
        let hit_tokens = opt_count(kw.num_new_computed_tokens, "num_new_computed_tokens", r)?;
        let lookahead = opt_count(kw.num_lookahead_tokens, "num_lookahead_tokens", r)?;
        let external = opt_count(
            kw.num_external_computed_tokens,
            "num_external_computed_tokens",
            r,
        )?;
        let delay = opt_flag(kw.delay_cache_blocks, "delay_cache_blocks", r, false)?;
        let full_seq = opt_flag(kw.full_sequence_must_fit, "full_sequence_must_fit", r, false)?;
        let reserved = opt_count(kw.reserved_blocks, "reserved_blocks", r)?;
        let scheduled = opt_flag(kw.has_scheduled_reqs, "has_scheduled_reqs", r, true)?;
        if opt_count(kw.num_encoder_tokens, "num_encoder_tokens", r)? != 0 {
            return Err(invalid(
                r,
                "encoder (cross-attention) tokens are not supported in scheduler mode".into(),
            ));
        }
        let given = match kw.new_computed_blocks {
            Some(b) if !b.is_none() => match b.cast::<KVBlocks>() {
                Ok(k) => k.get().ids.len(),
                Err(_) => {
                    return Err(type_error(
                        r,
                        format!(
                            "new_computed_blocks must be KVBlocks from this manager, got {}",
                            type_name(b)
                        ),
                    ))
                }
            },
            _ => 0,
        };
        let mut zero_external = true;
        if let Some(g) = kw.skip_zeroing_group_ids {
            if !g.is_none() {
                // Copied like every integer sequence (a broadcast numpy array of 2**40 ids was
                // iterated to its end).
                let ids = IntArg::<usize>::extract(g, "skip_zeroing_group_ids", r)?;
                if ids.as_slice().contains(&0) {
                    zero_external = false;
                }
            }
        }
        let num_tokens = num_tokens(request, rid)?;
        let computed = count_attr(
            request,
            intern!(py, "num_computed_tokens"),
            "request.num_computed_tokens",
            rid,
        )?;
        let watermark = watermark_of(slf, request, scheduled)
            .map_err(|e| reading_error(py, e, "request.status"))?;
        let hashes = RequestHashes::of(request, rid)?;

        let this = borrow_mut(slf)?;
        let bs = this.inner.block_size();
        if hit_tokens % bs != 0 {
            return Err(invalid(
                r,
                format!("num_new_computed_tokens = {hit_tokens} is not a multiple of the block size {bs}"),
            ));
        }
        let hits = hit_tokens / bs;
        if given != hits {
            return Err(invalid(
                r,
                format!("{given} computed blocks given for {hit_tokens} new computed tokens"),
            ));
        }
        let defer = this.defer_lookahead && lookahead > 0 && !delay;
        let a = AllocArgs {
            num_computed_tokens: computed,
            num_tokens,
            num_new_tokens: new,
            num_hit_blocks: hits,
            num_external_tokens: external,
            num_lookahead_tokens: lookahead,
            defer_lookahead: defer,
            max_model_len: this.max_model_len,
            reserved_blocks: reserved,
            watermark_blocks: watermark,
            full_sequence_tokens: full_seq.then(|| num_tokens.min(this.max_model_len)),
            delay_cache_blocks: delay,
            num_reprefillable_tokens: this.num_reprefillable,
            zero_external_blocks: zero_external,
        };
        let tag = request.as_ptr() as u64;
        let tagged = known.map(|s| (s, tag));
        // Whether and how it fits, decided once: a refused allocation (vLLM asks for requests
        // that do not fit every step under memory pressure) builds no event.
        let plan = this.inner.plan_allocation(rid, tagged, &a, &hashes);
        let Some(plan) = plan.map_err(|e| hashes.error(e))? else {
            return Ok(None);
        };
        // The event for the blocks it registers is built before anything changes: a hook that
        // raises leaves the allocation undone.
        let (stored, mut this) = stored_before(slf, this, request, rid, "allocated", plan.commit())?;
        let done = this.inner.allocate_planned(rid, plan, &hashes).map_err(|e| hashes.error(e))?;
        let untagged = this.inner.slot_tag(done.slot) != tag;
        if defer {
            let main = computed
                .saturating_add(hits * bs)
                .saturating_add(external)
                .min(this.max_model_len)
                .saturating_add(new);
            // One entry a request: its reservation is the latest allocation's. An earlier
            // entry of the same step materialised first used up that reservation, and the
            // later one then failed finish_step (CapacityExceededError) after the first had
            // taken its blocks.
            this.forget_deferred(rid);
            this.deferred_ids.insert(rid.to_owned());
            this.deferred.push((rid.to_owned(), main, lookahead));
        }
        let (out, hook) = this.allocated(py, &done);
        drop(this);
        let out = out.into_py(py)?;
        if untagged {
            note_slot(slf, request, rid, done.slot);
        }
        if hook {
            call_hook(slf, request, done.commit.start, done.commit.end, stored)?;
        }
        Ok(Some(out))
    }

    /// What `allocate_slots` hands back for a done allocation (made into an object once the
    /// borrow ends: allocating it may run the GC, whose finalizers may call the manager), and
    /// whether the event hook runs.
    fn allocated(&mut self, py: Python<'_>, done: &core::device::Allocated) -> (NewBlocks, bool) {
        self.last_commit = (done.commit.start, done.commit.end);
        let out = if done.new_blocks.is_empty() {
            NewBlocks::Empty(self.empty.clone_ref(py))
        } else {
            NewBlocks::Ids(self.inner.slot_blocks(done.slot)[done.new_blocks.clone()].to_vec())
        };
        (out, self.hook && (!done.commit.is_empty() || done.evicted > 0))
    }

    fn blocks_of(&self, py: Python<'_>, rid: &str) -> PyResult<Py<KVBlocks>> {
        let ids = self.inner.blocks(rid);
        if ids.is_empty() {
            return Ok(self.empty.clone_ref(py));
        }
        Py::new(py, KVBlocks { ids: ids.to_vec() })
    }
}

/// The new blocks of an allocation: the shared empty result, or ids for a new `KVBlocks`.
enum NewBlocks {
    Empty(Py<KVBlocks>),
    Ids(Vec<u32>),
}

impl NewBlocks {
    fn into_py(self, py: Python<'_>) -> PyResult<Py<KVBlocks>> {
        match self {
            NewBlocks::Empty(e) => Ok(e),
            NewBlocks::Ids(ids) => Py::new(py, KVBlocks { ids }),
        }
    }
}

/// Notes the request's slot on the object (`SLOT_ATTR`) and tags the slot with the object's
/// address, so the request's next `allocate_slots` skips the lookup by name. Outside any
/// borrow: the attribute is set first, and the tag goes to the slot the request holds then.
/// An object that takes no attribute is looked up by name every time. Never an error: the
/// allocation is done, and an untagged slot is only slower to find.
fn note_slot(slf: &Bound<'_, DeviceKVManager>, request: &Bound<'_, PyAny>, rid: &str, slot: usize) {
    if request.setattr(intern!(slf.py(), SLOT_ATTR), slot).is_ok() {
        if let Ok(mut this) = borrow_mut(slf) {
            this.inner.tag_slot(rid, request.as_ptr() as u64);
        }
    }
}

/// `allocate_slots`' optional arguments, as given.
#[derive(Clone, Copy)]
struct AllocKwargs<'a, 'py> {
    num_new_computed_tokens: Option<&'a Bound<'py, PyAny>>,
    new_computed_blocks: Option<&'a Bound<'py, PyAny>>,
    num_lookahead_tokens: Option<&'a Bound<'py, PyAny>>,
    num_external_computed_tokens: Option<&'a Bound<'py, PyAny>>,
    delay_cache_blocks: Option<&'a Bound<'py, PyAny>>,
    num_encoder_tokens: Option<&'a Bound<'py, PyAny>>,
    full_sequence_must_fit: Option<&'a Bound<'py, PyAny>>,
    reserved_blocks: Option<&'a Bound<'py, PyAny>>,
    has_scheduled_reqs: Option<&'a Bound<'py, PyAny>>,
    skip_zeroing_group_ids: Option<&'a Bound<'py, PyAny>>,
}

impl AllocKwargs<'_, '_> {
    /// Only what vLLM passes for a running request (`num_lookahead_tokens`, and
    /// `has_scheduled_reqs`): every other argument absent or `None`.
    fn running(&self) -> bool {
        [
            self.num_new_computed_tokens,
            self.new_computed_blocks,
            self.num_external_computed_tokens,
            self.delay_cache_blocks,
            self.num_encoder_tokens,
            self.full_sequence_must_fit,
            self.reserved_blocks,
            self.skip_zeroing_group_ids,
        ]
        .iter()
        .all(|o| o.map_or(true, |o| o.is_none()))
    }
}

/// The watermark (in blocks) that applies to the request: vLLM applies it to waiting and
/// preempted requests when some request is already scheduled this step.
fn watermark_of(
    slf: &Bound<'_, DeviceKVManager>,
    request: &Bound<'_, PyAny>,
    scheduled: bool,
) -> PyResult<usize> {
    let py = slf.py();
    let (watermark_blocks, statuses): (usize, Vec<Py<PyAny>>) = {
        let this = borrow(slf)?;
        if this.watermark_blocks == 0 || !scheduled {
            return Ok(0);
        }
        let statuses = this.watermark_statuses.iter().map(|s| s.clone_ref(py)).collect();
        (this.watermark_blocks, statuses)
    };
    let status = request.getattr(intern!(py, "status"))?;
    for s in &statuses {
        let s = s.bind(py);
        // Identity first (vLLM's statuses are enum members), then equality, as `in` does.
        if status.is(s) || status.eq(s)? {
            return Ok(watermark_blocks);
        }
    }
    Ok(0)
}

/// An exact non-negative `int`, or `None` for an absent one (0); anything else is `None`
/// from the outer option (the general path converts it or raises).
fn exact_count(obj: Option<&Bound<'_, PyAny>>) -> Option<usize> {
    match obj {
        None => Some(0),
        Some(o) if o.is_none() => Some(0),
        Some(o) if o.is_exact_instance_of::<pyo3::types::PyInt>() => {
            o.extract::<i64>().ok().filter(|v| *v >= 0).map(|v| v as usize)
        }
        Some(_) => None,
    }
}

/// The subclass's event for the blocks `planned` of the request's table that a call is about
/// to register (`self._prepare_stored(request, start, end)`; None for none, with events off or
/// without the method), built before the call changes anything: whatever it raises (the
/// request's fields are read there) leaves the manager as it was. It is built with no borrow
/// held (Python code: it may raise, or call this manager), then the borrow is taken again: a
/// call that may have changed the allocator meanwhile ([`DeviceAllocator::changes`]) makes the
/// plan stale, a ConcurrentUseError saying nothing was `done`.
fn stored_before<'py>(
    slf: &Bound<'py, DeviceKVManager>,
    this: PyRefMut<'py, DeviceKVManager>,
    request: &Bound<'py, PyAny>,
    rid: &str,
    done: &str,
    planned: std::ops::Range<usize>,
) -> PyResult<(Option<Py<PyAny>>, PyRefMut<'py, DeviceKVManager>)> {
    if !this.hook || planned.is_empty() {
        return Ok((None, this));
    }
    let changes = this.inner.changes();
    drop(this);
    let ev = prepare_stored(slf, request, rid, &planned)?;
    let this = borrow_mut(slf)?;
    if this.inner.changes() != changes {
        return Err(changed_meanwhile(format!(
            "the DeviceKVManager was changed while the KV event for request {} was built \
             (by the request's attributes or another thread); nothing was {done}",
            core::error::shown(rid)
        )));
    }
    Ok((Some(ev), this))
}

fn prepare_stored(
    slf: &Bound<'_, DeviceKVManager>,
    request: &Bound<'_, PyAny>,
    rid: &str,
    planned: &std::ops::Range<usize>,
) -> PyResult<Py<PyAny>> {
    let py = slf.py();
    match slf.getattr_opt(intern!(py, "_prepare_stored"))? {
        // kvslots's own _prepare_stored tells the request's fault (its fields) from the rest
        // with kvslots errors, which pass through; anything else (a subclass's method) is a
        // kvslots error that blames nobody in particular.
        Some(f) => Ok(f
            .call1((request, planned.start, planned.end))
            .map_err(|e| event_error(e, rid))?
            .unbind()),
        None => Ok(py.None()),
    }
}

#[cold]
#[inline(never)]
fn event_error(e: PyErr, rid: &str) -> PyErr {
    Python::attach(|py| {
        if e.is_instance_of::<KVSlotsError>(py) || !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
            return e;
        }
        let new = KVSlotsError::new_err((
            format!("building the KV event for request {} failed: {e}", core::error::shown(rid)),
            rid.to_owned(),
        ));
        new.set_cause(py, Some(e));
        new
    })
}

/// Calls the subclass's event hook outside any borrow of the manager, after the call is done:
/// `self._on_alloc(request, start, end, stored)`, `stored` the event `prepare_stored` built
/// (`None` when the call registered nothing). It only queues the events (the evictions', then
/// `stored`); what can fail was done before anything changed.
fn call_hook(
    slf: &Bound<'_, DeviceKVManager>,
    request: &Bound<'_, PyAny>,
    start: usize,
    end: usize,
    stored: Option<Py<PyAny>>,
) -> PyResult<()> {
    // The base class used directly (record_evictions=True) has no hook: the allocation stands
    // and the evictions stay queued for drain_evicted, instead of an AttributeError raised
    // after the allocation was made.
    if let Some(hook) = slf.getattr_opt(intern!(slf.py(), "_on_alloc"))? {
        hook.call1((request, start, end, stored))?;
    }
    Ok(())
}

#[pymethods]
impl DeviceKVManager {
    /// The Python objects it holds, for the cycle collector: without it a cycle through this
    /// object (a request, array or status whose attribute refers back to it) was never freed.
    fn __traverse__(&self, visit: pyo3::pyclass::PyVisit<'_>) -> Result<(), pyo3::pyclass::PyTraverseError> {
        for o in &self.watermark_statuses {
            visit.call(o)?;
        }
        visit.call(&self.empty)
    }

    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it owns the device block pool and its requests' blocks, which a copy would hand out twice",
        )
    }

    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, max_model_len, enable_caching=None, record_evictions=None, record_new_blocks=None, num_reprefillable_tokens=None, watermark_blocks=None, defer_lookahead=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        max_model_len: &Bound<'_, PyAny>,
        enable_caching: Option<&Bound<'_, PyAny>>,
        record_evictions: Option<&Bound<'_, PyAny>>,
        record_new_blocks: Option<&Bound<'_, PyAny>>,
        num_reprefillable_tokens: Option<&Bound<'_, PyAny>>,
        watermark_blocks: Option<&Bound<'_, PyAny>>,
        defer_lookahead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let record_evictions = opt_flag(record_evictions, "record_evictions", None, false)?;
        let defer_lookahead = opt_flag(defer_lookahead, "defer_lookahead", None, false)?;
        let cfg = DeviceConfig {
            num_blocks: count(num_blocks, "num_blocks", None)?,
            block_size: count(block_size, "block_size", None)?,
            enable_caching: opt_flag(enable_caching, "enable_caching", None, true)?,
            record_evictions,
            record_new_blocks: opt_flag(record_new_blocks, "record_new_blocks", None, false)?,
            // With deferred lookahead the schedule is kvslots' own: hits take held duplicates.
            prefer_held_duplicates: defer_lookahead,
        };
        Ok(DeviceKVManager {
            max_model_len: count(max_model_len, "max_model_len", None)?,
            num_reprefillable: opt_count(
                num_reprefillable_tokens,
                "num_reprefillable_tokens",
                None,
            )?,
            watermark_blocks: opt_count(watermark_blocks, "watermark_blocks", None)?,
            inner: DeviceAllocator::new(cfg).map_err(err)?,
            watermark_statuses: Vec::new(),
            hook: record_evictions,
            defer_lookahead,
            deferred: Vec::new(),
            deferred_ids: std::collections::HashSet::new(),
            empty: Py::new(py, KVBlocks { ids: Vec::new() })?,
            last_commit: (0, 0),
            scratch: Vec::new(),
        })
    }

    /// The shared empty result (vLLM's `empty_kv_cache_blocks`).
    #[getter]
    fn empty_kv_cache_blocks(slf: &Bound<'_, Self>) -> PyResult<Py<KVBlocks>> {
        Ok(borrow(slf)?.empty.clone_ref(slf.py()))
    }

    /// The request statuses the watermark applies to (vLLM: WAITING and PREEMPTED).
    fn _set_watermark_statuses(slf: &Bound<'_, Self>, statuses: &Bound<'_, PyAny>) -> PyResult<()> {
        // A list or tuple, as vLLM passes (pyo3's Vec extraction let a builtin TypeError escape
        // for anything else, and iterating any iterable ran to the end of a broadcast numpy
        // array of 2**40 items).
        let Some(items) = list_or_tuple_items(statuses) else {
            return Err(type_error(
                None,
                format!(
                    "statuses must be a list or tuple of request statuses, got {} {}",
                    type_name(statuses),
                    show(statuses)
                ),
            ));
        };
        let list = items.into_iter().map(Bound::unbind).collect();
        borrow_mut(slf)?.watermark_statuses = list;
        Ok(())
    }

    /// Whether allocations call `self._prepare_stored` and `self._on_alloc` when they register or
    /// evict blocks (the subclass builds vLLM's KV events there).
    #[getter(_hook)]
    fn hook_flag(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let this = borrow(slf)?;
        Ok(this.hook)
    }
    #[setter(_hook)]
    fn set_hook_flag(slf: &Bound<'_, Self>, on: &Bound<'_, PyAny>) -> PyResult<()> {
        let on = flag(on, "_hook", None)?;
        borrow_mut(slf)?.hook = on;
        Ok(())
    }

    /// vLLM's `KVCacheManager.allocate_slots`: the new blocks (the shared empty result when
    /// none), or `None` when they do not fit (then nothing changed).
    #[pyo3(signature = (request, num_new_tokens, num_new_computed_tokens=None, new_computed_blocks=None, num_lookahead_tokens=None, num_external_computed_tokens=None, delay_cache_blocks=None, num_encoder_tokens=None, full_sequence_must_fit=None, reserved_blocks=None, has_scheduled_reqs=None, skip_zeroing_group_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_new_computed_tokens: Option<&Bound<'py, PyAny>>,
        new_computed_blocks: Option<&Bound<'py, PyAny>>,
        num_lookahead_tokens: Option<&Bound<'py, PyAny>>,
        num_external_computed_tokens: Option<&Bound<'py, PyAny>>,
        delay_cache_blocks: Option<&Bound<'py, PyAny>>,
        num_encoder_tokens: Option<&Bound<'py, PyAny>>,
        full_sequence_must_fit: Option<&Bound<'py, PyAny>>,
        reserved_blocks: Option<&Bound<'py, PyAny>>,
        has_scheduled_reqs: Option<&Bound<'py, PyAny>>,
        skip_zeroing_group_ids: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Py<KVBlocks>>> {
        let kw = AllocKwargs {
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        };
        let known = noted_slot(request);
        if let (Some(s), true) = (known, kw.running()) {
            if let Some(out) = Self::allocate_running(
                slf,
                request,
                s,
                num_new_tokens,
                num_lookahead_tokens,
                has_scheduled_reqs,
            )? {
                return Ok(out);
            }
        }
        Self::allocate_general(slf, known, request, num_new_tokens, kw)
    }

    /// vLLM's `cache_blocks(request, num_computed_tokens)`: registers the request's blocks full
    /// of verified tokens. Returns the table positions registered.
    fn cache_blocks<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        num_computed_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let rid = request_id_of(request)?;
        let n = count(num_computed_tokens, "num_computed_tokens", Some(&rid))?;
        let hashes = RequestHashes::of(request, &rid)?;
        let this = borrow_mut(slf)?;
        let reprefill = this.num_reprefillable;
        // As in allocate_slots: the event first, then the registration.
        let planned = this.inner.planned_cache(&rid, n, reprefill);
        let (stored, mut this) = stored_before(slf, this, request, &rid, "registered", planned)?;
        let done = this
            .inner
            .cache(&rid, n, reprefill, &hashes)
            .map_err(|e| hashes.error(e))?;
        let hook = this.hook && (!done.is_empty() || this.inner.num_evicted_pending() > 0);
        drop(this);
        if hook {
            call_hook(slf, request, done.start, done.end, stored)?;
        }
        Ok((done.start, done.end))
    }

    /// The table positions the last allocation registered.
    fn last_commit(slf: &Bound<'_, Self>) -> PyResult<(usize, usize)> {
        let this = borrow(slf)?;
        Ok(this.last_commit)
    }

    /// The longest prefix hit for the request (vLLM's `find_longest_cache_hit` for one
    /// full-attention group): at most `max_blocks` blocks, the last dropped with `drop_last`
    /// (EAGLE). The shared empty result when there is none.
    #[pyo3(signature = (request, max_blocks, drop_last=None))]
    fn computed_blocks(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        max_blocks: &Bound<'_, PyAny>,
        drop_last: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<KVBlocks>> {
        let py = slf.py();
        let rid = request_id_of(request).unwrap_or_default();
        // vLLM may ask for a negative number of blocks (none); a bool is no count.
        let max = match max_blocks.extract::<i64>() {
            Ok(v) if v <= 0 && !max_blocks.is_instance_of::<pyo3::types::PyBool>() => 0,
            _ => count(max_blocks, "max_blocks", None)?,
        };
        let drop_last = opt_flag(drop_last, "drop_last", None, false)?;
        let hashes = RequestHashes::of(request, &rid)?;
        let mut this = borrow_mut(slf)?;
        let mut n = this
            .inner
            .find_prefix(&hashes, max)
            .map_err(|e| hashes.error(e))?;
        if drop_last && n > 0 {
            n -= 1;
        }
        if n == 0 {
            return Ok(this.empty.clone_ref(py));
        }
        let mut ids = std::mem::take(&mut this.scratch);
        ids.clear();
        let res = this.inner.prefix_block_ids(&hashes, n, &mut ids);
        let out = res.map(|_| ids.clone());
        this.scratch = ids;
        drop(this);
        Py::new(
            py,
            KVBlocks {
                ids: out.map_err(|e| hashes.error(e))?,
            },
        )
    }

    /// The request's blocks (the shared empty result when it holds none).
    fn get_blocks(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Py<KVBlocks>> {
        let rid = text(request_id, "request_id")?;
        borrow(slf)?.blocks_of(slf.py(), rid)
    }

    /// `(ids,)`: the request's block ids, one list per KV cache group.
    fn get_block_ids<'py>(
        slf: &Bound<'py, Self>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let rid = text(request_id, "request_id")?;
        let this = borrow(slf)?;
        PyTuple::new(py, [PyList::new(py, this.inner.blocks(rid))?])
    }

    /// The request's block ids as a flat list.
    fn block_ids(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let rid = text(request_id, "request_id")?;
        Ok(borrow(slf)?.inner.blocks(rid).to_vec())
    }

    /// The request's block id at table position `i` (`None` past the end).
    fn block_id(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        i: &Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let rid = text(request_id, "request_id")?;
        let i = count(i, "i", Some(rid))?;
        Ok(borrow(slf)?.inner.blocks(rid).get(i).copied())
    }

    fn num_request_blocks(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let rid = text(request_id, "request_id")?;
        Ok(borrow(slf)?.inner.blocks(rid).len())
    }

    /// vLLM's `free(request)`: the request's blocks go back, tail first.
    fn free(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = request_id_of(request)?;
        let mut this = borrow_mut(slf)?;
        this.forget_deferred(&rid);
        Ok(this.inner.free(&rid))
    }

    fn free_request(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = text(request_id, "request_id")?;
        let mut this = borrow_mut(slf)?;
        this.forget_deferred(rid);
        Ok(this.inner.free(rid))
    }

    /// vLLM's `pop_blocks_for_free(request)`: the request's block ids, still held until
    /// `release_blocks` gives them back.
    fn pop_blocks_for_free(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let rid = request_id_of(request)?;
        let mut out = Vec::new();
        let mut this = borrow_mut(slf)?;
        this.forget_deferred(&rid);
        this.inner.pop_blocks(&rid, &mut out);
        Ok(out)
    }

    /// Gives back blocks from `pop_blocks_for_free`, in the order given (first evicted first).
    fn release_blocks(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = block_id_list(blocks, "blocks")?;
        borrow_mut(slf)?.inner.release(&ids).map_err(err)
    }

    /// vLLM's `evict_blocks(block_ids)`: out of the prefix registry. Returns how many were in it.
    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = block_id_list(block_ids, "block_ids")?;
        borrow_mut(slf)?.inner.evict_blocks(&ids).map_err(err)
    }

    /// Empties the prefix registry when no request holds a block; returns whether it did.
    fn reset(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow_mut(slf)?.inner.reset_prefix_cache())
    }

    /// Blocks the request still needs for `num_tokens` tokens.
    fn num_blocks_to_allocate(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = text(request_id, "request_id")?;
        let n = count(num_tokens, "num_tokens", Some(rid))?;
        Ok(borrow(slf)?.inner.num_blocks_to_allocate(rid, n))
    }

    fn estimate_cached_tokens(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let rid = request_id_of(request)?;
        Ok(borrow(slf)?.inner.estimate_cached_tokens(&rid))
    }

    /// Materialises this step's deferred lookahead for the step's K: `lookahead_cut` is how
    /// many lookahead tokens fewer than reserved the step needs (K max - K of the step).
    /// `scheduled` says which requests are still scheduled (a container of request ids).
    /// Returns `[(request_id, new ids)]` for the requests that got blocks; every reservation is
    /// released.
    fn finish_step(
        slf: &Bound<'_, Self>,
        lookahead_cut: &Bound<'_, PyAny>,
        scheduled: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(String, Vec<u32>)>> {
        let py = slf.py();
        let cut = count(lookahead_cut, "lookahead_cut", None)?;
        // Which deferred requests are still scheduled, asked of `scheduled` (Python code: it may
        // raise, or call this manager) with no borrow held and before anything changes.
        let deferred = borrow(slf)?.deferred.clone();
        let mut keep = Vec::with_capacity(deferred.len());
        for d in &deferred {
            keep.push(
                scheduled
                    .contains(d.0.as_str())
                    .map_err(|e| reading_error(py, e, "scheduled"))?,
            );
        }
        let mut this = borrow_mut(slf)?;
        if this.deferred != deferred {
            // `scheduled` allocated meanwhile: its answers are for another list.
            return Err(busy("DeviceKVManager"));
        }
        this.deferred.clear();
        this.deferred_ids.clear();
        let live: Vec<_> = deferred
            .into_iter()
            .zip(keep)
            .filter_map(|(d, k)| k.then_some(d))
            .collect();
        let mut out = Vec::new();
        let mut first_err = None;
        for (rid, main, la) in live {
            if !this.inner.contains(&rid) {
                continue;
            }
            let need = (main + la.saturating_sub(cut)).min(this.max_model_len);
            match this.inner.materialize_lookahead(&rid, need) {
                Ok(r) if !r.is_empty() => {
                    let ids = this.inner.blocks(&rid)[r].to_vec();
                    out.push((rid, ids));
                }
                Ok(_) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        this.inner.release_reservations();
        match first_err {
            Some(e) => Err(err(e)),
            None => Ok(out),
        }
    }

    fn num_deferred(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.deferred.len())
    }

    /// Hashes of the blocks evicted since the last call (bytes), in eviction order.
    fn drain_evicted<'py>(slf: &Bound<'py, Self>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let mut v = Vec::new();
        borrow_mut(slf)?.inner.drain_evicted(&mut v);
        Ok(v.iter()
            .map(|h| PyBytes::new(slf.py(), h.as_bytes()))
            .collect())
    }

    /// Evicted hashes waiting in `drain_evicted`.
    fn num_evicted_pending(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_evicted_pending())
    }

    fn take_new_block_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<u32>> {
        let mut v = Vec::new();
        borrow_mut(slf)?.inner.take_new_block_ids(&mut v);
        Ok(v)
    }

    fn record_blocks_for_zeroing(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
        start_token: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let rid = text(request_id, "request_id")?;
        let t = count(start_token, "start_token", Some(rid))?;
        let mut this = borrow_mut(slf)?;
        let bs = this.inner.block_size();
        if t % bs != 0 {
            return Err(invalid(
                Some(rid),
                format!("start_token {t} is not block aligned (block size {bs})"),
            ));
        }
        this.inner.record_for_zeroing(rid, t / bs);
        Ok(())
    }

    /// The full hash a block is registered under (`None` when it is not).
    fn registered_hash<'py>(
        slf: &Bound<'py, Self>,
        block_id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let b = count(block_id, "block_id", None)?;
        let b =
            u32::try_from(b).map_err(|_| invalid(None, format!("block_id {b} is out of range")))?;
        Ok(borrow(slf)?
            .inner
            .registered_hash(b)
            .map(|h| PyBytes::new(slf.py(), h.as_bytes())))
    }

    fn refcount(slf: &Bound<'_, Self>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = count(block_id, "block_id", None)?;
        let this = borrow(slf)?;
        u32::try_from(b)
            .ok()
            .and_then(|b| this.inner.refcount(b))
            .ok_or_else(|| {
                invalid(
                    None,
                    format!(
                        "block {b} is out of range (pool of {})",
                        this.inner.num_blocks()
                    ),
                )
            })
    }

    fn num_cached_in(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let rid = text(request_id, "request_id")?;
        Ok(borrow(slf)?.inner.num_cached_in(rid))
    }

    /// Full consistency check: `None` when every invariant holds, else what is wrong.
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        let this = borrow(slf)?;
        Ok(this.inner.check().err())
    }

    #[getter]
    fn usage(slf: &Bound<'_, Self>) -> PyResult<f64> {
        let this = borrow(slf)?;
        Ok(this.inner.usage())
    }
    /// Free plus cached blocks (vLLM's `get_num_free_blocks`).
    fn num_free_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_free_blocks())
    }
    fn num_uncached_free_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_uncached_free_blocks())
    }
    fn num_cached_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_cached_blocks())
    }
    fn num_held_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_held_blocks())
    }
    fn num_reserved_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_reserved_blocks())
    }
    /// Blocks vLLM's manager would hold on top of these (deferred lookahead for a smaller K).
    fn num_debt_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_debt_blocks())
    }
    fn num_registered_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.pool().num_registered_blocks())
    }
    fn num_parked_holds(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_parked_holds())
    }
    #[getter]
    fn num_gpu_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.num_blocks())
    }
    #[getter]
    fn block_size(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.inner.block_size())
    }
    #[getter]
    fn max_model_len(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let this = borrow(slf)?;
        Ok(this.max_model_len)
    }
    fn request_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        let this = borrow(slf)?;
        Ok(this.inner.request_ids().map(str::to_owned).collect())
    }
    fn __contains__(slf: &Bound<'_, Self>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rid = text(request_id, "request_id")?;
        Ok(borrow(slf)?.inner.contains(rid))
    }
    fn device_stats(slf: &Bound<'_, Self>) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        let s = borrow(slf)?.inner.stats();
        Ok(std::collections::HashMap::from([
            ("allocated_blocks", s.allocated_blocks),
            ("registered_blocks", s.registered_blocks),
            ("evicted_blocks", s.evicted_blocks),
            ("hit_blocks", s.hit_blocks),
            ("freed_requests", s.freed_requests),
        ]))
    }
    /// Bytes of allocator metadata per block (pool, registry, duplicate chains, full hashes).
    #[staticmethod]
    fn metadata_bytes_per_block() -> usize {
        core::BlockPool::bytes_per_block() + 4 + std::mem::size_of::<FullHash>()
    }
}

/// Block ids: ints, or objects with a `block_id` (vLLM's `KVCacheBlock`).
fn block_id_list(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    use numpy::{PyArrayDescrMethods, PyUntypedArrayMethods};
    if matches!(obj.cast::<numpy::PyUntypedArray>(), Ok(a) if a.dtype().kind() != b'O') {
        // Copied at once: iterating one item at a time never ended for a broadcast array of
        // 2**40 ids (no memory behind it), and a copy too large is an error, not an abort. An
        // object array may hold block objects: read item by item below.
        return IntArg::<u32>::extract(obj, what, None).map(|a| a.0);
    }
    let mut ids = Vec::new();
    let it = obj.try_iter().map_err(|_| {
        type_error(
            None,
            format!(
                "{what} must be an iterable of block ids, got {}",
                type_name(obj)
            ),
        )
    })?;
    for (i, item) in it.enumerate() {
        next_item(obj.py(), i, what, None)?;
        let item = item.map_err(|e| reading_error(obj.py(), e, what))?;
        // An int, an object with `__index__` (a numpy integer, as every integer argument may
        // be), or a block object with a `block_id`.
        let v = if item.is_instance_of::<pyo3::types::PyInt>() {
            count(&item, what, None)?
        } else if let Ok(Some(b)) = item.getattr_opt(intern!(item.py(), "block_id")) {
            count(&b, what, None)?
        } else {
            count(&item, what, None).map_err(|e| {
                if e.is_instance_of::<ArgumentTypeError>(item.py()) {
                    type_error(
                        None,
                        format!("{what} must hold block ids, got {}", show(&item)),
                    )
                } else {
                    e
                }
            })?
        };
        ids.push(
            u32::try_from(v)
                .map_err(|_| invalid(None, format!("{what}: block {v} is out of range")))?,
        );
    }
    Ok(ids)
}

/// Adds the scheduler-mode classes to `kvslots._core`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DeviceKVManager>()?;
    m.add_class::<KVBlocks>()?;
    Ok(())
}
