//! `kvslots._core.DiskIndex` (the disk tier's bookkeeping) and `kvslots._core.DiskStore` (its
//! file and background writer). The rules are kvslots-core's `disk` module's.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvslots_core as core;
use numpy::{PyReadonlyArray1, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::{arg, count, int, log_to_msgpack, opt_int, pin_arrays, text, IntArg, MetaArgs};
use crate::errors::{borrow, borrow_mut, invalid, slot_error, type_error};

pyo3::import_exception!(kvslots.errors, DiskTierError);
pyo3::import_exception!(kvslots.errors, InvalidStateError);

fn meta(
    hash: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    successor: Option<&Bound<'_, PyAny>>,
    parent: Option<&Bound<'_, PyAny>>,
    lora_id: Option<&Bound<'_, PyAny>>,
) -> PyResult<core::BlockMeta> {
    Ok(core::BlockMeta {
        hash: int::<u64>(hash, "block_hash", None)?,
        parent: opt_int::<u64>(parent, "parent_hash", None)?,
        lora: opt_int::<u64>(lora_id, "lora_id", None)?,
        successor: match successor {
            Some(s) if !s.is_none() => int::<u32>(s, "successor", None)?,
            _ => core::NO_SUCCESSOR,
        },
        tokens: IntArg::<u32>::extract(tokens, "token_ids", None)?.as_slice().to_vec(),
    })
}

fn layout(
    block_size: &Bound<'_, PyAny>,
    num_layers: &Bound<'_, PyAny>,
    bytes_per_block: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    fingerprint: &Bound<'_, PyAny>,
) -> PyResult<core::DiskLayout> {
    let l = core::DiskLayout {
        block_size: int::<u32>(block_size, "block_size", None)?,
        num_layers: int::<u32>(num_layers, "num_layers", None)?,
        bytes_per_block: int::<u64>(bytes_per_block, "bytes_per_block", None)?,
        dtype: text(dtype, "dtype")?.to_owned(),
        fingerprint: int::<u64>(fingerprint, "fingerprint", None)?,
    };
    l.check().map_err(|e| invalid(None, e.to_string()))?;
    Ok(l)
}

fn disk_error(e: core::DiskError) -> PyErr {
    match e {
        core::DiskError::Invalid(m) => invalid(None, m),
        e => DiskTierError::new_err(e.to_string()),
    }
}

/// The disk tier's bookkeeping: slots keyed by external block hashes, LRU, read pins,
/// successors, and its `STORAGE` events. See kvslots-core's `DiskIndex`.
#[pyclass(module = "kvslots._core", weakref)]
pub(crate) struct DiskIndex {
    inner: core::DiskIndex,
    wire: Vec<u8>,
    /// End offsets of each event's bytes in `wire` (`drain_events_raw`).
    ends: Vec<usize>,
}

#[pymethods]
impl DiskIndex {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it owns the slots of a disk tier file, which a copy would hand out twice",
        )
    }

    /// `publish_successors`: every `BlockStored` (written or restored) carries each block's
    /// recorded successor as vLLM 0.33's `lookahead_token_ids` (the connector's EAGLE rule).
    #[new]
    #[pyo3(signature = (num_slots, block_size, *, publish_successors=false))]
    fn new(
        num_slots: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::publish_successors)] publish_successors: bool,
    ) -> PyResult<Self> {
        let n = count(num_slots, "num_slots", None)?;
        let bs = count(block_size, "block_size", None)?;
        let mut inner = core::DiskIndex::new(n, bs).map_err(slot_error)?;
        inner.set_publish_successors(publish_successors);
        Ok(DiskIndex {
            inner,
            wire: Vec::new(),
            ends: Vec::new(),
        })
    }
    /// Whether `BlockStored` events carry the blocks' successors.
    #[getter]
    fn publishes_successors(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.inner.publishes_successors())
    }
    /// Takes a slot to write a block into (evicting the least recently used unpinned one), or
    /// None when the hash is on disk already or every slot is busy.
    #[pyo3(signature = (block_hash, token_ids, successor=None, parent_hash=None, lora_id=None))]
    fn begin_write(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        successor: Option<&Bound<'_, PyAny>>,
        parent_hash: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u32>> {
        let m = meta(block_hash, token_ids, successor, parent_hash, lora_id)?;
        borrow_mut(slf)?.inner.begin_write(m).map_err(slot_error)
    }
    fn complete_write(
        slf: &Bound<'_, Self>,
        slot: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::ok)] ok: bool,
    ) -> PyResult<()> {
        let s = int::<u32>(slot, "slot", None)?;
        borrow_mut(slf)?.inner.complete_write(s, ok).map_err(slot_error)
    }
    fn match_prefix(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        Ok(borrow_mut(slf)?.inner.match_prefix(h.as_slice()))
    }
    fn contains(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.contains(h))
    }
    /// Of `block_hashes`, those stored or being written (in order).
    fn held(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        let this = borrow(slf)?;
        Ok(h.as_slice().iter().copied().filter(|&x| this.inner.holds(x)).collect())
    }
    fn lookup(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow(slf)?.inner.lookup(h))
    }
    /// The successor recorded with a stored block (None if none).
    fn successor(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        let s = borrow(slf)?.inner.successor(h);
        Ok((s != core::NO_SUCCESSOR).then_some(s))
    }
    /// What a stored block's record carries: (token ids, successor or None, parent hash or
    /// None, LoRA id or None); None if the hash is not stored.
    #[allow(clippy::type_complexity)]
    fn block_meta(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(Vec<u32>, Option<u32>, Option<u64>, Option<u64>)>> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        let this = borrow(slf)?;
        Ok(this.inner.lookup(h).and_then(|s| this.inner.meta(s)).map(|m| {
            let succ = (m.successor != core::NO_SUCCESSOR).then_some(m.successor);
            (m.tokens.clone(), succ, m.parent, m.lora)
        }))
    }
    fn begin_read(slf: &Bound<'_, Self>, block_hashes: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?;
        borrow_mut(slf)?.inner.begin_read(h.as_slice()).map_err(slot_error)
    }
    fn end_read(slf: &Bound<'_, Self>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = IntArg::<u32>::extract(slots, "slots", None)?;
        borrow_mut(slf)?.inner.end_read(s.as_slice()).map_err(slot_error)
    }
    fn remove(slf: &Bound<'_, Self>, block_hash: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = int::<u64>(block_hash, "block_hash", None)?;
        Ok(borrow_mut(slf)?.inner.remove(h))
    }
    fn clear(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow_mut(slf)?.inner.clear())
    }
    /// Rebuilds the index from the tier's file (read-only; only on an empty index), if its
    /// header matches this layout: (blocks restored, damaged records, why the file was not
    /// used or None).
    #[pyo3(signature = (path, *, num_layers, bytes_per_block, dtype, fingerprint))]
    fn restore_from_file(
        slf: &Bound<'_, Self>,
        path: &Bound<'_, PyAny>,
        num_layers: &Bound<'_, PyAny>,
        bytes_per_block: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        fingerprint: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, Option<String>)> {
        let path = text(path, "path")?.to_owned();
        let bs = borrow(slf)?.inner.block_size();
        let bs = bs.into_pyobject(slf.py())?;
        let l = layout(bs.as_any(), num_layers, bytes_per_block, dtype, fingerprint)?;
        let n = borrow(slf)?.inner.num_slots() as u64;
        let file = match core::DiskFile::open_existing(Path::new(&path), &l, n) {
            Ok(f) => f,
            Err(why) => return Ok((0, 0, Some(why))),
        };
        // A file that cannot be read through (cut short since it was opened, an I/O error) is
        // not used, as one whose header does not match: nothing restored, the engine starts.
        let (records, damaged) = match slf.py().detach(|| file.scan()) {
            Ok(r) => r,
            Err(e) => return Ok((0, 0, Some(e.to_string()))),
        };
        let mut this = borrow_mut(slf)?;
        let before = this.inner.num_stored();
        this.inner.restore(records).map_err(slot_error)?;
        Ok((this.inner.num_stored() - before, damaged, None))
    }
    fn num_pending_events(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.events().len())
    }
    fn discard_events(slf: &Bound<'_, Self>) -> PyResult<()> {
        borrow_mut(slf)?.inner.events_mut().clear();
        Ok(())
    }
    /// The queued events as one msgpack `KVEventBatch` (medium "STORAGE" by default); with
    /// `drain`, the queue is emptied once encoded.
    #[pyo3(signature = (ts, medium=Some("STORAGE".to_owned()), data_parallel_rank=None, hashes_as_bytes=false, drain=false))]
    fn events_msgpack<'py>(
        slf: &Bound<'py, Self>,
        ts: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        data_parallel_rank: Option<&Bound<'py, PyAny>>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
        #[pyo3(from_py_with = arg::drain)] drain: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let args = MetaArgs::extract(ts, medium.as_deref(), data_parallel_rank, hashes_as_bytes)?;
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let bytes = log_to_msgpack(slf.py(), this.inner.events(), &mut this.wire, args.meta())?;
        if drain {
            this.inner.events_mut().clear();
        }
        Ok(bytes)
    }
    /// Drains the queued events as a list of `raw(bytes)`, one per event, each that event's
    /// msgpack bytes exactly as in `events_msgpack`'s batch (for vLLM's ZMQ publisher, which
    /// writes `msgspec.Raw` verbatim). The queue is emptied only on success.
    #[pyo3(signature = (raw, medium=Some("STORAGE".to_owned()), hashes_as_bytes=false))]
    fn drain_events_raw<'py>(
        slf: &Bound<'py, Self>,
        raw: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = arg::medium)] medium: Option<String>,
        #[pyo3(from_py_with = arg::hashes_as_bytes)] hashes_as_bytes: bool,
    ) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let mut this = borrow_mut(slf)?;
        let this = &mut *this;
        let out = crate::convert::log_to_raw_list(
            slf.py(),
            this.inner.events(),
            raw,
            medium.as_deref(),
            hashes_as_bytes,
            &mut this.wire,
            &mut this.ends,
        )?;
        this.inner.events_mut().clear();
        Ok(out)
    }
    fn stats(slf: &Bound<'_, Self>) -> PyResult<HashMap<&'static str, u64>> {
        let this = borrow(slf)?;
        let s = this.inner.stats();
        Ok(HashMap::from([
            ("capacity_blocks", this.inner.num_slots() as u64),
            ("used_blocks", this.inner.num_stored() as u64),
            ("writing_blocks", this.inner.num_writing() as u64),
            ("lookups", s.lookups),
            ("hit_blocks", s.hit_blocks),
            ("writes_started", s.writes_started),
            ("writes_completed", s.writes_completed),
            ("writes_failed", s.writes_failed),
            ("writes_skipped_full", s.writes_skipped_full),
            ("reads_started", s.reads_started),
            ("read_blocks", s.read_blocks),
            ("evicted_blocks", s.evicted_blocks),
            ("removed_blocks", s.removed_blocks),
            ("restored_blocks", s.restored_blocks),
        ]))
    }
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<Option<String>> {
        Ok(borrow(slf)?.inner.check().err())
    }
    #[getter]
    fn num_slots(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_slots())
    }
    #[getter]
    fn num_stored(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_stored())
    }
    #[getter]
    fn num_writing(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_writing())
    }
    #[getter]
    fn num_free(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_free())
    }
}

/// Reads in flight. Two reads into the same memory (one array's rows, or two views of one
/// buffer) raced: a row could end up holding the other read's block while this one was
/// reported intact, so a read whose rows overlap one in flight is refused.
#[derive(Default)]
struct Held {
    /// Async reads: ticket -> (the destination array, kept alive until taken; the start
    /// addresses of its rows, one per block).
    reads: HashMap<u64, (Py<PyAny>, Vec<usize>)>,
    /// Row start address -> row end of every row being read into; disjoint.
    rows: BTreeMap<usize, usize>,
}

impl Held {
    /// Claims `[start, start + len)` for each of `starts` (distinct rows of one array), or
    /// says which row overlaps a read in flight (nothing claimed then).
    fn claim(&mut self, starts: &[usize], len: usize) -> Result<(), usize> {
        if len == 0 {
            return Ok(());
        }
        for (i, &a) in starts.iter().enumerate() {
            if self.rows.range(..a.saturating_add(len)).next_back().is_some_and(|(_, &end)| end > a) {
                return Err(i);
            }
        }
        for &a in starts {
            self.rows.insert(a, a.saturating_add(len));
        }
        Ok(())
    }
    fn release(&mut self, starts: &[usize]) {
        for a in starts {
            self.rows.remove(a);
        }
    }
}

fn overlap_error(rows: &[usize], i: usize) -> PyErr {
    invalid(
        None,
        format!("rows[{i}] = {}: that memory is being read into by a read not yet finished (or, for an async read, not yet taken with take_reads)", rows[i]),
    )
}

/// The disk tier's file on one worker: records written by a background thread with a bounded
/// queue (a full queue drops the write), blocks read with positioned reads, the GIL released.
#[pyclass(module = "kvslots._core", weakref, frozen)]
pub(crate) struct DiskStore {
    // Dropped before `held`: dropping the reader first finishes every queued read, whose
    // destination arrays `held` keeps alive.
    reader: core::disk::reader::DiskReader,
    /// Reads in flight: their destination arrays and the memory they write.
    held: Mutex<Held>,
    next_ticket: AtomicU64,
    writer: core::DiskWriter,
    file: Arc<core::DiskFile>,
    opened: String,
    max_seq: u64,
    bytes_read: AtomicU64,
    read_blocks: AtomicU64,
    corrupt_blocks: AtomicU64,
    /// The process that opened the store: its writer and reader threads do not survive `fork`.
    pid: u32,
}

#[pymethods]
impl DiskStore {
    /// The Python objects it holds, for the cycle collector: without it a cycle through this
    /// object (a request, array or status whose attribute refers back to it) was never freed.
    fn __traverse__(&self, visit: pyo3::pyclass::PyVisit<'_>) -> Result<(), pyo3::pyclass::PyTraverseError> {
        // Never waits: a lock held elsewhere leaves the arrays unvisited (kept, as before).
        let held = match self.held.try_lock() {
            Ok(h) => h,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        for (o, _) in held.reads.values() {
            visit.call(o)?;
        }
        Ok(())
    }

    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(slf, "it owns an open file and its writer thread")
    }

    /// Opens (or creates, sized for `num_slots` blocks) the file at `path`. A file of another
    /// model, layout or format is started afresh: `opened` says which happened.
    #[new]
    #[pyo3(signature = (path, *, num_slots, block_size, num_layers, bytes_per_block, dtype, fingerprint, queue_len=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        num_slots: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        num_layers: &Bound<'_, PyAny>,
        bytes_per_block: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        fingerprint: &Bound<'_, PyAny>,
        queue_len: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let path = text(path, "path")?.to_owned();
        let n = int::<u32>(num_slots, "num_slots", None)? as u64;
        let l = layout(block_size, num_layers, bytes_per_block, dtype, fingerprint)?;
        let q = match queue_len {
            Some(q) if !q.is_none() => count(q, "queue_len", None)?,
            _ => 64,
        };
        let (file, opened, max_seq) = py
            .detach(|| -> Result<_, core::DiskError> {
                core::DiskFile::open_for_writer(Path::new(&path), &l, n)
            })
            .map_err(disk_error)?;
        let file = Arc::new(file);
        let writer = core::DiskWriter::new(file.clone(), q, max_seq + 1).map_err(disk_error)?;
        let opened = match opened {
            core::Opened::Created => "created".to_owned(),
            core::Opened::Reused => "reused".to_owned(),
            core::Opened::Discarded(why) => format!("discarded: {why}"),
        };
        let threads = READ_THREADS.min(std::thread::available_parallelism().map_or(1, |p| p.get()));
        Ok(DiskStore {
            reader: core::disk::reader::DiskReader::new(file.clone(), threads),
            held: Mutex::new(Held::default()),
            next_ticket: AtomicU64::new(1),
            writer,
            file,
            opened,
            max_seq,
            bytes_read: AtomicU64::new(0),
            read_blocks: AtomicU64::new(0),
            corrupt_blocks: AtomicU64::new(0),
            pid: std::process::id(),
        })
    }
    /// Why the store is out of use (a wipe failed: records from before a prefix-cache reset
    /// may be in the file), or None. Then every read reports its blocks as not intact, every
    /// write is refused, and a restart starts the file afresh.
    #[getter]
    fn out_of_use(&self) -> Option<String> {
        self.file.out_of_use().map(str::to_owned)
    }
    /// "created", "reused" or "discarded: <why>".
    #[getter]
    fn opened(&self) -> String {
        self.opened.clone()
    }
    #[getter]
    fn bytes_per_block(&self) -> u64 {
        self.file.layout().bytes_per_block
    }
    #[getter]
    fn num_slots(&self) -> u64 {
        self.file.num_slots()
    }
    /// Queues the record of one block (its bytes copied now): False when the queue is full
    /// (the slot is then reported not written by `take_done`).
    #[pyo3(signature = (slot, data, block_hash, token_ids, successor=None, parent_hash=None, lora_id=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        slot: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::data)] data: PyReadonlyArray1<'_, u8>,
        block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        successor: Option<&Bound<'_, PyAny>>,
        parent_hash: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.check_process()?;
        let s = int::<u32>(slot, "slot", None)?;
        if s as u64 >= self.file.num_slots() {
            return Err(invalid(None, format!("slot {s} is outside the file's {} slots", self.file.num_slots())));
        }
        let m = meta(block_hash, token_ids, successor, parent_hash, lora_id)?;
        let l = self.file.layout();
        if m.tokens.len() != l.block_size as usize {
            return Err(invalid(None, format!("{} tokens for a block of {}", m.tokens.len(), l.block_size)));
        }
        let src = data
            .as_slice()
            .map_err(|_| type_error(None, "data must be a contiguous uint8 array".into()))?;
        if src.len() as u64 != l.bytes_per_block {
            return Err(invalid(None, format!("data of {} bytes for blocks of {}", src.len(), l.bytes_per_block)));
        }
        if self.file.out_of_use().is_some() {
            return Ok(self.writer.submit(s, m, Vec::new())); // refused, reported: no copy
        }
        let mut buf = self.writer.buffer();
        buf.copy_from_slice(src);
        Ok(self.writer.submit(s, m, buf))
    }
    /// Writes finished since the last call: [(slot, written)].
    fn take_done(&self) -> PyResult<Vec<(u32, bool)>> {
        self.check_process()?;
        Ok(self.writer.take_done())
    }
    /// Reads blocks `slots[i]` (which must hold `block_hashes[i]`) into `out[i]` (a C-contiguous
    /// uint8 array [n, bytes_per_block]) with the GIL released. Returns [(i, why)] for blocks
    /// whose record is corrupt, torn or of another hash: their `out` rows are not to be used.
    fn read_into(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::out)] out: PyReadwriteArray2<'_, u8>,
    ) -> PyResult<Vec<(usize, String)>> {
        let n = IntArg::<u32>::extract(slots, "slots", None)?.as_slice().len();
        self.read(py, slots, block_hashes, out, (0..n).collect(), true)
    }
    /// As `read_into`, block `i` into row `rows[i]` of `out` (distinct rows, any order): reads
    /// straight into a host region's blocks.
    fn read_rows(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::out)] out: PyReadwriteArray2<'_, u8>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, String)>> {
        let r = IntArg::<u32>::extract(rows, "rows", None)?.as_slice().iter().map(|&x| x as usize).collect();
        self.read(py, slots, block_hashes, out, r, false)
    }
    /// As `read_rows`, but in the background: queues the reads on the store's reader threads
    /// (file I/O and checksums only: no Python, no GIL) and returns a ticket at once. `out` is
    /// kept alive until `take_reads` returns the ticket; its `rows` must not be read or written
    /// before that.
    fn read_rows_async(
        &self,
        slots: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::out)] mut out: PyReadwriteArray2<'_, u8>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.check_process()?;
        let r: Vec<usize> = IntArg::<u32>::extract(rows, "rows", None)?.as_slice().iter().map(|&x| x as usize).collect();
        let (s, h) = self.check_read(slots, block_hashes, &out, &r, false)?;
        let bpb = self.file.layout().bytes_per_block as usize;
        // The array, with weak references that keep numpy from resizing it (and the array it
        // views) under the read: (out, *pins).
        let mut kept = vec![out.as_any().clone().unbind()];
        kept.extend(pin_arrays(out.as_any())?);
        let owner: Py<PyAny> = pyo3::types::PyTuple::new(out.py(), kept)?.into_any().unbind();
        let base = out
            .as_slice_mut()
            .map_err(|_| type_error(None, "out must be a C-contiguous uint8 array".into()))?
            .as_mut_ptr();
        let targets = (0..s.len())
            // SAFETY: r[i] < the array's rows (checked), so the row lies inside `out`.
            .map(|i| core::disk::reader::ReadTarget { index: i, slot: s[i], hash: h[i], dst: unsafe { base.add(r[i] * bpb) } })
            .collect();
        let starts: Vec<usize> = r.iter().map(|&x| base as usize + x * bpb).collect();
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(i) = held.claim(&starts, bpb) {
            drop(held);
            return Err(overlap_error(&r, i));
        }
        held.reads.insert(ticket, (owner, starts.clone()));
        // SAFETY: the rows are distinct rows of `out` (checked), no other read in flight writes
        // them (claimed), and `held` keeps `out` alive until the ticket is taken; the reader is
        // dropped (finishing its jobs) before `held`.
        if let Err(e) = unsafe { self.reader.submit(ticket, targets) } {
            held.release(&starts);
            let kept = held.reads.remove(&ticket);
            drop(held); // before `kept`: see take_reads
            drop(kept);
            return Err(invalid(None, e));
        }
        Ok(ticket)
    }
    /// Background reads finished since the last call: [(ticket, [(i, why)] of the blocks not
    /// read intact, None)] or (ticket, [], the I/O error that failed the whole read).
    fn take_reads(&self) -> PyResult<Vec<FinishedRead>> {
        self.check_process()?;
        let done = self.reader.take_done();
        if done.is_empty() {
            return Ok(Vec::new());
        }
        let bpb = self.file.layout().bytes_per_block;
        // The arrays kept for the reads are dropped after the lock is let go: dropping the
        // last reference runs Python code (an ndarray subclass's __del__) that may call this
        // store again, which deadlocked on the lock (or, releasing the GIL, another thread's
        // call did).
        let mut owners = Vec::with_capacity(done.len());
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let out = done
            .into_iter()
            .map(|d| {
                let n = match held.reads.remove(&d.ticket) {
                    Some((owner, starts)) => {
                        held.release(&starts);
                        owners.push(owner);
                        starts.len() as u64
                    }
                    None => 0,
                };
                match d.result {
                    Ok(bad) => {
                        let good = n.saturating_sub(bad.len() as u64);
                        self.read_blocks.fetch_add(good, Ordering::Relaxed);
                        self.bytes_read.fetch_add(good * bpb, Ordering::Relaxed);
                        self.corrupt_blocks.fetch_add(bad.len() as u64, Ordering::Relaxed);
                        (d.ticket, bad, None)
                    }
                    Err(e) => (d.ticket, Vec::new(), Some(e)),
                }
            })
            .collect();
        drop(held);
        drop(owners);
        Ok(out)
    }
    /// Waits (the GIL released) until no background read is in flight, at most `timeout_s`
    /// seconds; True when none is.
    fn wait_reads(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = arg::timeout_s)] timeout_s: f64,
    ) -> PyResult<bool> {
        self.check_process()?;
        if !timeout_s.is_finite() || !(0.0..=3600.0).contains(&timeout_s) {
            return Err(invalid(None, format!("timeout_s must be a number of seconds in [0, 3600], got {timeout_s}")));
        }
        Ok(py.detach(|| self.reader.wait_idle(Duration::from_secs_f64(timeout_s))))
    }
    /// Background reads queued or being read.
    #[getter]
    fn reads_in_flight(&self) -> PyResult<usize> {
        self.check_process()?;
        Ok(self.reader.in_flight())
    }
    /// Queues making a slot's record unreadable (a block that left the tier).
    fn invalidate(&self, slot: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check_process()?;
        let s = int::<u32>(slot, "slot", None)?;
        if s as u64 >= self.file.num_slots() {
            return Err(invalid(None, format!("slot {s} is outside the file's {} slots", self.file.num_slots())));
        }
        self.writer.invalidate(s);
        Ok(())
    }
    /// Queues dropping every record (the header stays): after a prefix-cache reset nothing
    /// written before it may be found again, not even after a restart. A wipe that fails takes
    /// the store out of use (`out_of_use`, counted in `wipe_failures`).
    fn wipe(&self) -> PyResult<()> {
        self.check_process()?;
        self.writer.wipe();
        Ok(())
    }
    /// Why the last write that failed on the writer failed (ENOSPC, EROFS, EIO, ...), or None.
    #[getter]
    fn last_write_error(&self) -> Option<String> {
        self.writer.last_error()
    }
    /// Waits until every queued write is on disk.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.check_process()?;
        py.detach(|| self.writer.flush());
        Ok(())
    }
    fn stats(&self) -> PyResult<HashMap<&'static str, u64>> {
        self.check_process()?;
        let w = self.writer.stats();
        Ok(HashMap::from([
            ("queue_depth", w.queued.load(Ordering::Relaxed) as u64),
            ("written_blocks", w.written_blocks.load(Ordering::Relaxed)),
            ("bytes_written", w.bytes_written.load(Ordering::Relaxed)),
            ("dropped_full", w.dropped_full.load(Ordering::Relaxed)),
            ("write_failures", w.failed.load(Ordering::Relaxed)),
            ("wipe_failures", w.wipe_failures.load(Ordering::Relaxed)),
            ("read_blocks", self.read_blocks.load(Ordering::Relaxed)),
            ("bytes_read", self.bytes_read.load(Ordering::Relaxed)),
            ("corrupt_blocks", self.corrupt_blocks.load(Ordering::Relaxed)),
            ("max_seq_at_open", self.max_seq),
        ]))
    }
}

/// (ticket, [(i, why)] of the blocks not read intact, the I/O error of a failed read).
type FinishedRead = (u64, Vec<(usize, String)>, Option<String>);

/// Reader threads per call: the copy out of the page cache (or the device) and the checksum are
/// per block, so blocks are spread over a few threads.
const READ_THREADS: usize = 4;

impl DiskStore {
    /// Refuses use in a process forked from the one that opened the store: its writer and
    /// reader threads are not there, so a write would be queued for nobody and a flush or a
    /// wait would never return.
    fn check_process(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            return Ok(());
        }
        Err(InvalidStateError::new_err(format!(
            "this DiskStore was opened by process {} and cannot be used after fork(): its writer and reader threads are not in this one (open a store here instead)",
            self.pid
        )))
    }

    /// (slots, hashes) of a read of `slots[i]` into row `rows[i]` of `out`, checked.
    fn check_read(
        &self,
        slots: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        out: &PyReadwriteArray2<'_, u8>,
        rows: &[usize],
        exact: bool,
    ) -> PyResult<(Vec<u32>, Vec<u64>)> {
        let s = IntArg::<u32>::extract(slots, "slots", None)?.as_slice().to_vec();
        let h = IntArg::<u64>::extract(block_hashes, "block_hashes", None)?.as_slice().to_vec();
        let bpb = self.file.layout().bytes_per_block as usize;
        let shape = out.shape().to_vec();
        let n_rows = if exact { s.len() } else { shape[0] };
        if s.len() != h.len() || s.len() != rows.len() || shape != [n_rows, bpb] {
            return Err(invalid(
                None,
                format!(
                    "{} slots, {} hashes, {} rows and an output of shape {shape:?} (want [{n_rows}, {bpb}])",
                    s.len(),
                    h.len(),
                    rows.len()
                ),
            ));
        }
        if !out.is_c_contiguous() {
            // (as_slice_mut also takes Fortran order, where rows are not runs of bytes)
            return Err(type_error(None, "out must be a C-contiguous uint8 array".into()));
        }
        let mut seen = vec![false; n_rows];
        for (i, &r) in rows.iter().enumerate() {
            if r >= n_rows || std::mem::replace(&mut seen[r], true) {
                return Err(invalid(None, format!("rows[{i}] = {r}: outside the {n_rows} rows or repeated")));
            }
        }
        for &slot in &s {
            if slot as u64 >= self.file.num_slots() {
                return Err(invalid(None, format!("slot {slot} is outside the file's {} slots", self.file.num_slots())));
            }
        }
        Ok((s, h))
    }

    fn read(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        mut out: PyReadwriteArray2<'_, u8>,
        rows: Vec<usize>,
        exact: bool,
    ) -> PyResult<Vec<(usize, String)>> {
        self.check_process()?;
        let (s, h) = self.check_read(slots, block_hashes, &out, &rows, exact)?;
        let bpb = self.file.layout().bytes_per_block as usize;
        // numpy may not resize the array (or the one it views) while it is read into.
        let pins = pin_arrays(out.as_any())?;
        let dst = out
            .as_slice_mut()
            .map_err(|_| type_error(None, "out must be a C-contiguous uint8 array".into()))?;
        // Claimed for the read (the GIL is released meanwhile): no async read lands in them.
        let starts: Vec<usize> = rows.iter().map(|&x| dst.as_ptr() as usize + x * bpb).collect();
        self.held.lock().unwrap_or_else(|p| p.into_inner()).claim(&starts, bpb).map_err(|i| overlap_error(&rows, i))?;
        let file = &self.file;
        let res = py.detach(|| -> Result<Vec<(usize, String)>, core::DiskError> {
            let mut by_row: Vec<Option<&mut [u8]>> = dst.chunks_mut(bpb.max(1)).map(Some).collect();
            let mut jobs: Vec<(usize, u32, u64, &mut [u8])> = Vec::with_capacity(s.len());
            for (i, &r) in rows.iter().enumerate() {
                jobs.push((i, s[i], h[i], by_row[r].take().expect("rows are distinct")));
            }
            let threads = READ_THREADS
                .min(jobs.len())
                .min(std::thread::available_parallelism().map_or(1, |p| p.get()))
                .max(1);
            let per = jobs.len().div_ceil(threads).max(1);
            let read_part = |part: &mut [(usize, u32, u64, &mut [u8])]| {
                // One preadv per run of consecutive slots; checksums on this thread.
                let idx: Vec<usize> = part.iter().map(|j| j.0).collect();
                let mut items: Vec<(u32, u64, &mut [u8])> = part.iter_mut().map(|j| (j.1, j.2, &mut *j.3)).collect();
                let bad = file.read_many(&mut items, &mut Vec::new())?;
                Ok(bad
                    .into_iter()
                    .map(|(k, why)| (idx[k], core::DiskError::Corrupt { slot: items[k].0, why }.to_string()))
                    .collect())
            };
            let mut bad = Vec::new();
            if threads == 1 {
                bad = read_part(&mut jobs)?;
            } else {
                let parts: Vec<Result<Vec<(usize, String)>, core::DiskError>> = std::thread::scope(|sc| {
                    let handles: Vec<_> = jobs.chunks_mut(per).map(|part| sc.spawn(move || read_part(part))).collect();
                    handles.into_iter().map(|j| j.join().unwrap_or_else(|_| Err(core::DiskError::Invalid("reader thread panicked".into())))).collect()
                });
                for p in parts {
                    bad.extend(p?);
                }
                bad.sort_unstable_by_key(|b| b.0);
            }
            Ok(bad)
        });
        self.held.lock().unwrap_or_else(|p| p.into_inner()).release(&starts);
        drop(pins);
        let bad = res.map_err(disk_error)?;
        let good = (s.len() - bad.len()) as u64;
        self.read_blocks.fetch_add(good, Ordering::Relaxed);
        self.bytes_read.fetch_add(good * bpb as u64, Ordering::Relaxed);
        self.corrupt_blocks.fetch_add(bad.len() as u64, Ordering::Relaxed);
        Ok(bad)
    }
}
