//! The disk tier's storage: one preallocated file of fixed-size block records, positioned I/O
//! (`pread` / `pwrite`), and a background writer with a bounded queue.
//!
//! Layout. A [`HEADER_LEN`]-byte file header (magic, format version, model fingerprint, KV
//! layout: block size, layers, bytes per block, dtype; number of slots; its own checksum), then
//! `num_slots` records of `stride` bytes (a multiple of 4096). A record is a header (magic, write
//! sequence, hash, parent, LoRA id, successor, the block's tokens, the xxh3 of the data and the
//! xxh3 of the header) followed by the block's bytes. A record is written with one `pwrite`;
//! one torn by a crash fails its checksums and is discarded when scanned or read, so a `kill -9`
//! loses only the records being written.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

use super::BlockMeta;

/// The XXH3-64 of a block's bytes: the same value as `xxh3_64` (so files written before stay
/// readable), computed with AVX2 where the CPU has it, chosen at run time. A read checksums every
/// byte it copied, and with SSE2 the hash ran at about half the speed of the copy.
fn data_sum(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

/// `pwritev` of `parts` at `offset`, continued after short writes and EINTR.
fn write_all_vectored_at(file: &File, parts: &[&[u8]], mut offset: u64) -> io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    while !parts.is_empty() {
        let iov: Vec<libc::iovec> = parts
            .iter()
            .map(|p| libc::iovec { iov_base: p.as_ptr() as *mut libc::c_void, iov_len: p.len() })
            .collect();
        let off = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: every iovec points into a slice borrowed for the whole call.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int, off) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        let mut n = n as usize;
        offset += n as u64;
        while n > 0 {
            if n >= parts[0].len() {
                n -= parts[0].len();
                parts.remove(0);
            } else {
                parts[0] = &parts[0][n..];
                n = 0;
            }
        }
    }
    Ok(())
}

pub const MAGIC: &[u8; 8] = b"KVSLDSK\0";
/// 2: record header checksums seeded with the layout (version 1 files are started afresh).
pub const FORMAT_VERSION: u32 = 2;
pub const HEADER_LEN: u64 = 4096;
const RECORD_MAGIC: u32 = 0x5253_564b; // "KVSR"
const RECORD_FIXED: usize = 64;
/// Tokens a record can hold (block sizes above this are refused).
pub const MAX_BLOCK_TOKENS: usize = 1 << 16;
const DTYPE_LEN: usize = 32;
const FLAG_PARENT: u32 = 1;
const FLAG_LORA: u32 = 2;
/// Records per `preadv` (3 iovecs each, under Linux's IOV_MAX of 1024).
const MAX_RUN: usize = 256;
/// Write sequence numbers are below this: a record numbered at or above it is damaged (forged,
/// or not this tier's), and the writer writes no record past it. A writer that started at 0
/// and wrote a million records a second would get there in about 290,000 years.
pub const SEQ_LIMIT: u64 = 1 << 63;
/// A file whose records are numbered at or above this is started afresh by
/// [`DiskFile::open_for_writer`]: the writer then has at least 2^62 numbers ahead of it, never
/// wraps, and every record it writes is newer than those already in the file.
pub const SEQ_RESTART: u64 = 1 << 62;

/// What the file belongs to: a record is served only to an engine with the same layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// A hash of the model and everything else that changes the KV bytes (the caller's).
    pub fingerprint: u64,
    pub block_size: u32,
    pub num_layers: u32,
    pub bytes_per_block: u64,
    pub dtype: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk tier I/O error on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("disk tier: {0}")]
    Invalid(String),
    #[error("disk record {slot} is corrupt: {why}")]
    Corrupt { slot: u32, why: String },
    #[error("disk tier file {0} is in use by another engine (each needs a disk_path of its own)")]
    InUse(PathBuf),
}

/// How [`DiskFile::open`] found the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    Created,
    /// The header matched: its records may be served.
    Reused,
    /// A file was there but did not match (the reason); it was started afresh.
    Discarded(String),
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

impl Layout {
    pub fn check(&self) -> Result<(), DiskError> {
        if self.block_size == 0 || self.block_size as usize > MAX_BLOCK_TOKENS {
            return Err(DiskError::Invalid(format!(
                "block_size must be in [1, {MAX_BLOCK_TOKENS}], got {}",
                self.block_size
            )));
        }
        if self.bytes_per_block == 0 || self.bytes_per_block > (1 << 40) {
            return Err(DiskError::Invalid(format!(
                "bytes_per_block must be in [1, 2^40], got {}",
                self.bytes_per_block
            )));
        }
        if self.dtype.len() > DTYPE_LEN {
            return Err(DiskError::Invalid(format!(
                "dtype name longer than {DTYPE_LEN} bytes: {:?}",
                self.dtype
            )));
        }
        Ok(())
    }
    /// The length of a file of `num_slots` records. A file of another length is not this
    /// layout's (cut short, or grown): the worker starts it afresh, the restore skips it.
    pub fn file_len(&self, num_slots: u64) -> Result<u64, DiskError> {
        num_slots
            .checked_mul(self.stride())
            .and_then(|b| b.checked_add(HEADER_LEN))
            .filter(|&b| b < (1u64 << 62))
            .ok_or_else(|| DiskError::Invalid(format!("{num_slots} slots do not fit in a file")))
    }
    /// Bytes of a record header (fixed part and tokens), a multiple of 64.
    pub fn record_header_len(&self) -> u64 {
        round_up(RECORD_FIXED as u64 + 4 * self.block_size as u64, 64)
    }
    /// Bytes between record starts.
    pub fn stride(&self) -> u64 {
        round_up(self.record_header_len() + self.bytes_per_block, 4096)
    }

    /// The seed of every record header's checksum: the layout's identity (model fingerprint,
    /// block size, layers, bytes per block, dtype), so that only a file of this very layout
    /// can hold a record that verifies. The file header alone is not enough: a record of
    /// another model can land under this header (two engines pointed at one path, a record
    /// copied from another file) and would pass a checksum over its own bytes only.
    pub fn record_seed(&self) -> u64 {
        let mut b = [0u8; 24 + DTYPE_LEN];
        b[0..4].copy_from_slice(&self.block_size.to_le_bytes());
        b[4..8].copy_from_slice(&self.num_layers.to_le_bytes());
        b[8..16].copy_from_slice(&self.bytes_per_block.to_le_bytes());
        b[16..24].copy_from_slice(&self.fingerprint.to_le_bytes());
        let n = self.dtype.len().min(DTYPE_LEN);
        b[24..24 + n].copy_from_slice(&self.dtype.as_bytes()[..n]);
        xxh3_64(&b)
    }

    fn header(&self, num_slots: u64) -> Vec<u8> {
        let mut h = vec![0u8; HEADER_LEN as usize];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        h[16..20].copy_from_slice(&self.num_layers.to_le_bytes());
        h[24..32].copy_from_slice(&self.bytes_per_block.to_le_bytes());
        h[32..40].copy_from_slice(&self.fingerprint.to_le_bytes());
        h[40..48].copy_from_slice(&num_slots.to_le_bytes());
        h[48..48 + self.dtype.len()].copy_from_slice(self.dtype.as_bytes());
        let sum = xxh3_64(&h[..80]);
        h[80..88].copy_from_slice(&sum.to_le_bytes());
        h
    }

    /// Why `h` (a file header) does not belong to this layout and slot count, if it does not.
    fn mismatch(&self, num_slots: u64, h: &[u8]) -> Option<String> {
        if h.len() < 88 || &h[0..8] != MAGIC {
            return Some("not a kvslots disk tier file (bad magic)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
        if u64_at(80) != xxh3_64(&h[..80]) {
            return Some("header checksum mismatch (torn or corrupt header)".into());
        }
        if u32_at(8) != FORMAT_VERSION {
            return Some(format!(
                "format version {} (this build writes {FORMAT_VERSION})",
                u32_at(8)
            ));
        }
        let want = self.header(num_slots);
        let fields: [(&str, usize, usize); 6] = [
            ("block size", 12, 16),
            ("number of layers", 16, 20),
            ("bytes per block", 24, 32),
            ("model fingerprint", 32, 40),
            ("number of slots", 40, 48),
            ("dtype", 48, 80),
        ];
        for (name, a, b) in fields {
            if h[a..b] != want[a..b] {
                return Some(format!("{name} differs from this engine's"));
            }
        }
        None
    }
}

/// One record's header, as read back.
fn encode_record_header(layout: &Layout, seq: u64, meta: &BlockMeta, data: &[u8], out: &mut [u8]) {
    let mut flags = 0;
    if meta.parent.is_some() {
        flags |= FLAG_PARENT;
    }
    if meta.lora.is_some() {
        flags |= FLAG_LORA;
    }
    out.fill(0);
    out[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&flags.to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..24].copy_from_slice(&meta.hash.to_le_bytes());
    out[24..32].copy_from_slice(&meta.parent.unwrap_or(0).to_le_bytes());
    out[32..40].copy_from_slice(&meta.lora.unwrap_or(0).to_le_bytes());
    out[40..44].copy_from_slice(&meta.successor.to_le_bytes());
    out[44..48].copy_from_slice(&(meta.tokens.len() as u32).to_le_bytes());
    out[48..56].copy_from_slice(&data_sum(data).to_le_bytes());
    let tok_end = RECORD_FIXED + 4 * meta.tokens.len();
    for (i, t) in meta.tokens.iter().enumerate() {
        out[RECORD_FIXED + 4 * i..RECORD_FIXED + 4 * i + 4].copy_from_slice(&t.to_le_bytes());
    }
    let sum = header_sum(out, tok_end, layout.record_seed());
    out[56..64].copy_from_slice(&sum.to_le_bytes());
}

fn header_sum(h: &[u8], tok_end: usize, seed: u64) -> u64 {
    let mut buf = Vec::with_capacity(tok_end);
    buf.extend_from_slice(&h[..56]);
    buf.extend_from_slice(&h[RECORD_FIXED..tok_end]);
    xxhash_rust::xxh3::xxh3_64_with_seed(&buf, seed)
}

/// (meta, seq, data checksum) of a record header, or why it is not a valid one.
fn decode_record_header(layout: &Layout, h: &[u8]) -> Result<(BlockMeta, u64, u64), String> {
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
    if u32_at(0) != RECORD_MAGIC {
        return Err("no record".into());
    }
    let n = u32_at(44) as usize;
    if n != layout.block_size as usize {
        return Err(format!("{n} tokens in a record of block size {}", layout.block_size));
    }
    let tok_end = RECORD_FIXED + 4 * n;
    if u64_at(56) != header_sum(h, tok_end, layout.record_seed()) {
        return Err("record header checksum mismatch".into());
    }
    let seq = u64_at(8);
    if seq >= SEQ_LIMIT {
        // Checked after the checksum: only a record that verifies can carry one.
        return Err(format!("record sequence number {seq} is past any this tier writes"));
    }
    let flags = u32_at(4);
    let tokens = (0..n).map(|i| u32_at(RECORD_FIXED + 4 * i)).collect();
    let meta = BlockMeta {
        hash: u64_at(16),
        parent: (flags & FLAG_PARENT != 0).then(|| u64_at(24)),
        lora: (flags & FLAG_LORA != 0).then(|| u64_at(32)),
        successor: u32_at(40),
        tokens,
    };
    Ok((meta, seq, u64_at(48)))
}

/// The tier's file is a regular file: a FIFO, device or directory at its path is refused before
/// anything is read from it, cut back or written to it.
fn check_regular(file: &File) -> io::Result<()> {
    if file.metadata()?.is_file() {
        Ok(())
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"))
    }
}

/// The tier's file: fixed-size records at known offsets.
#[derive(Debug)]
pub struct DiskFile {
    file: File,
    path: PathBuf,
    layout: Layout,
    num_slots: u64,
    /// Set once a wipe failed (see [`DiskFile::out_of_use`]).
    out_of_use: OnceLock<String>,
}

impl DiskFile {
    fn io(&self, e: io::Error) -> DiskError {
        DiskError::Io {
            path: self.path.clone(),
            source: e,
        }
    }

    /// Opens the tier's file for reading and writing: reused when its header matches `layout`
    /// and `num_slots`, otherwise (missing, torn, other model or layout) started afresh. The
    /// file is sized once to hold every slot.
    pub fn open(path: &Path, layout: &Layout, num_slots: u64) -> Result<(DiskFile, Opened), DiskError> {
        layout.check()?;
        let io_err = |e| DiskError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let total = layout.file_len(num_slots)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err)?;
        check_regular(&file).map_err(io_err)?;
        // One engine per file, locked before anything is looked at: a second engine would cut
        // the file back (another layout) or write over the records of the first (the same)
        // while it serves them. flock, not fcntl locks: those are per process and dropped when
        // any descriptor of the file in the process is closed. The lock goes with the
        // descriptor (dropped, or closed by the kernel after a kill -9). A filesystem without
        // locks (ENOLCK, EOPNOTSUPP) is used unlocked.
        {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain system call on a descriptor we own.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0
                && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
            {
                return Err(DiskError::InUse(path.to_path_buf()));
            }
        }
        let len = file.metadata().map_err(io_err)?.len();
        let mut opened = Opened::Created;
        if len > 0 {
            let mut h = vec![0u8; HEADER_LEN.min(len) as usize];
            file.read_exact_at(&mut h, 0).map_err(io_err)?;
            match layout.mismatch(num_slots, &h) {
                None if len == total => opened = Opened::Reused,
                None => opened = Opened::Discarded(format!("file is {len} bytes, expected {total}")),
                Some(why) => opened = Opened::Discarded(why),
            }
        }
        if opened != Opened::Reused {
            // Start afresh: no record of another layout can survive.
            file.set_len(0).map_err(io_err)?;
            file.set_len(total).map_err(io_err)?;
            file.write_all_at(&layout.header(num_slots), 0).map_err(io_err)?;
            file.sync_all().map_err(io_err)?;
        }
        Ok((
            DiskFile {
                file,
                path: path.to_path_buf(),
                layout: layout.clone(),
                num_slots,
                out_of_use: OnceLock::new(),
            },
            opened,
        ))
    }

    /// [`DiskFile::open`] for the tier's writer, and the highest sequence number of a record in
    /// the file (0 if none): the writer starts above it. A file numbered at or above
    /// [`SEQ_RESTART`] (forged: no writer gets there) is started afresh (`Discarded`).
    pub fn open_for_writer(path: &Path, layout: &Layout, num_slots: u64) -> Result<(DiskFile, Opened, u64), DiskError> {
        let (f, mut opened) = DiskFile::open(path, layout, num_slots)?;
        let max_seq = f.scan()?.0.iter().map(|r| r.2).max().unwrap_or(0);
        if max_seq < SEQ_RESTART {
            return Ok((f, opened, max_seq));
        }
        f.wipe()?;
        if opened == Opened::Reused {
            opened = Opened::Discarded(format!("a record's sequence number ({max_seq}) is past any this tier writes"));
        }
        Ok((f, opened, 0))
    }

    /// Opens an existing file read-only, only if its header and length match; else why not.
    pub fn open_existing(path: &Path, layout: &Layout, num_slots: u64) -> Result<DiskFile, String> {
        layout.check().map_err(|e| e.to_string())?;
        // O_NONBLOCK: opening a FIFO to read waits for a writer (forever, for a stray one).
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
        }
        .and_then(|f| check_regular(&f).map(|()| f))
        .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut h = vec![0u8; HEADER_LEN as usize];
        file.read_exact_at(&mut h, 0)
            .map_err(|e| format!("{}: header: {e}", path.display()))?;
        if let Some(why) = layout.mismatch(num_slots, &h) {
            return Err(why);
        }
        let total = layout.file_len(num_slots).map_err(|e| e.to_string())?;
        let len = file
            .metadata()
            .map_err(|e| format!("{}: {e}", path.display()))?
            .len();
        if len != total {
            return Err(format!("file is {len} bytes, expected {total}"));
        }
        Ok(DiskFile {
            file,
            path: path.to_path_buf(),
            layout: layout.clone(),
            num_slots,
            out_of_use: OnceLock::new(),
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn num_slots(&self) -> u64 {
        self.num_slots
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Why the file is out of use, if it is: a wipe failed, so records from before a
    /// prefix-cache reset may still be in it. Nothing is read from it or written to it again.
    pub fn out_of_use(&self) -> Option<&str> {
        self.out_of_use.get().map(String::as_str)
    }

    /// Takes the file out of use after a failed wipe (`why`): reads report every block as not
    /// intact, writes fail, and its header is zeroed so that a restart starts it afresh instead
    /// of restoring what it held; where even that write fails, the file is unlinked (a restart
    /// then makes a new one), and where that fails too the reason says to delete it.
    fn retire(&self, why: String) {
        let zeroed = self.file.write_all_at(&[0u8; 8], 0).and_then(|()| self.file.sync_data());
        let why = match zeroed.map_err(|_| std::fs::remove_file(&self.path)) {
            Ok(()) | Err(Ok(())) => why,
            Err(Err(e)) => format!("{why}; nor could its header be zeroed or the file be removed ({e}): delete {} before a restart", self.path.display()),
        };
        let _ = self.out_of_use.set(why);
    }

    fn offset(&self, slot: u32) -> u64 {
        HEADER_LEN + slot as u64 * self.layout.stride()
    }
    fn check_slot(&self, slot: u32) -> Result<(), DiskError> {
        if slot as u64 >= self.num_slots {
            return Err(DiskError::Invalid(format!(
                "slot {slot} is outside the file's {} slots",
                self.num_slots
            )));
        }
        Ok(())
    }

    /// Every record whose header is intact: (slot, meta, seq). Block bytes are checked when
    /// read. Returns also the number of slots with a damaged record header.
    pub fn scan(&self) -> Result<(Vec<(u32, BlockMeta, u64)>, usize), DiskError> {
        let hl = self.layout.record_header_len() as usize;
        let mut buf = vec![0u8; hl];
        let mut out = Vec::new();
        let mut bad = 0;
        let stride = self.layout.stride();
        // Holes are skipped (`SEEK_DATA`): a record header in a hole is zeros, no record. A
        // fresh or wiped file is one hole after its header, and a read per slot of a 2^28-slot
        // one took minutes (at the worker's open and again at the scheduler's restore).
        let mut data_end = 0; // the end of the data region `slot` was found in
        let mut slot = 0u64;
        while slot < self.num_slots {
            if self.offset(slot as u32) >= data_end {
                let Some((start, end)) = self.data_region(self.offset(slot as u32)) else {
                    break; // no data from here to the end of the file
                };
                data_end = end;
                slot = slot.max((start - HEADER_LEN) / stride);
                if slot >= self.num_slots {
                    break;
                }
            }
            self.file
                .read_exact_at(&mut buf, self.offset(slot as u32))
                .map_err(|e| self.io(e))?;
            match decode_record_header(&self.layout, &buf) {
                Ok((meta, seq, _)) => out.push((slot as u32, meta, seq)),
                Err(why) if why != "no record" => bad += 1,
                Err(_) => {}
            }
            slot += 1;
        }
        Ok((out, bad))
    }

    /// The data region at or after `from` (>= `HEADER_LEN`): (start, end), None when only holes
    /// follow. Where the filesystem cannot tell (no `SEEK_DATA`), everything is data.
    fn data_region(&self, from: u64) -> Option<(u64, u64)> {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_raw_fd();
        let Ok(off) = libc::off_t::try_from(from) else {
            return None;
        };
        // SAFETY: plain system calls on our own descriptor. Only positioned I/O is used on it,
        // so moving its file offset changes nothing.
        let start = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if start < 0 {
            return match io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => None,
                _ => Some((from, u64::MAX)),
            };
        }
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        let end = if end < 0 { u64::MAX } else { end as u64 };
        Some(((start as u64).max(from), end))
    }

    /// Writes one record (header and block bytes) with one positioned write.
    pub fn write_record(&self, slot: u32, seq: u64, meta: &BlockMeta, data: &[u8], buf: &mut Vec<u8>) -> Result<(), DiskError> {
        self.check_slot(slot)?;
        if let Some(why) = self.out_of_use() {
            return Err(DiskError::Invalid(format!("the file is out of use: {why}")));
        }
        if data.len() as u64 != self.layout.bytes_per_block || meta.tokens.len() != self.layout.block_size as usize {
            return Err(DiskError::Invalid(format!(
                "record of {} bytes and {} tokens for blocks of {} bytes and {} tokens",
                data.len(),
                meta.tokens.len(),
                self.layout.bytes_per_block,
                self.layout.block_size
            )));
        }
        let hl = self.layout.record_header_len() as usize;
        buf.clear();
        buf.resize(hl, 0);
        encode_record_header(&self.layout, seq, meta, data, &mut buf[..hl]);
        // Header and block in one positioned gather write: no copy of the block into a record
        // buffer (a whole extra pass over the block's bytes).
        write_all_vectored_at(&self.file, &[buf.as_slice(), data], self.offset(slot)).map_err(|e| self.io(e))
    }

    /// Reads the block of `slot` into `out` after checking that the record is intact and holds
    /// `hash`. On a mismatch nothing is trusted: `Corrupt`.
    pub fn read_block(&self, slot: u32, hash: u64, out: &mut [u8], buf: &mut Vec<u8>) -> Result<(), DiskError> {
        let mut one = [(slot, hash, out)];
        match self.read_many(&mut one, buf)?.pop() {
            Some((_, why)) => Err(DiskError::Corrupt { slot, why }),
            None => Ok(()),
        }
    }

    /// Reads `items[i] = (slot, hash, out)` as [`DiskFile::read_block`] does, one `preadv` per
    /// run of consecutive slots (record header and bytes in one call, the bytes straight into
    /// `out`). Returns `(i, why)` for the records that are corrupt, torn or of another hash
    /// (their `out` holds garbage); an I/O error fails the whole call.
    pub fn read_many(&self, items: &mut [(u32, u64, &mut [u8])], scratch: &mut Vec<u8>) -> Result<Vec<(usize, String)>, DiskError> {
        let bpb = self.layout.bytes_per_block as usize;
        for (slot, _, out) in items.iter() {
            self.check_slot(*slot)?;
            if out.len() != bpb {
                return Err(DiskError::Invalid(format!("read buffer of {} bytes for blocks of {bpb}", out.len())));
            }
        }
        if let Some(why) = self.out_of_use() {
            // Records from before a reset may be there: none is served, each reported.
            return Ok((0..items.len()).map(|i| (i, format!("the disk tier file is out of use: {why}"))).collect());
        }
        let hl = self.layout.record_header_len() as usize;
        let gap = self.layout.stride() as usize - hl - bpb; // padding between two records
        let mut bad = Vec::new();
        let mut lo = 0;
        while lo < items.len() {
            let mut hi = lo + 1;
            while hi < items.len() && hi - lo < MAX_RUN && items[hi].0 == items[hi - 1].0.wrapping_add(1) {
                hi += 1;
            }
            let n = hi - lo;
            scratch.clear();
            scratch.resize(n * hl + gap, 0);
            let (headers, pad) = scratch.split_at_mut(n * hl);
            let mut iov: Vec<libc::iovec> = Vec::with_capacity(3 * n);
            for (k, (h, item)) in headers.chunks_mut(hl).zip(items[lo..hi].iter_mut()).enumerate() {
                iov.push(libc::iovec { iov_base: h.as_mut_ptr().cast(), iov_len: hl });
                iov.push(libc::iovec { iov_base: item.2.as_mut_ptr().cast(), iov_len: bpb });
                if k + 1 < n && gap > 0 {
                    // The padding is read into one scratch area, again and again: never looked at.
                    iov.push(libc::iovec { iov_base: pad.as_mut_ptr().cast(), iov_len: gap });
                }
            }
            self.preadv_exact(&mut iov, self.offset(items[lo].0))?;
            for (k, h) in headers.chunks(hl).enumerate() {
                let (_, hash, out) = &items[lo + k];
                let why = match decode_record_header(&self.layout, h) {
                    Err(why) => Some(why),
                    Ok((meta, _, _)) if meta.hash != *hash => Some(format!("holds hash {:#x}, not {hash:#x}", meta.hash)),
                    Ok((_, _, sum)) if data_sum(out) != sum => Some("block data checksum mismatch".into()),
                    Ok(_) => None,
                };
                if let Some(why) = why {
                    bad.push((lo + k, why));
                }
            }
            lo = hi;
        }
        Ok(bad)
    }

    /// Tells the kernel that the records of `slots` will be read soon (`posix_fadvise`
    /// WILLNEED, one call per run of consecutive slots), so their I/O is queued at once rather
    /// than as each reader gets to it. Only a hint: slots outside the file and errors are ignored.
    pub fn will_need(&self, slots: &[u32]) {
        use std::os::fd::AsRawFd;
        let mut sorted: Vec<u32> = slots.iter().copied().filter(|&s| (s as u64) < self.num_slots).collect();
        sorted.sort_unstable();
        sorted.dedup();
        let stride = self.layout.stride();
        let mut lo = 0;
        while lo < sorted.len() {
            let mut hi = lo + 1;
            while hi < sorted.len() && sorted[hi] == sorted[hi - 1] + 1 {
                hi += 1;
            }
            let len = (hi - lo) as u64 * stride;
            // SAFETY: a plain system call on our own descriptor; it reads no memory of ours.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    self.offset(sorted[lo]) as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                );
            }
            lo = hi;
        }
    }

    /// `preadv` until every buffer is full (a short read resumes where it stopped); the end of
    /// the file before that is an I/O error.
    fn preadv_exact(&self, iov: &mut [libc::iovec], mut offset: u64) -> Result<(), DiskError> {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_raw_fd();
        let mut first = 0;
        while first < iov.len() {
            let cnt = (iov.len() - first).min(1024) as libc::c_int; // IOV_MAX on Linux
            // SAFETY: every iovec points into a live, exclusively borrowed buffer of its length.
            let got = unsafe { libc::preadv(fd, iov[first..].as_ptr(), cnt, offset as libc::off_t) };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(self.io(e));
            }
            if got == 0 {
                return Err(self.io(io::Error::new(io::ErrorKind::UnexpectedEof, "record past the end of the file")));
            }
            offset += got as u64;
            let mut left = got as usize;
            while first < iov.len() && left >= iov[first].iov_len {
                left -= iov[first].iov_len;
                first += 1;
            }
            if left > 0 {
                let v = &mut iov[first];
                // SAFETY: stays inside the same buffer (left < its length).
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(left).cast() };
                v.iov_len -= left;
            }
        }
        Ok(())
    }

    /// Makes a slot's record unreadable (its magic zeroed), so a restart does not bring it back.
    pub fn invalidate(&self, slot: u32) -> Result<(), DiskError> {
        self.check_slot(slot)?;
        self.file
            .write_all_at(&[0u8; 4], self.offset(slot))
            .map_err(|e| self.io(e))
    }

    /// Drops every record, keeping the header (the prefix cache was reset: what the file held
    /// may belong to other weights). The file is cut back to its header and sized again, so
    /// no record survives and the space is given back (sparse).
    pub fn wipe(&self) -> Result<(), DiskError> {
        let total = self.offset(0) + self.num_slots * self.layout.stride();
        self.file.set_len(HEADER_LEN).map_err(|e| self.io(e))?;
        self.file.set_len(total).map_err(|e| self.io(e))?;
        self.file.sync_data().map_err(|e| self.io(e))
    }

    /// Starts the device write of `slot`'s record without waiting for it (Linux
    /// `sync_file_range(WRITE)`; elsewhere nothing). A writer that calls this after each record
    /// keeps the device busy while it writes the next ones, instead of leaving every dirty page
    /// to the final `fdatasync` or the kernel's flusher. Only a hint: errors show at `sync`.
    pub fn start_writeback(&self, slot: u32) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            if (slot as u64) < self.num_slots {
                // SAFETY: a plain system call on our own descriptor; it reads no memory of ours.
                unsafe {
                    libc::sync_file_range(
                        self.file.as_raw_fd(),
                        self.offset(slot) as libc::off64_t,
                        self.layout.stride() as libc::off64_t,
                        libc::SYNC_FILE_RANGE_WRITE,
                    );
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = slot;
    }

    pub fn sync(&self) -> Result<(), DiskError> {
        self.file.sync_data().map_err(|e| self.io(e))
    }
}

/// Counters of the background writer.
#[derive(Debug, Default)]
pub struct WriterStats {
    pub queued: AtomicUsize,
    pub written_blocks: AtomicU64,
    pub bytes_written: AtomicU64,
    pub dropped_full: AtomicU64,
    pub failed: AtomicU64,
    /// Wipes that failed (the file is then out of use: [`DiskFile::out_of_use`]).
    pub wipe_failures: AtomicU64,
}

/// How long dropping a [`DiskWriter`] lets queued writes go on (then the rest are dropped, and
/// a write stuck on the disk is left to its thread): a slow or stalled disk behind a long
/// queue held the engine's shutdown, with the GIL, until every queued block was written
/// (`disk_queue_len` blocks, up to 2^31; for ever on a hung disk).
pub const CLOSE_WAIT: Duration = Duration::from_secs(2);

enum Job {
    Write {
        slot: u32,
        meta: BlockMeta,
        data: Vec<u8>,
    },
    Invalidate(u32),
    Wipe,
    Flush(SyncSender<()>),
}

struct Shared {
    stats: WriterStats,
    /// (slot, written) per finished write, in order.
    done: Mutex<Vec<(u32, bool)>>,
    /// Buffers given back by the writer for the next submissions.
    spare: Mutex<Vec<Vec<u8>>>,
    seq: AtomicU64,
    /// Why the last failed write failed (a full or read-only disk, the file cut short): the
    /// worker logs it with the count of failures, which alone does not say what to fix.
    last_error: Mutex<Option<String>>,
    /// Set when the writer is dropped: queued writes not started by then are dropped.
    close_by: OnceLock<Instant>,
}

/// A thread that writes records with a bounded queue: [`DiskWriter::submit`] never waits; when
/// the queue is full the write is dropped (counted) and the slot reported not written.
///
/// The bound is kept by the `queued` count, over a channel that allocates as it fills: a
/// `sync_channel` allocates its whole bound at once, and a bound of 2^31 (the largest
/// `disk_queue_len`) aborted the process.
pub struct DiskWriter {
    file: Arc<DiskFile>,
    tx: Option<Sender<Job>>,
    /// Writes queued or being written at most: `queue_len` waiting and the one being written.
    max_queued: usize,
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
    /// The process that started the writer thread (it does not survive `fork`).
    pid: u32,
}

impl DiskWriter {
    /// `next_seq`: above every sequence number in the file (from [`DiskFile::scan`]).
    pub fn new(file: Arc<DiskFile>, queue_len: usize, next_seq: u64) -> Result<Self, DiskError> {
        if queue_len == 0 {
            return Err(DiskError::Invalid("queue_len must be at least 1".into()));
        }
        let (tx, rx) = channel::<Job>();
        let shared = Arc::new(Shared {
            stats: WriterStats::default(),
            done: Mutex::new(Vec::new()),
            spare: Mutex::new(Vec::new()),
            seq: AtomicU64::new(next_seq),
            last_error: Mutex::new(None),
            close_by: OnceLock::new(),
        });
        let (f, s) = (file.clone(), shared.clone());
        let handle = std::thread::Builder::new()
            .name("kvslots-disk-writer".into())
            .spawn(move || writer_loop(f, s, rx))
            .map_err(|e| DiskError::Invalid(format!("cannot start the disk writer: {e}")))?;
        Ok(DiskWriter {
            file,
            tx: Some(tx),
            max_queued: queue_len.saturating_add(1),
            shared,
            handle: Some(handle),
            pid: std::process::id(),
        })
    }

    pub fn file(&self) -> &Arc<DiskFile> {
        &self.file
    }
    pub fn stats(&self) -> &WriterStats {
        &self.shared.stats
    }

    /// Why the last write that failed on the writer failed, if one did.
    pub fn last_error(&self) -> Option<String> {
        self.shared.last_error.lock().unwrap().clone()
    }

    /// A buffer of one block's bytes to fill and pass to [`Self::submit`].
    pub fn buffer(&self) -> Vec<u8> {
        let mut b = self.shared.spare.lock().unwrap().pop().unwrap_or_default();
        b.resize(self.file.layout().bytes_per_block as usize, 0);
        b
    }

    /// Queues a record; false (the slot reported not written) when the queue is full.
    pub fn submit(&self, slot: u32, meta: BlockMeta, data: Vec<u8>) -> bool {
        let st = &self.shared.stats;
        let tx = self.tx.as_ref().expect("open until dropped");
        if self.file.out_of_use().is_some() {
            // Not queued: it would fail on the writer.
            st.failed.fetch_add(1, Ordering::Relaxed);
            self.shared.done.lock().unwrap().push((slot, false));
            return false;
        }
        let full = st.queued.fetch_add(1, Ordering::Relaxed) >= self.max_queued;
        if full || tx.send(Job::Write { slot, meta, data }).is_err() {
            st.queued.fetch_sub(1, Ordering::Relaxed);
            st.dropped_full.fetch_add(1, Ordering::Relaxed);
            self.shared.done.lock().unwrap().push((slot, false));
            return false;
        }
        true
    }

    /// Queues the invalidation of a slot's record (never waits: it is a few bytes).
    pub fn invalidate(&self, slot: u32) {
        let _ = self.tx.as_ref().expect("open").send(Job::Invalidate(slot));
    }

    /// Queues dropping every record ([`DiskFile::wipe`]): writes queued before it are lost
    /// (reported written: their slots must be treated as stale by the caller), later ones land.
    /// A wipe that fails takes the file out of use ([`DiskFile::out_of_use`], counted in
    /// `wipe_failures`): its records may still be there.
    pub fn wipe(&self) {
        let _ = self.tx.as_ref().expect("open").send(Job::Wipe);
    }

    /// Finished writes since the last call: (slot, written).
    pub fn take_done(&self) -> Vec<(u32, bool)> {
        std::mem::take(&mut *self.shared.done.lock().unwrap())
    }

    /// Waits until every queued job is on disk (tests, shutdown).
    pub fn flush(&self) {
        let (tx, rx) = sync_channel(1);
        if self.tx.as_ref().expect("open").send(Job::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

impl Drop for DiskWriter {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: no writer thread to join; the channel's locks may have been held
            // by it at the fork. Left as they are.
            std::mem::forget(self.tx.take());
            std::mem::forget(self.handle.take());
            return;
        }
        let by = Instant::now() + CLOSE_WAIT;
        let _ = self.shared.close_by.set(by);
        self.tx = None; // the writer ends once the queue is empty
        if let Some(h) = self.handle.take() {
            // Past the deadline it only drops what is queued; a write stuck in the kernel (a
            // hung disk) is not waited for: the thread ends with it (holding the file's lock).
            while !h.is_finished() && Instant::now() < by + Duration::from_millis(200) {
                std::thread::sleep(Duration::from_millis(1));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

fn writer_loop(file: Arc<DiskFile>, shared: Arc<Shared>, rx: Receiver<Job>) {
    let mut buf = Vec::new();
    while let Ok(job) = rx.recv() {
        match job {
            Job::Write { slot, meta, data } => {
                if shared.close_by.get().is_some_and(|&by| Instant::now() >= by) {
                    shared.stats.queued.fetch_sub(1, Ordering::Relaxed);
                    continue; // nobody takes the report any more
                }
                // Never past SEQ_LIMIT (a record numbered there is damaged), never wrapped: a
                // wrapped number would make this record older than the ones it replaces.
                let seq = shared.seq.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| if s < SEQ_LIMIT { Some(s + 1) } else { None });
                let res = match seq {
                    Ok(seq) => file.write_record(slot, seq, &meta, &data, &mut buf),
                    Err(_) => Err(DiskError::Invalid("the record sequence numbers are used up".into())),
                };
                let ok = res.is_ok();
                if let Err(e) = res {
                    *shared.last_error.lock().unwrap() = Some(e.to_string());
                }
                let st = &shared.stats;
                if ok {
                    file.start_writeback(slot);
                    st.written_blocks.fetch_add(1, Ordering::Relaxed);
                    st.bytes_written.fetch_add(data.len() as u64, Ordering::Relaxed);
                } else {
                    st.failed.fetch_add(1, Ordering::Relaxed);
                }
                st.queued.fetch_sub(1, Ordering::Relaxed);
                shared.done.lock().unwrap().push((slot, ok));
                let mut spare = shared.spare.lock().unwrap();
                if spare.len() < 64 {
                    spare.push(data);
                }
            }
            Job::Invalidate(slot) => {
                let _ = file.invalidate(slot);
            }
            Job::Wipe => {
                if let Err(e) = file.wipe() {
                    // Records from before the reset may have survived: never served again.
                    shared.stats.wipe_failures.fetch_add(1, Ordering::Relaxed);
                    file.retire(format!("wiping it after a prefix-cache reset failed ({e})"));
                }
            }
            Job::Flush(ack) => {
                let _ = file.sync();
                let _ = ack.send(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn layout(fp: u64) -> Layout {
        Layout {
            fingerprint: fp,
            block_size: 4,
            num_layers: 2,
            bytes_per_block: 1000,
            dtype: "bfloat16".into(),
        }
    }
    fn meta(h: u64) -> BlockMeta {
        BlockMeta {
            hash: h,
            parent: (h > 1).then(|| h - 1),
            lora: None,
            successor: 7,
            tokens: vec![h as u32; 4],
        }
    }
    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvslots-disk-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    #[test]
    fn data_sum_is_xxh3_64_at_every_length_the_simd_paths_split_on() {
        // Files written with xxhash-rust's xxh3_64 must keep verifying: the same function.
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for n in [0, 1, 16, 17, 128, 129, 240, 241, 1024, 1025, 65_536, 262_144 + 7, 300_000] {
            assert_eq!(data_sum(&data[..n]), xxh3_64(&data[..n]), "{n} bytes");
        }
    }

    #[test]
    fn records_round_trip_and_survive_reopen() {
        let p = tmp("rt");
        let (f, o) = DiskFile::open(&p, &layout(1), 3).unwrap();
        assert_eq!(o, Opened::Created);
        let data: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        let mut buf = Vec::new();
        f.write_record(2, 5, &meta(9), &data, &mut buf).unwrap();
        let mut out = vec![0u8; 1000];
        f.read_block(2, 9, &mut out, &mut buf).unwrap();
        assert_eq!(out, data);
        assert!(matches!(f.read_block(2, 8, &mut out, &mut buf), Err(DiskError::Corrupt { .. })));
        assert!(matches!(f.read_block(1, 9, &mut out, &mut buf), Err(DiskError::Corrupt { .. })));
        drop(f);
        let (f, o) = DiskFile::open(&p, &layout(1), 3).unwrap();
        assert_eq!(o, Opened::Reused);
        let (recs, bad) = f.scan().unwrap();
        assert_eq!((recs, bad), (vec![(2, meta(9), 5)], 0));
        // Another model: discarded, nothing found.
        drop(f);
        let (f, o) = DiskFile::open(&p, &layout(2), 3).unwrap();
        assert!(matches!(o, Opened::Discarded(ref w) if w.contains("fingerprint")), "{o:?}");
        assert!(f.scan().unwrap().0.is_empty());
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn flipped_bytes_are_detected() {
        let p = tmp("flip");
        let (f, _) = DiskFile::open(&p, &layout(1), 2).unwrap();
        let data = vec![3u8; 1000];
        let mut buf = Vec::new();
        f.write_record(0, 1, &meta(4), &data, &mut buf).unwrap();
        f.write_record(1, 2, &meta(5), &data, &mut buf).unwrap();
        let hl = layout(1).record_header_len();
        // A data byte of slot 0 and a token of slot 1.
        f.file.write_all_at(&[9], HEADER_LEN + hl + 10).unwrap();
        f.file
            .write_all_at(&[9], HEADER_LEN + layout(1).stride() + RECORD_FIXED as u64)
            .unwrap();
        let mut out = vec![0u8; 1000];
        let e = f.read_block(0, 4, &mut out, &mut buf).unwrap_err();
        assert!(e.to_string().contains("data checksum"), "{e}");
        let (recs, bad) = f.scan().unwrap();
        assert_eq!((recs.len(), bad), (1, 1), "slot 1's header is damaged");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn writer_reports_every_submission_and_drops_when_full() {
        let p = tmp("writer");
        let (f, _) = DiskFile::open(&p, &layout(1), 64).unwrap();
        let f = Arc::new(f);
        let w = DiskWriter::new(f.clone(), 1, 1).unwrap();
        let mut accepted = 0;
        for s in 0..64u32 {
            let mut b = w.buffer();
            b.fill(s as u8);
            accepted += w.submit(s, meta(s as u64 + 1), b) as u32;
        }
        w.flush();
        let done = w.take_done();
        assert_eq!(done.len(), 64, "every slot reported");
        let ok: Vec<u32> = done.iter().filter(|d| d.1).map(|d| d.0).collect();
        assert_eq!(ok.len() as u32, accepted);
        assert_eq!(
            w.stats().dropped_full.load(Ordering::Relaxed) as u32,
            64 - accepted
        );
        let mut out = vec![0u8; 1000];
        let mut buf = Vec::new();
        for s in ok {
            f.read_block(s, s as u64 + 1, &mut out, &mut buf).unwrap();
            assert!(out.iter().all(|&b| b == s as u8));
        }
        drop(w);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn wipe_drops_every_record_and_keeps_the_header() {
        let p = tmp("wipe");
        let (f, _) = DiskFile::open(&p, &layout(1), 4).unwrap();
        let f = Arc::new(f);
        let w = DiskWriter::new(f.clone(), 8, 1).unwrap();
        for s in 0..3u32 {
            assert!(w.submit(s, meta(s as u64 + 1), w.buffer()));
        }
        w.wipe();
        assert!(w.submit(3, meta(40), w.buffer()), "a write queued after the wipe lands");
        w.flush();
        let len = std::fs::metadata(&p).unwrap().len();
        assert_eq!(len, HEADER_LEN + 4 * layout(1).stride(), "sized again");
        let (recs, bad) = f.scan().unwrap();
        assert_eq!(bad, 0);
        assert_eq!(recs.iter().map(|r| r.0).collect::<Vec<_>>(), vec![3], "only the later write");
        drop(w);
        drop(f);
        let (_, o) = DiskFile::open(&p, &layout(1), 4).unwrap();
        assert_eq!(o, Opened::Reused, "the header survived");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn sequence_numbers_never_wrap_and_forged_ones_are_not_trusted() {
        let p = tmp("seq");
        let (f, _) = DiskFile::open(&p, &layout(1), 4).unwrap();
        let mut buf = Vec::new();
        let data = vec![1u8; 1000];
        f.write_record(0, 5, &meta(1), &data, &mut buf).unwrap();
        f.write_record(1, u64::MAX, &meta(2), &data, &mut buf).unwrap();
        f.write_record(2, SEQ_LIMIT, &meta(3), &data, &mut buf).unwrap();
        let (recs, bad) = f.scan().unwrap();
        assert_eq!((recs.iter().map(|r| r.0).collect::<Vec<_>>(), bad), (vec![0], 2));
        let mut out = vec![0u8; 1000];
        assert!(f.read_block(1, 2, &mut out, &mut buf).is_err(), "not served either");
        drop(f);
        let (f, o, max) = DiskFile::open_for_writer(&p, &layout(1), 4).unwrap();
        assert_eq!((o, max), (Opened::Reused, 5));
        // Numbered past any honest writer: started afresh.
        f.write_record(3, SEQ_RESTART, &meta(4), &data, &mut buf).unwrap();
        drop(f);
        let (f, o, max) = DiskFile::open_for_writer(&p, &layout(1), 4).unwrap();
        assert!(matches!(o, Opened::Discarded(ref w) if w.contains("sequence")), "{o:?}");
        assert_eq!(max, 0);
        assert!(f.scan().unwrap().0.is_empty());
        // A writer at the limit writes nothing more (its number would wrap past it).
        let f = Arc::new(f);
        let w = DiskWriter::new(f.clone(), 4, SEQ_LIMIT - 1).unwrap();
        assert!(w.submit(0, meta(1), w.buffer()) && w.submit(1, meta(2), w.buffer()));
        w.flush();
        assert_eq!(w.take_done(), vec![(0, true), (1, false)]);
        assert_eq!(f.scan().unwrap().0.iter().map(|r| r.2).collect::<Vec<_>>(), vec![SEQ_LIMIT - 1]);
        drop(w);
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn a_failed_wipe_takes_the_file_out_of_use_and_off_its_path() {
        let p = tmp("wipe-fails");
        let (f, _) = DiskFile::open(&p, &layout(1), 4).unwrap();
        let data = vec![2u8; 1000];
        f.write_record(0, 1, &meta(1), &data, &mut Vec::new()).unwrap();
        drop(f);
        // Read-only: the wipe's truncation fails, and so does zeroing the header.
        let f = Arc::new(DiskFile::open_existing(&p, &layout(1), 4).unwrap());
        let w = DiskWriter::new(f.clone(), 4, 2).unwrap();
        w.wipe();
        w.flush();
        assert_eq!(w.stats().wipe_failures.load(Ordering::Relaxed), 1);
        assert!(f.out_of_use().unwrap().contains("wiping it after a prefix-cache reset failed"), "{:?}", f.out_of_use());
        assert!(!p.exists(), "unlinked: a restart makes a new file, nothing from before comes back");
        let mut out = vec![0u8; 1000];
        let bad = f.read_many(&mut [(0, 1, &mut out[..])], &mut Vec::new()).unwrap();
        assert!(bad.len() == 1 && bad[0].1.contains("out of use"), "{bad:?}");
        assert!(!w.submit(1, meta(2), w.buffer()));
        assert_eq!(w.take_done(), vec![(1, false)]);
        assert_eq!(w.stats().failed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn scan_skips_holes_and_finds_every_record_between_them() {
        let p = tmp("holes");
        let (f, _) = DiskFile::open(&p, &layout(1), 1000).unwrap();
        let mut buf = Vec::new();
        let slots = [0u32, 1, 2, 500, 501, 997, 999];
        for (i, &s) in slots.iter().enumerate() {
            f.write_record(s, i as u64, &meta(10 + s as u64), &[s as u8; 1000], &mut buf).unwrap();
        }
        let (recs, bad) = f.scan().unwrap();
        assert_eq!(recs.iter().map(|r| r.0).collect::<Vec<_>>(), slots, "{bad}");
        f.wipe().unwrap();
        assert!(f.scan().unwrap().0.is_empty());
        std::fs::remove_file(&p).unwrap();
    }

    /// Slots 0..6 written with distinct bytes (slot 4 left empty), read back in runs.
    fn filled(name: &str) -> (Arc<DiskFile>, Vec<Vec<u8>>) {
        let p = tmp(name);
        let (f, _) = DiskFile::open(&p, &layout(9), 8).unwrap();
        let mut buf = Vec::new();
        let data: Vec<Vec<u8>> = (0..8u64).map(|s| (0..1000).map(|i| (i as u64 * 7 + s * 13) as u8).collect()).collect();
        for s in [0u32, 1, 2, 3, 5, 6] {
            f.write_record(s, s as u64, &meta(100 + s as u64), &data[s as usize], &mut buf).unwrap();
        }
        (Arc::new(f), data)
    }

    #[test]
    fn runs_of_consecutive_slots_read_each_block_into_its_own_buffer() {
        let (f, data) = filled("runs");
        // Out of order and with a gap: runs [2, 3], [5, 6], [0, 1]; 4 holds no record.
        let order = [2u32, 3, 5, 6, 4, 0, 1];
        let mut outs: Vec<Vec<u8>> = order.iter().map(|_| vec![0xAA; 1000]).collect();
        let mut items: Vec<(u32, u64, &mut [u8])> =
            order.iter().zip(outs.iter_mut()).map(|(&s, o)| (s, 100 + s as u64, o.as_mut_slice())).collect();
        let bad = f.read_many(&mut items, &mut Vec::new()).unwrap();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 4, "{bad:?}");
        for (k, &s) in order.iter().enumerate() {
            if s != 4 {
                assert_eq!(outs[k], data[s as usize], "slot {s}");
            }
        }
        // A read-ahead hint is only a hint: slots outside the file, repeats, gaps are fine.
        f.will_need(&[6, 0, 1, 2, 5, 99, 2, u32::MAX]);
        // Another hash in the middle of a run: only that block is refused.
        let mut a = vec![0u8; 1000];
        let mut b = vec![0u8; 1000];
        let mut c = vec![0u8; 1000];
        let mut items: Vec<(u32, u64, &mut [u8])> = vec![(0, 100, &mut a), (1, 999, &mut b), (2, 102, &mut c)];
        let bad = f.read_many(&mut items, &mut Vec::new()).unwrap();
        assert_eq!(bad.iter().map(|b| b.0).collect::<Vec<_>>(), vec![1]);
        assert!(bad[0].1.contains("holds hash"));
        assert_eq!((a, c), (data[0].clone(), data[2].clone()));
        // A wrong buffer size or a slot outside the file is refused before any read.
        let mut small = [0u8; 10];
        assert!(f.read_many(&mut [(0, 100, &mut small[..])], &mut Vec::new()).is_err());
        let mut ok = vec![0u8; 1000];
        assert!(f.read_many(&mut [(8, 100, &mut ok[..])], &mut Vec::new()).is_err());
    }

    #[test]
    fn reader_threads_fill_the_callers_buffers_and_report_each_ticket_once() {
        use super::super::reader::{DiskReader, ReadTarget};
        let (f, data) = filled("reader");
        // Flip one byte of slot 5's data: a checksum failure, reported by index.
        let off = f.offset(5) + f.layout().record_header_len() + 17;
        let mut byte = [0u8; 1];
        f.file.read_exact_at(&mut byte, off).unwrap();
        f.file.write_all_at(&[byte[0] ^ 1], off).unwrap();
        let r = DiskReader::new(f.clone(), 3);
        assert_eq!(r.num_threads(), 3);
        let slots = [0u32, 1, 2, 3, 5, 6];
        let mut out = vec![0u8; slots.len() * 1000];
        let targets: Vec<ReadTarget> = slots
            .iter()
            .enumerate()
            .map(|(i, &s)| ReadTarget { index: i, slot: s, hash: 100 + s as u64, dst: unsafe { out.as_mut_ptr().add(i * 1000) } })
            .collect();
        unsafe { r.submit(7, targets.clone()).unwrap() };
        assert!(unsafe { r.submit(7, targets) }.is_err(), "a ticket in flight is refused");
        unsafe { r.submit(8, Vec::new()).unwrap() };
        assert!(r.wait_idle(Duration::from_secs(10)));
        assert_eq!(r.in_flight(), 0);
        let mut done = r.take_done();
        done.sort_by_key(|d| d.ticket);
        assert_eq!(done.len(), 2);
        assert_eq!(done[1].result, Ok(vec![]));
        let bad = done[0].result.clone().unwrap();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0, 4);
        assert!(bad[0].1.contains("checksum"), "{bad:?}");
        for (i, &s) in slots.iter().enumerate() {
            if s != 5 {
                assert_eq!(&out[i * 1000..(i + 1) * 1000], &data[s as usize][..]);
            }
        }
        assert!(r.take_done().is_empty());
    }


    #[test]
    fn dropping_the_reader_first_finishes_every_queued_read() {
        use super::super::reader::{DiskReader, ReadTarget};
        let (f, data) = filled("reader-drop");
        let mut out = vec![0u8; 6 * 1000];
        let r = DiskReader::new(f, 2);
        for (t, &s) in [0u32, 1, 2, 3, 5, 6].iter().enumerate() {
            let dst = unsafe { out.as_mut_ptr().add(t * 1000) };
            unsafe { r.submit(t as u64, vec![ReadTarget { index: 0, slot: s, hash: 100 + s as u64, dst }]).unwrap() };
        }
        drop(r); // joins the threads after the queue is empty: `out` is written before it returns
        for (t, &s) in [0u32, 1, 2, 3, 5, 6].iter().enumerate() {
            assert_eq!(&out[t * 1000..(t + 1) * 1000], &data[s as usize][..]);
        }
    }

}
