//! Background reads for async disk hits: a few persistent threads that read records straight
//! into caller-owned memory ([`DiskFile::read_many`]: positioned I/O and checksums only), so a
//! read starts and finishes without the caller's thread (nor, in Python, the GIL) taking part.
//! The caller submits a job under a ticket and later collects finished tickets, or waits for
//! all of them with a bound.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::file::DiskFile;

/// One block of a read job: block `index` of the job, from `slot` (which must hold `hash`),
/// into `bytes_per_block` bytes at `dst`.
#[derive(Debug, Clone, Copy)]
pub struct ReadTarget {
    pub index: usize,
    pub slot: u32,
    pub hash: u64,
    pub dst: *mut u8,
}

// SAFETY: `dst` is only written by the one reader thread its chunk goes to; the submitter
// guarantees (see `DiskReader::submit`) that it stays valid and unaliased until collected.
unsafe impl Send for ReadTarget {}

/// A finished job: the blocks that were not read intact `(index, why)`, sorted, or the I/O
/// error that failed the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    pub ticket: u64,
    pub result: Result<Vec<(usize, String)>, String>,
}

struct Job {
    /// The job's slots, until a reader takes its first chunk and hints them all to the kernel.
    hint: Option<Vec<u32>>,
    left: usize,
    bad: Vec<(usize, String)>,
    error: Option<String>,
}

#[derive(Default)]
struct State {
    chunks: VecDeque<(u64, Vec<ReadTarget>)>,
    jobs: FxHashMap<u64, Job>,
    done: Vec<ReadDone>,
    stop: bool,
}

struct Shared {
    file: Arc<DiskFile>,
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Persistent reader threads over one [`DiskFile`].
pub struct DiskReader {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    bytes_per_block: usize,
    /// The process that started the threads (they do not survive `fork`).
    pid: u32,
}

impl DiskReader {
    pub fn new(file: Arc<DiskFile>, threads: usize) -> Self {
        let bytes_per_block = file.layout().bytes_per_block as usize;
        let shared = Arc::new(Shared {
            file,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            finished: Condvar::new(),
        });
        let threads = (0..threads.max(1))
            .filter_map(|i| {
                let sh = shared.clone();
                std::thread::Builder::new()
                    .name(format!("kvslots-disk-read-{i}"))
                    .spawn(move || reader_loop(&sh))
                    .ok()
            })
            .collect();
        DiskReader {
            shared,
            threads,
            bytes_per_block,
            pid: std::process::id(),
        }
    }

    pub fn num_threads(&self) -> usize {
        self.threads.len()
    }

    /// Queues a job of `blocks` under `ticket` (which must not be in flight), split over the
    /// threads in runs of consecutive blocks. Never waits.
    ///
    /// # Safety
    /// Every `dst` must point to `bytes_per_block` writable bytes, no two overlapping, that
    /// nothing else reads or writes and that stay valid until the ticket is returned by
    /// [`DiskReader::take_done`] (dropping the reader first waits for every queued job).
    pub unsafe fn submit(&self, ticket: u64, blocks: Vec<ReadTarget>) -> Result<(), String> {
        if self.threads.is_empty() {
            return Err("no reader thread could be started".into());
        }
        let mut st = self.shared.lock();
        if st.jobs.contains_key(&ticket) || st.done.iter().any(|d| d.ticket == ticket) {
            return Err(format!("read ticket {ticket} is already in flight"));
        }
        if blocks.is_empty() {
            st.done.push(ReadDone {
                ticket,
                result: Ok(Vec::new()),
            });
            drop(st);
            self.shared.finished.notify_all();
            return Ok(());
        }
        let parts = self.threads.len().min(blocks.len());
        let per = blocks.len().div_ceil(parts);
        let chunks: Vec<Vec<ReadTarget>> = blocks.chunks(per).map(|c| c.to_vec()).collect();
        let hint = (chunks.len() > 1).then(|| blocks.iter().map(|b| b.slot).collect());
        st.jobs.insert(
            ticket,
            Job {
                hint,
                left: chunks.len(),
                bad: Vec::new(),
                error: None,
            },
        );
        let n = chunks.len();
        st.chunks.extend(chunks.into_iter().map(|c| (ticket, c)));
        drop(st);
        if n == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
        Ok(())
    }

    /// Jobs finished since the last call.
    pub fn take_done(&self) -> Vec<ReadDone> {
        std::mem::take(&mut self.shared.lock().done)
    }

    /// Jobs queued or being read (not yet finished).
    pub fn in_flight(&self) -> usize {
        self.shared.lock().jobs.len()
    }

    /// Waits until no job is in flight, at most `timeout`; true when none is.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while !st.jobs.is_empty() {
            let now = Instant::now();
            if now >= end {
                return false;
            }
            st = self
                .shared
                .finished
                .wait_timeout(st, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }
}

impl Drop for DiskReader {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: the threads are not there to join, and the lock may have been
            // held by one of them at the fork. Left as they are.
            std::mem::forget(std::mem::take(&mut self.threads));
            return;
        }
        // Queued jobs are read first: their memory is the caller's until they are done.
        self.shared.lock().stop = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn reader_loop(sh: &Shared) {
    let bpb = sh.file.layout().bytes_per_block as usize;
    let mut scratch = Vec::new();
    loop {
        let (ticket, mut part, hint) = {
            let mut st = sh.lock();
            loop {
                if let Some((t, c)) = st.chunks.pop_front() {
                    let hint = st.jobs.get_mut(&t).and_then(|j| j.hint.take());
                    break (t, c, hint);
                }
                if st.stop {
                    return;
                }
                st = sh.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        if let Some(slots) = hint {
            // The job's other chunks wait for a thread (or are being read): their I/O can start.
            sh.file.will_need(&slots);
        }
        let mut items: Vec<(u32, u64, &mut [u8])> = part
            .iter_mut()
            // SAFETY: the submitter's contract (`DiskReader::submit`).
            .map(|t| {
                (t.slot, t.hash, unsafe {
                    std::slice::from_raw_parts_mut(t.dst, bpb)
                })
            })
            .collect();
        let res = sh.file.read_many(&mut items, &mut scratch);
        drop(items);
        let mut st = sh.lock();
        let Some(job) = st.jobs.get_mut(&ticket) else {
            continue;
        };
        match res {
            Ok(bad) => job
                .bad
                .extend(bad.into_iter().map(|(k, why)| (part[k].index, why))),
            Err(e) => job.error = job.error.take().or(Some(e.to_string())),
        }
        job.left -= 1;
        if job.left == 0 {
            let mut job = st.jobs.remove(&ticket).expect("present");
            job.bad.sort_unstable_by_key(|b| b.0);
            let result = match job.error {
                Some(e) => Err(e),
                None => Ok(job.bad),
            };
            st.done.push(ReadDone { ticket, result });
            drop(st);
            sh.finished.notify_all();
        }
    }
}
