//! The EAGLE last-block rule. An EAGLE-family drafter's KV at a block's last position depends on
//! the token after the block. With vLLM's token-only block hashes the engine therefore recomputes
//! the last block of every prefix hit; kvslots' connector serves it from its host or disk tier
//! when the request's next token equals the *successor* recorded with the stored block (published
//! as that block's `lookahead_token_ids` on medium CPU / STORAGE); vLLM 0.33's lookahead hashes
//! put that token into the key itself, so such a block is served whenever its key matched.
//!
//! For a worker marked EAGLE, a prompt's score counts the last matched block only when the
//! engine would serve it. What the index knows about a (worker, block) for this rule is a
//! [`LastBlock`]; the holder value mirrored to a shared store packs it with the tier mask
//! ([`holder_value`]), so the in-memory lookup and the Redis backend decide with one function,
//! [`serves_last`].

use super::Tier;

const TIER_MASK: u64 = 0b111;
const KEYED_AHEAD: u64 = 1 << 3;
const HAS_SUCCESSOR: u64 = 1 << 4;
const HOST_TIERS: u64 = (1 << Tier::Cpu as u8) | (1 << Tier::Storage as u8);

/// What decides whether a held block can be the last block of a hit on an EAGLE worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LastBlock(u64);

impl LastBlock {
    /// Nothing known: served as a last block only by a non-EAGLE worker.
    pub const UNKNOWN: LastBlock = LastBlock(0);

    /// The block's key covers the tokens after it (vLLM 0.33 lookahead hashes): a lookup that
    /// found the key has those tokens next.
    pub const KEYED_AHEAD: LastBlock = LastBlock(KEYED_AHEAD);

    /// A host or disk block whose stored draft KV was written with `token` after it.
    pub fn successor(token: u32) -> Self {
        LastBlock(HAS_SUCCESSOR | (u64::from(token) << 32))
    }

    /// The packed form (as in [`holder_value`], without tier bits).
    pub fn bits(self) -> u64 {
        self.0
    }

    /// From [`bits`](Self::bits) (or a holder value: its tier bits are ignored).
    pub fn from_bits(bits: u64) -> Self {
        LastBlock(bits & !TIER_MASK & (KEYED_AHEAD | HAS_SUCCESSOR | (u64::from(u32::MAX) << 32)))
    }
}

/// A worker's holding of a block as one integer: its tier mask (bit 0 GPU, 1 CPU, 2 STORAGE)
/// and its [`LastBlock`]. Zero exactly when it holds the block on no tier.
pub fn holder_value(tiers: u8, last: LastBlock) -> u64 {
    if tiers & TIER_MASK as u8 == 0 {
        0
    } else {
        u64::from(tiers) & TIER_MASK | last.0
    }
}

/// The tier mask of a holder value.
pub fn holder_tiers(value: u64) -> u8 {
    (value & TIER_MASK) as u8
}

/// Whether an EAGLE worker holding a block as `value` serves it as the last block of a hit for
/// a prompt whose next token is `next` (`None`: the prompt ends with the block, and the engine
/// computes at least one prompt token).
pub fn serves_last(value: u64, next: Option<u32>) -> bool {
    if value & TIER_MASK == 0 {
        return false;
    }
    if value & KEYED_AHEAD != 0 {
        return true;
    }
    value & HOST_TIERS != 0 && value & HAS_SUCCESSOR != 0 && next == Some((value >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_block_serves_its_recorded_successor_only() {
        let cpu = 1 << Tier::Cpu as u8;
        let v = holder_value(cpu, LastBlock::successor(7));
        assert!(serves_last(v, Some(7)));
        assert!(!serves_last(v, Some(8)));
        assert!(!serves_last(v, None));
        // Token ids use all 32 bits.
        let v = holder_value(cpu, LastBlock::successor(u32::MAX));
        assert!(serves_last(v, Some(u32::MAX)));
        assert!(!serves_last(v, Some(0)));
    }

    #[test]
    fn a_device_only_block_needs_a_lookahead_key() {
        let gpu = 1 << Tier::Gpu as u8;
        assert!(!serves_last(
            holder_value(gpu, LastBlock::successor(7)),
            Some(7)
        ));
        assert!(!serves_last(holder_value(gpu, LastBlock::UNKNOWN), Some(7)));
        assert!(serves_last(
            holder_value(gpu, LastBlock::KEYED_AHEAD),
            Some(7)
        ));
        assert_eq!(holder_value(0, LastBlock::successor(3)), 0);
        assert!(!serves_last(0, Some(3)));
    }

    #[test]
    fn packing_round_trips() {
        for last in [
            LastBlock::UNKNOWN,
            LastBlock::KEYED_AHEAD,
            LastBlock::successor(0),
            LastBlock::successor(123_456),
        ] {
            let v = holder_value(0b101, last);
            assert_eq!(holder_tiers(v), 0b101);
            assert_eq!(LastBlock::from_bits(v), last);
        }
    }
}
