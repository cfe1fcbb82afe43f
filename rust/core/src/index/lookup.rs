//! Lookups: a prompt's chained keys, and the walk that scores every worker holding its first
//! block.

use super::apply::{block_extra, lookahead_extra};
use super::{serves_last, IndexError, IndexResult, PrefixIndex, WorkerId, WorkerMatch};
use crate::wire::{lookahead_hash, Lookahead};

impl PrefixIndex {
    /// The chained keys of every full block of `tokens`.
    pub fn chain_keys(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<u64>,
    ) -> IndexResult<Vec<u64>> {
        if block_size == 0 {
            return Err(IndexError::Invalid("block_size must be > 0".into()));
        }
        Ok(self
            .hasher
            .chain(self.cfg.hash_seed, tokens, block_size, lora))
    }

    /// Per worker holding at least the first block: the matched prefix and the score (with the
    /// EAGLE last-block rule applied to workers marked EAGLE).
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<u64>,
    ) -> IndexResult<&[WorkerMatch]> {
        if block_size == 0 {
            return Err(IndexError::Invalid("block_size must be > 0".into()));
        }
        let lookahead_walk = self.lookahead_lens != 0;
        if lookahead_walk {
            self.lookup_lookahead(tokens, block_size, lora);
        } else {
            let mut blocks = tokens.chunks_exact(block_size);
            self.lookup_by(lora, |buf| match blocks.next() {
                Some(b) => {
                    buf.extend_from_slice(b);
                    true
                }
                None => false,
            });
        }
        self.apply_last_block_rule(tokens, block_size, lookahead_walk);
        Ok(self.scorer.results())
    }

    /// The EAGLE last-block rule (`last_block.rs`) on the walk just made: block `i`'s nodes are
    /// `scratch_nodes[i]` after the plain walk, `scratch_starts[i]..` after the lookahead walk.
    fn apply_last_block_rule(&mut self, tokens: &[u32], block_size: usize, lookahead_walk: bool) {
        if self.eagle_workers == 0 {
            return;
        }
        let mut scorer = std::mem::take(&mut self.scorer);
        let (nodes, starts) = (&self.scratch_nodes, &self.scratch_starts);
        scorer.drop_unserved_last(|w, i| {
            if !self.worker(w).is_some_and(|wk| wk.eagle) {
                return true;
            }
            let i = i as usize;
            let of_block = if lookahead_walk {
                let s = starts.get(i).map_or(nodes.len(), |&s| s as usize);
                let e = starts.get(i + 1).map_or(nodes.len(), |&e| e as usize);
                &nodes[s..e]
            } else {
                nodes.get(i..i + 1).unwrap_or(&[])
            };
            let next = tokens.get((i + 1) * block_size).copied();
            of_block
                .iter()
                .any(|&n| serves_last(self.holder_value_at(n, w), next))
        });
        self.scorer = scorer;
    }

    /// [`lookup`](Self::lookup) with the prompt's blocks produced on demand: `next_block`
    /// appends the next full block's tokens to the (cleared) buffer, or returns false when
    /// there is none. The walk stops at the first block no worker holds, so a caller converting
    /// tokens from elsewhere (Python) converts only the blocks that matter.
    pub fn lookup_by(
        &mut self,
        lora: Option<u64>,
        mut next_block: impl FnMut(&mut Vec<u32>) -> bool,
    ) -> &[WorkerMatch] {
        let mut scorer = std::mem::take(&mut self.scorer);
        let mut touched = std::mem::take(&mut self.scratch_nodes);
        let mut buf = std::mem::take(&mut self.scratch_tokens);
        scorer.reset();
        touched.clear();
        let mut parent = self.cfg.hash_seed;
        let mut blocks = 0u64;
        // Keys chain, but probing consecutive keys is independent work: hash a run of blocks,
        // then probe the run, so the CPU overlaps the cache misses. The run grows 1, 2, 4, 8 so
        // a prompt that misses at its first block hashes nothing extra.
        let mut run = [0u64; 8];
        let mut slots = [None::<u32>; 8];
        let mut want = 1usize;
        'walk: loop {
            let mut n = 0;
            while n < want {
                buf.clear();
                if !next_block(&mut buf) {
                    break;
                }
                parent = self.hasher.hash(parent, &buf, lora);
                run[n] = parent;
                n += 1;
            }
            if n == 0 {
                break;
            }
            for j in 0..n {
                slots[j] = self.blocks.keys.get(&run[j]).copied();
            }
            for &slot in &slots[..n] {
                blocks += 1;
                let Some(i) = slot else { break 'walk };
                let holders = &self.blocks.nodes[i as usize].holders;
                if !scorer.block(holders.iter().map(|h| (h.worker, h.tiers))) {
                    break 'walk;
                }
                touched.push(i);
            }
            want = (want * 2).min(run.len());
        }
        // Most recent = first block, as when storing.
        for &i in touched.iter().rev() {
            self.blocks.touch(i);
        }
        self.totals.lookups += 1;
        self.totals.lookup_blocks += blocks;
        self.scratch_nodes = touched;
        self.scratch_tokens = buf;
        self.scorer = scorer;
        self.scorer.results()
    }

    /// [`lookup`](Self::lookup) once blocks hashed with lookahead tokens (vLLM 0.33, EAGLE
    /// without a connector) were stored: besides the plain key chain, one chain per lookahead
    /// length `L` seen, where block `i` is keyed with the `L` prompt tokens after it. A worker
    /// holds block `i` if it holds it on any chain; a lookahead-hashed block matches only a
    /// prompt that goes on with the tokens its hash covers (and has them), as in the engine.
    fn lookup_lookahead(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<u64>,
    ) -> &[WorkerMatch] {
        let mut scorer = std::mem::take(&mut self.scorer);
        let mut touched = std::mem::take(&mut self.scratch_nodes);
        let mut starts = std::mem::take(&mut self.scratch_starts);
        scorer.reset();
        touched.clear();
        starts.clear();
        let lens: Vec<usize> = (1..=64usize)
            .filter(|l| self.lookahead_lens & (1u64 << (l - 1)) != 0)
            .collect();
        // parents[0]: the plain chain; parents[1 + j]: the chain of lookahead length lens[j].
        let mut parents: Vec<Option<u64>> = vec![Some(self.cfg.hash_seed); 1 + lens.len()];
        let mut holders: Vec<(WorkerId, u8)> = Vec::new();
        let mut blocks = 0u64;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let end = (i + 1) * block_size;
            holders.clear();
            starts.push(touched.len() as u32);
            for (c, parent) in parents.iter_mut().enumerate() {
                let Some(p) = *parent else { continue };
                let extra = if c == 0 {
                    lora
                } else {
                    let l = lens[c - 1];
                    let Some(after) = tokens.get(end..end + l) else {
                        *parent = None; // the prompt has no L tokens after this block
                        continue;
                    };
                    let la = Lookahead {
                        len: l as u32,
                        hash: lookahead_hash(after),
                        first: after[0],
                    };
                    block_extra(lora, lookahead_extra(None, Some(&la)))
                };
                let key = self.hasher.hash(p, block, extra);
                match self.blocks.keys.get(&key) {
                    Some(&n) => {
                        *parent = Some(key);
                        holders.extend(
                            self.blocks.nodes[n as usize]
                                .holders
                                .iter()
                                .map(|h| (h.worker, h.tiers)),
                        );
                        touched.push(n);
                    }
                    None => *parent = None,
                }
            }
            blocks += 1;
            if !scorer.block(holders.iter().copied()) {
                break;
            }
        }
        for &i in touched.iter().rev() {
            self.blocks.touch(i);
        }
        self.totals.lookups += 1;
        self.totals.lookup_blocks += blocks;
        self.scratch_nodes = touched;
        self.scratch_starts = starts;
        self.scorer = scorer;
        self.scorer.results()
    }
}
