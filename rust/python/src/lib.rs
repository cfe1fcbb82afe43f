//! `kvslots._core`: a thin pyo3 layer over kvslots-core. Conversions, exceptions, GIL release;
//! no slot logic lives here.

use std::collections::HashMap;

mod index;

use kvslots_core as core;
use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

pyo3::import_exception!(kvslots.errors, UnknownRequestError);
pyo3::import_exception!(kvslots.errors, DuplicateRequestError);
pyo3::import_exception!(kvslots.errors, OutOfBlocksError);
pyo3::import_exception!(kvslots.errors, InvalidRollbackError);
pyo3::import_exception!(kvslots.errors, CapacityExceededError);
pyo3::import_exception!(kvslots.errors, InvalidArgumentError);

/// Maps an engine error to its Python class: `(message, request_id, details)`.
fn err(e: core::SlotError) -> PyErr {
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

fn invalid(request: Option<&str>, message: String) -> PyErr {
    err(core::SlotError::invalid(request, message))
}

/// An integer sequence argument: a contiguous numpy array of the right dtype is borrowed as is;
/// anything else (lists, other integer dtypes) is range-checked and copied.
enum IntArg<'py, T: numpy::Element> {
    Borrowed(PyReadonlyArray1<'py, T>),
    Owned(Vec<T>),
}

impl<'py, T> IntArg<'py, T>
where
    T: numpy::Element + Copy + TryFrom<i128> + for<'a> FromPyObject<'a, 'py>,
{
    fn extract(obj: &Bound<'py, PyAny>, what: &str, request: Option<&str>) -> PyResult<Self> {
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

    fn as_slice(&self) -> &[T] {
        match self {
            IntArg::Borrowed(a) => a.as_slice().expect("checked contiguous"),
            IntArg::Owned(v) => v,
        }
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn count(v: i64, what: &str, request: Option<&str>) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid(request, format!("{what} must be >= 0, got {v}")))
}

/// A slot's counters.
#[pyclass(module = "kvslots._core", frozen, get_all, eq)]
#[derive(Clone, PartialEq)]
struct SlotInfo {
    committed: usize,
    pending: usize,
    lookahead: usize,
    reserved_lookahead: usize,
    num_blocks: usize,
    num_immutable: usize,
    capacity: usize,
}

#[pymethods]
impl SlotInfo {
    fn __repr__(&self) -> String {
        format!(
            "SlotInfo(committed={}, pending={}, lookahead={}, reserved_lookahead={}, num_blocks={}, num_immutable={}, capacity={})",
            self.committed, self.pending, self.lookahead, self.reserved_lookahead, self.num_blocks, self.num_immutable, self.capacity
        )
    }
}

impl From<core::SlotInfo> for SlotInfo {
    fn from(i: core::SlotInfo) -> Self {
        SlotInfo {
            committed: i.committed,
            pending: i.pending,
            lookahead: i.lookahead,
            reserved_lookahead: i.reserved_lookahead,
            num_blocks: i.num_blocks,
            num_immutable: i.num_immutable,
            capacity: i.capacity,
        }
    }
}

fn events_to_py<'py>(py: Python<'py>, log: &core::EventLog) -> PyResult<Bound<'py, PyList>> {
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

fn batch_meta<'a>(
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

fn encode_err(e: core::EncodeError) -> PyErr {
    invalid(None, e.to_string())
}

/// Encodes a queued log into `buf` (reused scratch) with the GIL released; the log is unchanged.
fn log_to_msgpack<'py>(
    py: Python<'py>,
    log: &core::EventLog,
    buf: &mut Vec<u8>,
    meta: core::BatchMeta<'_>,
) -> PyResult<Bound<'py, PyBytes>> {
    buf.clear();
    py.detach(|| log.encode_msgpack(&meta, buf))
        .map_err(encode_err)?;
    Ok(PyBytes::new(py, buf))
}

/// One raw event tuple (the shape `drain_raw_events` returns) as an owned event.
fn event_from_py(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<core::KvEvent> {
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

/// The slot manager over a block pool it owns. See `kvslots.SlotManager` for the documented API.
#[pyclass(module = "kvslots._core", subclass)]
struct SlotManager {
    inner: core::SlotManager,
    out: core::StepOutput,
    /// Scratch for msgpack event batches, reused so a warm encode allocates nothing.
    wire: Vec<u8>,
}

type StepArrays<'py> = (
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u32>>,
    Bound<'py, PyArray1<u32>>,
);

#[pymethods]
impl SlotManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, *, hash_seed=0, enable_prefix_caching=true, max_tokens_per_slot=None))]
    fn new(
        num_blocks: i64,
        block_size: i64,
        hash_seed: u64,
        enable_prefix_caching: bool,
        max_tokens_per_slot: Option<i64>,
    ) -> PyResult<Self> {
        let cfg = core::ManagerConfig {
            num_blocks: count(num_blocks, "num_blocks", None)?,
            block_size: count(block_size, "block_size", None)?,
            hash_seed,
            enable_prefix_caching,
            max_tokens_per_slot: max_tokens_per_slot
                .map(|m| count(m, "max_tokens_per_slot", None))
                .transpose()?,
        };
        Ok(SlotManager {
            inner: core::SlotManager::new(cfg).map_err(err)?,
            out: Default::default(),
            wire: Vec::new(),
        })
    }

    #[pyo3(signature = (request_id, prompt, *, lookahead=0, match_prefix=true, lora_id=None))]
    fn create(
        &mut self,
        request_id: &str,
        prompt: &Bound<'_, PyAny>,
        lookahead: i64,
        match_prefix: bool,
        lora_id: Option<u64>,
    ) -> PyResult<usize> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        let prompt = IntArg::<u32>::extract(prompt, "prompt", Some(request_id))?;
        self.inner
            .create(request_id, prompt.as_slice(), k, match_prefix, lora_id)
            .map(|(_, m)| m)
            .map_err(err)
    }

    fn slot_id(&self, request_id: &str) -> PyResult<u64> {
        self.inner.slot_id(request_id).map_err(err)
    }

    fn reserve(&mut self, request_id: &str, new_tokens: i64) -> PyResult<usize> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        self.inner.reserve(request_id, n).map_err(err)
    }

    fn commit(&mut self, request_id: &str, tokens: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = IntArg::<u32>::extract(tokens, "tokens", Some(request_id))?;
        self.inner
            .commit(request_id, tokens.as_slice())
            .map_err(err)
    }

    fn rollback(&mut self, request_id: &str, num_tokens: i64) -> PyResult<()> {
        let n = count(num_tokens, "num_tokens", Some(request_id))?;
        self.inner.rollback(request_id, n).map_err(err)
    }

    fn set_lookahead(&mut self, request_id: &str, lookahead: i64) -> PyResult<usize> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.set_lookahead(request_id, k).map_err(err)
    }

    fn finish(&mut self, request_id: &str) -> PyResult<()> {
        self.inner.finish(request_id).map_err(err)
    }

    fn evict(&mut self, num_blocks: i64) -> PyResult<usize> {
        Ok(self.inner.evict(count(num_blocks, "num_blocks", None)?))
    }

    fn clear_cache(&mut self) -> usize {
        self.inner.clear_cache()
    }

    #[pyo3(signature = (slot_ids, num_accepted, accepted_tokens, num_rejected, num_new_tokens, lookahead=None))]
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        slot_ids: &Bound<'py, PyAny>,
        num_accepted: &Bound<'py, PyAny>,
        accepted_tokens: &Bound<'py, PyAny>,
        num_rejected: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        lookahead: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<StepArrays<'py>> {
        let slots = IntArg::<u64>::extract(slot_ids, "slot_ids", None)?;
        let acc = IntArg::<u32>::extract(num_accepted, "num_accepted", None)?;
        let toks = IntArg::<u32>::extract(accepted_tokens, "accepted_tokens", None)?;
        let rej = IntArg::<u32>::extract(num_rejected, "num_rejected", None)?;
        let new = IntArg::<u32>::extract(num_new_tokens, "num_new_tokens", None)?;
        let look = lookahead
            .map(|l| IntArg::<u32>::extract(l, "lookahead", None))
            .transpose()?;
        let input = core::StepInput {
            slots: slots.as_slice(),
            num_accepted: acc.as_slice(),
            accepted_tokens: toks.as_slice(),
            num_rejected: rej.as_slice(),
            num_new_tokens: new.as_slice(),
            lookahead: look.as_ref().map(|l| l.as_slice()),
        };
        let (inner, out) = (&mut self.inner, &mut self.out);
        py.detach(|| inner.step(&input, out)).map_err(err)?;
        Ok((
            PyArray1::from_slice(py, &self.out.num_new_blocks),
            PyArray1::from_slice(py, &self.out.new_block_ids),
            PyArray1::from_slice(py, &self.out.num_committed_blocks),
        ))
    }

    // ---- queries ----

    fn block_table(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .block_table(request_id)
            .map(<[u32]>::to_vec)
            .map_err(err)
    }
    fn slot_info(&self, request_id: &str) -> PyResult<SlotInfo> {
        self.inner
            .slot_info(request_id)
            .map(Into::into)
            .map_err(err)
    }
    fn committed_tokens(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .slot(request_id)
            .map(|s| s.tokens().to_vec())
            .map_err(err)
    }
    fn block_hashes(&self, request_id: &str) -> PyResult<Vec<u64>> {
        self.inner
            .slot(request_id)
            .map(|s| s.hashes().to_vec())
            .map_err(err)
    }
    fn request_ids(&self) -> Vec<String> {
        self.inner.request_ids().map(str::to_owned).collect()
    }
    fn registered_hashes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        v
    }
    fn lookup(&self, block_hash: u64) -> Option<u32> {
        self.inner.pool().lookup(block_hash)
    }
    fn registered_hash(&self, block_id: u32) -> PyResult<Option<u64>> {
        self.check_block(block_id)?;
        Ok(self.inner.pool().registered_hash(block_id))
    }
    fn refcount(&self, block_id: u32) -> PyResult<u32> {
        self.check_block(block_id)?;
        Ok(self.inner.pool().refcount(block_id))
    }
    fn cached_blocks(&self) -> Vec<u32> {
        self.inner.pool().lru_order()
    }
    fn stats(&self) -> HashMap<&'static str, u64> {
        let s = self.inner.stats();
        HashMap::from([
            ("requests_created", s.requests_created),
            ("requests_finished", s.requests_finished),
            ("prefix_hit_tokens", s.prefix_hit_tokens),
            ("committed_tokens", s.committed_tokens),
            ("committed_blocks", s.committed_blocks),
            ("registered_blocks", s.registered_blocks),
            ("rolled_back_tokens", s.rolled_back_tokens),
            ("allocated_blocks", s.allocated_blocks),
            ("released_blocks", s.released_blocks),
            ("evicted_blocks", s.evicted_blocks),
        ])
    }
    /// Queued events as tuples, emptying the queue.
    fn drain_raw_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = events_to_py(py, self.inner.events())?;
        self.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format), leaving the queue as is.
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let meta = batch_meta(ts, medium, data_parallel_rank, hashes_as_bytes);
        log_to_msgpack(py, self.inner.events(), &mut self.wire, meta)
    }
    /// Like `events_msgpack`, then empties the queue (only when encoding succeeded).
    #[pyo3(signature = (ts, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.events_msgpack(py, ts, medium, data_parallel_rank, hashes_as_bytes)?;
        self.inner.events_mut().clear();
        Ok(bytes)
    }
    fn num_pending_events(&self) -> usize {
        self.inner.events().len()
    }
    /// Drops the queued events without turning them into Python objects (an engine with no
    /// event subscriber); returns how many there were.
    fn discard_events(&mut self) -> usize {
        let n = self.inner.events().len();
        self.inner.events_mut().clear();
        n
    }
    /// None when every invariant holds, else a description of the first broken one.
    fn check_invariants(&self) -> Option<String> {
        self.inner.check_invariants().err()
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn hash_seed(&self) -> u64 {
        self.inner.config().hash_seed
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    #[getter]
    fn num_held(&self) -> usize {
        self.inner.num_held()
    }
    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.num_cached()
    }
    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }
    #[staticmethod]
    fn metadata_bytes_per_block() -> usize {
        core::BlockPool::bytes_per_block()
    }
    fn __len__(&self) -> usize {
        self.inner.num_slots()
    }
    fn __contains__(&self, request_id: &str) -> bool {
        self.inner.contains(request_id)
    }
}

impl SlotManager {
    fn check_block(&self, block_id: u32) -> PyResult<()> {
        let n = self.inner.config().num_blocks;
        if block_id as usize >= n {
            return Err(invalid(
                None,
                format!("block id {block_id} is outside the pool of {n} blocks"),
            ));
        }
        Ok(())
    }
}

/// Slots over block ids owned elsewhere (vLLM's device blocks).
#[pyclass(module = "kvslots._core")]
struct SlotTracker {
    inner: core::SlotTracker,
}

#[pymethods]
impl SlotTracker {
    #[new]
    #[pyo3(signature = (block_size, *, hash_seed=0))]
    fn new(block_size: i64, hash_seed: u64) -> PyResult<Self> {
        Ok(SlotTracker {
            inner: core::SlotTracker::new(count(block_size, "block_size", None)?, hash_seed)
                .map_err(err)?,
        })
    }
    #[pyo3(signature = (request_id, *, lookahead=0, lora_id=None))]
    fn add(&mut self, request_id: &str, lookahead: i64, lora_id: Option<u64>) -> PyResult<()> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.add(request_id, k, lora_id).map_err(err)
    }
    fn blocks_needed(&self, request_id: &str, new_tokens: i64) -> PyResult<usize> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        self.inner.blocks_needed(request_id, n).map_err(err)
    }
    fn reserve(
        &mut self,
        request_id: &str,
        new_tokens: i64,
        new_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let n = count(new_tokens, "new_tokens", Some(request_id))?;
        let b = IntArg::<u32>::extract(new_blocks, "new_blocks", Some(request_id))?;
        self.inner.reserve(request_id, n, b.as_slice()).map_err(err)
    }
    /// Returns the blocks that became immutable as (index, block_id, hash) tuples.
    #[pyo3(signature = (request_id, tokens, block_hashes=None))]
    fn commit(
        &mut self,
        request_id: &str,
        tokens: &Bound<'_, PyAny>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(usize, u32, u64)>> {
        let t = IntArg::<u32>::extract(tokens, "tokens", Some(request_id))?;
        let h = block_hashes
            .map(|h| IntArg::<u64>::extract(h, "block_hashes", Some(request_id)))
            .transpose()?;
        let done = self
            .inner
            .commit(request_id, t.as_slice(), h.as_ref().map(|h| h.as_slice()))
            .map_err(err)?;
        Ok(done
            .into_iter()
            .map(|c| (c.index, c.block, c.hash))
            .collect())
    }
    fn rollback(&mut self, request_id: &str, num_tokens: i64) -> PyResult<()> {
        let n = count(num_tokens, "num_tokens", Some(request_id))?;
        self.inner.rollback(request_id, n).map_err(err)
    }
    fn set_lookahead(&mut self, request_id: &str, lookahead: i64) -> PyResult<Vec<u32>> {
        let k = count(lookahead, "lookahead", Some(request_id))?;
        self.inner.set_lookahead(request_id, k).map_err(err)
    }
    /// Forgets the request; returns its block ids.
    fn finish(&mut self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .finish(request_id)
            .map(|s| s.blocks().to_vec())
            .map_err(err)
    }
    fn slot_info(&self, request_id: &str) -> PyResult<SlotInfo> {
        self.inner.info(request_id).map(Into::into).map_err(err)
    }
    fn block_table(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .slot(request_id)
            .map(|s| s.blocks().to_vec())
            .map_err(err)
    }
    fn block_hashes(&self, request_id: &str) -> PyResult<Vec<u64>> {
        self.inner
            .slot(request_id)
            .map(|s| s.hashes().to_vec())
            .map_err(err)
    }
    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// The host-memory tier keyed by external (vLLM) block hashes. See kvslots-core's `HostCache`.
#[pyclass(module = "kvslots._core")]
struct HostCache {
    inner: core::HostCache,
    /// Scratch for msgpack event batches.
    wire: Vec<u8>,
}

fn pending(stores: Vec<(u64, u32)>) -> Vec<core::PendingStore> {
    stores
        .into_iter()
        .map(|(hash, block)| core::PendingStore { hash, block })
        .collect()
}

#[pymethods]
impl HostCache {
    #[new]
    fn new(num_blocks: i64, block_size: i64) -> PyResult<Self> {
        let n = count(num_blocks, "num_blocks", None)?;
        let bs = count(block_size, "block_size", None)?;
        Ok(HostCache {
            inner: core::HostCache::new(n, bs).map_err(err)?,
            wire: Vec::new(),
        })
    }
    /// Number of leading hashes whose blocks are complete in the cache.
    fn match_prefix(&mut self, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(self.inner.match_prefix(h.as_slice()))
    }
    fn contains(&self, block_hash: u64) -> bool {
        self.inner.contains(block_hash)
    }
    fn num_pending_events(&self) -> usize {
        self.inner.events().len()
    }
    /// The host block holding a cached hash, if any.
    fn lookup(&self, block_hash: u64) -> Option<u32> {
        self.inner.pool().lookup(block_hash)
    }
    /// Pins the blocks of `block_hashes` for a load; returns their host block ids.
    fn begin_load(
        &mut self,
        request_id: &str,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", Some(request_id))?;
        self.inner.begin_load(request_id, h.as_slice()).map_err(err)
    }
    fn end_load(&mut self, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let b = IntArg::<u32>::extract(blocks, "blocks", None)?;
        self.inner.end_load(b.as_slice()).map_err(err)
    }
    /// Takes host blocks for the hashes not cached nor being stored: [(index, hash, block)].
    fn begin_store(&mut self, block_hashes: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u64, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(self
            .inner
            .begin_store(h.as_slice())
            .into_iter()
            .map(|(i, p)| (i, p.hash, p.block))
            .collect())
    }
    /// Registers copied blocks [(hash, block)] of one request run and queues BlockStored.
    #[pyo3(signature = (stores, parent_block_hash, token_ids, lora_id=None))]
    fn complete_store(
        &mut self,
        stores: Vec<(u64, u32)>,
        parent_block_hash: Option<u64>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<u64>,
    ) -> PyResult<()> {
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        self.inner
            .complete_store(&pending(stores), parent_block_hash, t.as_slice(), lora_id)
            .map_err(err)
    }
    /// Begins storing one request's blocks as part of `step`; returns [(index, host block)].
    #[pyo3(signature = (step, block_hashes, parent_block_hash, token_ids, lora_id=None))]
    fn begin_store_run(
        &mut self,
        step: u64,
        block_hashes: &Bound<'_, PyAny>,
        parent_block_hash: Option<u64>,
        token_ids: &Bound<'_, PyAny>,
        lora_id: Option<u64>,
    ) -> PyResult<Vec<(usize, u32)>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        let t = IntArg::<u32>::extract(token_ids, "token_ids", None)?;
        self.inner
            .begin_store_run(step, h.as_slice(), parent_block_hash, t.as_slice(), lora_id)
            .map_err(err)
    }
    /// Completes every store run of `step` (aborting runs with a failed block); returns the
    /// number of blocks registered.
    #[pyo3(signature = (step, failed_blocks=Vec::new()))]
    fn complete_step(&mut self, step: u64, failed_blocks: Vec<u32>) -> PyResult<usize> {
        self.inner.complete_step(step, &failed_blocks).map_err(err)
    }
    #[getter]
    fn pending_steps(&self) -> usize {
        self.inner.pending_steps()
    }
    fn abort_store(&mut self, stores: Vec<(u64, u32)>) -> PyResult<()> {
        self.inner.abort_store(&pending(stores)).map_err(err)
    }
    fn clear(&mut self) -> usize {
        self.inner.clear()
    }
    fn drain_raw_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = events_to_py(py, self.inner.events())?;
        self.inner.events_mut().clear();
        Ok(list)
    }
    /// Queued events as one msgpack `KVEventBatch` (vLLM's wire format); the queue stays.
    #[pyo3(signature = (ts, medium=Some("CPU"), data_parallel_rank=None, hashes_as_bytes=false))]
    fn events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let meta = batch_meta(ts, medium, data_parallel_rank, hashes_as_bytes);
        log_to_msgpack(py, self.inner.events(), &mut self.wire, meta)
    }
    /// Like `events_msgpack`, then empties the queue (only when encoding succeeded).
    #[pyo3(signature = (ts, medium=Some("CPU"), data_parallel_rank=None, hashes_as_bytes=false))]
    fn drain_events_msgpack<'py>(
        &mut self,
        py: Python<'py>,
        ts: f64,
        medium: Option<&str>,
        data_parallel_rank: Option<i64>,
        hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.events_msgpack(py, ts, medium, data_parallel_rank, hashes_as_bytes)?;
        self.inner.events_mut().clear();
        Ok(bytes)
    }
    fn registered_hashes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inner.pool().registered_hashes().collect();
        v.sort_unstable();
        v
    }
    fn stats(&self) -> HashMap<&'static str, u64> {
        let s = self.inner.stats();
        HashMap::from([
            ("lookups", s.lookups),
            ("hit_blocks", s.hit_blocks),
            ("stores_started", s.stores_started),
            ("stores_completed", s.stores_completed),
            ("stores_aborted", s.stores_aborted),
            ("stores_skipped_full", s.stores_skipped_full),
            ("loads_started", s.loads_started),
            ("evicted_blocks", s.evicted_blocks),
        ])
    }
    fn check_invariants(&self) -> Option<String> {
        self.inner.pool().check().err()
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.pool().num_blocks()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.pool().num_free()
    }
    #[getter]
    fn num_held(&self) -> usize {
        self.inner.pool().num_held()
    }
    #[getter]
    fn num_cached(&self) -> usize {
        self.inner.pool().num_cached()
    }
    #[getter]
    fn num_storing(&self) -> usize {
        self.inner.num_storing()
    }
}

/// xxh3 chained block hash, identical to the engine's (for tests and tools).
#[pyfunction]
#[pyo3(signature = (parent, tokens, lora_id=None))]
fn block_hash(parent: u64, tokens: &Bound<'_, PyAny>, lora_id: Option<u64>) -> PyResult<u64> {
    let t = IntArg::<u32>::extract(tokens, "tokens", None)?;
    Ok(core::block_hash(parent, t.as_slice(), lora_id))
}

/// Encodes raw event tuples (as `SlotManager.drain_raw_events` returns them) as one msgpack
/// `KVEventBatch` in vLLM's wire format.
#[pyfunction]
#[pyo3(signature = (events, ts, *, medium=None, data_parallel_rank=None, hashes_as_bytes=false))]
fn encode_event_batch<'py>(
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
        .map_err(encode_err)?;
    Ok(PyBytes::new(py, &buf))
}

/// A caller-given host memory region: address (torch `data_ptr()`) and length in bytes.
fn host_region(addr: i128, len: i64, what: &str) -> PyResult<(usize, usize)> {
    let len = count(len, &format!("{what}_len"), None)?;
    let a = usize::try_from(addr).ok().filter(|&a| a != 0 || len == 0);
    let Some(a) = a else {
        return Err(invalid(
            None,
            format!("{what}_addr must be a non-null address, got {addr}"),
        ));
    };
    // from_raw_parts needs the region to fit in isize and not wrap the address space.
    if len > isize::MAX as usize || a.checked_add(len).is_none() {
        return Err(invalid(
            None,
            format!("{what} region {a:#x} + {len} bytes wraps the address space"),
        ));
    }
    Ok((a, len))
}

/// Block ids as u64; negative ids are typed errors naming the index.
fn block_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
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

/// Copies whole blocks between two host memory regions given by address and length:
/// `dst[dst_offset + dst_blocks[i] * dst_stride ..][..block_bytes] =
///  src[src_offset + src_blocks[i] * src_stride ..][..block_bytes]`. Returns the bytes copied.
///
/// Every range is validated before anything is copied; the GIL is released during the copy.
/// The addresses cannot be checked: the caller promises that both regions are live host memory
/// (readable / writable) for the whole call and that nothing else writes them meanwhile.
#[pyfunction]
#[pyo3(signature = (src_addr, src_len, src_offset, src_stride, dst_addr, dst_len, dst_offset, dst_stride, block_bytes, src_blocks, dst_blocks, threads=1))]
#[allow(clippy::too_many_arguments)]
fn copy_blocks(
    py: Python<'_>,
    src_addr: i128,
    src_len: i64,
    src_offset: i64,
    src_stride: i64,
    dst_addr: i128,
    dst_len: i64,
    dst_offset: i64,
    dst_stride: i64,
    block_bytes: i64,
    src_blocks: &Bound<'_, PyAny>,
    dst_blocks: &Bound<'_, PyAny>,
    threads: i64,
) -> PyResult<usize> {
    let (sa, sl) = host_region(src_addr, src_len, "src")?;
    let (da, dl) = host_region(dst_addr, dst_len, "dst")?;
    // A shared and a mutable slice over the same bytes would be undefined behaviour.
    if sl > 0 && dl > 0 && sa < da + dl && da < sa + sl {
        return Err(invalid(
            None,
            format!(
                "src region {sa:#x}+{sl} and dst region {da:#x}+{dl} overlap; \
                 copy_blocks needs two distinct regions"
            ),
        ));
    }
    let spec = core::CopySpec {
        block_bytes: count(block_bytes, "block_bytes", None)?,
        src: core::BlockLayout {
            offset: count(src_offset, "src_offset", None)?,
            stride: count(src_stride, "src_stride", None)?,
        },
        dst: core::BlockLayout {
            offset: count(dst_offset, "dst_offset", None)?,
            stride: count(dst_stride, "dst_stride", None)?,
        },
    };
    let threads = count(threads, "threads", None)?;
    // Owned ids: nothing Python can mutate is read once the GIL is released.
    let sb = block_ids(src_blocks, "src_blocks")?;
    let db = block_ids(dst_blocks, "dst_blocks")?;
    py.detach(move || {
        // SAFETY: both regions are non-null (or empty), fit in isize, do not overlap each other
        // (checked above), and are live host memory for the duration of the call by this
        // function's documented contract. The core touches only validated in-bounds ranges.
        let (src, dst) = unsafe {
            let src: &[u8] = if sl == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(sa as *const u8, sl)
            };
            let dst: &mut [u8] = if dl == 0 {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(da as *mut u8, dl)
            };
            (src, dst)
        };
        core::copy_blocks(src, dst, &spec, &sb, &db, threads)
    })
    .map_err(err)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SlotManager>()?;
    m.add_class::<SlotTracker>()?;
    m.add_class::<SlotInfo>()?;
    m.add_class::<HostCache>()?;
    m.add_class::<index::PrefixIndex>()?;
    m.add_class::<index::ApplyStats>()?;
    m.add_function(wrap_pyfunction!(index::lora_key, m)?)?;
    m.add_function(wrap_pyfunction!(block_hash, m)?)?;
    m.add_function(wrap_pyfunction!(encode_event_batch, m)?)?;
    m.add_function(wrap_pyfunction!(copy_blocks, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
