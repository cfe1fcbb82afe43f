use kvslots_core::*;

fn manager(num_blocks: usize, block_size: usize) -> SlotManager {
    SlotManager::new(ManagerConfig::new(num_blocks, block_size)).unwrap()
}

/// Observable state, for "a failing call changes nothing" checks.
fn snapshot(m: &SlotManager) -> String {
    let mut ids: Vec<_> = m.request_ids().map(str::to_owned).collect();
    ids.sort();
    let tables: Vec<_> = ids
        .iter()
        .map(|r| (m.block_table(r).unwrap().to_vec(), m.slot_info(r).unwrap()))
        .collect();
    format!(
        "{:?} {:?} {} {} {} {:?} {}",
        ids,
        tables,
        m.num_free(),
        m.num_held(),
        m.num_cached(),
        m.stats(),
        m.events().len()
    )
}

#[test]
fn eagle_decode_commits_only_verified_blocks() {
    let mut m = manager(16, 4);
    let prompt: Vec<u32> = (1..=6).collect();
    let (_, matched) = m.create("a", &prompt, 3, true, None).unwrap();
    assert_eq!(matched, 0);
    // Prefill: 6 tokens + K=3 lookahead = 9 -> 3 blocks.
    assert_eq!(m.reserve("a", 6).unwrap(), 3);
    assert_eq!(m.commit("a", &prompt).unwrap(), 1);
    // Decode with 1 + K = 4 new tokens: 6 + 4 + 3 = 13 -> 4 blocks.
    assert_eq!(m.reserve("a", 4).unwrap(), 1);
    // Accept 1 draft: commit sampled + accepted (2 tokens), reject 2.
    assert_eq!(m.commit("a", &[7, 8]).unwrap(), 1);
    m.rollback("a", 2).unwrap();
    let info = m.slot_info("a").unwrap();
    assert_eq!(
        (
            info.committed,
            info.pending,
            info.num_immutable,
            info.num_blocks
        ),
        (8, 0, 2, 4)
    );
    m.check_invariants().unwrap();
    let ev = m.events_mut().drain();
    assert_eq!(ev.len(), 2);
    match &ev[1] {
        KvEvent::BlockStored {
            parent_block_hash,
            token_ids,
            ..
        } => {
            assert!(parent_block_hash.is_some());
            assert_eq!(token_ids, &[5, 6, 7, 8]);
        }
        e => panic!("unexpected {e:?}"),
    }
}

#[test]
fn prefix_hit_pins_cached_blocks_and_leaves_one_token() {
    let mut m = manager(8, 4);
    let prompt: Vec<u32> = (0..8).collect();
    m.create("a", &prompt, 0, true, None).unwrap();
    m.reserve("a", 8).unwrap();
    m.commit("a", &prompt).unwrap();
    m.finish("a").unwrap();
    assert_eq!((m.num_cached(), m.num_held()), (2, 0));
    // Same 8 tokens: only the first block may match (one token must stay to compute).
    let (_, matched) = m.create("b", &prompt, 0, true, None).unwrap();
    assert_eq!(matched, 4);
    assert_eq!((m.num_cached(), m.num_held()), (1, 1));
    // A longer prompt matches both blocks.
    let long: Vec<u32> = (0..9).collect();
    let (_, matched) = m.create("c", &long, 0, true, None).unwrap();
    assert_eq!(matched, 8);
    assert_eq!(
        m.block_table("c").unwrap(),
        m.block_table("b")
            .unwrap()
            .iter()
            .copied()
            .chain([m.block_table("c").unwrap()[1]])
            .collect::<Vec<_>>()
            .as_slice()
    );
    // A different LoRA (extra key) does not match.
    let (_, matched) = m.create("d", &long, 0, true, Some(7)).unwrap();
    assert_eq!(matched, 0);
    m.check_invariants().unwrap();
}

#[test]
fn eviction_is_lazy_lru_and_queues_removed() {
    let mut m = manager(4, 2);
    for (r, base) in [("a", 0u32), ("b", 100)] {
        let p = [base, base + 1, base + 2, base + 3];
        m.create(r, &p, 0, true, None).unwrap();
        m.reserve(r, 4).unwrap();
        m.commit(r, &p).unwrap();
        m.finish(r).unwrap();
    }
    m.events_mut().clear();
    assert_eq!((m.num_free(), m.num_cached()), (0, 4));
    m.create("c", &[9, 9, 9], 0, true, None).unwrap();
    m.reserve("c", 3).unwrap();
    let ev = m.events_mut().drain();
    assert_eq!(ev.len(), 1);
    let KvEvent::BlockRemoved { block_hashes } = &ev[0] else {
        panic!()
    };
    assert_eq!(block_hashes.len(), 2);
    // "a" finished first, and its tail block was queued first: evicted first.
    let a = BlockHasher::new().chain(0, &[0, 1, 2, 3], 2, None);
    assert_eq!(block_hashes, &vec![a[1], a[0]]);
    m.check_invariants().unwrap();
}

#[test]
fn failed_calls_change_nothing() {
    let mut m = manager(4, 4);
    m.create("a", &[1, 2, 3], 2, true, None).unwrap();
    m.reserve("a", 3).unwrap();
    let before = snapshot(&m);
    assert!(matches!(
        m.reserve("a", 100),
        Err(SlotError::OutOfBlocks {
            needed: 25,
            available: 2,
            ..
        })
    ));
    assert!(matches!(
        m.commit("a", &[1, 2, 3, 4]),
        Err(SlotError::CapacityExceeded { .. })
    ));
    assert!(matches!(
        m.rollback("a", 4),
        Err(SlotError::InvalidRollback {
            requested: 4,
            pending: 3,
            ..
        })
    ));
    assert!(matches!(
        m.create("a", &[1], 0, true, None),
        Err(SlotError::DuplicateRequest { .. })
    ));
    assert!(matches!(
        m.finish("zz"),
        Err(SlotError::UnknownRequest { .. })
    ));
    let id = m.slot_id("a").unwrap();
    let bad = StepInput {
        slots: &[id, id],
        num_accepted: &[0, 0],
        accepted_tokens: &[],
        num_rejected: &[0, 0],
        num_new_tokens: &[1, 1],
        lookahead: None,
    };
    let mut out = StepOutput::default();
    assert!(matches!(
        m.step(&bad, &mut out),
        Err(SlotError::InvalidArgument { .. })
    ));
    let too_big = StepInput {
        slots: &[id],
        num_accepted: &[3],
        accepted_tokens: &[1, 2, 3],
        num_rejected: &[0],
        num_new_tokens: &[100],
        lookahead: None,
    };
    assert!(matches!(
        m.step(&too_big, &mut out),
        Err(SlotError::OutOfBlocks { .. })
    ));
    assert_eq!(before, snapshot(&m));
    let err = m.reserve("a", 100).unwrap_err().to_string();
    assert!(
        err.contains("\"a\"") && err.contains("25") && err.contains('2'),
        "{err}"
    );
}

#[test]
fn stale_slot_ids_are_rejected() {
    let mut m = manager(4, 4);
    let (id, _) = m.create("a", &[1], 0, true, None).unwrap();
    m.finish("a").unwrap();
    let (id2, _) = m.create("b", &[1], 0, true, None).unwrap();
    assert_ne!(id, id2);
    let input = StepInput {
        slots: &[id],
        num_accepted: &[0],
        accepted_tokens: &[],
        num_rejected: &[0],
        num_new_tokens: &[1],
        lookahead: None,
    };
    assert!(m.step(&input, &mut StepOutput::default()).is_err());
}

#[test]
fn shrinking_lookahead_returns_surplus_at_once() {
    let mut m = manager(16, 4);
    m.create("a", &[1, 2, 3, 4], 8, true, None).unwrap();
    m.reserve("a", 4).unwrap(); // 4 + 8 -> 3 blocks
    assert_eq!(m.num_held(), 3);
    assert_eq!(m.set_lookahead("a", 1).unwrap(), 1); // 4 pending + 1 -> 2 blocks
    assert_eq!(m.num_held(), 2);
    assert_eq!(
        m.set_lookahead("a", 6).unwrap(),
        0,
        "growing waits for the next reserve"
    );
    assert_eq!(m.num_held(), 2);
    m.check_invariants().unwrap();
}

/// Batch step equals the same per-request calls, over a long random EAGLE run.
#[test]
fn step_matches_per_request_calls_and_keeps_invariants() {
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut batch = manager(4000, 4);
    let mut single = manager(4000, 4);
    let k = 3u32;
    let mut ids = Vec::new();
    for r in 0..8u32 {
        let prompt: Vec<u32> = (0..(5 + r * 3)).map(|t| t % 7).collect();
        let name = format!("r{r}");
        for m in [&mut batch, &mut single] {
            m.create(&name, &prompt, k as usize, true, None).unwrap();
            m.reserve(&name, prompt.len()).unwrap();
            m.commit(&name, &prompt).unwrap();
            m.reserve(&name, 1 + k as usize).unwrap();
        }
        ids.push((name.clone(), batch.slot_id(&name).unwrap()));
    }
    let mut out = StepOutput::default();
    for _ in 0..150 {
        let mut acc = Vec::new();
        let mut toks = Vec::new();
        let mut rej = Vec::new();
        let mut look = Vec::new();
        for (name, _) in &ids {
            let pending = single.slot_info(name).unwrap().pending as u64;
            let a = 1 + next(pending);
            let new_k = next(4) as u32;
            let t: Vec<u32> = (0..a).map(|_| next(5) as u32).collect();
            single.commit(name, &t).unwrap();
            single.rollback(name, (pending - a) as usize).unwrap();
            // Per-request equivalent of the step's one-shot resize: reserve with the new K.
            single.set_lookahead(name, new_k as usize).unwrap();
            acc.push(a as u32);
            toks.extend(t);
            rej.push((pending - a) as u32);
            look.push(new_k);
        }
        let slots: Vec<_> = ids.iter().map(|(_, id)| *id).collect();
        let new: Vec<u32> = look.iter().map(|k| 1 + k).collect();
        batch
            .step(
                &StepInput {
                    slots: &slots,
                    num_accepted: &acc,
                    accepted_tokens: &toks,
                    num_rejected: &rej,
                    num_new_tokens: &new,
                    lookahead: Some(&look),
                },
                &mut out,
            )
            .unwrap();
        for (j, (name, _)) in ids.iter().enumerate() {
            single.reserve(name, new[j] as usize).unwrap();
        }
        batch.check_invariants().unwrap();
        for (name, _) in &ids {
            let (a, b) = (
                batch.slot_info(name).unwrap(),
                single.slot_info(name).unwrap(),
            );
            assert_eq!(
                (a.committed, a.pending, a.lookahead, a.num_immutable),
                (b.committed, b.pending, b.lookahead, b.num_immutable)
            );
            assert!(a.num_blocks <= b.num_blocks.max(a.num_blocks));
            assert_eq!(
                batch.slot(name).unwrap().hashes(),
                single.slot(name).unwrap().hashes()
            );
        }
        let mut h1: Vec<_> = batch.pool().registered_hashes().collect();
        let mut h2: Vec<_> = single.pool().registered_hashes().collect();
        h1.sort();
        h2.sort();
        assert_eq!(h1, h2);
    }
}
