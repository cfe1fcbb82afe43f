//! Slots over block ids the tracker does not own. Inside vLLM the device blocks belong to vLLM's
//! own KV cache manager, which hands out their ids each step; the tracker applies the same
//! commit / rollback / lookahead rules as [`crate::SlotManager`] and reports which blocks hold
//! only verified tokens (safe to hash, offload and publish) and which surplus blocks the owner may
//! take back.

use std::collections::HashMap;

use crate::error::{Result, SlotError};
use crate::hash::BlockHasher;
use crate::manager::MAX_BLOCK_SIZE;
use crate::pool::BlockId;
use crate::slot::{blocks_for, Slot, SlotInfo};

/// A block that just became immutable: its index in the request's block table, its id and hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommittedBlock {
    pub index: usize,
    pub block: BlockId,
    pub hash: u64,
}

#[derive(Debug, Clone)]
pub struct SlotTracker {
    block_size: usize,
    hash_seed: u64,
    slots: HashMap<String, Slot>,
    hasher: BlockHasher,
}

impl SlotTracker {
    pub fn new(block_size: usize, hash_seed: u64) -> Result<Self> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(SlotError::invalid(
                None,
                format!("block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}"),
            ));
        }
        Ok(SlotTracker {
            block_size,
            hash_seed,
            slots: HashMap::new(),
            hasher: BlockHasher::new(),
        })
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn slot(&self, request_id: &str) -> Result<&Slot> {
        self.slots
            .get(request_id)
            .ok_or_else(|| SlotError::UnknownRequest {
                request: request_id.to_owned(),
            })
    }
    fn slot_mut(&mut self, request_id: &str) -> Result<&mut Slot> {
        self.slots
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest {
                request: request_id.to_owned(),
            })
    }
    pub fn info(&self, request_id: &str) -> Result<SlotInfo> {
        Ok(self.slot(request_id)?.info(self.block_size))
    }

    pub fn add(
        &mut self,
        request_id: &str,
        lookahead: usize,
        extra_key: Option<u64>,
    ) -> Result<()> {
        if self.slots.contains_key(request_id) {
            return Err(SlotError::DuplicateRequest {
                request: request_id.to_owned(),
            });
        }
        self.slots.insert(
            request_id.to_owned(),
            Slot::new(request_id, lookahead, extra_key),
        );
        Ok(())
    }

    /// How many more blocks the owner must hand over before `new_tokens` more positions (plus
    /// the lookahead) fit.
    pub fn blocks_needed(&self, request_id: &str, new_tokens: usize) -> Result<usize> {
        let slot = self.slot(request_id)?;
        let target = blocks_for(Self::needed_tokens(slot, new_tokens)?, self.block_size);
        Ok(target.saturating_sub(slot.blocks.len()))
    }

    /// committed + pending + `new_tokens` + lookahead, or the error naming the overflow.
    fn needed_tokens(slot: &Slot, new_tokens: usize) -> Result<usize> {
        slot.tokens_needed(new_tokens, slot.lookahead)
            .ok_or_else(|| SlotError::CapacityExceeded {
                request: slot.request_id.clone(),
                what: "committed + pending + new tokens + lookahead overflow a usize",
                // Exact, as the manager's: a placeholder u64::MAX said nothing of the count.
                requested: slot.filled_exact(new_tokens) + slot.lookahead as u128,
                limit: usize::MAX as u64,
            })
    }

    /// Takes `new_blocks` from the owner and marks `new_tokens` positions pending. Fails (changing
    /// nothing) when the blocks given do not cover the positions plus the lookahead.
    pub fn reserve(
        &mut self,
        request_id: &str,
        new_tokens: usize,
        new_blocks: &[BlockId],
    ) -> Result<()> {
        let bs = self.block_size;
        let slot = self.slot_mut(request_id)?;
        let k = slot.lookahead;
        let needed = blocks_for(Self::needed_tokens(slot, new_tokens)?, bs);
        let have = slot.blocks.len().saturating_add(new_blocks.len());
        if have < needed {
            return Err(SlotError::OutOfBlocks {
                request: request_id.to_owned(),
                needed: (needed - slot.blocks.len()) as u128,
                available: new_blocks.len() as u64,
                total: have as u64,
            });
        }
        // A block listed twice would hold two table positions' KV at once and be handed back
        // twice by `finish`.
        let mut seen: std::collections::HashSet<BlockId> =
            std::collections::HashSet::with_capacity(slot.blocks.len() + new_blocks.len());
        seen.extend(slot.blocks.iter().copied());
        if let Some(&b) = new_blocks.iter().find(|&&b| !seen.insert(b)) {
            return Err(SlotError::invalid(
                Some(request_id),
                format!("block {b} is given twice or is already in the request's block table"),
            ));
        }
        slot.blocks.extend_from_slice(new_blocks);
        slot.pending += new_tokens;
        slot.reserved_lookahead = k;
        Ok(())
    }

    /// Commits verified tokens. `hashes`, when given, are the owner's hashes for the request's
    /// full blocks (vLLM's `request.block_hashes`; entries past the newly full blocks are
    /// ignored); otherwise the tracker chains its own. Returns the blocks that became immutable.
    pub fn commit(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        hashes: Option<&[u64]>,
    ) -> Result<Vec<CommittedBlock>> {
        let bs = self.block_size;
        let seed = self.hash_seed;
        let slot = self
            .slots
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest {
                request: request_id.to_owned(),
            })?;
        slot.check_commit(tokens.len())?;
        let full_after = (slot.committed() + tokens.len()) / bs;
        if let Some(h) = hashes {
            if h.len() < full_after {
                return Err(SlotError::invalid(
                    Some(request_id),
                    format!(
                        "{} block hashes given for {full_after} full blocks",
                        h.len()
                    ),
                ));
            }
        }
        let full = slot.commit_tokens(tokens, bs);
        let mut out = Vec::with_capacity(full.len());
        for b in full {
            let h = match hashes {
                Some(h) => h[b],
                None => {
                    let parent = if b == 0 { seed } else { slot.hashes[b - 1] };
                    self.hasher
                        .hash(parent, &slot.tokens[b * bs..(b + 1) * bs], slot.extra_key)
                }
            };
            slot.hashes.push(h);
            out.push(CommittedBlock {
                index: b,
                block: slot.blocks[b],
                hash: h,
            });
        }
        Ok(out)
    }

    pub fn rollback(&mut self, request_id: &str, n: usize) -> Result<()> {
        let slot = self.slot_mut(request_id)?;
        slot.check_rollback(n)?;
        slot.pending -= n;
        Ok(())
    }

    /// Sets K; shrinking below the reserved K hands back the surplus trailing blocks.
    pub fn set_lookahead(&mut self, request_id: &str, k: usize) -> Result<Vec<BlockId>> {
        let bs = self.block_size;
        let slot = self.slot_mut(request_id)?;
        slot.lookahead = k;
        if k >= slot.reserved_lookahead {
            return Ok(Vec::new());
        }
        slot.reserved_lookahead = k;
        let surplus = slot.surplus_blocks(slot.tokens_needed(0, k).unwrap_or(usize::MAX), bs);
        let keep = slot.blocks.len() - surplus;
        Ok(slot.blocks.split_off(keep))
    }

    /// Checks every slot's accounting (tests and debugging): capacity covers committed +
    /// pending + the reserved lookahead, and the immutable blocks are exactly the full
    /// committed ones. All arithmetic is checked.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let bs = self.block_size;
        for (rid, slot) in &self.slots {
            let info = slot.info(bs);
            let promised = info
                .committed
                .checked_add(info.pending)
                .and_then(|t| t.checked_add(info.reserved_lookahead))
                .ok_or_else(|| {
                    format!(
                        "{rid:?}: committed {} + pending {} + lookahead {} overflows",
                        info.committed, info.pending, info.reserved_lookahead
                    )
                })?;
            if info.capacity < promised {
                return Err(format!(
                    "{rid:?}: capacity {} < committed {} + pending {} + lookahead {}",
                    info.capacity, info.committed, info.pending, info.reserved_lookahead
                ));
            }
            if slot.hashes.len() != slot.committed() / bs || slot.hashes.len() > slot.blocks.len() {
                return Err(format!(
                    "{rid:?}: {} immutable blocks for {} committed tokens in {} blocks",
                    slot.hashes.len(),
                    slot.committed(),
                    slot.blocks.len()
                ));
            }
            if rid != &slot.request_id {
                return Err(format!("{rid:?}: slot names {:?}", slot.request_id));
            }
        }
        Ok(())
    }

    /// Forgets a request and returns its slot (block ids included) to the caller.
    pub fn finish(&mut self, request_id: &str) -> Result<Slot> {
        self.slots
            .remove(request_id)
            .ok_or_else(|| SlotError::UnknownRequest {
                request: request_id.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eagle_step_over_external_blocks() {
        let mut t = SlotTracker::new(4, 0).unwrap();
        t.add("r", 2, None).unwrap();
        // Prefill 6 tokens with K=2: needs ceil(8/4) = 2 blocks.
        assert_eq!(t.blocks_needed("r", 6).unwrap(), 2);
        assert!(matches!(
            t.reserve("r", 6, &[10]),
            Err(SlotError::OutOfBlocks { .. })
        ));
        assert_eq!(
            t.info("r").unwrap().pending,
            0,
            "failed reserve changes nothing"
        );
        t.reserve("r", 6, &[10, 11]).unwrap();
        let c = t.commit("r", &[1, 2, 3, 4, 5, 6], None).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].index, c[0].block), (0, 10));
        // Decode step: 1 + K = 3 new positions, lookahead 2 -> 6 + 3 + 2 = 11 -> 3 blocks.
        assert_eq!(t.blocks_needed("r", 3).unwrap(), 1);
        t.reserve("r", 3, &[12]).unwrap();
        // One draft accepted: commit 2 tokens (sampled + accepted), reject 1.
        let c = t.commit("r", &[7, 8], Some(&[100, 200])).unwrap();
        assert_eq!(
            c,
            vec![CommittedBlock {
                index: 1,
                block: 11,
                hash: 200
            }]
        );
        assert!(matches!(
            t.rollback("r", 2),
            Err(SlotError::InvalidRollback { .. })
        ));
        t.rollback("r", 1).unwrap();
        // Shrink K to 0: 8 committed need 2 blocks; block 12 comes back.
        assert_eq!(t.set_lookahead("r", 0).unwrap(), vec![12]);
        assert_eq!(t.finish("r").unwrap().blocks(), &[10, 11]);
    }

    #[test]
    fn reserve_refuses_a_block_twice() {
        let mut t = SlotTracker::new(4, 0).unwrap();
        t.add("r", 0, None).unwrap();
        let e = t.reserve("r", 8, &[5, 5]).unwrap_err();
        assert!(matches!(e, SlotError::InvalidArgument { .. }), "{e:?}");
        assert!(t.slot("r").unwrap().blocks.is_empty());
        t.reserve("r", 4, &[5]).unwrap();
        assert!(t.reserve("r", 4, &[5]).is_err());
        assert_eq!(t.slot("r").unwrap().blocks, vec![5]);
        t.reserve("r", 4, &[6]).unwrap();
        assert_eq!(t.slot("r").unwrap().blocks, vec![5, 6]);
    }
}
