//! Whole-block copies between two byte regions: a KV layer and the host tier, either way.
//!
//! Block `id` of a region is the byte range `offset + id * stride .. + block_bytes`. Only whole
//! blocks are copied because vLLM's CPU attention backend packs K transposed inside a block, so a
//! per-token slice is meaningless. Every range is checked before the first byte moves: a bad id
//! fails with [`SlotError::InvalidArgument`] and copies nothing.
//!
//! Consecutive blocks that are also byte-contiguous in both regions are coalesced into one
//! memcpy. Large copies (over [`PARALLEL_MIN_BYTES`]) may be split across scoped threads; that is
//! sound because destination blocks are required to be disjoint, so every thread gets its own
//! `&mut` sub-slice of the destination.

use std::ops::Range;
use std::sync::Mutex;

use crate::error::{Result, SlotError};

/// Where the blocks of one region live: block `id` starts at `offset + id * stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockLayout {
    pub offset: usize,
    pub stride: usize,
}

/// A block copy between two regions: `block_bytes` bytes per block, the layout of each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySpec {
    pub block_bytes: usize,
    pub src: BlockLayout,
    pub dst: BlockLayout,
}

/// Copies smaller than this stay on the calling thread: spawning costs more than it saves.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;
/// Each extra thread must have at least this much to copy.
const MIN_BYTES_PER_THREAD: usize = 1 << 20;

/// Whether every byte of `base .. base + len` lies in memory this process has mapped writable,
/// read from `/proc/self/maps` (sorted by address): `None` where that file cannot be read. A
/// region registered over a read-only mapping (a tensor over a read-only `mmap`) would
/// otherwise turn a copy into it into a segmentation fault.
pub fn mapped_writable(base: usize, len: usize) -> Option<bool> {
    if len == 0 {
        return Some(true);
    }
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    Some(covered_writable(&maps, base, base.checked_add(len)?))
}

fn covered_writable(maps: &str, base: usize, end: usize) -> bool {
    let mut at = base;
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at || perms.as_bytes().get(1) != Some(&b'w') {
            return false; // a hole or a read-only mapping
        }
        at = hi;
        if at >= end {
            return true;
        }
    }
    false
}

/// One memcpy: `len` bytes from `src` to `dst` (byte offsets into the two regions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    src: usize,
    dst: usize,
    len: usize,
}

/// Copies block `src_blocks[i]` of `src` into block `dst_blocks[i]` of `dst` for every `i`;
/// returns the number of bytes copied.
///
/// Fails, having copied nothing, when the id lists differ in length, `block_bytes` or `threads`
/// is 0, a block lies outside its region, or two destination blocks overlap (each destination
/// byte is written at most once, which makes the order of the copies irrelevant).
pub fn copy_blocks(
    src: &[u8],
    dst: &mut [u8],
    spec: &CopySpec,
    src_blocks: &[u64],
    dst_blocks: &[u64],
    threads: usize,
) -> Result<usize> {
    if threads == 0 {
        return Err(SlotError::invalid(
            None,
            "threads must be at least 1, got 0",
        ));
    }
    let runs = plan(src.len(), dst.len(), spec, src_blocks, dst_blocks)?;
    let total = src_blocks.len() * spec.block_bytes;
    execute(src, dst, &runs, total, threads);
    Ok(total)
}

/// Byte range of block `id` in a region of `len` bytes, or the error naming `which[i]`.
fn block_range(
    which: &str,
    i: usize,
    id: u64,
    layout: BlockLayout,
    block_bytes: usize,
    len: usize,
) -> Result<Range<usize>> {
    // u128 cannot overflow here (u64 * u64 + 2 * usize), so the check itself is exact.
    let start = id as u128 * layout.stride as u128 + layout.offset as u128;
    let end = start + block_bytes as u128;
    if end > len as u128 {
        return Err(SlotError::invalid(
            None,
            format!(
                "{which}_blocks[{i}] = {id}: bytes {start}..{end} lie outside the {which} region \
                 of {len} bytes (offset {}, stride {}, block_bytes {block_bytes})",
                layout.offset, layout.stride
            ),
        ));
    }
    Ok(start as usize..end as usize)
}

/// Validates every block and returns the memcpy runs sorted by destination, coalesced.
fn plan(
    src_len: usize,
    dst_len: usize,
    spec: &CopySpec,
    src_blocks: &[u64],
    dst_blocks: &[u64],
) -> Result<Vec<Run>> {
    if src_blocks.len() != dst_blocks.len() {
        return Err(SlotError::invalid(
            None,
            format!(
                "src_blocks has {} ids but dst_blocks has {}",
                src_blocks.len(),
                dst_blocks.len()
            ),
        ));
    }
    let bb = spec.block_bytes;
    if bb == 0 {
        return Err(SlotError::invalid(
            None,
            "block_bytes must be at least 1, got 0",
        ));
    }
    // (dst start, src start, index into the id lists)
    let mut blocks = Vec::with_capacity(src_blocks.len());
    for (i, (&s, &d)) in src_blocks.iter().zip(dst_blocks).enumerate() {
        let sr = block_range("src", i, s, spec.src, bb, src_len)?;
        let dr = block_range("dst", i, d, spec.dst, bb, dst_len)?;
        blocks.push((dr.start, sr.start, i));
    }
    // Callers usually pass ascending ids; sorting is then a linear check.
    if !blocks.windows(2).all(|w| w[0].0 <= w[1].0) {
        blocks.sort_unstable_by_key(|b| b.0);
    }
    for w in blocks.windows(2) {
        let ((a, _, i), (b, _, j)) = (w[0], w[1]);
        if a + bb > b {
            return Err(SlotError::invalid(
                None,
                format!(
                    "dst_blocks[{i}] = {} and dst_blocks[{j}] = {} overlap in the dst region \
                     (bytes {a}..{} and {b}..{}); a destination block may be written only once",
                    dst_blocks[i],
                    dst_blocks[j],
                    a + bb,
                    b + bb
                ),
            ));
        }
    }
    let mut runs: Vec<Run> = Vec::with_capacity(blocks.len());
    for (dst, src, _) in blocks {
        match runs.last_mut() {
            Some(r) if r.src + r.len == src && r.dst + r.len == dst => r.len += bb,
            _ => runs.push(Run { src, dst, len: bb }),
        }
    }
    Ok(runs)
}

/// Runs validated, destination-sorted, disjoint runs, on up to `threads` threads.
fn execute(src: &[u8], dst: &mut [u8], runs: &[Run], total: usize, threads: usize) {
    let threads = if total > PARALLEL_MIN_BYTES {
        threads.min(total / MIN_BYTES_PER_THREAD).max(1)
    } else {
        1
    };
    if threads == 1 {
        copy_part(src, dst, 0, runs);
        return;
    }
    // Carve the destination into one disjoint sub-slice per part, in destination order.
    let parts = split(runs, total, threads);
    let mut tasks = Vec::with_capacity(parts.len());
    let mut rest: &mut [u8] = dst;
    let mut base = 0;
    for part in &parts {
        let (lo, hi) = (
            part[0].dst,
            part[part.len() - 1].dst + part[part.len() - 1].len,
        );
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(lo - base);
        let (mine, tail) = tail.split_at_mut(hi - lo);
        rest = tail;
        base = hi;
        tasks.push((mine, lo, part.as_slice()));
    }
    // Workers and this thread take parts from one queue, so a thread that cannot be spawned
    // (resource limits) only means fewer workers, never a lost part or a panic.
    let queue = Mutex::new(tasks);
    let work = || loop {
        let task = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match task {
            Some((mine, lo, part)) => copy_part(src, mine, lo, part),
            None => break,
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            let _ = std::thread::Builder::new().spawn_scoped(scope, work);
        }
        work();
    });
}

fn copy_part(src: &[u8], dst: &mut [u8], dst_base: usize, runs: &[Run]) {
    for r in runs {
        let d = r.dst - dst_base;
        dst[d..d + r.len].copy_from_slice(&src[r.src..r.src + r.len]);
    }
}

/// Splits destination-sorted runs into `parts` groups of about equal bytes, cutting a run in two
/// where a group boundary falls inside it. Groups stay in destination order.
fn split(runs: &[Run], total: usize, parts: usize) -> Vec<Vec<Run>> {
    let target = total.div_ceil(parts);
    let mut out: Vec<Vec<Run>> = vec![Vec::new()];
    let mut filled = 0;
    for &r in runs {
        let mut r = r;
        while r.len > 0 {
            if filled == target {
                out.push(Vec::new());
                filled = 0;
            }
            let take = r.len.min(target - filled);
            out.last_mut()
                .expect("never empty")
                .push(Run { len: take, ..r });
            filled += take;
            r = Run {
                src: r.src + take,
                dst: r.dst + take,
                len: r.len - take,
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(bb: usize, src: (usize, usize), dst: (usize, usize)) -> CopySpec {
        CopySpec {
            block_bytes: bb,
            src: BlockLayout {
                offset: src.0,
                stride: src.1,
            },
            dst: BlockLayout {
                offset: dst.0,
                stride: dst.1,
            },
        }
    }

    /// The definition: block by block, in order.
    fn reference(src: &[u8], dst: &mut [u8], s: &CopySpec, sb: &[u64], db: &[u64]) {
        for (&a, &b) in sb.iter().zip(db) {
            let (a, b) = (
                s.src.offset + a as usize * s.src.stride,
                s.dst.offset + b as usize * s.dst.stride,
            );
            dst[b..b + s.block_bytes].copy_from_slice(&src[a..a + s.block_bytes]);
        }
    }

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A deterministic shuffle of 0..n (xorshift Fisher-Yates).
    fn shuffled(n: u64, seed: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        let mut x = seed | 1;
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
        v
    }

    #[test]
    fn copies_scattered_blocks_and_leaves_the_rest() {
        let s = spec(3, (1, 4), (2, 5));
        let src = pattern(1 + 4 * 10, 7);
        let mut dst = vec![0xAA; 2 + 5 * 6];
        let mut want = dst.clone();
        let (sb, db) = ([9, 0, 4], [2, 5, 0]);
        reference(&src, &mut want, &s, &sb, &db);
        assert_eq!(copy_blocks(&src, &mut dst, &s, &sb, &db, 1), Ok(9));
        assert_eq!(dst, want);
        assert_eq!(dst[0..2], [0xAA, 0xAA], "bytes before the offset untouched");
    }

    #[test]
    fn coalesces_runs_that_are_contiguous_on_both_sides() {
        let s = spec(4, (0, 4), (0, 4));
        let runs = plan(64, 64, &s, &[3, 4, 5, 9, 1], &[0, 1, 2, 3, 7]).unwrap();
        // sorted by destination: 3->0, 4->1, 5->2 merge; 9->3 breaks the src run; 1->7 alone
        assert_eq!(
            runs,
            vec![
                Run {
                    src: 12,
                    dst: 0,
                    len: 12
                },
                Run {
                    src: 36,
                    dst: 12,
                    len: 4
                },
                Run {
                    src: 4,
                    dst: 28,
                    len: 4
                },
            ]
        );
        // A stride larger than the block leaves gaps: consecutive ids are not one memcpy.
        let s = spec(4, (0, 8), (0, 4));
        assert_eq!(plan(64, 64, &s, &[0, 1], &[0, 1]).unwrap().len(), 2);
    }

    #[test]
    fn out_of_range_ids_copy_nothing_and_name_the_index() {
        let s = spec(4, (0, 4), (8, 4));
        let src = pattern(40, 3);
        let mut dst = vec![0u8; 8 + 4 * 4];
        let before = dst.clone();
        let e = copy_blocks(&src, &mut dst, &s, &[0, 1, 10], &[0, 1, 2], 1).unwrap_err();
        assert!(matches!(e, SlotError::InvalidArgument { .. }));
        let m = e.to_string();
        assert!(
            m.contains("src_blocks[2] = 10") && m.contains("40..44") && m.contains("40 bytes"),
            "{m}"
        );
        assert_eq!(dst, before);
        let e = copy_blocks(&src, &mut dst, &s, &[0, 1], &[3, 4], 1).unwrap_err();
        assert!(
            e.to_string().contains("dst_blocks[1] = 4: bytes 24..28"),
            "{e}"
        );
        assert_eq!(dst, before);
        // Ids near u64::MAX cannot wrap around into range.
        let e = copy_blocks(&src, &mut dst, &s, &[u64::MAX], &[0], 1).unwrap_err();
        assert!(e.to_string().contains("src_blocks[0]"), "{e}");
        assert_eq!(dst, before);
    }

    #[test]
    fn malformed_arguments_are_typed_errors() {
        let s = spec(4, (0, 4), (0, 4));
        let src = [0u8; 16];
        let mut dst = [0u8; 16];
        let e = copy_blocks(&src, &mut dst, &s, &[0, 1], &[0], 1).unwrap_err();
        assert!(
            e.to_string()
                .contains("src_blocks has 2 ids but dst_blocks has 1"),
            "{e}"
        );
        let e = copy_blocks(&src, &mut dst, &s, &[0], &[0], 0).unwrap_err();
        assert!(e.to_string().contains("threads must be at least 1"), "{e}");
        let e = copy_blocks(&src, &mut dst, &spec(0, (0, 4), (0, 4)), &[0], &[0], 1).unwrap_err();
        assert!(e.to_string().contains("block_bytes"), "{e}");
        assert_eq!(copy_blocks(&src, &mut dst, &s, &[], &[], 1), Ok(0));
    }

    #[test]
    fn overlapping_destinations_are_rejected() {
        let src = pattern(64, 5);
        let mut dst = vec![0u8; 64];
        let e = copy_blocks(
            &src,
            &mut dst,
            &spec(4, (0, 4), (0, 4)),
            &[0, 1, 2],
            &[5, 3, 5],
            1,
        )
        .unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("dst_blocks[0] = 5 and dst_blocks[2] = 5 overlap"),
            "{m}"
        );
        // stride < block_bytes: distinct ids whose bytes overlap
        let e = copy_blocks(
            &src,
            &mut dst,
            &spec(4, (0, 4), (0, 2)),
            &[0, 1],
            &[0, 1],
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        assert!(dst.iter().all(|&b| b == 0));
        // Reading one source block twice is fine.
        assert_eq!(
            copy_blocks(
                &src,
                &mut dst,
                &spec(4, (0, 4), (0, 4)),
                &[1, 1],
                &[0, 1],
                1
            ),
            Ok(8)
        );
        assert_eq!(dst[0..4], dst[4..8]);
    }

    #[test]
    fn threads_split_large_copies_exactly() {
        // 3 x 4 MiB-ish: large enough to be split, with runs cut at part boundaries.
        let bb = 4096 + 8; // not a power of two, so cuts fall inside blocks
        let n = 3000u64;
        let src = pattern(bb * n as usize, 11);
        let perm = shuffled(n, 99);
        for (name, sb, db) in [
            ("scattered", perm.clone(), (0..n).rev().collect::<Vec<_>>()),
            ("one run", (0..n).collect(), (0..n).collect()),
            (
                "runs",
                (0..n).map(|i| (i + 17) % n).collect(),
                (0..n).collect(),
            ),
        ] {
            let s = spec(bb, (0, bb), (0, bb));
            let mut want = vec![1u8; bb * n as usize];
            reference(&src, &mut want, &s, &sb, &db);
            for threads in [1, 2, 3, 8] {
                let mut dst = vec![1u8; bb * n as usize];
                assert_eq!(
                    copy_blocks(&src, &mut dst, &s, &sb, &db, threads),
                    Ok(bb * n as usize)
                );
                assert!(dst == want, "{name} threads={threads}");
            }
        }
    }

    #[test]
    fn split_keeps_order_and_bytes() {
        let runs = [
            Run {
                src: 100,
                dst: 0,
                len: 10,
            },
            Run {
                src: 0,
                dst: 20,
                len: 7,
            },
            Run {
                src: 50,
                dst: 40,
                len: 3,
            },
        ];
        let parts = split(&runs, 20, 3);
        assert_eq!(parts.len(), 3);
        let flat: Vec<Run> = parts.iter().flatten().copied().collect();
        assert_eq!(flat.iter().map(|r| r.len).sum::<usize>(), 20);
        assert!(parts
            .iter()
            .all(|p| p.iter().map(|r| r.len).sum::<usize>() <= 7));
        assert!(flat.windows(2).all(|w| w[0].dst + w[0].len <= w[1].dst));
        assert_eq!(
            flat[0],
            Run {
                src: 100,
                dst: 0,
                len: 7
            }
        );
        assert_eq!(
            flat[1],
            Run {
                src: 107,
                dst: 7,
                len: 3
            }
        );
    }

    #[test]
    fn random_plans_match_the_reference() {
        let mut x = 12345u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let bb = 1 + next(40) as usize;
            let ss = bb + next(8) as usize;
            let ds = bb + next(8) as usize;
            let (so, dof) = (next(16) as usize, next(16) as usize);
            let (ns, nd) = (1 + next(30), 1 + next(30));
            let s = spec(bb, (so, ss), (dof, ds));
            let src = pattern(so + ss * ns as usize, next(1000));
            let k = next(nd + 1);
            let db: Vec<u64> = shuffled(nd, next(1000))
                .into_iter()
                .take(k as usize)
                .collect();
            let sb: Vec<u64> = (0..k).map(|_| next(ns)).collect();
            let mut dst = pattern(dof + ds * nd as usize, 3);
            let mut want = dst.clone();
            reference(&src, &mut want, &s, &sb, &db);
            let threads = 1 + next(3) as usize;
            assert_eq!(
                copy_blocks(&src, &mut dst, &s, &sb, &db, threads),
                Ok(k as usize * bb)
            );
            assert_eq!(dst, want);
        }
    }

    #[test]
    fn writable_mappings_cover_the_range() {
        let maps = "1000-3000 rw-p 00000000 00:00 0\n3000-4000 rw-p 0 00:00 0\n\
                    5000-6000 r--p 0 00:00 0\n7000-8000 rw-s 0 00:00 0 /dev/shm/x\n";
        assert!(covered_writable(maps, 0x1000, 0x4000)); // two adjacent writable mappings
        assert!(covered_writable(maps, 0x2fff, 0x3001));
        assert!(!covered_writable(maps, 0x3800, 0x4800)); // runs into a hole
        assert!(!covered_writable(maps, 0x5000, 0x5001)); // read-only
        assert!(!covered_writable(maps, 0x0800, 0x1800)); // starts unmapped
        assert!(covered_writable(maps, 0x7000, 0x8000));
        assert!(!covered_writable(maps, 0x9000, 0x9001));
        let heap = vec![0u8; 1 << 16];
        assert_eq!(mapped_writable(heap.as_ptr() as usize, heap.len()), Some(true));
        static RO: [u8; 4096] = [1; 4096];
        assert_eq!(mapped_writable(RO.as_ptr() as usize, RO.len()), Some(false));
    }
}
