//! `kvslots._core.ConnectorPlanner`: the scheduler side of the KVSlotsConnector in one call per
//! engine step. The planning rules are `kvslots_core::ConnectorPlanner`'s; this file reads
//! vLLM's objects (the scheduler output's lists, `Request` attributes) without Python-level
//! loops and hands the planner plain slices.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use kvslots_core as core;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyString, PyTuple};

use crate::convert::{
    self as conv, arg, count, events_to_py, flag, int, log_to_msgpack, opt_int, IntArg,
    MetaArgs,
};
use crate::errors::{borrow, borrow_mut, invalid, reading_error, slot_error};

type PyPlan<'py> = (
    u64,
    Vec<u32>,
    Vec<u32>,
    Vec<(Bound<'py, PyString>, Vec<u32>, Vec<u32>)>,
);

/// The host tier and a mirror of every request vLLM schedules; see kvslots-core's
/// `ConnectorPlanner` for the rules.
#[pyclass(module = "kvslots._core", weakref)]
pub(crate) struct ConnectorPlanner {
    inner: core::ConnectorPlanner,
    /// The vLLM `Request` object of each planner slot (None when the slot is free).
    objs: Vec<Option<Py<PyAny>>>,
    /// The request id string object of each slot, held so that its address identifies it.
    id_objs: Vec<Option<Py<PyAny>>>,
    /// Request id objects by address: the scheduler output lists the same `str` objects every
    /// step, so most lookups neither hash nor read the id's characters.
    by_ptr: HashMap<usize, core::ReqSlot, BuildHasherDefault<PtrHasher>>,
    plan: core::StepPlan,
    /// The last step's `scheduled_cached_reqs.req_ids`: item addresses and their slots (0: not
    /// tracked). vLLM lists running requests in the same order step after step, so most are
    /// found at the same index, checked against `id_objs`, without a hash lookup.
    pos_ptrs: Vec<usize>,
    pos_slots: Vec<core::ReqSlot>,
    /// `build`'s inputs, read (and checked) before it changes anything; reused step to step.
    stage: Stage,
    /// Per slot: the last `build` call (`builds`) that listed it as new or cached, and as
    /// preempted (a request listed twice is refused before anything changes).
    seen: Vec<u64>,
    pre_seen: Vec<u64>,
    builds: u64,
    /// Staged block hashes (`StoreIn::hashes`), read before they are handed to the planner.
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    wire: Vec<u8>,
    /// Addresses of borrowed list items (`read_tokens`' scratch, valid only inside it).
    items: Vec<usize>,
    /// End offsets of each event's bytes in `wire` (`drain_events_raw`).
    ends: Vec<usize>,
    /// Whether anyone reads the host-tier events (their token ids are read only then).
    events_wanted: bool,
}

/// A store read from Python, not applied yet: blocks `next_block..full` of `slot`, the block
/// hashes from position `hash_from` on in `hashes` (of the planner's staging buffer) and the
/// tokens in `tokens` (of its token buffer).
#[derive(Debug, Clone)]
struct StoreIn {
    slot: core::ReqSlot,
    full: usize,
    hash_from: usize,
    hashes: std::ops::Range<usize>,
    tokens: std::ops::Range<usize>,
}

/// A request listed by the scheduler output, read: its new blocks (a range of the block
/// buffer), computed count (None: skippable, appended without one) and scheduled count.
#[derive(Debug, Clone)]
struct MirrorIn {
    slot: core::ReqSlot,
    blocks: std::ops::Range<usize>,
    resumed: bool,
    computed: Option<usize>,
    scheduled: Option<usize>,
}

/// Everything one `build` reads from vLLM's objects, in the order it is applied.
#[derive(Debug, Default)]
struct Stage {
    preempted: Vec<(core::ReqSlot, Option<StoreIn>)>,
    new: Vec<MirrorIn>,
    cached: Vec<MirrorIn>,
    /// Store candidates: slot, preempted this step, device blocks once mirrored.
    due: Vec<(core::ReqSlot, bool, usize)>,
    stores: Vec<StoreIn>,
}

impl Stage {
    fn clear(&mut self) {
        self.preempted.clear();
        self.new.clear();
        self.cached.clear();
        self.due.clear();
        self.stores.clear();
    }
}

/// Hashes an object address (a multiply: addresses differ in their middle bits).
#[derive(Default)]
struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = ((v as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// vLLM's 64-bit external form of a block hash (`maybe_convert_block_hash`): the low 64 bits of
/// the hash bytes read big-endian, or of an int hash.
fn external_hash(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        let bytes = b.as_bytes();
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        return Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64));
    }
    // An int as every integer the bindings read (a bool, numpy's too, is no block hash), its
    // low 64 bits as vLLM masks one; nothing else (no `__and__`) runs on another object.
    conv::int_low64(obj, "a block hash (bytes or int)", None)
}

/// Item `j` of a token sequence: an exact int read from a list without a reference count
/// change, anything else converted as every integer the bindings read (a bool is no token).
fn token_at(seq: &Bound<'_, PyAny>, j: usize) -> PyResult<u32> {
    if let Ok(list) = seq.cast::<PyList>() {
        if j >= list.len() {
            return Err(invalid(
                None,
                format!(
                    "token position {j} is past the request's {} tokens",
                    list.len()
                ),
            ));
        }
        if let Some(v) = conv::list_small_int(list, j) {
            return u32::try_from(v).map_err(|_| {
                invalid(
                    None,
                    format!(
                        "token id {v} at position {j} of {} is out of range",
                        list.len()
                    ),
                )
            });
        }
    }
    int::<u32>(&seq.get_item(j)?, "a token id", None)
}

/// A token read that is not a u32 (a pending Python error, e.g. not an int, is replaced).
#[cold]
fn token_error(py: Python<'_>, v: i64, j: usize, len: usize) -> PyErr {
    let _ = PyErr::take(py);
    invalid(
        None,
        format!("token id {v} at position {j} of {len} is not a token id (an int in 0..2**32)"),
    )
}

/// The request's tokens as a sequence: vLLM's plain list behind the read-only view if present.
fn tokens_of<'py>(req: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = req.py();
    match req.getattr(intern!(py, "_all_token_ids")) {
        Ok(t) => Ok(t),
        Err(_) => req.getattr(intern!(py, "all_token_ids")),
    }
}

/// Starts loading the cache line at `p` (a hint: any address is safe, nothing is read).
#[inline(always)]
fn prefetch(p: *const pyo3::ffi::PyObject) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it does not fault on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Item `i` of a list, borrowed (no reference count change: the object is not touched).
#[inline]
fn borrowed_item(list: &Bound<'_, PyList>, i: usize) -> PyResult<*mut pyo3::ffi::PyObject> {
    // SAFETY: the list is alive and the GIL held; PyList_GetItem checks the index.
    let p = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
    if p.is_null() {
        return Err(PyErr::fetch(list.py()));
    }
    Ok(p)
}

/// The largest value of vLLM's `num_scheduled_tokens` (0 if empty), read without touching its
/// keys (the values of a decoding batch are small cached ints).
fn max_scheduled(scheduled: &Bound<'_, PyDict>) -> PyResult<usize> {
    let mut pos: pyo3::ffi::Py_ssize_t = 0;
    let mut key: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    let mut value: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    let mut max = 0usize;
    // Values other than an exact int (a bool, an int subclass, numpy) are converted after the
    // walk, as every integer argument is: that may run their Python code.
    let mut others: Vec<Bound<'_, PyAny>> = Vec::new();
    // SAFETY: the dict is alive and the GIL held; nothing here runs Python code that could
    // mutate it; key and value are borrowed and only read (a value kept is a new reference).
    unsafe {
        while pyo3::ffi::PyDict_Next(scheduled.as_ptr(), &mut pos, &mut key, &mut value) != 0 {
            if pyo3::ffi::PyLong_CheckExact(value) == 0 {
                others.push(Bound::from_borrowed_ptr(scheduled.py(), value));
                continue;
            }
            let v = pyo3::ffi::PyLong_AsSsize_t(value);
            if v < 0 {
                let _ = PyErr::take(scheduled.py());
                return Err(invalid(
                    None,
                    "num_scheduled_tokens: every value must be a non-negative int".to_owned(),
                ));
            }
            max = max.max(v as usize);
        }
    }
    for v in &others {
        max = max.max(count(v, "num_scheduled_tokens", None)?);
    }
    Ok(max)
}

fn usize_attr(obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<usize> {
    count(&obj.getattr(name)?, name.to_str()?, None)
}

/// What tracking a request takes, read from its object before anything changes: its id
/// object, the slot its id has (if any), and whether it is a new request (`fresh`: not tracked,
/// or tracked under another object), with the prompt length and LoRA then read too.
struct Tracking<'py> {
    rid_obj: Bound<'py, PyAny>,
    existing: Option<core::ReqSlot>,
    fresh: bool,
    prompt_len: usize,
    lora: Option<u64>,
}

impl ConnectorPlanner {
    fn slot_for(&mut self, py: Python<'_>, req: &Bound<'_, PyAny>) -> PyResult<core::ReqSlot> {
        let t = self.read_tracking(py, req)?;
        Ok(self.apply_tracking(req, &t))
    }

    /// Reads what [`Self::apply_tracking`] needs of a request, changing nothing.
    fn read_tracking<'py>(
        &self,
        py: Python<'py>,
        req: &Bound<'py, PyAny>,
    ) -> PyResult<Tracking<'py>> {
        let rid_obj = req.getattr(intern!(py, "request_id"))?;
        let existing = self.inner.slot_of(rid_obj.cast::<PyString>()?.to_str()?);
        let fresh = match existing {
            Some(s) => !self.objs[s as usize].as_ref().is_some_and(|o| o.is(req)),
            None => true,
        };
        let (mut prompt_len, mut lora) = (0, None);
        if fresh {
            prompt_len = usize_attr(req, intern!(py, "num_prompt_tokens"))?;
            lora = match req.getattr(intern!(py, "lora_request")) {
                Ok(l) if !l.is_none() => opt_int::<u64>(
                    Some(&l.getattr(intern!(py, "lora_int_id"))?),
                    "lora_request.lora_int_id",
                    None,
                )?,
                _ => None,
            };
        }
        Ok(Tracking {
            rid_obj,
            existing,
            fresh,
            prompt_len,
            lora,
        })
    }

    /// Tracks a request read by [`Self::read_tracking`] (nothing to do unless it is fresh);
    /// returns its slot.
    fn apply_tracking(&mut self, req: &Bound<'_, PyAny>, t: &Tracking<'_>) -> core::ReqSlot {
        if !t.fresh {
            return t.existing.expect("known");
        }
        let rid = t
            .rid_obj
            .cast::<PyString>()
            .expect("read as a str")
            .to_str()
            .expect("read as UTF-8");
        if let Some(old) = t.existing {
            self.forget(old);
        }
        let slot = self
            .inner
            .track(rid, t.prompt_len, t.lora, t.existing.is_some());
        let i = slot as usize;
        if self.objs.len() <= i {
            self.objs.resize_with(i + 1, || None);
            self.id_objs.resize_with(i + 1, || None);
        }
        self.objs[i] = Some(req.clone().unbind());
        self.remember_id(slot, &t.rid_obj);
        slot
    }

    /// Drops the binding's references of a slot (its request and id objects).
    fn forget(&mut self, slot: core::ReqSlot) {
        let i = slot as usize;
        if let Some(o) = self.objs.get_mut(i) {
            *o = None;
        }
        if let Some(Some(id)) = self.id_objs.get_mut(i).map(Option::take) {
            self.by_ptr.remove(&(id.as_ptr() as usize));
        }
    }

    /// Makes `id` (held from now on) the id object of `slot` for address lookups.
    fn remember_id(&mut self, slot: core::ReqSlot, id: &Bound<'_, PyAny>) {
        let i = slot as usize;
        if let Some(Some(old)) = self.id_objs.get(i) {
            if old.as_ptr() == id.as_ptr() {
                return;
            }
            self.by_ptr.remove(&(old.as_ptr() as usize));
        }
        self.by_ptr.insert(id.as_ptr() as usize, slot);
        self.id_objs[i] = Some(id.clone().unbind());
    }

    /// The slot of a request id object: by address when it is the id object we hold (we hold a
    /// reference, so no other object can live at that address), else by its characters.
    #[inline]
    fn slot_of_id(&mut self, id: &Bound<'_, PyAny>) -> PyResult<Option<core::ReqSlot>> {
        if let Some(&s) = self.by_ptr.get(&(id.as_ptr() as usize)) {
            return Ok(Some(s));
        }
        let Some(s) = self.inner.slot_of(id.cast::<PyString>()?.to_str()?) else {
            return Ok(None);
        };
        self.remember_id(s, id);
        Ok(Some(s))
    }

    /// The slot of the request id at address `ptr`, listed at index `i` of the cached requests,
    /// when the last step listed the same id object there. Exact: the slot's held id object is
    /// at `ptr` (held, so no other object can be there), which is what `by_ptr` maps.
    #[inline]
    fn slot_at(&self, i: usize, ptr: usize) -> Option<core::ReqSlot> {
        if self.pos_ptrs[i] != ptr {
            return None;
        }
        let s = self.pos_slots[i];
        match self.id_objs.get(s as usize) {
            Some(Some(id)) if id.as_ptr() as usize == ptr => Some(s),
            _ => None,
        }
    }

    /// Reads the request's external hashes `from..n` into the staging buffer (appended).
    fn stage_hashes(
        &mut self,
        block_hashes: &Bound<'_, PyAny>,
        from: usize,
        n: usize,
    ) -> PyResult<std::ops::Range<usize>> {
        let start = self.hashes.len();
        if let Ok(list) = block_hashes.cast::<PyList>() {
            for j in from..n {
                self.hashes.push(external_hash(&list.get_item(j)?)?);
            }
        } else {
            for j in from..n {
                self.hashes.push(external_hash(&block_hashes.get_item(j)?)?);
            }
        }
        Ok(start..self.hashes.len())
    }

    /// Tokens `lo*bs .. min(hi*bs + 1, num_tokens)` of a request, appended to `self.tokens`;
    /// returns their range there.
    fn read_tokens(
        &mut self,
        seq: &Bound<'_, PyAny>,
        lo: usize,
        hi: usize,
        num_tokens: usize,
    ) -> PyResult<std::ops::Range<usize>> {
        let bs = self.inner.config().block_size;
        // Checked whether or not the tokens are read: a request claiming more computed tokens
        // than it has would otherwise store blocks of no tokens (and size `tokens` by its claim).
        if hi * bs > num_tokens {
            return Err(invalid(
                None,
                format!("{} tokens asked, the request has {num_tokens}", hi * bs),
            ));
        }
        let end = (hi * bs + 1).min(num_tokens);
        let start = self.tokens.len();
        if !self.events_wanted {
            // Nobody reads the BlockStored events: their token ids are not read either (only
            // the successor, below). The events are dropped when taken.
            self.tokens.resize(start + (hi - lo) * bs, 0);
        } else if let Ok(list) = seq.cast::<PyList>() {
            if hi * bs > list.len() {
                return Err(invalid(
                    None,
                    format!("{} tokens asked, the request has {}", hi * bs, list.len()),
                ));
            }
            // The items (borrowed), their int objects prefetched first: they were allocated over
            // many steps and are mostly out of cache, so their misses overlap instead of each
            // stalling the read of one token.
            self.items.clear();
            for j in lo * bs..hi * bs {
                // SAFETY: the list is alive and the GIL held; j < hi * bs <= len was checked and
                // nothing in these loops runs Python code or changes the list.
                let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), j as pyo3::ffi::Py_ssize_t) };
                if item.is_null() {
                    return Err(PyErr::fetch(seq.py()));
                }
                prefetch(item);
                self.items.push(item as usize);
            }
            let mut all_ints = true;
            for (k, &item) in self.items.iter().enumerate() {
                let item = item as *mut pyo3::ffi::PyObject;
                // SAFETY: as above; the item is borrowed and only read. Only an exact int is
                // read here: for anything else PyLong_AsLongLong would run its `__index__`,
                // which could free the other borrowed items, or read a bool as 0/1 (token_at
                // converts the others, refusing a bool as every integer argument is).
                if unsafe { pyo3::ffi::PyLong_CheckExact(item) } == 0 {
                    all_ints = false;
                    break;
                }
                let v = unsafe { pyo3::ffi::PyLong_AsLongLong(item) };
                match u32::try_from(v) {
                    Ok(t) => self.tokens.push(t),
                    Err(_) => return Err(token_error(seq.py(), v, lo * bs + k, list.len())),
                }
            }
            if !all_ints {
                self.tokens.truncate(start);
                self.items.clear();
                for j in lo * bs..hi * bs {
                    self.tokens.push(token_at(seq, j)?);
                }
            }
        } else {
            for j in lo * bs..hi * bs {
                self.tokens.push(token_at(seq, j)?);
            }
        }
        // The successor, when known and a real token (else none is recorded).
        if end > hi * bs {
            if let Ok(t) = token_at(seq, hi * bs) {
                self.tokens.push(t);
            }
        }
        Ok(start..self.tokens.len())
    }

    /// Reads what is storable of a request now (blocks full of `verified` tokens), changing
    /// nothing: its hashes and tokens are appended to the staging buffers. `lo`: the request's
    /// next block to store; `blocks`: its device blocks (once this step's are mirrored).
    #[allow(clippy::too_many_arguments)]
    fn read_store(
        &mut self,
        slot: core::ReqSlot,
        req: &Bound<'_, PyAny>,
        verified: usize,
        block_hashes: &Bound<'_, PyAny>,
        lo: usize,
        blocks: usize,
    ) -> PyResult<Option<StoreIn>> {
        let bs = self.inner.config().block_size;
        let n_hashes = block_hashes.len()?;
        let full = (verified / bs).min(n_hashes).min(blocks);
        if full <= lo {
            return Ok(None);
        }
        let hash_from = self.inner.known_hashes(slot).min(full);
        let hashes = self.stage_hashes(block_hashes, hash_from, full)?;
        let seq = tokens_of(req)?;
        let num_tokens = seq.len()?;
        let tokens = self.read_tokens(&seq, lo, full, num_tokens)?;
        Ok(Some(StoreIn {
            slot,
            full,
            hash_from,
            hashes,
            tokens,
        }))
    }

    /// Applies a store read by [`Self::read_store`]: the hashes the planner lacks, then the
    /// store itself. Returns the blocks taken.
    fn apply_store(
        &mut self,
        s: &StoreIn,
        device: Option<&[u32]>,
        deferred: bool,
    ) -> Result<usize, core::SlotError> {
        let known = self.inner.known_hashes(s.slot);
        let have = known.saturating_sub(s.hash_from);
        if have < s.hashes.len() {
            self.inner
                .extend_hashes(s.slot, &self.hashes[s.hashes.start + have..s.hashes.end]);
        }
        self.inner
            .store(s.slot, s.full, &self.tokens[s.tokens.clone()], device, deferred)
    }

    /// Stores what is storable of a request now: blocks full of `verified` tokens. `device`:
    /// the blocks to copy from; `deferred`: at the next step. Everything is read before the
    /// planner changes.
    fn store_request(
        &mut self,
        slot: core::ReqSlot,
        req: &Bound<'_, PyAny>,
        verified: usize,
        block_hashes: &Bound<'_, PyAny>,
        device: &[u32],
        deferred: bool,
    ) -> PyResult<usize> {
        self.hashes.clear();
        self.tokens.clear();
        let lo = self.inner.next_block(slot);
        let Some(s) = self.read_store(slot, req, verified, block_hashes, lo, device.len())? else {
            return Ok(0);
        };
        self.apply_store(&s, Some(device), deferred).map_err(slot_error)
    }

    fn obj(&self, py: Python<'_>, slot: core::ReqSlot) -> Option<Py<PyAny>> {
        self.objs
            .get(slot as usize)
            .and_then(|o| o.as_ref().map(|o| o.clone_ref(py)))
    }

    /// Marks `slot` as listed by build call `next` in `marks`; false if it already was.
    #[inline]
    fn mark(marks: &mut Vec<u64>, slot: core::ReqSlot, next: u64) -> bool {
        let i = slot as usize;
        if marks.len() <= i {
            marks.resize(i + 1, 0);
        }
        std::mem::replace(&mut marks[i], next) != next
    }

    #[cold]
    fn listed_twice(&self, slot: core::ReqSlot) -> PyErr {
        let rid = self.inner.request_id(slot);
        invalid(
            Some(rid),
            format!("the scheduler output lists request {rid:?} twice"),
        )
    }

    /// `build`: the planner is borrowed by the caller. Reads (and checks) everything the step
    /// needs from vLLM's objects first, into `self.stage`, then applies it: an error, whatever
    /// Python code the objects run while they are read, leaves the planner as it was.
    fn build_step<'py>(
        &mut self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
    ) -> PyResult<PyPlan<'py>> {
        let mut stage = std::mem::take(&mut self.stage);
        stage.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.blocks.clear();
        let read = self.read_step(py, scheduler_output, &mut stage);
        let res = match read {
            Ok(max_sched) => Ok(self.apply_step(&stage, max_sched)),
            Err(e) => Err(reading_error(py, e, "the scheduler output")),
        };
        self.stage = stage;
        let step = res?;
        if let Some(e) = step {
            return Err(e);
        }
        let loads = self
            .plan
            .loads
            .iter()
            .map(|(slot, dev, host)| {
                (
                    PyString::new(py, self.inner.request_id(*slot)),
                    dev.clone(),
                    host.clone(),
                )
            })
            .collect();
        // Plain lists: vLLM pickles the metadata to its workers every step.
        Ok((
            self.plan.step,
            self.plan.store_device.clone(),
            self.plan.store_host.clone(),
            loads,
        ))
    }

    /// The step's changes, from inputs read and checked by [`Self::read_step`]. Only a store
    /// the host tier itself refuses can fail here (returned, after the step is ended).
    fn apply_step(&mut self, stage: &Stage, max_sched: usize) -> Option<PyErr> {
        let mut failed: Option<PyErr> = None;
        let step = self.inner.begin_step();
        for (slot, store) in &stage.preempted {
            let n = match store {
                Some(s) => self.apply_store(s, None, false).unwrap_or_else(|e| {
                    failed.get_or_insert(slot_error(e));
                    0
                }),
                None => 0,
            };
            self.inner.after_preemption(*slot, n);
        }
        for m in &stage.new {
            let dev = &self.blocks[m.blocks.clone()];
            self.inner
                .mirror(m.slot, dev, true, m.computed.unwrap_or(0), m.scheduled, true);
        }
        for m in &stage.cached {
            let blocks = &self.blocks[m.blocks.clone()];
            match m.computed {
                None => self.inner.append_blocks(m.slot, blocks),
                Some(nc) => {
                    self.inner
                        .mirror(m.slot, blocks, m.resumed, nc, m.scheduled, m.resumed);
                }
            }
        }
        self.inner.note_max_scheduled(max_sched);
        for s in &stage.stores {
            if let Err(e) = self.apply_store(s, None, false) {
                failed.get_or_insert(slot_error(e));
            }
        }
        self.inner.end_step(&mut self.plan);
        debug_assert_eq!(self.plan.step, step);
        failed
    }

    /// Reads everything a step needs from vLLM's `SchedulerOutput` (and the requests it
    /// names) into `stage` and the staging buffers, changing nothing the planner shows.
    /// Returns the step's largest scheduled count.
    fn read_step<'py>(
        &mut self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
        stage: &mut Stage,
    ) -> PyResult<usize> {
        let scheduled = scheduler_output.getattr(intern!(py, "num_scheduled_tokens"))?;
        let scheduled = scheduled.cast::<PyDict>()?;
        let n_computed = intern!(py, "num_computed_tokens");
        let n_inflight = intern!(py, "num_in_flight_tokens");
        let n_tokens = intern!(py, "num_tokens");
        let hashes_attr = intern!(py, "block_hashes");
        let preempted = scheduler_output.getattr(intern!(py, "preempted_req_ids"))?;
        let new_reqs = scheduler_output.getattr(intern!(py, "scheduled_new_reqs"))?;
        let new_reqs = new_reqs.cast::<PyList>()?;
        let cached = scheduler_output.getattr(intern!(py, "scheduled_cached_reqs"))?;
        let req_ids = cached.getattr(intern!(py, "req_ids"))?;
        let req_ids = req_ids.cast::<PyList>()?;
        let new_block_ids = cached.getattr(intern!(py, "new_block_ids"))?;
        let new_block_ids = new_block_ids.cast::<PyList>()?;
        let computed = cached.getattr(n_computed)?;
        let computed = computed.cast::<PyList>()?;
        let resumed = cached.getattr(intern!(py, "resumed_req_ids"))?;
        let resumed = resumed.cast::<PySet>().ok();
        if new_block_ids.len() != req_ids.len() || computed.len() != req_ids.len() {
            return Err(invalid(
                None,
                format!(
                    "scheduled_cached_reqs lists {} req_ids, {} new_block_ids and {} \
                     num_computed_tokens (want as many of each)",
                    req_ids.len(),
                    new_block_ids.len(),
                    computed.len()
                ),
            ));
        }
        // This call, marking the requests it lists (the step is begun only once all are read).
        self.builds += 1;
        let next = self.builds;

        // Preempted requests: vLLM freed their blocks in this schedule(); store their full
        // verified blocks before this step's forward can reuse them.
        if !preempted.is_none() {
            for (i, rid) in preempted.try_iter()?.enumerate() {
                crate::convert::next_item(py, i, "preempted", None)?;
                let rid = rid?;
                let Some(slot) = self.slot_of_id(&rid)? else {
                    continue;
                };
                let Some(obj) = self.obj(py, slot) else {
                    continue;
                };
                if !Self::mark(&mut self.pre_seen, slot, next) {
                    continue; // listed twice: the second changes nothing
                }
                let req = obj.bind(py);
                let num_tokens = usize_attr(req, n_tokens)?;
                // The KV of at most computed_hi positions was written; vLLM verified all but
                // the last sampled token (it reset num_computed_tokens when preempting).
                let verified = self
                    .inner
                    .preempted_computed(slot)
                    .min(num_tokens.saturating_sub(1));
                let hashes = req.getattr(hashes_attr)?;
                let lo = self.inner.next_block(slot);
                let blocks = self.inner.device_blocks(slot).len();
                let store = self.read_store(slot, req, verified, &hashes, lo, blocks)?;
                stage.preempted.push((slot, store));
            }
        }

        // New requests: their whole block table.
        for nr in new_reqs.iter() {
            let rid_obj = nr.getattr(intern!(py, "req_id"))?;
            let Some(slot) = self.slot_of_id(&rid_obj)? else {
                continue;
            };
            if !Self::mark(&mut self.seen, slot, next) {
                return Err(self.listed_twice(slot));
            }
            let groups = nr.getattr(intern!(py, "block_ids"))?;
            let ids = groups.get_item(0)?;
            let dev = IntArg::<u32>::extract(&ids, "block_ids", None)?;
            let nc = usize_attr(&nr, n_computed)?;
            let sched = scheduled
                .get_item(&rid_obj)?
                .map_or(Ok(0), |v| count(&v, "num_scheduled_tokens", None))?;
            let start = self.blocks.len();
            self.blocks.extend_from_slice(dev.as_slice());
            stage.new.push(MirrorIn {
                slot,
                blocks: start..self.blocks.len(),
                resumed: true,
                computed: Some(nc),
                scheduled: Some(sched),
            });
        }

        // Running and resumed requests: the blocks vLLM added this step.
        let any_resumed = resumed.as_ref().is_some_and(|s| !s.is_empty());
        // Items are read borrowed and by address: a decoding request that cannot have filled a
        // block touches neither its id string nor its computed count (memory the scheduler's
        // own work has mostly evicted by now), only the None of its new block ids.
        let n_cached = req_ids.len();
        self.pos_ptrs.resize(n_cached, 0);
        self.pos_slots.resize(n_cached, 0);
        for i in 0..n_cached {
            let mut rid_ptr = borrowed_item(req_ids, i)?;
            let slot = match self.slot_at(i, rid_ptr as usize) {
                Some(s) => s,
                None => {
                    let found = match self.by_ptr.get(&(rid_ptr as usize)) {
                        Some(&s) => Some(s),
                        None => {
                            // SAFETY: a live item of the list, which the GIL keeps alive.
                            let rid_obj = unsafe { Bound::from_borrowed_ptr(py, rid_ptr) };
                            self.slot_of_id(&rid_obj)?
                        }
                    };
                    let Some(s) = found else {
                        self.pos_ptrs[i] = 0;
                        continue;
                    };
                    self.pos_ptrs[i] = rid_ptr as usize;
                    self.pos_slots[i] = s;
                    // Found by value: go on with the planner's own (equal) id object, which it
                    // holds, so Python code run below (an item's `__index__`) cannot free it.
                    if let Some(Some(id)) = self.id_objs.get(s as usize) {
                        rid_ptr = id.as_ptr();
                    }
                    s
                }
            };
            if !Self::mark(&mut self.seen, slot, next) {
                return Err(self.listed_twice(slot));
            }
            let is_resumed = any_resumed && {
                // SAFETY: `rid_ptr` is now an id object the planner holds.
                let rid_obj = unsafe { Bound::from_borrowed_ptr(py, rid_ptr) };
                resumed.as_ref().expect("any_resumed").contains(&rid_obj)?
            };
            // Read after the set lookup above, which may run Python code (a str subclass's
            // `__eq__`) that changes the list.
            let nb_ptr = borrowed_item(new_block_ids, i)?;
            let start = self.blocks.len();
            if nb_ptr != unsafe { pyo3::ffi::Py_None() } {
                // SAFETY: as above.
                let nb = unsafe { Bound::from_borrowed_ptr(py, nb_ptr) };
                let group = nb
                    .cast::<PyTuple>()
                    .map(|t| t.get_item(0))
                    .unwrap_or_else(|_| nb.get_item(0))?;
                if let Ok(list) = group.cast::<PyList>() {
                    // Exact ints read borrowed (as token_at does); the others converted. The
                    // length is read again each item: a conversion may run Python code.
                    let mut j = 0;
                    while j < list.len() {
                        let b = match conv::list_small_int(list, j)
                            .and_then(|v| u32::try_from(v).ok())
                        {
                            Some(b) => b,
                            None => int::<u32>(&list.get_item(j)?, "new_block_ids", None)?,
                        };
                        self.blocks.push(b);
                        j += 1;
                    }
                } else {
                    let d = IntArg::<u32>::extract(&group, "new_block_ids", None)?;
                    self.blocks.extend_from_slice(d.as_slice());
                }
            }
            let blocks = start..self.blocks.len();
            // Preempted in this step too: its state then is after_preemption's.
            let preempted_now = self.pre_seen.get(slot as usize) == Some(&next);
            if !is_resumed && !preempted_now && self.inner.skippable(slot) {
                if blocks.is_empty() {
                    continue; // nothing to append (most decoding requests, most steps)
                }
                stage.cached.push(MirrorIn {
                    slot,
                    blocks,
                    resumed: false,
                    computed: None,
                    scheduled: None,
                });
                continue;
            }
            let nc = count(&computed.get_item(i)?, "num_computed_tokens", None)?;
            // The scheduled count matters only while prefilling (chunk ends, preemption).
            let sched = if self.inner.prefilling(slot, nc) {
                // SAFETY: as above.
                let rid_obj = unsafe { Bound::from_borrowed_ptr(py, rid_ptr) };
                Some(
                    scheduled
                        .get_item(&rid_obj)?
                        .map_or(Ok(0), |v| count(&v, "num_scheduled_tokens", None))?,
                )
            } else {
                None
            };
            if self.inner.candidate_next(slot, nc, is_resumed, preempted_now) {
                let kept = if is_resumed || preempted_now {
                    0
                } else {
                    self.inner.device_blocks(slot).len()
                };
                stage.due.push((slot, preempted_now, kept + blocks.len()));
            }
            stage.cached.push(MirrorIn {
                slot,
                blocks,
                resumed: is_resumed,
                computed: Some(nc),
                scheduled: sched,
            });
        }
        let max_sched = max_scheduled(scheduled)?;

        // The candidates (a block may have filled): only they are read further.
        for k in 0..stage.due.len() {
            let (slot, preempted_now, blocks) = stage.due[k];
            let Some(obj) = self.obj(py, slot) else {
                continue;
            };
            let req = obj.bind(py);
            let nc = usize_attr(req, n_computed)?;
            let verified = nc.saturating_sub(usize_attr(req, n_inflight).unwrap_or(0));
            let hashes = req.getattr(hashes_attr)?;
            let lo = if preempted_now { 0 } else { self.inner.next_block(slot) };
            // Nothing storable unless vLLM hashed the block (no token read then).
            if hashes.len()? <= lo {
                continue;
            }
            if let Some(s) = self.read_store(slot, req, verified, &hashes, lo, blocks)? {
                stage.stores.push(s);
            }
        }
        Ok(max_sched)
    }

    /// `finish`: the planner is borrowed by the caller.
    fn finish_request(
        &mut self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_ids: &[u32],
    ) -> PyResult<bool> {
        let rid_obj = request.getattr(intern!(py, "request_id"))?;
        let Some(slot) = self.inner.slot_of(rid_obj.cast::<PyString>()?.to_str()?) else {
            return Ok(false);
        };
        // Everything read first: a request that cannot be read, or a store the host tier
        // refuses, leaves the request tracked as it was (the error says why).
        let nc = usize_attr(request, intern!(py, "num_computed_tokens"))?;
        let verified = nc.saturating_sub(
            usize_attr(request, intern!(py, "num_in_flight_tokens")).unwrap_or(0),
        );
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        self.store_request(slot, request, verified, &hashes, block_ids, true)?;
        self.inner.finish(slot);
        self.forget(slot);
        Ok(true)
    }
}

#[pymethods]
impl ConnectorPlanner {
    /// The Python objects it holds, for the cycle collector: without it a cycle through this
    /// object (a request, array or status whose attribute refers back to it) was never freed.
    fn __traverse__(&self, visit: pyo3::pyclass::PyVisit<'_>) -> Result<(), pyo3::pyclass::PyTraverseError> {
        for o in self.objs.iter().chain(self.id_objs.iter()) {
            visit.call(o)?;
        }
        Ok(())
    }

    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it holds the vLLM request objects it tracks and the host tier's blocks, which a copy would detach or hand out twice",
        )
    }

    #[new]
    #[pyo3(signature = (block_size, num_host_blocks, eagle, expected_workers=None, max_decode_tokens=None))]
    fn new(
        block_size: &Bound<'_, PyAny>,
        num_host_blocks: &Bound<'_, PyAny>,
        eagle: &Bound<'_, PyAny>,
        expected_workers: Option<&Bound<'_, PyAny>>,
        max_decode_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let cfg = core::PlannerConfig {
            block_size: count(block_size, "block_size", None)?,
            num_host_blocks: count(num_host_blocks, "num_host_blocks", None)?,
            eagle: flag(eagle, "eagle", None)?,
            expected_workers: opt_int::<u32>(expected_workers, "expected_workers", None)?
                .unwrap_or(1),
            max_decode_tokens: opt_int::<usize>(max_decode_tokens, "max_decode_tokens", None)?
                .unwrap_or(1),
        };
        Ok(ConnectorPlanner {
            inner: core::ConnectorPlanner::new(cfg).map_err(slot_error)?,
            objs: Vec::new(),
            id_objs: Vec::new(),
            by_ptr: HashMap::default(),
            plan: core::StepPlan::default(),
            pos_ptrs: Vec::new(),
            pos_slots: Vec::new(),
            stage: Stage::default(),
            seen: Vec::new(),
            pre_seen: Vec::new(),
            builds: 0,
            hashes: Vec::new(),
            tokens: Vec::new(),
            blocks: Vec::new(),
            wire: Vec::new(),
            items: Vec::new(),
            ends: Vec::new(),
            events_wanted: true,
        })
    }

    /// Host-tier hit of a waiting request beyond vLLM's local hit of `num_computed_tokens`, in
    /// tokens (never the whole prompt; for EAGLE, the last block only when the next token is
    /// the one recorded with it). Reads the vLLM `Request` while the planner is borrowed.
    fn lookup(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let py = slf.py();
        let num_computed = count(num_computed_tokens, "num_computed_tokens", None)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let bs = this.inner.config().block_size;
        (|| -> PyResult<usize> {
            // Everything read (the request may run Python code, and raise) before the request
            // is tracked: a failed lookup changes nothing.
            let t = this.read_tracking(py, request)?;
            let block_hashes = request.getattr(intern!(py, "block_hashes"))?;
            let num_tokens = usize_attr(request, intern!(py, "num_tokens"))?;
            let max_blocks = (num_tokens.saturating_sub(1) / bs).min(block_hashes.len()?);
            let local = num_computed / bs;
            if max_blocks <= local {
                this.apply_tracking(request, &t);
                return Ok(0);
            }
            let known = match (t.fresh, t.existing) {
                (false, Some(s)) => this.inner.known_hashes(s),
                _ => 0,
            };
            this.hashes.clear();
            let staged = if known < max_blocks {
                this.stage_hashes(&block_hashes, known, max_blocks)?
            } else {
                0..0
            };
            let seq = tokens_of(request)?;
            let slot = this.apply_tracking(request, &t);
            if !staged.is_empty() {
                this.inner.extend_hashes(slot, &this.hashes[staged]);
            }
            Ok(this
                .inner
                .lookup(slot, local, max_blocks, |p| token_at(&seq, p).ok()))
        })()
        .map_err(|e| reading_error(py, e, "the request"))
    }

    /// vLLM allocated the request's blocks (`device_blocks`: its whole block table): pins the
    /// host blocks of its external hit for a load in the next step.
    fn after_alloc(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        device_blocks: &Bound<'_, PyAny>,
        num_external_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let n = count(num_external_tokens, "num_external_tokens", None)?;
        let dev = if n > 0 {
            Some(IntArg::<u32>::extract(
                device_blocks,
                "device_blocks",
                None,
            )?)
        } else {
            None
        };
        let mut this = borrow_mut(slf)?;
        let t = this
            .read_tracking(py, request)
            .map_err(|e| reading_error(py, e, "the request"))?;
        if let (Some(d), true) = (&dev, t.fresh) {
            // A request tracked by this call has no hit: a load it cannot take is refused
            // before it is tracked.
            let rid = t.rid_obj.cast::<PyString>().expect("read as a str").to_str()?;
            this.inner
                .check_new_load(rid, d.as_slice().len(), n)
                .map_err(slot_error)?;
        }
        let slot = this.apply_tracking(request, &t);
        match dev {
            Some(d) => this
                .inner
                .plan_load(slot, d.as_slice(), n)
                .map_err(slot_error),
            None => Ok(()),
        }
    }

    /// Starts mirroring a request without a lookup (vLLM allocated it without asking).
    fn track(slf: &Bound<'_, Self>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        borrow_mut(slf)?
            .slot_for(py, request)
            .map(|_| ())
            .map_err(|e| reading_error(py, e, "the request"))
    }

    /// Plans one engine step from vLLM's `SchedulerOutput`: returns
    /// `(step, store_device_blocks, store_host_blocks, [(request_id, device_blocks, host_blocks)])`.
    fn build<'py>(
        slf: &Bound<'py, Self>,
        scheduler_output: &Bound<'py, PyAny>,
    ) -> PyResult<PyPlan<'py>> {
        let py = slf.py();
        let mut this = borrow_mut(slf)?;
        this.build_step(py, scheduler_output)
    }

    /// A finished request: its last verified blocks (of `block_ids`, its device blocks) are
    /// stored at the start of the next step; the request is forgotten. Never holds blocks. A
    /// request that cannot be read (or whose store is refused) raises and stays tracked.
    fn finish(
        slf: &Bound<'_, Self>,
        request: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let py = slf.py();
        let dev = IntArg::<u32>::extract(block_ids, "block_ids", None)?;
        let mut this = borrow_mut(slf)?;
        this.finish_request(py, request, dev.as_slice())
            .map_err(|e| reading_error(py, e, "the request"))
    }

    /// The workers' report for `step` (see `KVSlotsWorkerMetadata`); returns blocks registered.
    #[pyo3(signature = (step, acks, failed_store_blocks=None, failed_loads=None))]
    fn complete(
        slf: &Bound<'_, Self>,
        step: &Bound<'_, PyAny>,
        acks: &Bound<'_, PyAny>,
        failed_store_blocks: Option<&Bound<'_, PyAny>>,
        failed_loads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let step = int::<u64>(step, "step", None)?;
        let acks = int::<u32>(acks, "acks", None)?;
        let failed = match failed_store_blocks {
            Some(f) if !f.is_none() => IntArg::<u32>::extract(f, "failed_store_blocks", None)?.0,
            _ => Vec::new(),
        };
        let failed_loads = opt_int::<u64>(failed_loads, "failed_loads", None)?.unwrap_or(0);
        borrow_mut(slf)?
            .inner
            .complete(step, acks, &failed, failed_loads)
            .map_err(slot_error)
    }

    fn has_pending_work(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.inner.has_pending_work())
    }
    /// Whether anyone reads the host-tier events: when not, stores do not read the token ids
    /// the BlockStored events would carry (the events are to be dropped with discard_events).
    #[getter]
    fn events_wanted(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.events_wanted)
    }
    #[setter]
    fn set_events_wanted(slf: &Bound<'_, Self>, wanted: &Bound<'_, PyAny>) -> PyResult<()> {
        let w = flag(wanted, "events_wanted", None)?;
        borrow_mut(slf)?.events_wanted = w;
        Ok(())
    }
    #[getter]
    fn step(slf: &Bound<'_, Self>) -> PyResult<u64> {
        Ok(borrow(slf)?.inner.step())
    }
    #[getter]
    fn expected_workers(slf: &Bound<'_, Self>) -> PyResult<u32> {
        Ok(borrow(slf)?.inner.config().expected_workers)
    }
    #[setter]
    fn set_expected_workers(slf: &Bound<'_, Self>, n: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = int::<u32>(n, "expected_workers", None)?;
        borrow_mut(slf)?
            .inner
            .set_expected_workers(n)
            .map_err(slot_error)
    }
    #[getter]
    fn num_tracked(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_tracked())
    }
    /// The device block ids mirrored for a request (None if not tracked).
    fn device_blocks(
        slf: &Bound<'_, Self>,
        request_id: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<u32>>> {
        let rid = conv::request_id(request_id)?;
        let this = borrow(slf)?;
        Ok(this
            .inner
            .slot_of(rid)
            .map(|s| this.inner.device_blocks(s).to_vec()))
    }
    fn stats(slf: &Bound<'_, Self>) -> PyResult<HashMap<&'static str, u64>> {
        let s = borrow(slf)?.inner.stats();
        Ok(HashMap::from([
            ("hit_tokens", s.hit_tokens),
            ("loaded_blocks", s.loaded_blocks),
            ("stored_blocks", s.stored_blocks),
            ("preempted_stored_blocks", s.preempted_stored_blocks),
            ("failed_loads", s.failed_loads),
            ("failed_stores", s.failed_stores),
            ("last_blocks_served", s.last_blocks_served),
            ("last_blocks_dropped", s.last_blocks_dropped),
            ("checked", s.checked),
        ]))
    }

    // ---- the host tier ----
    /// Drops every cached host block (queues AllBlocksCleared).
    fn clear(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow_mut(slf)?.inner.cache_mut().clear())
    }
    fn registered_hashes(slf: &Bound<'_, Self>) -> PyResult<Vec<u64>> {
        let mut v: Vec<u64> = borrow(slf)?
            .inner
            .cache()
            .pool()
            .registered_hashes()
            .collect();
        v.sort_unstable();
        Ok(v)
    }
    /// The host block holding a cached hash, if any.
    fn lookup_block(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.cache().pool().lookup(h))
    }
    /// Whether the host tier's `BlockStored` events carry the blocks' successors (vLLM 0.33's
    /// `lookahead_token_ids`): with the EAGLE rule (`eagle`).
    #[getter]
    fn publishes_successors(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.inner.cache().publishes_successors())
    }
    /// The successor token recorded with a cached block (None: none recorded).
    fn successor(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        let s = borrow(slf)?.inner.cache().successor(h);
        Ok((s != core::NO_SUCCESSOR).then_some(s))
    }
    fn host_stats(slf: &Bound<'_, Self>) -> PyResult<HashMap<&'static str, u64>> {
        let s = borrow(slf)?.inner.cache().stats();
        Ok(HashMap::from([
            ("lookups", s.lookups),
            ("hit_blocks", s.hit_blocks),
            ("stores_started", s.stores_started),
            ("stores_completed", s.stores_completed),
            ("stores_aborted", s.stores_aborted),
            ("stores_skipped_full", s.stores_skipped_full),
            ("loads_started", s.loads_started),
            ("evicted_blocks", s.evicted_blocks),
        ]))
    }
    /// Disk tier below: from now on, blocks evicted from the host tier are kept for
    /// `take_spills`.
    fn enable_spill(slf: &Bound<'_, Self>) -> PyResult<()> {
        borrow_mut(slf)?.inner.cache_mut().enable_spill();
        Ok(())
    }
    /// Host blocks evicted since the last call: [(host block, hash, parent, lora_id,
    /// successor or None, token ids)]. Their bytes stay valid until the next step's copies.
    #[allow(clippy::type_complexity)]
    fn take_spills(
        slf: &Bound<'_, Self>,
    ) -> PyResult<Vec<(u32, u64, Option<u64>, Option<u64>, Option<u32>, Vec<u32>)>> {
        Ok(borrow_mut(slf)?
            .inner
            .cache_mut()
            .take_spills()
            .into_iter()
            .map(|(b, m)| {
                let succ = (m.successor != core::NO_SUCCESSOR).then_some(m.successor);
                (b, m.hash, m.parent, m.lora, succ, m.tokens)
            })
            .collect())
    }
    /// Disk tier below: hashes registered in the host tier since the last call.
    fn take_registered(slf: &Bound<'_, Self>) -> PyResult<Vec<u64>> {
        Ok(borrow_mut(slf)?.inner.cache_mut().take_registered())
    }
    /// Drops the hashes registered since the last call without building a list (nothing is on
    /// disk, so none of them has a disk copy to drop); returns how many there were.
    fn discard_registered(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow_mut(slf)?.inner.cache_mut().take_registered().len())
    }
    /// Disk tier below: takes host blocks (evicting least recently used ones, spilled like any
    /// eviction) for blocks a disk hit moves up: [(index into `block_hashes`, host block)] for
    /// those not cached nor being stored, as far as blocks can be taken. They stay unregistered
    /// (and pinned) until `complete_promote` or `abort_promote`.
    fn begin_promote(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(borrow_mut(slf)?
            .inner
            .cache_mut()
            .begin_store(h.as_slice())
            .into_iter()
            .map(|(i, p)| (i, p.block))
            .collect())
    }
    /// Registers promoted blocks (a contiguous run of one chain: `parent_hash` before the
    /// first, `block_size` tokens per block, a successor or None per block): one `BlockStored`.
    #[pyo3(signature = (block_hashes, host_blocks, token_ids, successors, parent_hash=None, lora_id=None))]
    fn complete_promote(
        slf: &Bound<'_, Self>,
        block_hashes: &Bound<'_, PyAny>,
        host_blocks: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        successors: &Bound<'_, PyAny>,
        parent_hash: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stores = pending(block_hashes, host_blocks)?;
        let tokens = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        let succ = conv::successors(successors, "successors")?;
        let parent = opt_int::<u64>(parent_hash, "parent_hash", None)?;
        let lora = opt_int::<u64>(lora_id, "lora_id", None)?;
        borrow_mut(slf)?
            .inner
            .cache_mut()
            .complete_store_with_successors(&stores, parent, tokens.as_slice(), lora, &succ)
            .map_err(slot_error)
    }
    /// Gives back the host blocks of promotions that did not happen (a failed disk read).
    fn abort_promote(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>, host_blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let stores = pending(block_hashes, host_blocks)?;
        borrow_mut(slf)?.inner.cache_mut().abort_store(&stores).map_err(slot_error)
    }
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        Ok(borrow(slf)?.inner.cache().pool().check().err())
    }
    #[getter]
    fn num_host_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.cache().pool().num_blocks())
    }
    #[getter]
    fn num_held(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.cache().pool().num_held())
    }
    #[getter]
    fn num_cached(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.cache().pool().num_cached())
    }
    #[getter]
    fn num_storing(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.cache().num_storing())
    }

    // ---- host-tier events ----
    fn num_pending_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.cache().events().len())
    }
    fn drain_raw_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let mut this = borrow_mut(slf)?;
        let list = events_to_py(slf.py(), this.inner.cache().events())?;
        this.inner.cache_mut().events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format); the queue stays.
    #[pyo3(signature = (ts, medium=Some("CPU".to_owned()), data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode_events(slf, ts, medium, data_parallel_rank, hashes_as_bytes, false)
    }
    /// Like ``events_msgpack``, then empties the queue (one call per step for the connector).
    #[pyo3(signature = (ts, medium=Some("CPU".to_owned()), data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Self::encode_events(slf, ts, medium, data_parallel_rank, hashes_as_bytes, true)
    }
    /// Drains the queued events as a list of `raw(bytes)`, one per event, each holding that
    /// event's msgpack bytes exactly as in the `events` array of ``drain_events_msgpack``'s
    /// batch. With ``raw = msgspec.Raw``, vLLM's publisher (msgspec) writes them verbatim: the
    /// batch it publishes is byte for byte the one it would build from the decoded structs,
    /// without building a Python object per field. The queue is emptied only on success.
    #[pyo3(signature = (raw, medium=Some("CPU".to_owned()), hashes_as_bytes=false))]
    fn drain_events_raw<'py>(
        slf: &Bound<'py, Self>,
        raw: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let out = conv::log_to_raw_list(
            slf.py(),
            this.inner.cache().events(),
            raw,
            medium.as_deref(),
            hashes_as_bytes,
            &mut this.wire,
            &mut this.ends,
        )?;
        this.inner.cache_mut().events_mut().clear();
        Ok(out)
    }
    /// Drops the queued events (nobody reads them); returns how many there were.
    fn discard_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let mut this = borrow_mut(slf)?;
        let n = this.inner.cache().events().len();
        this.inner.cache_mut().events_mut().clear();
        Ok(n)
    }
}

impl ConnectorPlanner {
    /// The queued events encoded; emptied only when ``drain`` and the encoding succeeded.
    fn encode_events<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        hashes_as_bytes: bool,
        drain: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let args = MetaArgs::extract(ts, medium.as_deref(), data_parallel_rank, hashes_as_bytes)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let out = log_to_msgpack(slf.py(), this.inner.cache().events(), &mut this.wire, args.meta())?;
        if drain {
            this.inner.cache_mut().events_mut().clear();
        }
        Ok(out)
    }
}

/// (hash, host block) pairs of promotions under way.
fn pending(block_hashes: &Bound<'_, PyAny>, host_blocks: &Bound<'_, PyAny>) -> PyResult<Vec<core::PendingStore>> {
    let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
    let b = IntArg::<u32>::extract(host_blocks, "host_blocks", None)?;
    if h.as_slice().len() != b.as_slice().len() {
        return Err(invalid(None, format!("{} hashes and {} host blocks", h.as_slice().len(), b.as_slice().len())));
    }
    Ok(h.as_slice().iter().zip(b.as_slice()).map(|(&hash, &block)| core::PendingStore { hash, block }).collect())
}
