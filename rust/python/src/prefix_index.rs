//! `kvslots._core.PrefixIndex`: the indexer's in-memory prefix index, and `lora_key`.
//! Conversions, exceptions and locking only; the index logic is `kvslots_core::index`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use kvslots_core::index::{
    self as ix, holder_tiers, lora_name_key, serves_last, Change, EngineEntryView, IndexConfig,
    LastBlock, Tier, NUM_TIERS,
};
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::apply_stats::ApplyStats;
use crate::convert::{
    self as conv, arg, flag, int, opt_int, opt_text, show, text, tuples, type_name, IntArg,
};
use crate::errors::{busy, index_error, index_invalid, type_error};

pyo3::import_exception!(kvslots.errors, InvalidStateError);

type Match = (String, u32, [u32; NUM_TIERS], f64);
type Entry = (String, u64, u64, [u32; NUM_TIERS], u64);
type PyMatch<'py> = (Bound<'py, PyString>, u32, [u32; NUM_TIERS], f64);

/// In-memory prefix index: which (worker, tier) holds which block. Thread-safe: calls are
/// serialized by an internal lock, and `apply` decodes and applies without the GIL. Every
/// argument is converted before the lock is taken (converting may run Python code that calls
/// back into the index), and a call made while the same thread holds the lock (a finalizer,
/// say) is refused with `ConcurrentUseError` instead of deadlocking.
#[pyclass(module = "kvslots._core", weakref, frozen)]
pub(crate) struct PrefixIndex {
    inner: Mutex<Inner>,
    /// The thread holding `inner` (its `thread_token`), 0 when none.
    owner: AtomicUsize,
    /// The fork generation ([`FORK_GENERATION`]) of the thread that last took `inner`. After
    /// fork() the child has the lock as it was: held by a thread of the parent (applying
    /// events), it is never released there.
    holder_gen: AtomicU64,
}

thread_local!(static TOKEN: u8 = const { 0 });

/// How many fork()s lie between the first process and this one: bumped in each child by
/// [`after_fork_in_child`] (os.register_at_fork), read by every lock (an atomic load, where
/// asking the pid is a system call: ~250 ns on this machine's lookups of ~1.5 us).
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

#[pyfunction]
pub(crate) fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// A nonzero number unique to the calling thread while it lives.
fn thread_token() -> usize {
    TOKEN.with(|t| t as *const u8 as usize)
}

/// The index's lock, held by this thread.
struct Guard<'a> {
    guard: MutexGuard<'a, Inner>,
    owner: &'a AtomicUsize,
}
impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.owner.store(0, Ordering::Release);
    }
}
impl std::ops::Deref for Guard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}
impl std::ops::DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

/// A tier name, as `Tier::parse` reads it (`GPU`, `CPU`, `STORAGE`; any case).
fn tier(name: &str, what: &str) -> PyResult<Tier> {
    Tier::parse(name).ok_or_else(|| {
        index_invalid(format!(
            "{what} = {name:?} is not a tier (GPU, CPU or STORAGE)"
        ))
    })
}

/// The LoRA identity of a lookup: `lora_id`, else the key of `lora_name`.
fn lora(
    lora_id: Option<&Bound<'_, PyAny>>,
    lora_name: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<u64>> {
    let id = opt_int::<u64>(lora_id, "lora_id", None)?;
    let name = opt_text(lora_name, "lora_name")?;
    Ok(id.or_else(|| name.map(lora_name_key)))
}

/// A block size argument: at least 1.
fn block_size_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let b = conv::count(obj, "block_size", None)?;
    if b == 0 {
        return Err(index_invalid("block_size must be >= 1, got 0".into()));
    }
    Ok(b)
}

/// Token ids: a list is read in place (exact ints without any Python call, the common case
/// of a JSON body), anything else through the generic conversion.
fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        let mut j = 0;
        // An item's __index__ or a signal handler (run by next_item's check) may change the
        // list: its length is re-read each item, growth bounded as every integer sequence is.
        while j < list.len() {
            conv::next_item(obj.py(), j, "token_ids", None)?;
            if let Some(v) = conv::list_small_int(&list, j).and_then(|v| u32::try_from(v).ok()) {
                out.push(v);
                j += 1;
                continue;
            }
            if j >= list.len() {
                break; // a signal handler cut the list short
            }
            let item = list.get_item(j)?;
            let v = match item.cast::<pyo3::types::PyInt>() {
                Ok(i) if !item.is_instance_of::<pyo3::types::PyBool>() => {
                    i.extract::<u32>().map_err(|_| {
                        index_invalid(format!(
                            "token_ids[{j}] = {} is out of range for a token id [0, 2**32)",
                            show(&item)
                        ))
                    })?
                }
                _ => int::<u32>(&item, &format!("token_ids[{j}]"), None)?,
            };
            out.push(v);
            j += 1;
        }
        return Ok(out);
    }
    IntArg::<u32>::extract(obj, "token_ids", None).map(|a| a.0)
}

struct Inner {
    ix: ix::PrefixIndex,
    /// Worker names as Python strings, by worker id: lookups return them without allocating.
    names: Vec<Option<Py<PyString>>>,
}

impl std::ops::Deref for Inner {
    type Target = ix::PrefixIndex;
    fn deref(&self) -> &ix::PrefixIndex {
        &self.ix
    }
}
impl std::ops::DerefMut for Inner {
    fn deref_mut(&mut self) -> &mut ix::PrefixIndex {
        &mut self.ix
    }
}

impl PrefixIndex {
    /// Takes the lock; waits without the GIL so a thread applying events (GIL released, lock
    /// held) can always finish. A thread that already holds it gets `ConcurrentUseError`.
    fn lock<'a>(&'a self, py: Python<'_>) -> PyResult<Guard<'a>> {
        let me = thread_token();
        if self.owner.load(Ordering::Acquire) == me {
            return Err(busy("PrefixIndex"));
        }
        let gen = FORK_GENERATION.load(Ordering::Acquire);
        if self.holder_gen.load(Ordering::Acquire) != gen {
            if let Some(g) = self.lock_in_new_process(py, gen)? {
                return Ok(self.held(g, me, gen));
            }
        }
        // Poisoning needs a panic inside the index, which does not happen on any input; should
        // one happen, keep serving rather than fail every later call.
        let guard = self
            .inner
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner());
        Ok(self.held(guard, me, gen))
    }

    fn held<'a>(&'a self, guard: MutexGuard<'a, Inner>, me: usize, gen: u64) -> Guard<'a> {
        self.owner.store(me, Ordering::Release);
        if self.holder_gen.load(Ordering::Relaxed) != gen {
            self.holder_gen.store(gen, Ordering::Release);
        }
        Guard {
            guard,
            owner: &self.owner,
        }
    }

    /// The first lock in a forked child: the lock if free; `None` when a thread of this process
    /// holds it (wait as usual); an error when a thread of the parent held it at fork() (the
    /// child's call waited for ever). A thread of this process stores its generation right
    /// after it takes the lock: that is waited for (50 ms at most, without the GIL).
    fn lock_in_new_process<'a>(
        &'a self,
        py: Python<'_>,
        gen: u64,
    ) -> PyResult<Option<MutexGuard<'a, Inner>>> {
        let deadline = Instant::now() + Duration::from_millis(50);
        loop {
            match self.inner.try_lock() {
                Ok(g) => return Ok(Some(g)),
                Err(TryLockError::Poisoned(p)) => return Ok(Some(p.into_inner())),
                Err(TryLockError::WouldBlock) => {}
            }
            if self.holder_gen.load(Ordering::Acquire) == gen {
                return Ok(None);
            }
            if Instant::now() >= deadline {
                return Err(InvalidStateError::new_err(format!(
                    "this PrefixIndex was locked by another thread when this process ({}) was forked: \
                     that thread is not here to release it; make a new index here",
                    std::process::id()
                )));
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(1)));
        }
    }

    fn matches<'py>(py: Python<'py>, inner: &Inner, res: &[ix::WorkerMatch]) -> Vec<PyMatch<'py>> {
        res.iter()
            .map(|m| {
                let name = match inner.names.get(m.worker as usize) {
                    Some(Some(n)) => n.bind(py).clone(),
                    _ => PyString::new(py, inner.worker_name(m.worker).unwrap_or("?")),
                };
                (name, m.blocks, m.tier_blocks, m.score)
            })
            .collect()
    }
}

#[pymethods]
impl PrefixIndex {
    /// Refuses `pickle`, `copy.copy` and `copy.deepcopy`: see `errors::refuse_copy`.
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        crate::errors::refuse_copy(
            slf,
            "it owns a lock and the index behind it; share the one object (it is thread-safe)",
        )
    }

    #[new]
    #[pyo3(signature = (*, capacity=None, tier_weights=None, hash_seed=0, journal=false))]
    fn new(
        capacity: Option<&Bound<'_, PyAny>>,
        tier_weights: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = arg::hash_seed)] hash_seed: u64,
        #[pyo3(from_py_with = arg::journal)] journal: bool,
    ) -> PyResult<Self> {
        let mut cfg = IndexConfig {
            hash_seed,
            journal,
            ..Default::default()
        };
        if let Some(c) = opt_int::<usize>(capacity, "capacity", None)? {
            if c == 0 {
                return Err(index_invalid("capacity must be >= 1, got 0".into()));
            }
            cfg.capacity = Some(c);
        }
        if let Some(w) = tier_weights.filter(|w| !w.is_none()) {
            let d = w.cast::<PyDict>().map_err(|_| {
                type_error(
                    None,
                    format!(
                        "tier_weights must be a dict of tier name to weight, got {} {}",
                        type_name(w),
                        show(w)
                    ),
                )
            })?;
            for (k, v) in conv::dict_items(d) {
                let name = text(&k, "tier_weights key")?;
                let what = format!("tier_weights[{name:?}]");
                let t = tier(name, "tier_weights key")?;
                let weight = conv::float_arg(&v, &what)?;
                if !(weight >= 0.0 && weight.is_finite()) {
                    return Err(index_invalid(format!(
                        "{what} must be a finite weight >= 0, got {weight}"
                    )));
                }
                cfg.tier_weights[t as usize] = weight;
            }
        }
        Ok(PrefixIndex {
            inner: Mutex::new(Inner {
                ix: ix::PrefixIndex::new(cfg).map_err(index_error)?,
                names: Vec::new(),
            }),
            owner: AtomicUsize::new(0),
            holder_gen: AtomicU64::new(FORK_GENERATION.load(Ordering::Acquire)),
        })
    }

    fn add_worker(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<()> {
        let name = text(name, "name")?;
        let mut g = self.lock(py)?;
        let id = g.add_worker(name).map_err(index_error)? as usize;
        if g.names.len() <= id {
            g.names.resize_with(id + 1, || None);
        }
        g.names[id] = Some(PyString::new(py, name).unbind());
        Ok(())
    }

    /// Forgets the worker and its entries; returns how many entries were dropped.
    fn remove_worker(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<usize> {
        let name = text(name, "name")?;
        let mut g = self.lock(py)?;
        let id = g.worker_id(name).map_err(index_error)? as usize;
        let n = g.remove_worker(name).map_err(index_error)?;
        if let Some(slot) = g.names.get_mut(id) {
            *slot = None;
        }
        Ok(n)
    }

    /// Marks the worker as running an EAGLE-family drafter (or not): its lookups then count the
    /// last block of a prefix only when its engine would serve it from cache.
    fn set_worker_eagle(
        &self,
        py: Python<'_>,
        name: &Bound<'_, PyAny>,
        eagle: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let name = text(name, "name")?;
        let eagle = flag(eagle, "eagle", None)?;
        self.lock(py)?
            .set_worker_eagle(name, eagle)
            .map_err(index_error)
    }

    fn worker_eagle(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        let name = text(name, "name")?;
        self.lock(py)?.worker_eagle(name).map_err(index_error)
    }

    /// Drops the worker's entries (publisher restart, unrecoverable gap); keeps the worker.
    fn clear_worker(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<usize> {
        let name = text(name, "name")?;
        self.lock(py)?.clear_worker(name).map_err(index_error)
    }

    fn workers(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        Ok(self.lock(py)?.worker_names().map(str::to_owned).collect())
    }

    fn worker_len(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<usize> {
        let name = text(name, "name")?;
        self.lock(py)?.worker_len(name).map_err(index_error)
    }

    /// Decodes one raw msgpack `KVEventBatch` payload and applies it for `worker`. Events
    /// without a medium count for `default_tier`. Returns counters; raises `EventDecodeError`
    /// (and applies nothing) when the payload is not an event batch.
    #[pyo3(signature = (worker, payload, default_tier="GPU".to_owned()),
           text_signature = "(self, worker, payload, default_tier='GPU')")]
    fn apply(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = arg::default_tier)] default_tier: String,
    ) -> PyResult<ApplyStats> {
        let worker = text(worker, "worker")?;
        let payload = conv::payload(payload, "payload")?;
        let t = tier(&default_tier, "default_tier")?;
        let mut g = self.lock(py)?;
        let id = g.worker_id(worker).map_err(index_error)?;
        let g = &mut *g;
        let bytes = payload.as_slice();
        let st = py
            .detach(|| g.apply_payload(id, bytes, t))
            .map_err(index_error)?;
        Ok(st.into())
    }

    /// Per worker holding the prompt's first block:
    /// `(worker, blocks, (gpu_blocks, cpu_blocks, storage_blocks), score)`. The tokens are
    /// converted (and checked) in full first, so a refused lookup changes no counter and no
    /// recency.
    #[pyo3(signature = (token_ids, block_size, lora_id=None, lora_name=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: &Bound<'py, PyAny>,
        lora_id: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<PyMatch<'py>>> {
        let tokens = self::token_ids(token_ids)?;
        let bs = block_size_arg(block_size)?;
        let lora = lora(lora_id, lora_name)?;
        let mut g = self.lock(py)?;
        let res = g.lookup(&tokens, bs, lora).map_err(index_error)?.to_vec();
        Ok(Self::matches(py, &g, &res))
    }

    /// The index keys of every full block of the prompt (the Redis backend looks them up).
    #[pyo3(signature = (token_ids, block_size, lora_id=None, lora_name=None))]
    fn chain_keys(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u64>> {
        let tokens = self::token_ids(token_ids)?;
        let bs = block_size_arg(block_size)?;
        let lora = lora(lora_id, lora_name)?;
        self.lock(py)?
            .chain_keys(&tokens, bs, lora)
            .map_err(index_error)
    }

    /// Scores prompt blocks whose holders were fetched elsewhere: `blocks[i]` maps worker name
    /// to holder value (as `take_changes` gives it: bits 0-2 the tiers GPU, CPU, STORAGE, the
    /// rest what the EAGLE last-block rule needs). Same result shape as `lookup`. With `eagle`
    /// (worker names), those workers' last blocks count only when their engine would serve them
    /// for `token_ids` (block size `block_size`), as `lookup` decides.
    #[pyo3(signature = (blocks, token_ids=None, block_size=None, eagle=None))]
    fn score_blocks(
        &self,
        py: Python<'_>,
        blocks: &Bound<'_, PyAny>,
        token_ids: Option<&Bound<'_, PyAny>>,
        block_size: Option<&Bound<'_, PyAny>>,
        eagle: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Match>> {
        let eagle: Vec<String> = match eagle {
            None => Vec::new(),
            Some(e) => {
                let bad = || {
                    type_error(
                        None,
                        format!(
                            "eagle must be a list of worker names, got {} {}",
                            type_name(e),
                            show(e)
                        ),
                    )
                };
                if e.is_instance_of::<PyString>() {
                    return Err(bad());
                }
                let mut out = Vec::new();
                for (i, n) in e.try_iter().map_err(|_| bad())?.enumerate() {
                    crate::convert::next_item(e.py(), i, "eagle", None)?;
                    // An iterator that raises: a kvslots error, its exception the cause.
                    let n = n.map_err(|err| crate::errors::reading_error(e.py(), err, "eagle"))?;
                    out.push(text(&n, &format!("eagle[{i}]"))?.to_owned());
                }
                out
            }
        };
        let rule = if eagle.is_empty() {
            None
        } else {
            let (Some(t), Some(b)) = (token_ids, block_size) else {
                return Err(index_invalid(
                    "score_blocks with eagle workers needs token_ids and block_size".into(),
                ));
            };
            Some((self::token_ids(t)?, block_size_arg(b)?))
        };
        let not_list = || {
            type_error(
                None,
                format!(
                    "blocks must be a list of dicts (worker name -> tier mask), got {} {}",
                    type_name(blocks),
                    show(blocks)
                ),
            )
        };
        let list = blocks.cast::<PyList>().map_err(|_| not_list())?;
        // Convert everything first: the dicts' keys and values may run Python code.
        let mut names: Vec<String> = Vec::new();
        let mut ids = std::collections::HashMap::<String, u32>::new();
        let mut converted: Vec<Vec<(u32, u64)>> = Vec::with_capacity(list.len());
        for (i, block) in list.iter().enumerate() {
            let d = block.cast::<PyDict>().map_err(|_| {
                type_error(
                    None,
                    format!(
                        "blocks[{i}] must be a dict, got {} {}",
                        type_name(&block),
                        show(&block)
                    ),
                )
            })?;
            let mut holders = Vec::with_capacity(d.len());
            for (k, v) in conv::dict_items(d) {
                let name = text(&k, &format!("blocks[{i}] key"))?.to_owned();
                let value: u64 = int::<u64>(&v, &format!("blocks[{i}][{name:?}]"), None)?;
                let next = names.len() as u32;
                let id = *ids.entry(name.clone()).or_insert_with(|| {
                    names.push(name);
                    next
                });
                holders.push((id, value));
            }
            converted.push(holders);
        }
        let weights = self.lock(py)?.config().tier_weights;
        let mut scorer = ix::Scorer::new(weights);
        for holders in &converted {
            if !scorer.block(holders.iter().map(|&(w, v)| (w, holder_tiers(v)))) {
                break;
            }
        }
        if let Some((tokens, bs)) = rule {
            let eagle_ids: Vec<u32> = eagle.iter().filter_map(|n| ids.get(n).copied()).collect();
            scorer.drop_unserved_last(|w, i| {
                if !eagle_ids.contains(&w) {
                    return true;
                }
                let next = tokens.get((i as usize + 1) * bs).copied();
                converted[i as usize]
                    .iter()
                    .any(|&(h, v)| h == w && serves_last(v, next))
            });
        }
        Ok(scorer
            .results()
            .iter()
            .map(|m| {
                (
                    names[m.worker as usize].clone(),
                    m.blocks,
                    m.tier_blocks,
                    m.score,
                )
            })
            .collect())
    }

    /// Entries changed since the last call: `(engine_changes, holder_changes)` with
    /// `engine_changes = [(worker, engine_hash, key | None, (g_gpu, g_cpu, g_storage), last)]` and
    /// `holder_changes = [(key, worker, holder_value)]` (0 = gone; bits 0-2 the tier mask, the
    /// rest the EAGLE last-block facts, for `score_blocks`). Needs `journal=True`.
    fn take_changes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let changes = self.lock(py)?.take_changes();
        let engines = PyList::empty(py);
        let holders = PyList::empty(py);
        for c in changes {
            match c {
                Change::Engine {
                    worker,
                    engine,
                    entry,
                } => {
                    let (key, groups, last) = match entry {
                        Some(e) => (Some(e.key), e.groups, e.last.bits()),
                        None => (None, [0; NUM_TIERS], 0),
                    };
                    engines.append((worker, engine, key, groups, last))?;
                }
                Change::Holder { key, worker, value } => holders.append((key, worker, value))?,
            }
        }
        PyTuple::new(py, [engines.into_any(), holders.into_any()])
    }

    /// Every entry: `[(worker, engine_hash, key, (g_gpu, g_cpu, g_storage), last)]` (`last`:
    /// the EAGLE last-block facts, 0 when none).
    fn dump(&self, py: Python<'_>) -> PyResult<Vec<Entry>> {
        let d = self.lock(py)?.dump();
        Ok(d.into_iter()
            .map(|(w, e, v)| (w, e, v.key, v.groups, v.last.bits()))
            .collect())
    }

    /// Every (key, worker) holding: `[(key, worker, holder_value)]`, as `take_changes` reports
    /// them (for rewriting a shared store).
    fn dump_holders(&self, py: Python<'_>) -> PyResult<Vec<(u64, String, u64)>> {
        Ok(self.lock(py)?.dump_holders())
    }

    /// Restores entries of one worker, as `dump` gives them: `[(engine_hash, key, groups, last)]`.
    fn load(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        entries: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let worker = text(worker, "worker")?;
        let entries = tuples(entries, "entries", 4, |f, name| {
            let engine = int::<u64>(&f[0], &format!("{name}[0] (engine hash)"), None)?;
            let key = int::<u64>(&f[1], &format!("{name}[1] (key)"), None)?;
            let last = int::<u64>(&f[3], &format!("{name}[3] (last)"), None)?;
            let groups = IntArg::<u32>::extract(&f[2], &format!("{name}[2] (groups)"), None)?.0;
            let groups: [u32; NUM_TIERS] = groups.try_into().map_err(|g: Vec<u32>| {
                index_invalid(format!(
                    "{name}[2] (groups) must have {NUM_TIERS} counts, got {}",
                    g.len()
                ))
            })?;
            Ok((engine, key, groups, LastBlock::from_bits(last)))
        })?;
        let mut g = self.lock(py)?;
        let id = g.worker_id(worker).map_err(index_error)?;
        for (engine, key, groups, last) in entries {
            g.load_entry(id, engine, EngineEntryView { key, groups, last });
        }
        Ok(())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, cap) = {
            let g = self.lock(py)?;
            (g.stats(), g.config().capacity)
        };
        let d = PyDict::new(py);
        d.set_item("keys", s.keys)?;
        d.set_item("entries", s.entries)?;
        d.set_item("workers", s.workers)?;
        d.set_item("capacity", cap)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("events", s.totals.events)?;
        d.set_item("stored_blocks", s.totals.stored_blocks)?;
        d.set_item("removed_blocks", s.totals.removed_blocks)?;
        d.set_item("orphan_blocks", s.totals.orphan_blocks)?;
        d.set_item("unresolved_blocks", s.totals.unresolved_blocks)?;
        d.set_item("invalid_events", s.totals.invalid_events)?;
        d.set_item("unknown_events", s.totals.unknown_events)?;
        d.set_item("lookups", s.totals.lookups)?;
        d.set_item("lookup_blocks", s.totals.lookup_blocks)?;
        Ok(d)
    }

    #[getter]
    fn tier_weights(&self, py: Python<'_>) -> PyResult<Vec<(&'static str, f64)>> {
        let w = self.lock(py)?.config().tier_weights;
        Ok(Tier::ALL
            .iter()
            .map(|t| (t.name(), w[*t as usize]))
            .collect())
    }

    #[getter]
    fn capacity(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.lock(py)?.config().capacity)
    }

    /// None when every internal link holds, else the first broken one (tests call it).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self.lock(py)?.check_invariants().err())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.len())
    }
}

/// The LoRA key a lookup uses for a LoRA given by name only.
#[pyfunction]
pub(crate) fn lora_key(name: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(lora_name_key(text(name, "name")?))
}
