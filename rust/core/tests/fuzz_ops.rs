//! Property harness over random operation sequences (proptest), against a plain model.
//!
//! Every operation of `SlotManager`, `SlotTracker` and `HostCache` is drawn with arguments that
//! are often valid, sometimes wrong and sometimes at the ends of their range (0, 2**32, 2**62,
//! usize::MAX). After each one: it either succeeded as the model says or failed with the
//! model's error kind having changed nothing (a snapshot of everything observable), and every
//! invariant holds. Nothing may panic.
//!
//! Cases: 256 per test by default; `PROPTEST_CASES=100000 cargo test -p kvslots-core --release
//! --test fuzz_ops` for a long run (`scripts/fuzz.sh` does that and the Python side). A failing
//! case is shrunk by proptest and saved under `rust/core/proptest-regressions/` (commit it);
//! reduced cases found while writing this harness are the named tests of `tests/overflow.rs`
//! and `tests/host_cache_atomic.rs`.

use std::collections::HashMap;

use kvslots_core::{
    HostCache, ManagerConfig, PendingStore, SlotError, SlotManager, SlotTracker, StepInput,
    StepOutput,
};
use proptest::prelude::*;

/// Counts drawn from small values and the ends of every range.
fn count() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..12,
        1 => Just(u32::MAX as usize),
        1 => Just(1usize << 62),
        1 => Just(usize::MAX),
        1 => Just(usize::MAX - 3),
    ]
}

fn u32s() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0u32..8, 1 => Just(u32::MAX), 1 => Just(u32::MAX - 1)]
}

#[derive(Debug, Clone)]
enum Op {
    Create(u8, Vec<u32>, usize, bool),
    Reserve(u8, usize),
    Commit(u8, Vec<u32>),
    Rollback(u8, usize),
    SetLookahead(u8, usize),
    Finish(u8),
    Evict(usize),
    Clear,
    Step(Vec<(u8, u32, u32, u32, Option<u32>)>, u8),
}

fn op() -> impl Strategy<Value = Op> {
    let rid = 0u8..4;
    let toks = prop::collection::vec(0u32..3, 0..10);
    prop_oneof![
        1 => (rid.clone(), toks.clone(), count(), any::<bool>()).prop_map(|(r, t, k, m)| Op::Create(r, t, k, m)),
        3 => (rid.clone(), count()).prop_map(|(r, n)| Op::Reserve(r, n)),
        3 => (rid.clone(), toks.clone()).prop_map(|(r, t)| Op::Commit(r, t)),
        1 => (rid.clone(), count()).prop_map(|(r, n)| Op::Rollback(r, n)),
        1 => (rid.clone(), count()).prop_map(|(r, k)| Op::SetLookahead(r, k)),
        1 => (rid.clone()).prop_map(Op::Finish),
        1 => count().prop_map(Op::Evict),
        1 => Just(Op::Clear),
        2 => (prop::collection::vec((rid, u32s(), u32s(), u32s(), prop::option::of(u32s())), 0..4), 0u8..3)
            .prop_map(|(v, t)| Op::Step(v, t)),
    ]
}

/// Everything a caller can observe of a manager.
fn snapshot(m: &SlotManager) -> String {
    let mut ids: Vec<&str> = m.request_ids().collect();
    ids.sort_unstable();
    let slots: Vec<_> = ids
        .iter()
        .map(|r| {
            let s = m.slot(r).unwrap();
            (
                r.to_string(),
                m.slot_info(r).unwrap(),
                s.blocks().to_vec(),
                s.tokens().to_vec(),
            )
        })
        .collect();
    let mut reg: Vec<u64> = m.pool().registered_hashes().collect();
    reg.sort_unstable();
    format!(
        "{slots:?} {:?} {} {} {} {:?} {reg:?} {}",
        m.stats(),
        m.num_free(),
        m.num_held(),
        m.num_cached(),
        m.pool().lru_order(),
        m.events().len()
    )
}

/// The model: per request, committed / pending / lookahead / reserved lookahead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    committed: usize,
    pending: usize,
    lookahead: usize,
    reserved: usize,
}

fn name(r: u8) -> String {
    format!("r{r}")
}

fn check_model(m: &SlotManager, model: &HashMap<String, Counts>) {
    assert_eq!(m.num_slots(), model.len());
    for (r, c) in model {
        let i = m.slot_info(r).unwrap();
        assert_eq!(
            (i.committed, i.pending, i.lookahead, i.reserved_lookahead),
            (c.committed, c.pending, c.lookahead, c.reserved),
            "{r}"
        );
    }
}

fn run_manager(num_blocks: usize, block_size: usize, limit: Option<usize>, ops: &[Op]) {
    let mut cfg = ManagerConfig::new(num_blocks, block_size);
    cfg.max_tokens_per_slot = limit;
    let mut m = SlotManager::new(cfg).unwrap();
    let mut model: HashMap<String, Counts> = HashMap::new();
    let mut out = StepOutput::default();
    for op in ops {
        let before = snapshot(&m);
        let res: Result<(), SlotError> = match op {
            Op::Create(r, prompt, k, mp) => {
                let res = m.create(&name(*r), prompt, *k, *mp, None);
                if let Ok((_, matched)) = res {
                    assert!(!model.contains_key(&name(*r)));
                    model.insert(
                        name(*r),
                        Counts {
                            committed: matched,
                            lookahead: *k,
                            ..Default::default()
                        },
                    );
                } else if let Err(SlotError::DuplicateRequest { .. }) = res {
                    assert!(model.contains_key(&name(*r)));
                }
                res.map(|_| ())
            }
            Op::Reserve(r, n) => {
                let res = m.reserve(&name(*r), *n);
                if res.is_ok() {
                    let c = model.get_mut(&name(*r)).unwrap();
                    c.pending += n;
                    c.reserved = c.lookahead;
                }
                res.map(|_| ())
            }
            Op::Commit(r, t) => {
                let res = m.commit(&name(*r), t);
                match (&res, model.get_mut(&name(*r))) {
                    (Ok(_), Some(c)) => {
                        assert!(t.len() <= c.pending);
                        c.committed += t.len();
                        c.pending -= t.len();
                    }
                    (Err(SlotError::CapacityExceeded { .. }), Some(c)) => {
                        assert!(t.len() > c.pending)
                    }
                    (Err(SlotError::UnknownRequest { .. }), None) => {}
                    (r, c) => panic!("commit {t:?}: {r:?} with model {c:?}"),
                }
                res.map(|_| ())
            }
            Op::Rollback(r, n) => {
                let res = m.rollback(&name(*r), *n);
                match (&res, model.get_mut(&name(*r))) {
                    (Ok(_), Some(c)) => c.pending -= n,
                    (Err(SlotError::InvalidRollback { .. }), Some(c)) => assert!(*n > c.pending),
                    (Err(SlotError::UnknownRequest { .. }), None) => {}
                    (r, c) => panic!("rollback {n}: {r:?} with model {c:?}"),
                }
                res
            }
            Op::SetLookahead(r, k) => {
                let res = m.set_lookahead(&name(*r), *k);
                if let Some(c) = model.get_mut(&name(*r)) {
                    assert!(res.is_ok());
                    c.lookahead = *k;
                    c.reserved = c.reserved.min(*k);
                }
                res.map(|_| ())
            }
            Op::Finish(r) => {
                let res = m.finish(&name(*r));
                assert_eq!(res.is_ok(), model.remove(&name(*r)).is_some());
                res
            }
            Op::Evict(n) => {
                let cached = m.num_cached();
                assert_eq!(m.evict(*n), cached.min(*n));
                Ok(())
            }
            Op::Clear => {
                m.clear_cache();
                Ok(())
            }
            Op::Step(rows, ntok) => {
                let ids: Vec<u64> = rows
                    .iter()
                    .map(|r| m.slot_id(&name(r.0)).unwrap_or(u64::MAX))
                    .collect();
                let acc: Vec<u32> = rows.iter().map(|r| r.1).collect();
                let total: u64 = acc.iter().map(|&a| a as u64).sum();
                // Mostly consistent token counts, sometimes not.
                let tokens: Vec<u32> = if *ntok == 0 || total > 64 {
                    vec![1; (*ntok as usize) * 3]
                } else {
                    vec![2; total as usize]
                };
                let rej: Vec<u32> = rows.iter().map(|r| r.2).collect();
                let new: Vec<u32> = rows.iter().map(|r| r.3).collect();
                let look: Option<Vec<u32>> = if rows.iter().all(|r| r.4.is_some()) {
                    Some(rows.iter().map(|r| r.4.unwrap()).collect())
                } else {
                    None
                };
                let input = StepInput {
                    slots: &ids,
                    num_accepted: &acc,
                    accepted_tokens: &tokens,
                    num_rejected: &rej,
                    num_new_tokens: &new,
                    lookahead: look.as_deref(),
                };
                let res = m.step(&input, &mut out);
                if res.is_ok() {
                    for (j, row) in rows.iter().enumerate() {
                        let c = model.get_mut(&name(row.0)).unwrap();
                        c.committed += acc[j] as usize;
                        c.pending = c.pending - acc[j] as usize - rej[j] as usize + new[j] as usize;
                        if let Some(l) = &look {
                            c.lookahead = l[j] as usize;
                        }
                        c.reserved = c.lookahead;
                    }
                    assert_eq!(out.num_new_blocks.len(), rows.len());
                }
                res
            }
        };
        if res.is_err() {
            assert_eq!(
                snapshot(&m),
                before,
                "{op:?} failed ({res:?}) but changed state"
            );
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("after {op:?}: {e}"));
        check_model(&m, &model);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_model(
        num_blocks in prop_oneof![1usize..24, Just(0usize)],
        block_size in prop_oneof![1usize..5, Just(u32::MAX as usize)],
        limit in prop::option::of(prop_oneof![1usize..40, Just(usize::MAX)]),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run_manager(num_blocks, block_size, limit, &ops);
    }

    #[test]
    fn tracker_never_panics_and_fails_cleanly(
        block_size in prop_oneof![1usize..5, Just(u32::MAX as usize)],
        ops in prop::collection::vec((0u8..6, 0u8..3, count(), prop::collection::vec(0u32..9, 0..4)), 1..40),
    ) {
        let mut t = SlotTracker::new(block_size, 0).unwrap();
        for (kind, r, n, v) in &ops {
            let rid = name(*r);
            let before = format!("{:?} {:?} {:?}", t.info(&rid), t.slot(&rid).map(|s| s.blocks().to_vec()), t.len());
            let res: Result<(), SlotError> = match kind {
                0 => t.add(&rid, *n, None),
                1 => t.blocks_needed(&rid, *n).map(|_| ()),
                2 => t.reserve(&rid, *n, v),
                3 => t.commit(&rid, v, None).map(|_| ()),
                4 => t.rollback(&rid, *n),
                _ => t.set_lookahead(&rid, *n).map(|_| ()),
            };
            if res.is_err() {
                let after = format!("{:?} {:?} {:?}", t.info(&rid), t.slot(&rid).map(|s| s.blocks().to_vec()), t.len());
                prop_assert_eq!(before, after);
            }
            prop_assert!(t.check_invariants().is_ok(), "{:?}", t.check_invariants());
        }
    }

    #[test]
    fn host_cache_never_panics_and_fails_cleanly(
        ops in prop::collection::vec((0u8..9, prop::collection::vec(0u64..6, 0..4), 0u64..3), 1..50),
    ) {
        let mut c = HostCache::new(5, 1).unwrap();
        let mut stores: Vec<PendingStore> = Vec::new();
        let mut loads: Vec<Vec<u32>> = Vec::new();
        for (kind, hashes, step) in &ops {
            let snap = |c: &HostCache| {
                let p = c.pool();
                let refs: Vec<u32> = (0..p.num_blocks() as u32).map(|b| p.refcount(b)).collect();
                let mut reg: Vec<u64> = p.registered_hashes().collect();
                reg.sort_unstable();
                format!("{refs:?} {reg:?} {:?} {} {} {}", p.lru_order(), c.num_storing(), c.pending_steps(), c.events().len())
            };
            let before = snap(&c);
            let toks = vec![1u32; hashes.len()];
            let res: Result<(), SlotError> = match kind {
                0 => { stores.extend(c.begin_store(hashes).into_iter().map(|x| x.1)); Ok(()) }
                1 => {
                    let pick: Vec<PendingStore> = stores.iter().copied().take(hashes.len()).collect();
                    let r = c.complete_store(&pick, None, &vec![1; pick.len()], None);
                    if r.is_ok() { stores.retain(|s| !pick.contains(s)); }
                    r
                }
                2 => {
                    // Sometimes a duplicate or a made-up store.
                    let mut pick: Vec<PendingStore> = stores.iter().copied().take(1).collect();
                    pick.extend(pick.clone());
                    pick.push(PendingStore { hash: hashes.first().copied().unwrap_or(0), block: 3 });
                    c.abort_store(&pick)
                }
                3 => c.begin_load("r", hashes).map(|b| loads.push(b)),
                4 => {
                    let b = loads.pop().unwrap_or_default();
                    let mut twice = b.clone();
                    twice.extend(b.iter().copied());
                    let r = c.end_load(if *step == 0 { &twice } else { &b });
                    if r.is_err() && *step != 0 { loads.push(b); }
                    r
                }
                5 => c.begin_store_run(*step, hashes, None, &toks, None).map(|_| ()),
                6 => c.complete_step(*step, &[0, 2]).map(|_| ()),
                7 => { c.match_prefix(hashes); Ok(()) }
                _ => { let s = stores.clone(); let r = c.abort_store(&s); if r.is_ok() { stores.clear(); } r }
            };
            if res.is_err() {
                prop_assert_eq!(before, snap(&c));
            }
            prop_assert!(c.pool().check().is_ok(), "{:?}", c.pool().check());
        }
    }
}
