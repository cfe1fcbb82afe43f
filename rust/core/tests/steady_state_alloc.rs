//! The batch path allocates nothing per request-step once warm: the benchmark trace (B=64,
//! K=3, the second half of 256 steps) replayed under a counting allocator. Counts
//! allocations, never time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvslots_core::StepInput;

#[path = "../benches/trace/mod.rs"]
mod trace;

struct Counting;

thread_local! {
    /// Allocations made by this thread while counting is on (None: off).
    static COUNT: Cell<Option<usize>> = const { Cell::new(None) };
}

fn bump() {
    COUNT.with(|c| {
        if let Some(n) = c.get() {
            c.set(Some(n + 1));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; counting touches only a
// const-initialised thread-local Cell, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        bump();
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        bump();
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        bump();
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn counted<T>(f: impl FnOnce() -> T) -> (T, usize) {
    COUNT.with(|c| c.set(Some(0)));
    let out = f();
    let n = COUNT.with(|c| c.replace(None)).unwrap();
    (out, n)
}

#[test]
fn steady_state_steps_do_not_allocate() {
    let t = trace::generate(trace::TraceConfig::new(64, 3, 256));
    let warmup = t.cfg.steps / 2;
    for blocks in [t.roomy_blocks, t.tight_blocks] {
        let mut m = trace::manager(&t, blocks);
        let mut slot_of = vec![0u64; t.requests.len()];
        let (mut ids, new) = (Vec::new(), vec![4u32; t.cfg.batch]);
        let mut out = Default::default();
        let (mut step_allocs, mut other_allocs, mut request_steps, mut admissions) = (0, 0, 0, 0);
        for (i, st) in t.steps.iter().enumerate() {
            let timed = i >= warmup;
            let (_, n) = counted(|| {
                for &r in &st.finishes {
                    m.finish(&t.requests[r].rid).unwrap();
                }
            });
            other_allocs += if timed { n } else { 0 };
            ids.clear();
            ids.extend(st.batch.iter().map(|&r| slot_of[r]));
            let input = StepInput {
                slots: &ids,
                num_accepted: &st.num_accepted,
                accepted_tokens: &st.accepted_tokens,
                num_rejected: &st.num_rejected,
                num_new_tokens: &new[..st.batch.len()],
                lookahead: None,
            };
            let (res, n) = counted(|| m.step(&input, &mut out));
            res.unwrap();
            step_allocs += if timed { n } else { 0 };
            let (_, n) = counted(|| {
                for &r in &st.admits {
                    let q = &t.requests[r];
                    let (id, matched) = m.create(&q.rid, &q.prompt, 3, true, None).unwrap();
                    slot_of[r] = id;
                    m.reserve(&q.rid, q.prompt.len() - matched).unwrap();
                    m.commit(&q.rid, &q.prompt[matched..]).unwrap();
                }
                m.events_mut().clear();
            });
            if timed {
                other_allocs += n;
                request_steps += st.batch.len();
                admissions += st.admits.len();
            }
        }
        // The step calls allocate nothing per request-step. What remains is a reused slot's
        // buffers growing when it serves a longer request than it held before: amortized per
        // request, and fading as the reused buffers reach the longest requests seen (this
        // trace: 30 in the timed 8k request-steps; 15 in 65k with 2048 steps). Admissions:
        // about one each (the request-id map's key).
        assert!(
            step_allocs <= admissions,
            "{step_allocs} allocations in {request_steps} request-steps, {admissions} admissions \
             (pool {blocks})"
        );
        assert!(
            other_allocs <= 2 * admissions,
            "{other_allocs} allocations for {admissions} admissions (pool {blocks})"
        );
    }
}
