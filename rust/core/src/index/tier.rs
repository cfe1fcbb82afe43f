//! The storage tiers a block can be held on, as the events' `medium` field names them.

/// A storage tier, as named by the events' `medium` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Storage = 2,
}

pub const NUM_TIERS: usize = 3;

impl Tier {
    pub const ALL: [Tier; NUM_TIERS] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// vLLM's medium names (`GPU`, `CPU`, `STORAGE`), case-insensitively; `DISK` is STORAGE.
    pub fn parse(s: &str) -> Option<Tier> {
        if s.eq_ignore_ascii_case("GPU") {
            Some(Tier::Gpu)
        } else if s.eq_ignore_ascii_case("CPU") {
            Some(Tier::Cpu)
        } else if s.eq_ignore_ascii_case("STORAGE") || s.eq_ignore_ascii_case("DISK") {
            Some(Tier::Storage)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Storage => "STORAGE",
        }
    }

    #[inline]
    pub(super) fn bit(self) -> u8 {
        1 << (self as u8)
    }
}
