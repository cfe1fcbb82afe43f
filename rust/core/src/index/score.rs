//! Scoring a prompt: per worker, the longest prefix held on any tier and on each tier, and the
//! weighted score (the rule is in the [module docs](super)).

use rustc_hash::FxHashMap;

use super::{WorkerId, NUM_TIERS};

const GOING: u8 = 0b1000;
const LAST_SHIFT: u8 = 4;

/// One worker's match for a prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerMatch {
    pub worker: WorkerId,
    /// Longest prefix (in blocks) the worker holds on any tier.
    pub blocks: u32,
    /// Longest prefix held entirely on each tier.
    pub tier_blocks: [u32; NUM_TIERS],
    pub score: f64,
}

/// The scoring walk, shared by the in-memory lookup and by callers that fetch holders
/// elsewhere (the Redis backend): feed the holders of each prompt block in order.
#[derive(Debug, Default, Clone)]
pub struct Scorer {
    weights: [f64; 8],
    out: Vec<WorkerMatch>,
    // Per entry of `out`: bits 0-2 the tiers still unbroken, `GOING` while the worker's prefix
    // continues, bits 4-6 the tier mask of its last counted block (for the last-block rule;
    // kept in the same byte so the walk stores nothing more per block).
    alive: Vec<u8>,
    slot_of: FxHashMap<WorkerId, u32>,
    cur: Vec<u8>,
    started: bool,
    any_alive: bool,
}

impl Scorer {
    pub fn new(tier_weights: [f64; NUM_TIERS]) -> Self {
        let mut weights = [0.0; 8];
        for (m, w) in weights.iter_mut().enumerate() {
            *w = (0..NUM_TIERS)
                .filter(|t| m & (1 << t) != 0)
                .map(|t| tier_weights[t])
                .fold(0.0, f64::max);
        }
        Scorer {
            weights,
            ..Default::default()
        }
    }

    pub fn reset(&mut self) {
        self.out.clear();
        self.alive.clear();
        self.slot_of.clear();
        self.cur.clear();
        self.started = false;
        self.any_alive = false;
    }

    /// Whether another block can still extend some worker's prefix.
    pub fn wants_more(&self) -> bool {
        !self.started || self.any_alive
    }

    /// Feeds the holders `(worker, tiers)` of the next block (duplicates are OR-ed).
    /// Returns whether some worker's prefix still continues.
    pub fn block<I: IntoIterator<Item = (WorkerId, u8)>>(&mut self, holders: I) -> bool {
        if !self.started {
            self.started = true;
            for (w, tiers) in holders {
                if tiers == 0 {
                    continue;
                }
                match self.slot_of.get(&w) {
                    Some(&s) => self.cur[s as usize] |= tiers,
                    None => {
                        self.slot_of.insert(w, self.out.len() as u32);
                        self.out.push(WorkerMatch {
                            worker: w,
                            blocks: 0,
                            tier_blocks: [0; NUM_TIERS],
                            score: 0.0,
                        });
                        self.alive.push(0b111 | GOING);
                        self.cur.push(tiers);
                    }
                }
            }
        } else {
            if !self.any_alive {
                return false;
            }
            for (w, tiers) in holders {
                if let Some(&s) = self.slot_of.get(&w) {
                    self.cur[s as usize] |= tiers;
                }
            }
        }
        let mut any = false;
        for i in 0..self.out.len() {
            let m = std::mem::take(&mut self.cur[i]) & 0b111;
            if self.alive[i] & GOING == 0 {
                continue;
            }
            if m == 0 {
                self.alive[i] &= !GOING;
                continue;
            }
            let o = &mut self.out[i];
            o.blocks += 1;
            o.score += self.weights[m as usize];
            let still = self.alive[i] & m;
            for t in 0..NUM_TIERS {
                if still & (1 << t) != 0 {
                    o.tier_blocks[t] += 1;
                }
            }
            self.alive[i] = still | GOING | (m << LAST_SHIFT);
            any = true;
        }
        self.any_alive = any;
        any
    }

    pub fn results(&self) -> &[WorkerMatch] {
        &self.out
    }

    /// The EAGLE last-block rule (`last_block.rs`), after the last block was fed:
    /// `serves_last(worker, i)` says whether the worker's engine serves block `i`, the last of
    /// its prefix, from cache. Where it does not, that block leaves the worker's prefix, every
    /// tier prefix and the score (its weight is taken off again: equal to the sum of the
    /// remaining blocks' weights up to float rounding, and exactly 0 for a single block).
    pub fn drop_unserved_last(&mut self, mut serves_last: impl FnMut(WorkerId, u32) -> bool) {
        for (o, a) in self.out.iter_mut().zip(&mut self.alive) {
            if o.blocks == 0 || serves_last(o.worker, o.blocks - 1) {
                continue;
            }
            o.blocks -= 1;
            let last = (*a >> LAST_SHIFT) & 0b111;
            o.score = if o.blocks == 0 { 0.0 } else { o.score - self.weights[last as usize] };
            for t in &mut o.tier_blocks {
                *t = (*t).min(o.blocks);
            }
            *a &= !(0b111 << LAST_SHIFT);
        }
    }
}
