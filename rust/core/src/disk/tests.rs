use super::*;
use crate::events::KvEvent;
use proptest::prelude::*;

fn meta(h: u64, bs: usize) -> BlockMeta {
    BlockMeta {
        hash: h,
        parent: None,
        lora: None,
        successor: h as u32 + 1000,
        tokens: vec![h as u32; bs],
    }
}

#[test]
fn writes_are_invisible_until_written_and_evict_lru_unpinned() {
    let mut d = DiskIndex::new(2, 2).unwrap();
    assert!(d.begin_write(BlockMeta { tokens: vec![1], ..meta(1, 2) }).is_err());
    let a = d.begin_write(meta(1, 2)).unwrap().unwrap();
    assert_eq!(d.match_prefix(&[1]), 0, "not visible while writing");
    assert_eq!(d.begin_write(meta(1, 2)).unwrap(), None, "no double write");
    d.complete_write(a, true).unwrap();
    let b = d.begin_write(meta(2, 2)).unwrap().unwrap();
    d.complete_write(b, true).unwrap();
    assert_eq!(d.match_prefix(&[1, 2, 3]), 2);
    assert_eq!(d.successor(2), 1002);
    let ev = d.events_mut().drain();
    assert_eq!(ev.len(), 2);
    assert!(matches!(&ev[0], KvEvent::BlockStored { block_hashes, token_ids, .. }
        if block_hashes == &vec![1] && token_ids == &vec![1, 1]));
    // Reading 1 makes it the most recent and pins it: 2 is evicted first, then nothing.
    let r = d.begin_read(&[1]).unwrap();
    let c = d.begin_write(meta(3, 2)).unwrap().unwrap();
    assert_eq!(c, b);
    assert_eq!(
        d.events_mut().drain(),
        vec![KvEvent::BlockRemoved { block_hashes: vec![2] }]
    );
    assert_eq!(d.begin_write(meta(4, 2)).unwrap(), None, "1 pinned, 3 writing");
    assert_eq!(d.stats().writes_skipped_full, 1);
    assert!(!d.remove(1), "pinned");
    d.end_read(&r).unwrap();
    assert!(d.end_read(&r).is_err(), "not pinned twice");
    d.complete_write(c, false).unwrap();
    assert!(d.complete_write(c, true).is_err());
    assert!(d.remove(1));
    assert_eq!(d.num_free(), 2);
    d.check().unwrap();
}

#[test]
fn restore_keeps_the_latest_record_of_a_hash_in_write_order() {
    let mut d = DiskIndex::new(4, 1).unwrap();
    let dropped = d
        .restore(vec![
            (0, meta(7, 1), 5),
            (1, meta(8, 1), 2),
            (2, meta(7, 1), 9),
            (9, meta(6, 1), 1),
        ])
        .unwrap();
    assert_eq!(dropped.len(), 2, "an older copy of 7 and a slot out of range");
    assert!(dropped.contains(&0) && dropped.contains(&9));
    assert_eq!(d.lookup(7), Some(2));
    assert_eq!(d.num_stored(), 2);
    // 8 was written first: evicted first once the two free slots are used.
    for h in [10, 11] {
        let s = d.begin_write(meta(h, 1)).unwrap().unwrap();
        d.complete_write(s, true).unwrap();
    }
    d.events_mut().clear();
    let s = d.begin_write(meta(12, 1)).unwrap().unwrap();
    assert_eq!(s, 1);
    assert_eq!(
        d.events_mut().drain(),
        vec![KvEvent::BlockRemoved { block_hashes: vec![8] }]
    );
    assert!(d.restore(vec![]).is_err(), "only on an empty index");
    d.check().unwrap();
}

/// The reference model: an LRU list of stored hashes (oldest first), writes under way, pins.
#[derive(Default)]
struct Model {
    cap: usize,
    lru: Vec<u64>,
    writing: Vec<u64>,
    pins: std::collections::HashMap<u64, u32>,
}

#[derive(Debug, Clone)]
enum Op {
    Write(u64),
    Complete(usize, bool),
    Read(Vec<u64>),
    EndRead(usize),
    Remove(u64),
    Match(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..12).prop_map(Op::Write),
        4 => (0usize..8, prop::bool::weighted(0.85)).prop_map(|(i, ok)| Op::Complete(i, ok)),
        2 => prop::collection::vec(0u64..12, 1..4).prop_map(Op::Read),
        2 => (0usize..8).prop_map(Op::EndRead),
        1 => (0u64..12).prop_map(Op::Remove),
        2 => prop::collection::vec(0u64..12, 0..5).prop_map(Op::Match),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn agrees_with_the_reference_model(cap in 1usize..6, ops in prop::collection::vec(op(), 1..80)) {
        let mut d = DiskIndex::new(cap, 1).unwrap();
        let mut m = Model { cap, ..Default::default() };
        let mut writes: Vec<(u32, u64)> = Vec::new();
        let mut reads: Vec<(Vec<u32>, Vec<u64>)> = Vec::new();
        for op in ops {
            d.events_mut().clear();
            match op {
                Op::Write(h) => {
                    let got = d.begin_write(meta(h, 1)).unwrap();
                    let present = m.lru.contains(&h) || m.writing.contains(&h);
                    let busy = m.lru.len() + m.writing.len();
                    let victim = m.lru.iter().position(|x| m.pins.get(x).copied().unwrap_or(0) == 0);
                    let expect = !present && (busy < m.cap || victim.is_some());
                    prop_assert_eq!(got.is_some(), expect);
                    if let Some(s) = got {
                        let mut removed = vec![];
                        if busy == m.cap {
                            removed.push(m.lru.remove(victim.unwrap()));
                        }
                        let ev: Vec<_> = d.events_mut().drain().into_iter().filter_map(|e| match e {
                            KvEvent::BlockRemoved { block_hashes } => Some(block_hashes),
                            _ => None,
                        }).flatten().collect();
                        prop_assert_eq!(ev, removed);
                        m.writing.push(h);
                        writes.push((s, h));
                    }
                }
                Op::Complete(i, ok) => {
                    if writes.is_empty() { continue; }
                    let (s, h) = writes.remove(i % writes.len());
                    d.complete_write(s, ok).unwrap();
                    m.writing.retain(|&x| x != h);
                    if ok { m.lru.push(h); }
                }
                Op::Read(hs) => {
                    let got = d.begin_read(&hs);
                    let all = hs.iter().all(|h| m.lru.contains(h));
                    prop_assert_eq!(got.is_ok(), all);
                    if let Ok(slots) = got {
                        for h in &hs {
                            *m.pins.entry(*h).or_default() += 1;
                            m.lru.retain(|x| x != h);
                            m.lru.push(*h);
                        }
                        reads.push((slots, hs));
                    }
                }
                Op::EndRead(i) => {
                    if reads.is_empty() { continue; }
                    let (slots, hs) = reads.remove(i % reads.len());
                    d.end_read(&slots).unwrap();
                    for h in hs { *m.pins.get_mut(&h).unwrap() -= 1; }
                }
                Op::Remove(h) => {
                    let expect = m.lru.contains(&h) && m.pins.get(&h).copied().unwrap_or(0) == 0;
                    prop_assert_eq!(d.remove(h), expect);
                    if expect { m.lru.retain(|&x| x != h); }
                }
                Op::Match(hs) => {
                    let n = hs.iter().take_while(|h| m.lru.contains(h)).count();
                    prop_assert_eq!(d.match_prefix(&hs), n);
                }
            }
            prop_assert!(m.lru.len() + m.writing.len() <= cap);
            prop_assert_eq!(d.num_stored(), m.lru.len());
            prop_assert_eq!(d.num_writing(), m.writing.len());
            prop_assert_eq!(d.check(), Ok(()));
        }
    }
}

#[test]
fn clear_drops_unpinned_blocks_as_one_block_removed_with_their_hashes() {
    let mut d = DiskIndex::new(4, 2).unwrap();
    for h in 1..=3 {
        let s = d.begin_write(meta(h, 2)).unwrap().unwrap();
        d.complete_write(s, true).unwrap();
    }
    let w = d.begin_write(meta(9, 2)).unwrap().unwrap();
    let r = d.begin_read(&[2]).unwrap();
    d.events_mut().clear();
    assert_eq!(d.clear(), 2, "the pinned block stays, the write under way too");
    let ev = d.events_mut().drain();
    assert_eq!(ev.len(), 1);
    assert!(matches!(&ev[0], KvEvent::BlockRemoved { block_hashes } if {
        let mut h = block_hashes.clone();
        h.sort_unstable();
        h == vec![1, 3]
    }), "a medium-carrying removal, not AllBlocksCleared: {ev:?}");
    assert!(d.contains(2) && !d.contains(1) && d.num_writing() == 1);
    d.end_read(&r).unwrap();
    d.complete_write(w, true).unwrap();
    d.events_mut().clear();
    assert_eq!(d.clear(), 2);
    assert_eq!(d.clear(), 0);
    assert!(d.events_mut().drain().len() == 1, "nothing published for an empty clear");
    d.check().unwrap();
}

fn stored_events(d: &mut DiskIndex) -> Vec<(Vec<u64>, Option<Vec<u32>>)> {
    d.events_mut()
        .drain()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { block_hashes, successors, .. } => Some((block_hashes, successors)),
            _ => None,
        })
        .collect()
}

#[test]
fn storage_events_carry_successors_when_published_on_write_and_restore() {
    let mut d = DiskIndex::new(3, 1).unwrap();
    d.set_publish_successors(true);
    assert!(d.publishes_successors());
    let a = d.begin_write(meta(1, 1)).unwrap().unwrap();
    let b = d.begin_write(BlockMeta { successor: NO_SUCCESSOR, ..meta(2, 1) }).unwrap().unwrap();
    assert!(stored_events(&mut d).is_empty(), "nothing published while writing");
    d.complete_write(b, true).unwrap();
    d.complete_write(a, true).unwrap();
    assert_eq!(
        stored_events(&mut d),
        vec![(vec![2], Some(vec![NO_SUCCESSOR])), (vec![1], Some(vec![1001]))]
    );
    // A failed write publishes nothing.
    let c = d.begin_write(meta(3, 1)).unwrap().unwrap();
    d.complete_write(c, false).unwrap();
    assert!(stored_events(&mut d).is_empty());

    // A restart rebuilds the index from the records, successors included, and publishes them.
    let mut r = DiskIndex::new(3, 1).unwrap();
    r.set_publish_successors(true);
    r.restore(vec![(0, meta(1, 1), 2), (1, BlockMeta { successor: NO_SUCCESSOR, ..meta(2, 1) }, 1)])
        .unwrap();
    assert_eq!(
        stored_events(&mut r),
        vec![(vec![2], Some(vec![NO_SUCCESSOR])), (vec![1], Some(vec![1001]))]
    );
    // Off (the default): the same events without the field.
    let mut r = DiskIndex::new(3, 1).unwrap();
    r.restore(vec![(0, meta(1, 1), 2)]).unwrap();
    assert_eq!(stored_events(&mut r), vec![(vec![1], None)]);
}
