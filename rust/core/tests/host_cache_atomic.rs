//! HostCache calls that fail change nothing; a block listed twice cannot drop a refcount twice;
//! a store owned by a step run is finished by that step only.

use kvslots_core::{HostCache, PendingStore};

fn snapshot(c: &HostCache) -> String {
    let p = c.pool();
    let mut reg: Vec<u64> = p.registered_hashes().collect();
    reg.sort_unstable();
    let refs: Vec<u32> = (0..p.num_blocks() as u32).map(|b| p.refcount(b)).collect();
    format!(
        "{reg:?} {refs:?} {:?} {} {} {:?} {}",
        p.lru_order(),
        c.num_storing(),
        c.pending_steps(),
        c.stats(),
        c.events().len()
    )
}

#[test]
fn duplicate_blocks_in_end_load_are_refused() {
    let mut c = HostCache::new(4, 1).unwrap();
    let s = c.begin_store(&[10]);
    c.complete_store(&[s[0].1], None, &[1], None).unwrap();
    let b = c.begin_load("r", &[10]).unwrap();
    let before = snapshot(&c);
    assert!(c.end_load(&[b[0], b[0]]).is_err());
    assert!(c.end_load(&[b[0], 99]).is_err());
    assert_eq!(snapshot(&c), before);
    // Pinned twice, released twice: fine.
    let b2 = c.begin_load("r", &[10, 10]).unwrap();
    c.end_load(&b2).unwrap();
    c.end_load(&b).unwrap();
    assert!(c.end_load(&b).is_err(), "no longer held");
    c.pool().check().unwrap();
}

#[test]
fn duplicate_or_mismatched_stores_are_refused() {
    let mut c = HostCache::new(4, 1).unwrap();
    let s: Vec<PendingStore> = c.begin_store(&[10, 20]).into_iter().map(|x| x.1).collect();
    let before = snapshot(&c);
    let dup = [s[0], s[0]];
    assert!(c.complete_store(&dup, None, &[1, 1], None).is_err());
    assert!(c.abort_store(&dup).is_err());
    let swapped = [PendingStore {
        hash: 10,
        block: s[1].block,
    }];
    assert!(c.complete_store(&swapped, None, &[1], None).is_err());
    assert!(c.abort_store(&swapped).is_err());
    assert!(
        c.complete_store(&s, None, &[1], None).is_err(),
        "token count"
    );
    assert_eq!(snapshot(&c), before);
    c.complete_store(&s, None, &[1, 2], None).unwrap();
    c.pool().check().unwrap();
}

#[test]
fn step_runs_are_finished_by_their_step_only() {
    let mut c = HostCache::new(8, 1).unwrap();
    let a = c.begin_store_run(3, &[1, 2], None, &[1, 2], None).unwrap();
    let before = snapshot(&c);
    let st = PendingStore {
        hash: 1,
        block: a[0].1,
    };
    assert!(c.abort_store(&[st]).is_err());
    assert!(c.complete_store(&[st], None, &[1], None).is_err());
    assert_eq!(snapshot(&c), before);
    assert_eq!(c.complete_step(3, &[u32::MAX, 77]).unwrap(), 2);
    assert_eq!(c.num_storing(), 0);
    assert_eq!(c.pending_steps(), 0);
    assert_eq!(c.complete_step(3, &[]).unwrap(), 0);
    c.pool().check().unwrap();
}

#[test]
fn token_count_overflow_is_an_error() {
    let mut c = HostCache::new(2, u32::MAX as usize).unwrap();
    let hashes = vec![0u64; 5];
    assert!(c.begin_store_run(1, &hashes, None, &[], None).is_err());
    assert_eq!(c.num_storing(), 0);
}
