//! `kvslots._core.copy_blocks`: whole-block copies between two caller-given host memory regions
//! (the host tier's transfers). Validates the regions, then hands slices to
//! `kvslots_core::copy_blocks` with the GIL released.

use kvslots_core as core;
use pyo3::prelude::*;

use crate::convert::{block_ids, count};
use crate::errors::{invalid, slot_error};

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
pub(crate) fn copy_blocks(
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
    .map_err(slot_error)
}
