//! Caller numbers near the top of their range: every call either succeeds or returns an error,
//! never wraps, never panics, and a failed call changes nothing.

use kvslots_core::{ManagerConfig, SlotError, SlotManager, SlotTracker, StepInput, StepOutput};

fn snapshot(m: &SlotManager) -> String {
    let mut ids: Vec<&str> = m.request_ids().collect();
    ids.sort_unstable();
    let slots: Vec<_> = ids
        .iter()
        .map(|r| (m.slot_info(r).unwrap(), m.block_table(r).unwrap().to_vec()))
        .collect();
    format!(
        "{slots:?} {:?} {} {}",
        m.stats(),
        m.num_free(),
        m.num_cached()
    )
}

#[test]
fn huge_reserve_is_refused_not_wrapped() {
    for bs in [1usize, 16, u32::MAX as usize] {
        let mut m = SlotManager::new(ManagerConfig::new(8, bs)).unwrap();
        m.create("a", &[], 1 << 62, false, None).unwrap();
        for n in [usize::MAX, usize::MAX - 1, 1 << 63, 1 << 62, (1 << 62) + 5] {
            let before = snapshot(&m);
            assert!(matches!(
                m.reserve("a", n),
                Err(SlotError::OutOfBlocks { .. })
            ));
            assert_eq!(snapshot(&m), before);
        }
        m.check_invariants().unwrap();
    }
}

#[test]
fn huge_reserve_after_a_fitting_one() {
    // A block size near u32::MAX makes huge token counts fit in few blocks.
    let bs = u32::MAX as usize;
    let mut m = SlotManager::new(ManagerConfig::new(4, bs)).unwrap();
    m.create("a", &[], 0, false, None).unwrap();
    assert_eq!(m.reserve("a", bs * 3).unwrap(), 3);
    let before = snapshot(&m);
    assert!(m.reserve("a", usize::MAX - 10).is_err());
    assert!(m.set_lookahead("a", usize::MAX).is_ok());
    assert!(m.reserve("a", 1).is_err());
    assert_eq!(m.set_lookahead("a", 0).unwrap(), 0);
    assert_eq!(snapshot(&m).len(), before.len());
    m.commit("a", &[1, 2, 3]).unwrap();
    m.check_invariants().unwrap();
    let mut out = StepOutput::default();
    let id = m.slot_id("a").unwrap();
    let before = snapshot(&m);
    let e = m.step(
        &StepInput {
            slots: &[id],
            num_accepted: &[0],
            accepted_tokens: &[],
            num_rejected: &[0],
            num_new_tokens: &[u32::MAX],
            lookahead: Some(&[u32::MAX]),
        },
        &mut out,
    );
    assert!(matches!(e, Err(SlotError::OutOfBlocks { .. })), "{e:?}");
    assert_eq!(snapshot(&m), before);
    m.check_invariants().unwrap();
}

#[test]
fn limit_checks_do_not_wrap() {
    let mut cfg = ManagerConfig::new(8, 4);
    cfg.max_tokens_per_slot = Some(100);
    let mut m = SlotManager::new(cfg).unwrap();
    m.create("a", &[1, 2, 3], 0, true, None).unwrap();
    m.reserve("a", 3).unwrap();
    assert!(matches!(
        m.reserve("a", usize::MAX),
        Err(SlotError::CapacityExceeded { .. })
    ));
    m.check_invariants().unwrap();
}

#[test]
fn block_size_is_bounded() {
    for bs in [0usize, u32::MAX as usize + 1, usize::MAX] {
        assert!(SlotManager::new(ManagerConfig::new(4, bs)).is_err());
        assert!(SlotTracker::new(bs, 0).is_err());
        assert!(kvslots_core::HostCache::new(4, bs).is_err());
    }
}

#[test]
fn tracker_overflow_is_an_error() {
    let mut t = SlotTracker::new(u32::MAX as usize, 0).unwrap();
    t.add("a", usize::MAX, None).unwrap();
    assert!(t.blocks_needed("a", 1).is_err());
    assert!(t.reserve("a", 1, &[1, 2, 3]).is_err());
    t.set_lookahead("a", 0).unwrap();
    t.reserve("a", usize::MAX - 1, &[]).unwrap_err();
    t.reserve("a", u32::MAX as usize * 2, &[7, 8]).unwrap();
    assert!(t.blocks_needed("a", usize::MAX).is_err());
    assert!(t.set_lookahead("a", usize::MAX).unwrap().is_empty());
    assert_eq!(t.info("a").unwrap().capacity, u32::MAX as usize * 2);
    t.check_invariants().unwrap();
}
