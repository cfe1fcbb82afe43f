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
    pub fn hash(&mut self, parent: u64, tokens: &[u32], extra: Option<u64>) -> u64 {
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
