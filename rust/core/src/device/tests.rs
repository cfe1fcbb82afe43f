use super::*;

const BS: usize = 4;

fn alloc(num_blocks: usize) -> DeviceAllocator {
    DeviceAllocator::new(DeviceConfig {
        num_blocks,
        block_size: BS,
        enable_caching: true,
        record_evictions: true,
        record_new_blocks: true,
        prefer_held_duplicates: false,
    })
    .unwrap()
}

/// Chained block hashes of a token sequence (full blocks only), 32 bytes each.
fn hashes(tokens: &[u32]) -> Vec<FullHash> {
    let mut out = Vec::new();
    let mut parent = 0u64;
    for chunk in tokens.chunks_exact(BS) {
        let mut h = parent ^ 0x9E37_79B9_7F4A_7C15;
        for &t in chunk {
            h = (h ^ t as u64)
                .wrapping_mul(0x0100_0000_01B3)
                .rotate_left(17);
        }
        parent = h;
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&h.rotate_left(7).to_le_bytes());
        b[24..].copy_from_slice(&h.to_be_bytes());
        out.push(FullHash::from_bytes(&b).unwrap());
    }
    out
}

fn args(computed: usize, num_tokens: usize, new: usize) -> AllocArgs {
    AllocArgs {
        num_computed_tokens: computed,
        num_tokens,
        num_new_tokens: new,
        max_model_len: 1 << 20,
        zero_external_blocks: true,
        ..Default::default()
    }
}

#[test]
fn null_block_is_never_handed_out() {
    let mut a = alloc(3);
    assert_eq!(a.num_free_blocks(), 2);
    assert_eq!(a.usage(), 0.0);
    let h = hashes(&[1; 8]);
    let r = a.allocate("r", &args(0, 8, 8), &h).unwrap().unwrap();
    assert_eq!(r.new_blocks, 0..2);
    assert!(!a.blocks("r").contains(&NULL_BLOCK));
    assert_eq!(a.usage(), 1.0);
    // Nothing left: does not fit, nothing changes.
    assert_eq!(
        a.allocate("s", &args(0, 4, 4), &hashes(&[2; 4])).unwrap(),
        None
    );
    assert!(!a.contains("s"));
    a.check().unwrap();
}

#[test]
fn prefill_commit_hit_and_decode() {
    let mut a = alloc(16);
    let prompt: Vec<u32> = (0..10).collect();
    let h = hashes(&prompt);
    // Prefill 10 tokens with a lookahead of 3: 13 slots, 4 blocks; blocks 0 and 1 are full.
    let r = a
        .allocate(
            "a",
            &AllocArgs {
                num_lookahead_tokens: 3,
                ..args(0, 10, 10)
            },
            &h,
        )
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 0..4);
    assert_eq!(r.commit, 0..2);
    assert_eq!(a.num_cached_in("a"), 2);
    assert_eq!(a.find_prefix(&h, 2).unwrap(), 2);
    // A second request with the same prompt hits both blocks.
    let mut ids = Vec::new();
    a.prefix_block_ids(&h, 2, &mut ids).unwrap();
    assert_eq!(ids, a.blocks("a")[..2].to_vec());
    let r = a
        .allocate(
            "b",
            &AllocArgs {
                num_hit_blocks: 2,
                ..args(0, 10, 2)
            },
            &h,
        )
        .unwrap()
        .unwrap();
    assert_eq!(a.blocks("b")[..2], a.blocks("a")[..2]);
    assert_eq!(r.new_blocks, 2..3);
    assert_eq!(a.pool().refcount(ids[0]), 2);
    // Decode: 11 tokens verified, 1 + 3 scheduled with a lookahead of 3 -> 17 slots, 5 blocks.
    let toks: Vec<u32> = (0..11).collect();
    let r = a
        .allocate(
            "a",
            &AllocArgs {
                num_lookahead_tokens: 3,
                ..args(10, 11, 4)
            },
            &hashes(&toks),
        )
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 4..5);
    assert_eq!(r.commit, 2..2);
    // Rejections lower num_computed_tokens: the table never shrinks (the workers' are append-only).
    let toks: Vec<u32> = (0..13).collect();
    let r = a
        .allocate(
            "a",
            &AllocArgs {
                num_lookahead_tokens: 3,
                ..args(12, 13, 4)
            },
            &hashes(&toks),
        )
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 5..5);
    assert_eq!(r.commit, 2..3, "13 verified tokens: 3 full blocks");
    assert_eq!(a.estimate_cached_tokens("a"), 3 * BS);
    a.check().unwrap();
    assert!(a.free("a"));
    assert!(a.free("b"));
    assert!(!a.free("b"));
    assert_eq!(a.num_held_blocks(), 1);
    assert_eq!(a.num_cached_blocks(), 3);
    a.check().unwrap();
}

#[test]
fn duplicates_are_all_registered_and_found_in_order() {
    let mut a = alloc(16);
    let h = hashes(&[7; 8]);
    // Both compute the same two blocks (neither hit the other).
    a.allocate("a", &args(0, 8, 8), &h).unwrap().unwrap();
    a.allocate("b", &args(0, 8, 8), &h).unwrap().unwrap();
    assert_eq!(a.pool().num_registered(), 2);
    assert_eq!(a.pool().num_registered_blocks(), 4);
    let (a0, b0) = (a.blocks("a")[0], a.blocks("b")[0]);
    let mut ids = Vec::new();
    a.prefix_block_ids(&h, 1, &mut ids).unwrap();
    assert_eq!(ids, vec![a0], "the oldest registration is found");
    a.free("a");
    a.free("b");
    // Free order: a's tail, a's head, b's tail, b's head. Evict two: a's blocks go first.
    let r = a
        .allocate("c", &args(0, 8, 8), &hashes(&[9; 8]))
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 0..2);
    // 16 - 1 null - 4 cached = 11 free: no eviction yet.
    assert_eq!(r.evicted, 0);
    let r = a
        .allocate("d", &args(0, 44, 44), &hashes(&[3; 44]))
        .unwrap()
        .unwrap();
    assert_eq!(r.evicted, 2);
    let mut ev = Vec::new();
    a.drain_evicted(&mut ev);
    assert_eq!(ev, vec![h[1], h[0]], "tail first");
    ids.clear();
    a.prefix_block_ids(&h, 2, &mut ids).unwrap();
    assert_eq!(ids[0], b0, "b's copy takes over");
    a.check().unwrap();
}

#[test]
fn key_collision_evicts_the_older_holder() {
    let mut a = alloc(8);
    let mut x = [0u8; 32];
    x[0] = 1;
    x[31] = 5;
    let mut y = x;
    y[0] = 2; // same low 64 bits, different hash
    let (hx, hy) = (
        FullHash::from_bytes(&x).unwrap(),
        FullHash::from_bytes(&y).unwrap(),
    );
    assert_eq!(hx.key(), hy.key());
    a.allocate("a", &args(0, 4, 4), &vec![hx]).unwrap().unwrap();
    assert_eq!(
        a.find_prefix(&vec![hy], 1).unwrap(),
        0,
        "a collision is a miss"
    );
    a.allocate("b", &args(0, 4, 4), &vec![hy]).unwrap().unwrap();
    assert_eq!(a.find_prefix(&vec![hx], 1).unwrap(), 0);
    assert_eq!(a.find_prefix(&vec![hy], 1).unwrap(), 1);
    let mut ev = Vec::new();
    a.drain_evicted(&mut ev);
    assert_eq!(ev, vec![hx]);
    a.check().unwrap();
}

#[test]
fn external_tokens_watermark_reserved_and_full_sequence() {
    let mut a = alloc(10);
    let h = hashes(&(0..20).collect::<Vec<_>>());
    // 8 external tokens, 4 new: blocks for 12 tokens; external blocks are not zeroed.
    let r = a
        .allocate(
            "a",
            &AllocArgs {
                num_external_tokens: 8,
                zero_external_blocks: false,
                delay_cache_blocks: true,
                ..args(0, 20, 4)
            },
            &h,
        )
        .unwrap()
        .unwrap();
    assert_eq!(a.blocks("a").len(), 3);
    assert_eq!(r.new_blocks, 2..3);
    assert_eq!(r.commit, 0..0, "delayed caching registers nothing");
    let mut z = Vec::new();
    a.take_new_block_ids(&mut z);
    assert_eq!(z, a.blocks("a")[2..].to_vec());
    // Later the load completes and the blocks are cached.
    assert_eq!(a.cache("a", 12, 0, &h).unwrap(), 0..3);
    // 6 free blocks left: a watermark of 3 + 4 needed does not fit; reserved 3 + 4 neither.
    let big = args(0, 16, 16);
    assert_eq!(
        a.allocate(
            "b",
            &AllocArgs {
                watermark_blocks: 3,
                ..big.clone()
            },
            &h[..0]
        )
        .unwrap(),
        None
    );
    assert_eq!(
        a.allocate(
            "b",
            &AllocArgs {
                reserved_blocks: 3,
                ..big.clone()
            },
            &h[..0]
        )
        .unwrap(),
        None
    );
    // The whole sequence (40 tokens = 10 blocks) cannot fit even though the chunk would.
    let chunk = AllocArgs {
        full_sequence_tokens: Some(40),
        ..args(0, 40, 4)
    };
    assert_eq!(a.allocate("b", &chunk, &h[..0]).unwrap(), None);
    assert!(!a.contains("b"));
    a.check().unwrap();
}

#[test]
fn deferred_lookahead_is_reserved_then_materialised_for_the_step_k() {
    let mut a = alloc(8);
    // 2 tokens + lookahead 5 = 7 slots = 2 blocks, but only the main block is taken now.
    let r = a
        .allocate(
            "a",
            &AllocArgs {
                num_lookahead_tokens: 5,
                defer_lookahead: true,
                ..args(0, 2, 2)
            },
            &[FullHash::EMPTY; 0][..],
        )
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 0..1);
    assert_eq!(a.num_reserved_blocks(), 1);
    // The reservation is out of every fit check: 7 - 1 held - 1 reserved = 5 left.
    assert_eq!(
        a.allocate("b", &args(0, 0, 24), &[FullHash::EMPTY; 0][..])
            .unwrap(),
        None
    );
    a.allocate("b", &args(0, 0, 20), &[FullHash::EMPTY; 0][..])
        .unwrap()
        .unwrap();
    a.check().unwrap();
    // The step's K is 1: 3 slots fit in the block held; the reservation goes back.
    assert_eq!(a.materialize_lookahead("a", 3).unwrap(), 1..1);
    assert_eq!(a.num_reserved_blocks(), 0);
    assert!(
        a.materialize_lookahead("a", 9).is_err(),
        "nothing reserved any more"
    );
    // vLLM's manager would still hold a's second block (its lookahead for K = 5): a debt,
    // held for every other request's fit check, so "c" does not take the last free block...
    assert_eq!(a.num_debt_blocks(), 1);
    assert_eq!(a.num_free_blocks(), 1);
    assert_eq!(
        a.allocate("c", &args(0, 0, 4), &[FullHash::EMPTY; 0][..])
            .unwrap(),
        None
    );
    // ... while "a" grows into its own debt, as into the block vLLM's table already has.
    let r = a
        .allocate("a", &args(2, 3, 4), &[FullHash::EMPTY; 0][..])
        .unwrap()
        .unwrap();
    assert_eq!(r.new_blocks, 1..2);
    assert_eq!(a.num_debt_blocks(), 0);
    a.check().unwrap();
    // A request freed while reserving gives its reservation back.
    a.free("b");
    a.allocate(
        "d",
        &AllocArgs {
            num_lookahead_tokens: 4,
            defer_lookahead: true,
            ..args(0, 1, 1)
        },
        &[FullHash::EMPTY; 0][..],
    )
    .unwrap();
    assert_eq!(a.num_reserved_blocks(), 1);
    a.free("d");
    assert_eq!(a.num_reserved_blocks(), 0);
    a.check().unwrap();
}

#[test]
fn pop_release_evict_and_reset() {
    let mut a = alloc(8);
    let h = hashes(&[4; 8]);
    a.allocate("a", &args(0, 8, 8), &h).unwrap().unwrap();
    assert!(!a.reset_prefix_cache(), "blocks are held");
    let mut popped = Vec::new();
    assert!(a.pop_blocks("a", &mut popped));
    assert_eq!(popped.len(), 2);
    a.check().unwrap();
    assert!(!a.reset_prefix_cache(), "popped blocks are still held");
    assert!(
        a.release(&[popped[0], popped[0]]).is_err(),
        "released twice"
    );
    assert!(a.release(&[99]).is_err());
    let rev: Vec<_> = popped.iter().rev().copied().collect();
    a.release(&rev).unwrap();
    assert!(a.release(&rev).is_err(), "already released");
    assert_eq!(a.num_cached_blocks(), 2);
    // evict_blocks: an unregistered or out-of-range id is fine / an error.
    assert!(a.evict_blocks(&[100]).is_err());
    assert_eq!(a.evict_blocks(&[popped[1], 0]).unwrap(), 1);
    assert_eq!(a.find_prefix(&h, 2).unwrap(), 1);
    a.check().unwrap();
    assert!(a.reset_prefix_cache());
    assert_eq!(a.find_prefix(&h, 2).unwrap(), 0);
    assert_eq!(a.num_free_blocks(), 7);
    a.check().unwrap();
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let mut a = alloc(8);
    let h = hashes(&[1; 8]);
    assert!(DeviceAllocator::new(DeviceConfig {
        num_blocks: 0,
        block_size: 4,
        enable_caching: true,
        record_evictions: false,
        record_new_blocks: false,
        prefer_held_duplicates: false,
    })
    .is_err());
    assert!(DeviceAllocator::new(DeviceConfig {
        num_blocks: 4,
        block_size: 0,
        enable_caching: true,
        record_evictions: false,
        record_new_blocks: false,
        prefer_held_duplicates: false,
    })
    .is_err());
    assert!(
        a.allocate("a", &args(0, 8, 0), &h).is_err(),
        "nothing to do"
    );
    assert!(
        a.allocate(
            "a",
            &AllocArgs {
                num_hit_blocks: 1,
                ..args(0, 8, 7)
            },
            &h
        )
        .is_err(),
        "no such hit"
    );
    assert!(
        a.allocate(
            "a",
            &AllocArgs {
                num_hit_blocks: 9,
                ..args(0, 8, 7)
            },
            &h
        )
        .is_err(),
        "more hits than hashes"
    );
    assert!(
        a.allocate("a", &args(0, 8, 8), &h[..1]).is_err(),
        "hashes missing for the commit"
    );
    assert!(!a.contains("a"));
    assert!(a.materialize_lookahead("zz", 4).is_err());
    a.check().unwrap();
}

/// Random operations with random (often wrong) arguments: never a panic, and the invariants
/// hold after every call; when every request ends the pool is whole again.
/// Plans the allocation, checks the plan changed nothing, then allocates (`planned`: by carrying
/// the plan out, else by `allocate`) and checks the plan agreed with what it did: refused
/// exactly when the plan said so, the same argument errors, the positions registered and the
/// blocks taken from the pool the plan's.
fn plan_and_allocate(
    a: &mut DeviceAllocator,
    id: &str,
    aa: &AllocArgs,
    h: &Vec<FullHash>,
    planned: bool,
) -> Result<Option<Allocated>> {
    let (avail, changes) = (a.pool().available(), a.changes());
    let plan = a.plan_allocation(id, None, aa, h);
    assert_eq!((a.pool().available(), a.changes()), (avail, changes));
    let res = match (&plan, planned) {
        (Ok(Some(p)), true) => a.allocate_planned(id, p.clone(), h).map(Some),
        _ => a.allocate(id, aa, h),
    };
    let taken = avail - a.pool().available();
    match (&plan, &res) {
        (Err(p), Err(r)) => assert_eq!(p.to_string(), r.to_string()),
        (Ok(None), Ok(None)) => assert_eq!(taken, 0),
        (Ok(Some(p)), Ok(Some(done))) => {
            assert_eq!(done.commit, p.commit(), "{id}");
            assert_eq!(taken, p.num_blocks_taken(), "{id}");
        }
        // A check made when it is carried out (the hashes of what it registers, the table).
        (Ok(Some(_)), Err(_)) => assert_eq!(taken, 0),
        (p, r) => panic!("{id}: planned {p:?}, allocated {r:?}"),
    }
    res
}

#[test]
fn a_stale_plan_is_refused_and_changes_nothing() {
    let mut a = alloc(16);
    let h = hashes(&[1; 8]);
    let plan = a.plan_allocation("r", None, &args(0, 8, 8), &h).unwrap().unwrap();
    assert_eq!(plan.commit(), 0..2);
    a.allocate("s", &args(0, 8, 8), &hashes(&[2; 8])).unwrap().unwrap();
    let free = a.num_free_blocks();
    assert!(a.allocate_planned("r", plan, &h).is_err());
    assert_eq!((a.num_free_blocks(), a.blocks("r").len()), (free, 0));
    // Refused: a plan says so without a hash of what it would register being read.
    let big = args(0, 64, 64);
    let few = hashes(&[3; 4]);
    assert!(a.plan_allocation("big", None, &big, &few).unwrap().is_none());
    assert!(a.allocate("big", &big, &few).unwrap().is_none());
    a.check().unwrap();
}

#[test]
fn random_operations_keep_the_invariants() {
    let mut x = 0x853c_49e6_748f_ea9bu64;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    for round in 0..30 {
        let num_blocks = 2 + rnd(40) as usize;
        let mut a = alloc(num_blocks);
        // A few prompt families so that hits, duplicates and evictions happen.
        let families: Vec<Vec<u32>> = (0..3)
            .map(|f| (0..64).map(|i| (f * 1000 + i) as u32).collect())
            .collect();
        let mut live: Vec<(String, Vec<u32>, usize)> = Vec::new(); // id, tokens, computed
        let mut popped: Vec<Vec<BlockId>> = Vec::new();
        for step in 0..400 {
            match rnd(10) {
                0..=2 => {
                    let f = &families[rnd(3) as usize];
                    let len = 1 + rnd(40) as usize;
                    let mut toks = f[..len].to_vec();
                    if rnd(2) == 0 {
                        toks.push(9999 + step);
                    }
                    let h = hashes(&toks);
                    let max = (toks.len() - 1) / BS;
                    let hit = a.find_prefix(&h, max).unwrap();
                    let hit = if rnd(2) == 0 {
                        hit.saturating_sub(1)
                    } else {
                        hit
                    };
                    let id = format!("r{round}-{step}");
                    let new = toks.len() - hit * BS;
                    let la = rnd(4) as usize;
                    let aa = AllocArgs {
                        num_hit_blocks: hit,
                        num_lookahead_tokens: la,
                        ..args(0, toks.len(), new)
                    };
                    let res = plan_and_allocate(&mut a, &id, &aa, &h, rnd(2) == 0);
                    if let Ok(Some(done)) = res {
                        live.push((id, toks, hit * BS + new));
                    }
                }
                3..=5 if !live.is_empty() => {
                    // A decode step: accept some drafts, schedule 1 + k, maybe reject.
                    let i = rnd(live.len() as u64) as usize;
                    let (id, toks, computed) = &mut live[i];
                    let k = rnd(4) as usize;
                    let rejected = rnd(k as u64 + 1) as usize;
                    toks.push(7 + rnd(5) as u32);
                    let h = hashes(toks);
                    let aa = AllocArgs {
                        num_lookahead_tokens: k,
                        ..args(*computed, toks.len(), 1 + k)
                    };
                    if rnd(4) == 0 {
                        let n = rnd(*computed as u64 + 1) as usize;
                        let planned = a.planned_cache(id, n, 0);
                        assert_eq!(a.cache(id, n, 0, &h).unwrap(), planned);
                    }
                    let res = plan_and_allocate(&mut a, id, &aa, &h, rnd(2) == 0);
                    match res {
                        Ok(Some(_)) => *computed = (*computed + 1 + k - rejected).min(toks.len()),
                        Ok(None) => {
                            // Preempt it.
                            a.free(id);
                            live.swap_remove(i);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                6 if !live.is_empty() => {
                    let i = rnd(live.len() as u64) as usize;
                    let (id, ..) = live.swap_remove(i);
                    if rnd(3) == 0 {
                        let mut out = Vec::new();
                        a.pop_blocks(&id, &mut out);
                        popped.push(out);
                    } else {
                        assert!(a.free(&id));
                    }
                }
                7 if !popped.is_empty() => {
                    let mut p = popped.swap_remove(0);
                    p.reverse();
                    a.release(&p).unwrap();
                }
                8 => {
                    // Garbage: unknown ids, wrong counts, out-of-range blocks.
                    let _ = a.allocate(
                        "nobody",
                        &AllocArgs {
                            num_hit_blocks: rnd(3) as usize,
                            ..args(rnd(50) as usize, rnd(50) as usize, rnd(3) as usize)
                        },
                        &hashes(&[1; 8]),
                    );
                    let _ = a.release(&[num_blocks as u32 + rnd(5) as u32]);
                    let _ = a.evict_blocks(&[rnd(60) as u32]);
                    let _ = a.materialize_lookahead("nobody", rnd(20) as usize);
                    let _ = a.cache("nobody", rnd(50) as usize, 0, &hashes(&[1; 8]));
                    a.free("nobody");
                }
                9 if rnd(3) == 0 => a.release_reservations(),
                9 if rnd(20) == 0 => {
                    let ok = a.reset_prefix_cache();
                    assert_eq!(ok, live.is_empty() && popped.is_empty());
                }
                _ => {}
            }
            a.check()
                .unwrap_or_else(|e| panic!("round {round} step {step}: {e}"));
        }
        for (id, ..) in live.drain(..) {
            a.free(&id);
        }
        for mut p in popped.drain(..) {
            p.reverse();
            a.release(&p).unwrap();
        }
        a.check().unwrap();
        assert_eq!(a.num_held_blocks(), 1, "only the null block is held");
        assert_eq!(a.num_free_blocks(), num_blocks - 1, "the pool is whole");
        assert_eq!(a.num_parked_holds(), 0);
    }
}

#[test]
fn a_slot_is_found_by_its_tag_only_while_it_carries_it() {
    let mut a = alloc(16);
    let hr = hashes(&[1; 8]);
    let hs = hashes(&[2; 8]);
    let r = a.allocate("r", &args(0, 8, 4), &hr).unwrap().unwrap();
    assert_eq!(a.slot_tag(r.slot), 0);
    assert_eq!(a.tag_slot("r", 7), Some(r.slot));
    assert_eq!(a.tag_slot("nobody", 9), None);
    assert_eq!(a.slot_tag(r.slot), 7);
    // Tagged: the slot is used as is.
    let t = a
        .allocate_tagged("r", r.slot, 7, &args(4, 8, 4), &hr)
        .unwrap()
        .unwrap();
    assert_eq!((t.slot, a.blocks("r").len()), (r.slot, 2));
    // A wrong tag or slot falls back to the name: the same answer, no other table touched.
    let s = a.allocate("s", &args(0, 8, 4), &hs).unwrap().unwrap();
    assert_eq!(a.tag_slot("s", 8), Some(s.slot));
    let before_s = a.blocks("s").to_vec();
    let u = a
        .allocate_tagged("r", s.slot, 7, &args(8, 12, 1), &hr)
        .unwrap()
        .unwrap();
    assert_eq!(u.slot, r.slot);
    assert_eq!(a.blocks("s"), &before_s[..]);
    assert_eq!(a.blocks("r").len(), 3);
    let v = a
        .allocate_tagged("r", 1 << 40, 7, &args(9, 13, 1), &hr)
        .unwrap();
    assert_eq!(v.unwrap().slot, r.slot);
    // Released: the tag goes with the slot, and a request that takes the slot next is found
    // by its name until it is tagged itself.
    assert!(a.free("r"));
    assert_eq!(a.slot_tag(r.slot), 0);
    let w = a
        .allocate_tagged("w", r.slot, 7, &args(0, 4, 4), &hashes(&[3; 4]))
        .unwrap()
        .unwrap();
    assert_eq!(a.blocks("w").len(), 1);
    assert_eq!(a.blocks("r"), &[] as &[BlockId]);
    assert_eq!(a.slot_tag(w.slot), 0);
    // Tag 0 is "none".
    let x = a
        .allocate_tagged("s", s.slot, 0, &args(4, 8, 4), &hs)
        .unwrap()
        .unwrap();
    assert_eq!(x.slot, s.slot);
}

#[test]
fn a_plan_from_another_allocator_is_refused_and_changes_nothing() {
    // B's counter brought to A's: the count alone took A's plan (A's hit ids, A's slot) as B's.
    let filler = hashes(&(0..160).map(|t| 100 + t as u32).collect::<Vec<_>>());
    let h = hashes(&[1; 32]);
    let mut a = alloc(64);
    a.allocate("filler", &args(0, 160, 160), &filler).unwrap().unwrap();
    a.allocate("x", &args(0, 32, 32), &h).unwrap().unwrap();
    a.free("x");
    let hit = AllocArgs { num_hit_blocks: 8, ..args(0, 33, 1) };
    let plan = a.plan_allocation("y", None, &hit, &h).unwrap().unwrap();
    let slot_plan = a.plan_allocation("filler", None, &args(160, 164, 4), &filler).unwrap().unwrap();
    for (rid, plan, hs) in [("y", plan, &h), ("filler", slot_plan, &filler)] {
        let mut b = alloc(64);
        while b.changes() < a.changes() {
            b.release_reservations();
        }
        let free = b.num_free_blocks();
        let err = b.allocate_planned(rid, plan, hs).unwrap_err();
        assert!(err.to_string().contains("another allocator"), "{err}");
        assert_eq!((b.num_free_blocks(), b.blocks(rid).len(), b.changes()), (free, 0, a.changes()));
        b.check().unwrap();
    }
    a.check().unwrap();
}
