//! Chained block hashing: xxh3-64 over `parent (u64 LE) || tokens (u32 LE each) || extra (u64 LE)`.
//!
//! The byte layout is part of the contract: the pure-Python reference model reproduces it with
//! the `xxhash` package, and the prefix registry of one manager is only meaningful with one seed.

use xxhash_rust::xxh3::xxh3_64;

/// Reusable hasher: keeps one scratch buffer so hashing a block allocates nothing once warm.
#[derive(Debug, Clone, Default)]
pub struct BlockHasher {
    scratch: Vec<u8>,
}

impl BlockHasher {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hash of one full block given its parent's hash (the seed for the first block).
    #[inline]
    pub fn hash(&mut self, parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
        // The usual block sizes: a buffer of a size known at compile time, so the copies
        // inline and xxh3's length dispatch folds away (16 tokens: ~4.5 ns, ~2x the general
        // inline path below).
        if cfg!(target_endian = "little") {
            if let Ok(t) = <&[u32; 16]>::try_from(tokens) {
                return fixed::<16, 80>(parent, t, extra);
            }
            if let Ok(t) = <&[u32; 32]>::try_from(tokens) {
                return fixed::<32, 144>(parent, t, extra);
            }
        }
        if tokens.len() <= INLINE_TOKENS {
            return hash_inline(parent, tokens, extra);
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&parent.to_le_bytes());
        if cfg!(target_endian = "little") {
            self.scratch.extend_from_slice(bytemuck::cast_slice(tokens));
        } else {
            for t in tokens {
                self.scratch.extend_from_slice(&t.to_le_bytes());
            }
        }
        if let Some(e) = extra {
            self.scratch.extend_from_slice(&e.to_le_bytes());
        }
        xxh3_64(&self.scratch)
    }

    /// Hashes of every full block of `tokens`, chained from `seed`.
    pub fn chain(
        &mut self,
        seed: u64,
        tokens: &[u32],
        block_size: usize,
        extra: Option<u64>,
    ) -> Vec<u64> {
        let mut parent = seed;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                parent = self.hash(parent, block, extra);
                parent
            })
            .collect()
    }
}

/// [`BlockHasher::hash`] for blocks of `N` tokens; `B` = 8 + 4 N + 8 bytes of buffer.
#[inline(always)]
fn fixed<const N: usize, const B: usize>(
    parent: u64,
    tokens: &[u32; N],
    extra: Option<u64>,
) -> u64 {
    debug_assert_eq!(B, 8 + 4 * N + 8);
    let mut buf = [0u8; B];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..8 + 4 * N].copy_from_slice(bytemuck::cast_slice::<u32, u8>(tokens));
    match extra {
        None => xxh3_64(&buf[..8 + 4 * N]),
        Some(e) => {
            buf[8 + 4 * N..].copy_from_slice(&e.to_le_bytes());
            xxh3_64(&buf)
        }
    }
}

/// Blocks up to this many tokens are laid out in a stack buffer: growing the scratch vector
/// piecewise cost about twice the hash itself.
const INLINE_TOKENS: usize = 64;

#[inline]
fn hash_inline(parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
    // Zeroing the buffer is a visible part of the cost, so small blocks get a small one; and
    // the with/without-extra layouts are separate functions (a shared one with a branch on
    // `extra` measured 1.7x slower).
    const SMALL: usize = 1 + 16 / 2 + 1;
    const LARGE: usize = 1 + INLINE_TOKENS / 2 + 1;
    match (tokens.len() <= 16, extra) {
        (true, None) => hash_in::<SMALL>(parent, tokens),
        (false, None) => hash_in::<LARGE>(parent, tokens),
        (true, Some(e)) => hash_in_extra::<SMALL>(parent, tokens, e),
        (false, Some(e)) => hash_in_extra::<LARGE>(parent, tokens, e),
    }
}

/// `W` u64 words hold parent, tokens (two per word) and extra. Each field is written with
/// stores at least as wide as xxh3's 8-byte reads: writing the parent as two 4-byte halves
/// made every hash stall on store-to-load forwarding (18 ns instead of 10).
#[inline]
fn hash_in<const W: usize>(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = [0u64; W];
    let end = fill(&mut buf, parent, tokens);
    xxh3_64(&bytemuck::cast_slice::<u64, u8>(&buf)[..end])
}

#[inline]
fn hash_in_extra<const W: usize>(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut buf = [0u64; W];
    let end = fill(&mut buf, parent, tokens);
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
    bytes[end..end + 8].copy_from_slice(&extra.to_le_bytes());
    xxh3_64(&bytes[..end + 8])
}

/// Writes parent and tokens little-endian; returns the byte length written. Tokens go in
/// pairs as whole u64 words: a memcpy's wide stores read back by xxh3's 8-byte loads stalled
/// on store forwarding.
#[inline]
fn fill(buf: &mut [u64], parent: u64, tokens: &[u32]) -> usize {
    buf[0] = parent.to_le();
    let pairs = tokens.chunks_exact(2);
    let odd = pairs.remainder();
    for (w, p) in buf[1..].iter_mut().zip(pairs) {
        *w = (u64::from(p[0]) | (u64::from(p[1]) << 32)).to_le();
    }
    if let [t] = odd {
        buf[1 + tokens.len() / 2] = u64::from(*t).to_le();
    }
    8 + 4 * tokens.len()
}

/// One-shot convenience over [`BlockHasher::hash`].
pub fn block_hash(parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
    BlockHasher::new().hash(parent, tokens, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_parent_tokens_extra_little_endian() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&7u64.to_le_bytes());
        for t in [1u32, 2, 3, 4] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(block_hash(7, &[1, 2, 3, 4], None), xxh3_64(&bytes));
        bytes.extend_from_slice(&9u64.to_le_bytes());
        assert_eq!(block_hash(7, &[1, 2, 3, 4], Some(9)), xxh3_64(&bytes));
    }

    #[test]
    fn inline_and_long_blocks_share_the_layout() {
        // 16 and 32 take the fixed-size paths, up to INLINE_TOKENS the inline one.
        let sizes = [
            0usize,
            1,
            15,
            16,
            17,
            31,
            32,
            33,
            INLINE_TOKENS,
            INLINE_TOKENS + 1,
            200,
        ];
        for n in sizes {
            let tokens: Vec<u32> = (0..n as u32).map(|t| t.wrapping_mul(2654435761)).collect();
            for extra in [None, Some(42u64)] {
                let mut bytes = 9u64.to_le_bytes().to_vec();
                for t in &tokens {
                    bytes.extend_from_slice(&t.to_le_bytes());
                }
                if let Some(e) = extra {
                    bytes.extend_from_slice(&e.to_le_bytes());
                }
                assert_eq!(block_hash(9, &tokens, extra), xxh3_64(&bytes), "{n} tokens");
            }
        }
    }

    #[test]
    fn chain_depends_on_parent_and_extra() {
        let mut h = BlockHasher::new();
        let a = h.chain(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1], block_hash(a[0], &[5, 6, 7, 8], None));
        let b = h.chain(0, &[1, 2, 3, 4, 5, 6, 7, 8], 4, Some(1));
        assert_ne!(a[0], b[0]);
        let c = h.chain(1, &[1, 2, 3, 4], 4, None);
        assert_ne!(a[0], c[0]);
    }
}
