use super::*;
use crate::hash::block_hash;
use serde::Serialize;

// Events in vLLM 0.32's wire shape: maps tagged by "type" (first), batch = [ts, events, rank].
#[derive(Serialize, Clone)]
struct Stored {
    #[serde(rename = "type")]
    ty: &'static str,
    block_hashes: Vec<u64>,
    parent_block_hash: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<u64>,
    medium: Option<&'static str>,
    lora_name: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    extra_keys: Option<Vec<Option<(String,)>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group_idx: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

#[derive(Serialize, Clone)]
struct Removed {
    #[serde(rename = "type")]
    ty: &'static str,
    block_hashes: Vec<u64>,
    medium: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group_idx: Option<u32>,
}

#[derive(Serialize, Clone)]
struct Cleared {
    #[serde(rename = "type")]
    ty: &'static str,
}

#[derive(Serialize, Clone)]
#[serde(untagged)]
enum Ev {
    S(Stored),
    R(Removed),
    C(Cleared),
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) -> Ev {
    Ev::S(Stored {
        ty: "BlockStored",
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: bs,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        lookahead_token_ids: None,
    })
}

fn stored_on(
    medium: &'static str,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    bs: u32,
) -> Ev {
    match stored(hashes, parent, tokens, bs) {
        Ev::S(mut s) => {
            s.medium = Some(medium);
            Ev::S(s)
        }
        _ => unreachable!(),
    }
}

fn removed(hashes: &[u64], medium: Option<&'static str>) -> Ev {
    Ev::R(Removed {
        ty: "BlockRemoved",
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: None,
    })
}

fn cleared() -> Ev {
    Ev::C(Cleared {
        ty: "AllBlocksCleared",
    })
}

fn batch(events: &[Ev]) -> Vec<u8> {
    rmp_serde::to_vec_named(&(1.5f64, events, 0u32)).unwrap()
}

fn index() -> PrefixIndex {
    PrefixIndex::new(IndexConfig::default()).unwrap()
}

fn apply(ix: &mut PrefixIndex, w: WorkerId, events: &[Ev]) -> ApplyStats {
    let st = ix.apply_payload(w, &batch(events), Tier::Gpu).unwrap();
    ix.check_invariants().unwrap();
    st
}

/// `(worker name, blocks, tier_blocks, score)` sorted by name.
fn look(ix: &mut PrefixIndex, tokens: &[u32], bs: usize) -> Vec<(String, u32, [u32; 3], f64)> {
    let res: Vec<WorkerMatch> = ix.lookup(tokens, bs, None).unwrap().to_vec();
    let mut v: Vec<_> = res
        .iter()
        .map(|m| {
            (
                ix.worker_name(m.worker).unwrap().to_owned(),
                m.blocks,
                m.tier_blocks,
                (m.score * 1000.0).round() / 1000.0,
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    ix.check_invariants().unwrap();
    v
}

const T: [u32; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

#[test]
fn keys_are_the_slot_managers_chain_hash() {
    let mut ix = index();
    let keys = ix.chain_keys(&T, 4, None).unwrap();
    let k0 = block_hash(0, &T[..4], None);
    assert_eq!(
        keys,
        vec![
            k0,
            block_hash(k0, &T[4..8], None),
            block_hash(block_hash(k0, &T[4..8], None), &T[8..], None)
        ]
    );
}

#[test]
fn store_lookup_remove() {
    let mut ix = index();
    let a = ix.add_worker("a").unwrap();
    let b = ix.add_worker("b").unwrap();
    let st = apply(&mut ix, a, &[stored(&[100, 101, 102], None, &T, 4)]);
    assert_eq!(st.stored_blocks, 3);
    // b holds the first two blocks, under its own engine hashes (another hash seed).
    apply(
        &mut ix,
        b,
        &[
            stored(&[900], None, &T[..4], 4),
            stored(&[901], Some(900), &T[4..8], 4),
        ],
    );
    assert_eq!(
        look(&mut ix, &T, 4),
        vec![
            ("a".into(), 3, [3, 0, 0], 3.0),
            ("b".into(), 2, [2, 0, 0], 2.0)
        ]
    );
    // Removing a's middle block ends its prefix at one block.
    let st = apply(&mut ix, a, &[removed(&[101], Some("GPU"))]);
    assert_eq!(st.removed_blocks, 1);
    assert_eq!(look(&mut ix, &T, 4)[0], ("a".into(), 1, [1, 0, 0], 1.0));
    // A partial trailing block never matches; a different first block matches nothing.
    assert_eq!(look(&mut ix, &T[..7], 4).len(), 2);
    assert!(look(&mut ix, &[9, 9, 9, 9], 4).is_empty());
    assert!(
        look(&mut ix, &T, 3).is_empty(),
        "another block size is another chain"
    );
}

#[test]
fn tiers_and_weights() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    // Blocks 0-1 on GPU, blocks 0-2 on CPU (an offloaded copy), block 2 CPU only.
    apply(&mut ix, w, &[stored(&[1, 2], None, &T[..8], 4)]);
    apply(&mut ix, w, &[stored_on("CPU", &[1, 2, 3], None, &T, 4)]);
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 3, [2, 3, 0], 2.8)]);
    // Dropping the GPU copy of block 0 breaks the GPU prefix but not the any-tier prefix.
    apply(&mut ix, w, &[removed(&[1], Some("GPU"))]);
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 3, [0, 3, 0], 2.6)]);
    // A placeholder (no tokens, as vLLM's offloading connector sends) adds STORAGE to known hashes.
    let st = apply(&mut ix, w, &[stored_on("STORAGE", &[1, 77], None, &[], 0)]);
    assert_eq!((st.stored_blocks, st.unresolved_blocks), (1, 1));
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 3, [0, 3, 1], 2.6)]);
    let st = apply(&mut ix, w, &[stored_on("NVME?", &[5], None, &T[..4], 4)]);
    assert_eq!(st.unknown_medium_events, 1);
}

#[test]
fn custom_weights() {
    let mut ix = PrefixIndex::new(IndexConfig {
        tier_weights: [1.0, 0.25, 0.0],
        ..Default::default()
    })
    .unwrap();
    let w = ix.add_worker("w").unwrap();
    apply(&mut ix, w, &[stored_on("CPU", &[1, 2], None, &T[..8], 4)]);
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 2, [0, 2, 0], 0.5)]);
    assert!(PrefixIndex::new(IndexConfig {
        tier_weights: [1.0, f64::NAN, 0.0],
        ..Default::default()
    })
    .is_err());
}

#[test]
fn duplicates_are_harmless() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let ev = stored(&[1, 2, 3], None, &T, 4);
    apply(&mut ix, w, &[ev.clone(), ev.clone()]);
    apply(&mut ix, w, &[ev]);
    assert_eq!(ix.stats().entries, 3);
    let st = apply(&mut ix, w, &[removed(&[3], None), removed(&[3], None)]);
    assert_eq!((st.removed_blocks, st.unresolved_blocks), (1, 1));
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 2, [2, 0, 0], 2.0)]);
    assert_eq!(ix.stats().entries, 2);
}

#[test]
fn groups_hold_a_block_until_all_remove_it() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let mut g0 = stored(&[1], None, &T[..4], 4);
    let mut g1 = g0.clone();
    if let (Ev::S(a), Ev::S(b)) = (&mut g0, &mut g1) {
        a.group_idx = Some(0);
        b.group_idx = Some(1);
    }
    apply(&mut ix, w, &[g0, g1]);
    let mut r1 = removed(&[1], None);
    if let Ev::R(r) = &mut r1 {
        r.group_idx = Some(1);
    }
    apply(&mut ix, w, &[r1]);
    assert_eq!(look(&mut ix, &T, 4).len(), 1, "group 0 still holds it");
    apply(&mut ix, w, &[removed(&[1], None)]);
    assert!(look(&mut ix, &T, 4).is_empty());
}

#[test]
fn orphans_are_skipped_and_counted() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let st = apply(&mut ix, w, &[stored(&[2, 3], Some(1), &T[4..], 4)]);
    assert_eq!((st.stored_blocks, st.orphan_blocks), (0, 2));
    assert_eq!(ix.len(), 0);
    // Once the parent arrives, the chain continues.
    apply(
        &mut ix,
        w,
        &[
            stored(&[1], None, &T[..4], 4),
            stored(&[2, 3], Some(1), &T[4..], 4),
        ],
    );
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 3, [3, 0, 0], 3.0)]);
}

#[test]
fn same_hash_new_content_replaces() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    apply(&mut ix, w, &[stored(&[1], None, &T[..4], 4)]);
    apply(&mut ix, w, &[stored(&[1], None, &T[4..8], 4)]);
    assert_eq!(ix.stats().entries, 1);
    assert!(look(&mut ix, &T, 4).is_empty());
    assert_eq!(look(&mut ix, &T[4..], 4).len(), 1);
}

#[test]
fn engine_hash_repeated_within_one_event() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let o = ix.add_worker("o").unwrap();
    // o holds blocks 1 and 2 of T but no longer block 0: T's block-1 key exists, its parent not.
    apply(
        &mut ix,
        o,
        &[stored(&[7, 8], None, &T[..8], 4), removed(&[7], None)],
    );
    // w reports one engine hash for two different blocks: block 0 gets a new slot, then block 1
    // replaces the entry (freeing that slot) and lands on the existing key. The freed slot must
    // not be linked back into the LRU list.
    apply(&mut ix, w, &[stored(&[1, 1], None, &T[..8], 4)]);
    assert_eq!(ix.stats().entries, 2);
}

#[test]
fn cleared_clears_the_stream_tier_only() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let o = ix.add_worker("o").unwrap();
    apply(
        &mut ix,
        w,
        &[
            stored(&[1, 2], None, &T[..8], 4),
            stored_on("CPU", &[1], None, &T[..4], 4),
        ],
    );
    apply(&mut ix, o, &[stored(&[1], None, &T[..4], 4)]);
    let st = apply(&mut ix, w, &[cleared()]);
    assert_eq!(st.cleared, 1);
    assert_eq!(
        look(&mut ix, &T, 4),
        vec![
            ("o".into(), 1, [1, 0, 0], 1.0),
            ("w".into(), 1, [0, 1, 0], 0.8)
        ]
    );
    // A CPU-tier stream's AllBlocksCleared clears CPU.
    ix.apply_payload(w, &batch(&[cleared()]), Tier::Cpu)
        .unwrap();
    assert_eq!(look(&mut ix, &T, 4), vec![("o".into(), 1, [1, 0, 0], 1.0)]);
}

#[test]
fn worker_clear_and_removal() {
    let mut ix = index();
    let a = ix.add_worker("a").unwrap();
    let b = ix.add_worker("b").unwrap();
    apply(&mut ix, a, &[stored(&[1, 2, 3], None, &T, 4)]);
    apply(&mut ix, b, &[stored(&[1, 2, 3], None, &T, 4)]);
    assert_eq!(ix.clear_worker("a").unwrap(), 3);
    ix.check_invariants().unwrap();
    assert_eq!(look(&mut ix, &T, 4).len(), 1);
    assert_eq!(ix.remove_worker("b").unwrap(), 3);
    ix.check_invariants().unwrap();
    assert!(ix.is_empty());
    assert!(matches!(
        ix.clear_worker("b"),
        Err(IndexError::UnknownWorker { .. })
    ));
    assert!(matches!(
        ix.add_worker("a"),
        Err(IndexError::DuplicateWorker { .. })
    ));
    assert_eq!(ix.worker_names().collect::<Vec<_>>(), vec!["a"]);
    // Events for a removed worker id are refused, not applied.
    assert!(ix
        .apply_payload(b, &batch(&[stored(&[1], None, &T[..4], 4)]), Tier::Gpu)
        .is_err());
}

#[test]
fn capacity_evicts_least_recent_tail_first() {
    let mut ix = PrefixIndex::new(IndexConfig {
        capacity: Some(4),
        ..Default::default()
    })
    .unwrap();
    let w = ix.add_worker("w").unwrap();
    apply(&mut ix, w, &[stored(&[1, 2, 3], None, &T, 4)]);
    let other: Vec<u32> = (100..112).collect();
    apply(&mut ix, w, &[stored(&[7, 8], None, &other[..8], 4)]);
    // 5 entries > 4: the oldest prefix loses its last block first.
    assert_eq!(ix.stats().entries, 4);
    assert_eq!(ix.stats().evictions, 1);
    assert_eq!(look(&mut ix, &T, 4), vec![("w".into(), 2, [2, 0, 0], 2.0)]);
    // The lookup made T's prefix recent again, so the next store evicts from `other`.
    apply(&mut ix, w, &[stored(&[9], None, &[50, 51, 52, 53], 4)]);
    assert_eq!(look(&mut ix, &T, 4)[0].1, 2);
    assert_eq!(look(&mut ix, &other, 4)[0].1, 1);
    // Removing an evicted hash is a harmless unknown.
    let st = apply(&mut ix, w, &[removed(&[3, 8], None)]);
    assert_eq!(st.unresolved_blocks, 2);
    assert!(PrefixIndex::new(IndexConfig {
        capacity: Some(0),
        ..Default::default()
    })
    .is_err());
}

#[test]
fn lora_and_extra_keys_separate_chains() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let mut ev = stored(&[1], None, &T[..4], 4);
    if let Ev::S(s) = &mut ev {
        s.lora_id = Some(7);
        s.lora_name = Some("adapter");
        // vLLM lists the LoRA name first in extra_keys; it must not count twice.
        s.extra_keys = Some(vec![Some(("adapter".to_string(),))]);
    }
    apply(&mut ix, w, &[ev]);
    assert!(look(&mut ix, &T, 4).is_empty());
    assert_eq!(ix.lookup(&T, 4, Some(7)).unwrap().len(), 1);
    // A cache salt (any other extra key) makes the block unmatchable by plain tokens.
    let mut salted = stored(&[2], None, &T[..4], 4);
    if let Ev::S(s) = &mut salted {
        s.extra_keys = Some(vec![Some(("salt".to_string(),))]);
    }
    apply(&mut ix, w, &[salted]);
    assert!(look(&mut ix, &T, 4).is_empty());
    // LoRA by name only: keyed by the name's hash.
    let mut named = stored(&[3], None, &T[..4], 4);
    if let Ev::S(s) = &mut named {
        s.lora_name = Some("other");
    }
    apply(&mut ix, w, &[named]);
    assert_eq!(
        ix.lookup(&T, 4, Some(lora_name_key("other")))
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn bytes_hashes_use_low_64_bits_big_endian() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let mut h = vec![0xAAu8; 24];
    h.extend_from_slice(&0x0102030405060708u64.to_be_bytes());
    #[derive(Serialize)]
    struct S<'a> {
        #[serde(rename = "type")]
        ty: &'a str,
        block_hashes: Vec<serde_bytes_like::Bytes>,
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<&'a str>,
        lora_name: Option<&'a str>,
    }
    let p = rmp_serde::to_vec_named(&(
        0.0,
        [S {
            ty: "BlockStored",
            block_hashes: vec![serde_bytes_like::Bytes(h)],
            parent_block_hash: None,
            token_ids: &T[..4],
            block_size: 4,
            lora_id: None,
            medium: Some("GPU"),
            lora_name: None,
        }],
    ))
    .unwrap();
    let st = ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    assert_eq!(st.stored_blocks, 1);
    assert!(ix.resolve(w, 0x0102030405060708).is_some());
}

mod serde_bytes_like {
    pub struct Bytes(pub Vec<u8>);
    impl serde::Serialize for Bytes {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&self.0)
        }
    }
}

#[test]
fn array_encoded_events_of_older_vllm() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    // ["BlockStored", hashes, parent, tokens, block_size, lora_id] (no medium: older vLLM)
    let p = rmp_serde::to_vec(&(
        0.0,
        (
            (
                "BlockStored",
                [1u64, 2],
                None::<u64>,
                &T[..8],
                4u32,
                None::<u64>,
            ),
            ("BlockRemoved", [2u64]),
            ("AllBlocksCleared",),
        ),
    ))
    .unwrap();
    let st = ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    assert_eq!((st.stored_blocks, st.removed_blocks, st.cleared), (2, 1, 1));
    assert!(ix.is_empty());
}

#[test]
fn malformed_payloads_change_nothing() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    apply(&mut ix, w, &[stored(&[1], None, &T[..4], 4)]);
    for bad in [
        &b""[..],
        b"\xc1",
        b"\x93\xcb",
        &rmp_serde::to_vec(&"hello").unwrap(),
        &rmp_serde::to_vec(&(1.0, 5)).unwrap(),
        // a valid first event followed by garbage: nothing applies
        &{
            let mut v = batch(&[removed(&[1], None)]);
            v.truncate(v.len() - 3);
            v
        },
    ] {
        assert!(
            matches!(
                ix.apply_payload(w, bad, Tier::Gpu),
                Err(IndexError::Decode(_))
            ),
            "{bad:?}"
        );
    }
    assert_eq!(ix.stats().entries, 1);
    // Semantically wrong events are skipped one by one; the rest of the batch applies.
    let st = apply(
        &mut ix,
        w,
        &[
            stored(&[5, 6], None, &T[..5], 4), // 5 tokens for 2 blocks of 4
            stored(&[5], None, &T[..4], 0),    // block_size 0
            removed(&[1], None),
        ],
    );
    assert_eq!((st.invalid_events, st.removed_blocks), (2, 1));
    // Wrong field types.
    let p = rmp_serde::to_vec_named(&(
        0.0,
        [("type", "BlockStored", "block_hashes", "nope")]
            .iter()
            .map(|(k1, v1, k2, v2)| std::collections::BTreeMap::from([(*k1, *v1), (*k2, *v2)]))
            .collect::<Vec<_>>(),
    ))
    .unwrap();
    let st = ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    assert_eq!(st.invalid_events, 1);
    let p = rmp_serde::to_vec_named(&(
        0.0,
        [std::collections::BTreeMap::from([("type", "Future")])],
    ))
    .unwrap();
    assert_eq!(
        ix.apply_payload(w, &p, Tier::Gpu).unwrap().unknown_events,
        1
    );
    // Token ids out of u32 range.
    let p = rmp_serde::to_vec_named(&(
        0.0,
        [(
            "BlockStored",
            [1u64],
            None::<u64>,
            [1i64, -2, 3, 4],
            4u32,
            None::<u64>,
        )],
    ))
    .unwrap();
    assert_eq!(
        ix.apply_payload(w, &p, Tier::Gpu).unwrap().invalid_events,
        1
    );
    ix.check_invariants().unwrap();
}

#[test]
fn journal_reports_current_state() {
    let mut ix = PrefixIndex::new(IndexConfig {
        journal: true,
        ..Default::default()
    })
    .unwrap();
    let w = ix.add_worker("w").unwrap();
    apply(
        &mut ix,
        w,
        &[stored(&[1, 2], None, &T[..8], 4), removed(&[2], None)],
    );
    let mut ch = ix.take_changes();
    ch.sort_by_key(|c| format!("{c:?}"));
    let k0 = block_hash(0, &T[..4], None);
    let k1 = block_hash(k0, &T[4..8], None);
    assert!(ch.contains(&Change::Engine {
        worker: "w".into(),
        engine: 1,
        entry: Some(EngineEntryView {
            key: k0,
            groups: [1, 0, 0],
            last: LastBlock::UNKNOWN,
        })
    }));
    assert!(ch.contains(&Change::Engine {
        worker: "w".into(),
        engine: 2,
        entry: None
    }));
    assert!(ch.contains(&Change::Holder {
        key: k0,
        worker: "w".into(),
        value: 1
    }));
    assert!(ch.contains(&Change::Holder {
        key: k1,
        worker: "w".into(),
        value: 0
    }));
    assert_eq!(ch.len(), 4);
    assert!(ix.take_changes().is_empty());
    // dump + load reproduce the index in a fresh one.
    let dump = ix.dump();
    let mut other = index();
    let w2 = other.add_worker("w").unwrap();
    for (_, engine, e) in dump {
        other.load_entry(w2, engine, e);
    }
    other.check_invariants().unwrap();
    assert_eq!(look(&mut other, &T, 4), look(&mut ix, &T, 4));
}

type ModelWorker = std::collections::HashMap<u64, (Vec<u32>, [bool; 3])>;

/// A brute-force model: per worker, engine hash -> (full token prefix, tiers), matched by
/// comparing token prefixes, never by hashes.
#[derive(Default, Clone)]
struct Model {
    workers: Vec<ModelWorker>,
}

impl Model {
    fn lookup(&self, tokens: &[u32], bs: usize) -> Vec<(usize, u32, [u32; 3], f64)> {
        let w8 = [1.0, 0.8, 0.5];
        let mut out = vec![];
        for (wi, m) in self.workers.iter().enumerate() {
            let (mut blocks, mut tb, mut score, mut alive) = (0u32, [0u32; 3], 0.0, [true; 3]);
            for n in 1..=tokens.len() / bs {
                let prefix = &tokens[..n * bs];
                let mut held = [false; 3];
                for (p, t) in m.values() {
                    if p.as_slice() == prefix {
                        for i in 0..3 {
                            held[i] |= t[i];
                        }
                    }
                }
                if !held.iter().any(|h| *h) {
                    break;
                }
                blocks += 1;
                score += (0..3)
                    .filter(|&i| held[i])
                    .map(|i| w8[i])
                    .fold(0.0, f64::max);
                for i in 0..3 {
                    alive[i] &= held[i];
                    tb[i] += u32::from(alive[i]);
                }
            }
            if blocks > 0 {
                out.push((wi, blocks, tb, (score * 1000.0f64).round() / 1000.0));
            }
        }
        out
    }
}

#[test]
fn random_streams_match_brute_force_model() {
    random_streams(None);
    // With a capacity that never binds: the LRU list is kept and must not change any result.
    random_streams(Some(1_000_000));
}

#[test]
fn random_streams_under_eviction_keep_invariants() {
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    for cap in [1usize, 3, 10] {
        let mut ix = PrefixIndex::new(IndexConfig {
            capacity: Some(cap),
            ..Default::default()
        })
        .unwrap();
        let ws: Vec<WorkerId> = (0..3)
            .map(|i| ix.add_worker(&format!("w{i}")).unwrap())
            .collect();
        for _ in 0..3000 {
            let wi = next(3) as usize;
            let len = 1 + next(4) as usize;
            let tokens: Vec<u32> = (0..len * 2).map(|_| next(3) as u32).collect();
            let hashes: Vec<u64> = (1..=len)
                .map(|n| block_hash(wi as u64, &tokens[..n * 2], None))
                .collect();
            let ev = match next(4) {
                0 => removed(&hashes[next(len as u64) as usize..], None),
                1 => stored_on("CPU", &hashes, None, &tokens, 2),
                _ => stored(&hashes, None, &tokens, 2),
            };
            ix.apply_payload(ws[wi], &batch(&[ev]), Tier::Gpu).unwrap();
            if next(5) == 0 {
                ix.lookup(&tokens, 2, None).unwrap();
            }
            // Includes: entries <= capacity unless a single block (several holders) remains.
            ix.check_invariants().unwrap();
        }
        assert!(ix.stats().evictions > 0);
    }
}

fn random_streams(capacity: Option<usize>) {
    let mut rng = 0x9E3779B97F4A7C15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let bs = 2usize;
    let mut nonempty = 0;
    for round in 0..60 {
        let mut ix = PrefixIndex::new(IndexConfig {
            capacity,
            ..Default::default()
        })
        .unwrap();
        let mut model = Model::default();
        let ws: Vec<WorkerId> = (0..3)
            .map(|i| ix.add_worker(&format!("w{i}")).unwrap())
            .collect();
        model.workers = vec![Default::default(); 3];
        // Prompts from a tiny alphabet so prefixes are shared.
        for _ in 0..40 {
            let wi = next(3) as usize;
            let tier = next(3) as usize;
            let medium = ["GPU", "CPU", "STORAGE"][tier];
            let len = 1 + next(4) as usize;
            let tokens: Vec<u32> = (0..len * bs).map(|_| next(2) as u32).collect();
            // Engine hash: a per-worker deterministic function of the prefix (any algorithm works).
            let eh = |p: &[u32]| block_hash(1000 + wi as u64, p, None);
            match next(5) {
                0..=2 => {
                    let hashes: Vec<u64> = (1..=len).map(|n| eh(&tokens[..n * bs])).collect();
                    // Sometimes store only a tail run, parented on the previous block.
                    let from = if len > 1 { next(2) as usize } else { 0 };
                    let parent = (from > 0).then(|| hashes[from - 1]);
                    let ev = stored_on(
                        medium,
                        &hashes[from..],
                        parent,
                        &tokens[from * bs..],
                        bs as u32,
                    );
                    apply(&mut ix, ws[wi], &[ev]);
                    let m = &mut model.workers[wi];
                    let parent_known = from == 0 || m.contains_key(&hashes[from - 1]);
                    if parent_known {
                        for n in from + 1..=len {
                            let e = m
                                .entry(hashes[n - 1])
                                .or_insert((tokens[..n * bs].to_vec(), [false; 3]));
                            e.1[tier] = true;
                        }
                    }
                }
                3 => {
                    let n = 1 + next(len as u64) as usize;
                    let h = eh(&tokens[..n * bs]);
                    apply(&mut ix, ws[wi], &[removed(&[h], Some(medium))]);
                    if let Some(e) = model.workers[wi].get_mut(&h) {
                        e.1[tier] = false;
                        if !e.1.iter().any(|t| *t) {
                            model.workers[wi].remove(&h);
                        }
                    }
                }
                _ => {
                    if next(4) == 0 {
                        ix.apply_payload(ws[wi], &batch(&[cleared()]), Tier::ALL[tier])
                            .unwrap();
                        for e in model.workers[wi].values_mut() {
                            e.1[tier] = false;
                        }
                        model.workers[wi].retain(|_, e| e.1.iter().any(|t| *t));
                    }
                }
            }
            ix.check_invariants().unwrap();
            let q: Vec<u32> = (0..4 * bs).map(|_| next(2) as u32).collect();
            let got: Vec<_> = ix
                .lookup(&q, bs, None)
                .unwrap()
                .iter()
                .map(|m| {
                    (
                        m.worker as usize,
                        m.blocks,
                        m.tier_blocks,
                        (m.score * 1000.0).round() / 1000.0,
                    )
                })
                .collect::<Vec<_>>();
            let mut got = got;
            got.sort_by_key(|g| g.0);
            assert_eq!(got, model.lookup(&q, bs), "round {round}, query {q:?}");
            nonempty += usize::from(!got.is_empty());
        }
    }
    assert!(
        nonempty > 500,
        "too few matching lookups ({nonempty}) to mean anything"
    );
}

#[test]
fn mutated_payloads_never_panic() {
    let mut rng = 0xDEADBEEFCAFEF00Du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let mut lora = stored(&[9], Some(1), &T[..4], 4);
    if let Ev::S(s) = &mut lora {
        s.lora_name = Some("x");
        s.extra_keys = Some(vec![Some(("x".to_string(),))]);
        s.group_idx = Some(3);
    }
    let base = batch(&[
        stored(&[1, 2, 3], None, &T, 4),
        removed(&[2], Some("CPU")),
        lora,
        cleared(),
    ]);
    for _ in 0..20_000 {
        let mut p = base.clone();
        for _ in 0..1 + next(4) {
            if p.is_empty() {
                p.push(0x90);
            }
            match next(3) {
                0 => {
                    let i = next(p.len() as u64) as usize;
                    p[i] = next(256) as u8;
                }
                1 => p.truncate(next(p.len() as u64) as usize),
                _ => {
                    let i = next(p.len() as u64) as usize;
                    p.insert(i, next(256) as u8);
                }
            }
        }
        let _ = ix.apply_payload(w, &p, Tier::Gpu);
        ix.check_invariants().unwrap();
    }
}

#[test]
fn token_ids_in_every_integer_width() {
    // fixint, uint8, uint16 runs (the unrolled path) broken by uint32 and signed encodings.
    let tokens: Vec<u32> = vec![
        1,
        200,
        300,
        301,
        302,
        303,
        304,
        70_000,
        305,
        306,
        307,
        308,
        309,
        310,
        4_000_000_000,
        5,
        311,
        312,
        313,
        314,
    ];
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let hashes: Vec<u64> = (1..=5).collect();
    apply(&mut ix, w, &[stored(&hashes, None, &tokens, 4)]);
    assert_eq!(
        look(&mut ix, &tokens, 4),
        vec![("w".into(), 5, [5, 0, 0], 5.0)]
    );
    // The same ids encoded as msgpack signed ints (as some encoders do) decode the same.
    let signed: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let p = rmp_serde::to_vec(&(
        0.0,
        [(
            "BlockStored",
            [9u64],
            None::<u64>,
            &signed[..4],
            4u32,
            None::<u64>,
        )],
    ))
    .unwrap();
    let mut raw = p.clone();
    // Re-encode the fixint 1 as int8 0xd0 0x01 to exercise the signed path.
    let i = raw
        .windows(2)
        .position(|w| w == [0x94, 0x01])
        .expect("token list header");
    raw.splice(i + 1..i + 2, [0xd0, 0x01]);
    assert_eq!(
        ix.apply_payload(w, &raw, Tier::Gpu).unwrap().stored_blocks,
        1
    );
    assert_eq!(ix.resolve(w, 9), ix.resolve(w, 1));
}

/// vLLM 0.33's `lookahead_token_ids`, in the map form (by name, any position) and in the
/// positional form (15th field): a lookahead-hashed block only matches a prompt that goes on
/// with its lookahead tokens; a plain lookup of the same tokens ending at the block does not.
#[test]
fn lookahead_hashed_blocks_match_only_with_their_next_tokens() {
    #[derive(Serialize)]
    struct StoredLa {
        #[serde(rename = "type")]
        ty: &'static str,
        lookahead_token_ids: Vec<Vec<u32>>,
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<&'static str>,
        lora_name: Option<&'static str>,
    }
    let mut ix = index();
    let a = ix.add_worker("a").unwrap();
    let b = ix.add_worker("b").unwrap();
    let ev = StoredLa {
        ty: "BlockStored",
        lookahead_token_ids: vec![vec![5], vec![9]],
        block_hashes: vec![11, 12],
        parent_block_hash: None,
        token_ids: T[..8].to_vec(),
        block_size: 4,
        lora_id: None,
        medium: None,
        lora_name: None,
    };
    let p = rmp_serde::to_vec_named(&(1.0, [ev], 0u32)).unwrap();
    let st = ix.apply_payload(a, &p, Tier::Gpu).unwrap();
    assert_eq!((st.stored_blocks, st.invalid_events), (2, 0));
    // Positional: tag, 14 fields of 0.32/0.33, then lookahead_token_ids.
    let p = rmp_serde::to_vec(&(
        0.0,
        ((
            "BlockStored",
            [21u64, 22],
            None::<u64>,
            &T[..8],
            4u32,
            None::<u64>,
            None::<&str>,
            None::<&str>,
            None::<u8>,
            0u32,
            None::<&str>,
            None::<u32>,
            None::<&str>,
            None::<&str>,
            None::<&str>,
            [[5u32, 6], [9, 10]],
        ),),
    ))
    .unwrap();
    let st = ix.apply_payload(b, &p, Tier::Gpu).unwrap();
    assert_eq!((st.stored_blocks, st.invalid_events), (2, 0));
    ix.check_invariants().unwrap();
    let blocks = |ix: &mut PrefixIndex, t: &[u32]| -> Vec<(String, u32)> {
        look(ix, t, 4).into_iter().map(|m| (m.0, m.1)).collect()
    };
    let s = |v: &[(&str, u32)]| -> Vec<(String, u32)> {
        v.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    };
    assert_eq!(blocks(&mut ix, &T[..10]), s(&[("a", 2), ("b", 2)]));
    assert_eq!(blocks(&mut ix, &T[..9]), s(&[("a", 2), ("b", 1)]));
    assert_eq!(blocks(&mut ix, &T[..8]), s(&[("a", 1), ("b", 1)]));
    assert_eq!(
        blocks(&mut ix, &[1, 2, 3, 4, 0, 6, 7, 8, 9, 10]),
        Vec::new()
    );
    assert_eq!(
        blocks(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 0, 10]),
        s(&[("a", 1), ("b", 1)])
    );
    // Removing by engine hash works as for any block.
    let st = ix
        .apply_payload(a, &batch(&[removed(&[12], None)]), Tier::Gpu)
        .unwrap();
    assert_eq!(st.removed_blocks, 1);
    assert_eq!(blocks(&mut ix, &T[..10]), s(&[("a", 1), ("b", 2)]));
}

/// A `BlockStored` with `lookahead_token_ids` on a given medium (vLLM 0.33's field; on CPU /
/// STORAGE kvslots' connector puts each block's recorded successor there).
fn stored_la(
    medium: &'static str,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    la: Vec<Vec<u32>>,
) -> Vec<u8> {
    match stored_on(medium, hashes, parent, tokens, 4) {
        Ev::S(mut s) => {
            s.lookahead_token_ids = Some(la);
            batch(&[Ev::S(s)])
        }
        _ => unreachable!(),
    }
}

/// Host and disk blocks keep token-only keys (the same entry as the device block of the same
/// hash), and an EAGLE worker's score counts the last block of its prefix only when its engine
/// serves it: from a host / disk block whose successor is the prompt's next token.
#[test]
fn eagle_workers_count_the_last_block_only_with_a_matching_host_successor() {
    let mut ix = index();
    let w = ix.add_worker("w").unwrap();
    let d = ix.add_worker("d").unwrap(); // same blocks, not EAGLE
    for id in [w, d] {
        apply(&mut ix, id, &[stored(&[11, 12, 13], None, &T[..12], 4)]);
        // The host tier stores blocks 0 and 1: successors 5 and 9; block 2 unknown ([]).
        let st = ix
            .apply_payload(
                id,
                &stored_la(
                    "CPU",
                    &[11, 12, 13],
                    None,
                    &T[..12],
                    vec![vec![5], vec![9], vec![]],
                ),
                Tier::Gpu,
            )
            .unwrap();
        assert_eq!((st.stored_blocks, st.invalid_events), (3, 0));
    }
    ix.check_invariants().unwrap();
    assert_eq!(
        ix.worker_len("w").unwrap(),
        3,
        "one entry per hash: the keys are token-only"
    );
    ix.set_worker_eagle("w", true).unwrap();
    assert!(ix.worker_eagle("w").unwrap() && !ix.worker_eagle("d").unwrap());
    let by =
        |ix: &mut PrefixIndex, t: &[u32]| -> Vec<(String, u32, [u32; 3], f64)> { look(ix, t, 4) };
    // Prompt goes on with 9 after block 1: block 1 is served from the host tier.
    let r = by(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]);
    assert_eq!(r[0], ("d".into(), 2, [2, 2, 0], 2.0));
    assert_eq!(r[1], ("w".into(), 2, [2, 2, 0], 2.0));
    // Another next token: the EAGLE worker recomputes block 1.
    let r = by(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 7, 0]);
    assert_eq!(r[0].1, 2);
    assert_eq!(r[1], ("w".into(), 1, [1, 1, 0], 1.0));
    // The prompt ends with the block: nothing after it, never served as a last block.
    assert_eq!(by(&mut ix, &T[..8])[1].1, 1);
    // Block 2 has no successor on the host tier: a full-length match stops one short.
    assert_eq!(
        by(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])[1].1,
        2
    );
    // Only on the device: vLLM drops it.
    let p = batch(&[removed(&[12], Some("CPU"))]);
    ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    assert_eq!(by(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 0])[1].1, 1);
    // On the disk tier with the successor: served again; the score keeps the exact sum.
    let p = stored_la("STORAGE", &[12], Some(11), &T[4..8], vec![vec![9]]);
    ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    let r = by(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]);
    assert_eq!(r[1], ("w".into(), 2, [2, 1, 0], 2.0));
    ix.check_invariants().unwrap();
    // Unmarked again: plain prefix counting.
    ix.set_worker_eagle("w", false).unwrap();
    assert_eq!(by(&mut ix, &T[..8])[1].1, 2);
    assert!(ix.set_worker_eagle("nobody", true).is_err());
    // The count of EAGLE workers (lookups skip the rule when it is 0) follows marks and removals.
    ix.set_worker_eagle("w", true).unwrap();
    ix.set_worker_eagle("w", true).unwrap();
    ix.set_worker_eagle("d", true).unwrap();
    ix.remove_worker("w").unwrap();
    ix.check_invariants().unwrap();
    assert_eq!(by(&mut ix, &T[..8])[0].1, 1, "d is EAGLE now");
    ix.set_worker_eagle("d", false).unwrap();
    ix.check_invariants().unwrap();
    assert_eq!(by(&mut ix, &T[..8])[0].1, 2);
}

/// Device blocks hashed with lookahead tokens (vLLM 0.33 without a connector) are served as the
/// last block whenever their key matched; their host copies' successors are not needed.
#[test]
fn eagle_workers_keep_lookahead_keyed_device_blocks() {
    let mut ix = index();
    let a = ix.add_worker("a").unwrap();
    let p = stored_la("GPU", &[11, 12], None, &T[..8], vec![vec![5], vec![9]]);
    ix.apply_payload(a, &p, Tier::Gpu).unwrap();
    ix.set_worker_eagle("a", true).unwrap();
    assert_eq!(look(&mut ix, &T[..10], 4)[0].1, 2);
    assert_eq!(look(&mut ix, &[1, 2, 3, 4, 5, 6, 7, 8, 0, 0], 4)[0].1, 1);
}

/// The journal and dump carry the last-block facts, so a Redis mirror and a replica loaded from
/// it score EAGLE workers the same way.
#[test]
fn journal_and_dump_carry_successors() {
    let mut ix = PrefixIndex::new(IndexConfig {
        journal: true,
        ..IndexConfig::default()
    })
    .unwrap();
    let w = ix.add_worker("w").unwrap();
    let p = stored_la("CPU", &[11, 12], None, &T[..8], vec![vec![5], vec![9]]);
    ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    let k1 = block_hash(block_hash(0, &T[..4], None), &T[4..8], None);
    let ch = ix.take_changes();
    let v = ch
        .iter()
        .find_map(|c| match c {
            Change::Holder { key, value, .. } if *key == k1 => Some(*value),
            _ => None,
        })
        .unwrap();
    assert!(serves_last(v, Some(9)) && !serves_last(v, Some(8)));
    assert_eq!(holder_tiers(v), 0b010);
    assert_eq!(ix.dump_holders().len(), 2);
    // The same store again changes nothing; another successor is journaled.
    ix.apply_payload(w, &p, Tier::Gpu).unwrap();
    assert!(ix.take_changes().is_empty());
    let p2 = stored_la("CPU", &[12], Some(11), &T[4..8], vec![vec![3]]);
    ix.apply_payload(w, &p2, Tier::Gpu).unwrap();
    assert_eq!(ix.take_changes().len(), 2);
    let mut other = index();
    let w2 = other.add_worker("w").unwrap();
    for (_, engine, e) in ix.dump() {
        other.load_entry(w2, engine, e);
    }
    for x in [&mut ix, &mut other] {
        x.set_worker_eagle("w", true).unwrap();
    }
    let t = [1, 2, 3, 4, 5, 6, 7, 8, 3, 0];
    assert_eq!(look(&mut other, &t, 4), look(&mut ix, &t, 4));
    assert_eq!(look(&mut other, &t, 4)[0].1, 2);
    assert_eq!(look(&mut other, &T[..10], 4)[0].1, 1);
}
