//! Criterion benches of the engine alone (no Python):
//!
//! - `step_b256_k3/{roomy,tight}`: the speculative-decoding trace of `benches/slots_trace.py`
//!   (B=256, K=3, 512 steps, seed 0; regenerated bit for bit in `trace/mod.rs`) replayed
//!   through `SlotManager` exactly as `benches/bench_slots.py` drives the batch API; throughput
//!   is in request-steps, so criterion's time per element is the pure-Rust ns per request-step.
//!   Only the steps after a warm-up of a quarter of the trace are timed, in thread CPU time
//!   (as the Python side does by default; the machines this runs on are shared).
//! - `hash_block_16`: hashing one full block of 16 tokens (throughput in tokens).
//! - `pool_new_1m`: building a manager over a pool of 1M blocks.
//!
//! Each step bench also writes `target/kvslots-bench/step_b256_k3_<pool>.json` (trace digest,
//! request-steps, the manager's counters after one replay) so `benches/bench_engine.py` can
//! check that the Python side replayed the very same trace.
//!
//! `KVSLOTS_BENCH_STEPS` overrides the number of steps (the Python report passes the same).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvslots_core::{BlockHasher, ManagerConfig, SlotManager};

mod trace;

fn out_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("kvslots-bench")
}

fn steps() -> usize {
    std::env::var("KVSLOTS_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512)
}

fn bench_step(c: &mut Criterion) {
    let t = trace::generate(trace::TraceConfig::new(256, 3, steps()));
    let warmup = t.cfg.steps / 4;
    let timed = trace::request_steps_from(&t, warmup);
    let mut g = c.benchmark_group("step_b256_k3");
    g.throughput(Throughput::Elements(timed));
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(10));
    for (pool, blocks) in [("roomy", t.roomy_blocks), ("tight", t.tight_blocks)] {
        // One untimed replay: its counters say what the trace did.
        let mut scratch = trace::Scratch::default();
        let mut m = trace::manager(&t, blocks);
        let (events, _) = trace::replay(&t, &mut m, &mut scratch, warmup);
        let s = m.stats();
        let dir = out_dir();
        std::fs::create_dir_all(&dir).ok();
        let json = format!(
            "{{\"batch\": 256, \"k\": 3, \"steps\": {}, \"warmup\": {warmup}, \"pool\": \"{pool}\", \
             \"num_blocks\": {blocks}, \"digest\": {}, \"request_steps\": {}, \"timed_request_steps\": {timed}, \
             \"events\": {events}, \"allocated_blocks\": {}, \"registered_blocks\": {}, \"evicted_blocks\": {}, \
             \"committed_tokens\": {}, \"prefix_hit_tokens\": {}}}\n",
            t.cfg.steps,
            t.digest,
            t.request_steps,
            s.allocated_blocks,
            s.registered_blocks,
            s.evicted_blocks,
            s.committed_tokens,
            s.prefix_hit_tokens
        );
        std::fs::write(dir.join(format!("step_b256_k3_{pool}.json")), json).ok();
        // Time per iteration: thread CPU time of the steady steps (after the warm-up) of one
        // replay on a fresh manager; building the pool and the warm-up are not counted.
        g.bench_function(pool, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mut m = trace::manager(&t, blocks);
                    total += trace::replay(&t, &mut m, &mut scratch, warmup).1;
                }
                total
            })
        });
    }
    g.finish();
}

fn bench_hash(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..16u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 32000)
        .collect();
    let mut h = BlockHasher::new();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(16));
    let mut parent = 0u64;
    g.bench_function("block_16", |b| {
        b.iter(|| {
            parent = h.hash(black_box(parent), black_box(&tokens), None);
            parent
        })
    });
    g.finish();
}

fn bench_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    g.sample_size(20);
    g.bench_function("new_1m", |b| {
        b.iter(|| SlotManager::new(ManagerConfig::new(black_box(1_000_000), 16)).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench_step, bench_hash, bench_pool);
criterion_main!(benches);
