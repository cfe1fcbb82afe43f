//! The speculative-decoding trace of `benches/slots_trace.py`, regenerated bit for bit in Rust
//! (same counter-based generator, same schedule, same digest), and its replay through the
//! engine exactly as `benches/bench_slots.py` drives the batch API from Python.

#![allow(dead_code)]

use kvslots_core::{ManagerConfig, SlotId, SlotManager, StepInput, StepOutput};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const META: u64 = 0;
const PROMPT: u64 = 1;
const OUTPUT: u64 = 2;
const ACCEPT: u64 = 3;
const SHARED_STREAM: u64 = 1 << 32;

pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn key(seed: u64, stream: u64, purpose: u64) -> u64 {
    mix64(
        mix64(seed.wrapping_add((stream + 1).wrapping_mul(GAMMA)))
            .wrapping_add((purpose + 1).wrapping_mul(GAMMA)),
    )
}

fn draw(k: u64, i: u64) -> u64 {
    mix64((i + 1).wrapping_mul(GAMMA).wrapping_add(k))
}

#[derive(Debug, Clone, Copy)]
pub struct TraceConfig {
    pub batch: usize,
    pub k: usize,
    pub steps: usize,
    pub seed: u64,
    pub block_size: usize,
    pub acceptance_ppm: u64,
    pub prompt_min: u64,
    pub prompt_max: u64,
    pub shared_prefix: u64,
    pub shared_permille: u64,
    pub output_min: u64,
    pub output_max: u64,
    pub vocab: u64,
}

impl TraceConfig {
    pub fn new(batch: usize, k: usize, steps: usize) -> Self {
        TraceConfig {
            batch,
            k,
            steps,
            seed: 0,
            block_size: 16,
            acceptance_ppm: 700_000,
            prompt_min: 512,
            prompt_max: 2048,
            shared_prefix: 1024,
            shared_permille: 300,
            output_min: 128,
            output_max: 512,
            vocab: 32000,
        }
    }
}

pub struct Request {
    pub rid: String,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub output_len: usize,
    pub accepted: Vec<u32>,
}

fn make_request(cfg: &TraceConfig, r: u64, shared: &[u32]) -> Request {
    let m = key(cfg.seed, r, META);
    let (u0, u1, u2) = (draw(m, 0), draw(m, 1), draw(m, 2));
    let kp = key(cfg.seed, r, PROMPT);
    let prompt: Vec<u32> = if u1 % 1000 < cfg.shared_permille {
        let n = cfg.shared_prefix + 1 + u0 % (cfg.prompt_max - cfg.shared_prefix);
        let mut p = shared.to_vec();
        p.extend((0..n - cfg.shared_prefix).map(|i| (draw(kp, i) % cfg.vocab) as u32));
        p
    } else {
        let n = cfg.prompt_min + u0 % (cfg.prompt_max - cfg.prompt_min + 1);
        (0..n).map(|i| (draw(kp, i) % cfg.vocab) as u32).collect()
    };
    let out_len = (cfg.output_min + u2 % (cfg.output_max - cfg.output_min + 1)) as usize;
    let ko = key(cfg.seed, r, OUTPUT);
    let output = (0..(out_len + cfg.k) as u64)
        .map(|i| (draw(ko, i) % cfg.vocab) as u32)
        .collect();
    let ka = key(cfg.seed, r, ACCEPT);
    let mut accepted = Vec::new();
    let mut gen = 1usize;
    for t in 0..out_len {
        let mut a = 0;
        while a < cfg.k && draw(ka, (t * cfg.k + a) as u64) % 1_000_000 < cfg.acceptance_ppm {
            a += 1;
        }
        accepted.push(a as u32);
        gen += 1 + a;
        if gen >= out_len {
            break;
        }
    }
    Request {
        rid: format!("req-{r}"),
        prompt,
        output,
        output_len: out_len,
        accepted,
    }
}

pub struct Step {
    pub finishes: Vec<usize>,
    pub batch: Vec<usize>,
    pub num_accepted: Vec<u32>,
    pub num_rejected: Vec<u32>,
    pub accepted_tokens: Vec<u32>,
    pub admits: Vec<usize>,
}

pub struct Trace {
    pub cfg: TraceConfig,
    pub requests: Vec<Request>,
    pub steps: Vec<Step>,
    pub request_steps: u64,
    pub digest: u64,
    pub roomy_blocks: usize,
    pub tight_blocks: usize,
}

fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens.div_ceil(bs)
}

pub fn generate(cfg: TraceConfig) -> Trace {
    let ks = key(cfg.seed, SHARED_STREAM, PROMPT);
    let shared: Vec<u32> = (0..cfg.shared_prefix)
        .map(|i| (draw(ks, i) % cfg.vocab) as u32)
        .collect();
    let (k, bs) = (cfg.k, cfg.block_size);
    let mut requests: Vec<Request> = Vec::new();
    // Per request: decode steps done, generated, committed output tokens, blocks held.
    let (mut t_of, mut gen_of, mut com_of, mut blocks_of) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut live = Vec::<bool>::new();
    let mut running: Vec<usize> = Vec::new();
    let mut steps = Vec::new();
    let (mut request_steps, mut digest, mut total_blocks, mut peak) = (0u64, 0u64, 0usize, 0usize);
    let mut held = 0usize;
    for _ in 0..cfg.steps {
        let (finishes, keep): (Vec<usize>, Vec<usize>) = running
            .iter()
            .partition(|&&r| gen_of[r] >= requests[r].output_len);
        running = keep;
        let n = running.len();
        let (mut acc, mut rej) = (vec![0u32; n], vec![0u32; n]);
        let mut toks = Vec::new();
        for (j, &r) in running.iter().enumerate() {
            let req = &requests[r];
            let t = t_of[r];
            if t > 0 {
                let a = req.accepted[t - 1] as usize;
                acc[j] = (1 + a) as u32;
                rej[j] = (k - a) as u32;
                let c = com_of[r];
                toks.extend_from_slice(&req.output[c..c + 1 + a]);
                com_of[r] = c + 1 + a;
            }
            gen_of[r] += 1 + req.accepted[t] as usize;
            t_of[r] = t + 1;
            let need = blocks_for(req.prompt.len() + com_of[r] + (1 + k) + k, bs);
            if need > blocks_of[r] {
                total_blocks += need - blocks_of[r];
                held += need - blocks_of[r];
                blocks_of[r] = need;
            }
        }
        let batch = running.clone();
        let mut admits = Vec::new();
        while running.len() < cfg.batch {
            let r = requests.len();
            let req = make_request(&cfg, r as u64, &shared);
            let sum: u64 = req.prompt.iter().map(|&t| t as u64).sum();
            digest =
                mix64(digest ^ (r as u64 + 1) ^ ((req.prompt.len() as u64) << 32) ^ (sum << 40));
            let b = blocks_for(req.prompt.len() + k, bs);
            t_of.push(0);
            gen_of.push(1);
            com_of.push(0);
            blocks_of.push(b);
            live.push(true);
            total_blocks += b;
            held += b;
            requests.push(req);
            running.push(r);
            admits.push(r);
        }
        for &r in &finishes {
            digest = mix64(digest ^ (r as u64 + 1) ^ (1 << 63));
            held -= blocks_of[r];
            live[r] = false;
        }
        let acc_sum: u64 = acc.iter().map(|&a| a as u64).sum();
        let tok_sum: u64 = toks.iter().map(|&t| t as u64).sum();
        digest = mix64(digest ^ n as u64 ^ (acc_sum << 20) ^ (tok_sum << 24));
        peak = peak.max(held);
        request_steps += (n + admits.len()) as u64;
        steps.push(Step {
            finishes,
            batch,
            num_accepted: acc,
            num_rejected: rej,
            accepted_tokens: toks,
            admits,
        });
    }
    Trace {
        cfg,
        requests,
        steps,
        request_steps,
        digest,
        roomy_blocks: total_blocks + 64,
        tight_blocks: peak + 64,
    }
}

/// Reused across replays, like the numpy arrays of the Python driver.
#[derive(Default)]
pub struct Scratch {
    slot_of: Vec<SlotId>,
    ids: Vec<SlotId>,
    new: Vec<u32>,
    out: StepOutput,
}

pub fn manager(trace: &Trace, num_blocks: usize) -> SlotManager {
    SlotManager::new(ManagerConfig::new(num_blocks, trace.cfg.block_size)).unwrap()
}

/// Request-steps of steps `from..` (what a timed replay of those steps does).
pub fn request_steps_from(trace: &Trace, from: usize) -> u64 {
    trace.steps[from..]
        .iter()
        .map(|s| (s.batch.len() + s.admits.len()) as u64)
        .sum()
}

/// Replays the trace through a fresh `m` as `bench_slots.py`'s batch driver does: per step,
/// finishes, one `step` call, admissions (create + reserve + commit of the prompt), and the
/// event log dropped. Steps `..warmup` run untimed; returns the events queued and the thread
/// CPU time of steps `warmup..`.
pub fn replay(
    trace: &Trace,
    m: &mut SlotManager,
    s: &mut Scratch,
    warmup: usize,
) -> (usize, std::time::Duration) {
    let k = trace.cfg.k;
    s.slot_of.clear();
    s.slot_of.resize(trace.requests.len(), 0);
    s.new.clear();
    s.new.resize(trace.cfg.batch, (1 + k) as u32);
    let mut events = 0;
    let mut t0 = cpu::now();
    for (i, st) in trace.steps.iter().enumerate() {
        if i == warmup {
            t0 = cpu::now();
        }
        for &r in &st.finishes {
            m.finish(&trace.requests[r].rid).unwrap();
        }
        if !st.batch.is_empty() {
            s.ids.clear();
            s.ids.extend(st.batch.iter().map(|&r| s.slot_of[r]));
            let input = StepInput {
                slots: &s.ids,
                num_accepted: &st.num_accepted,
                accepted_tokens: &st.accepted_tokens,
                num_rejected: &st.num_rejected,
                num_new_tokens: &s.new[..st.batch.len()],
                lookahead: None,
            };
            m.step(&input, &mut s.out).unwrap();
        }
        for &r in &st.admits {
            let req = &trace.requests[r];
            let (id, matched) = m.create(&req.rid, &req.prompt, k, true, None).unwrap();
            s.slot_of[r] = id;
            m.reserve(&req.rid, req.prompt.len() - matched).unwrap();
            m.commit(&req.rid, &req.prompt[matched..]).unwrap();
        }
        events += m.events().len();
        m.events_mut().clear();
    }
    (events, cpu::now().saturating_sub(t0))
}

/// The calling thread's CPU time (the Python side measures with `time.thread_time_ns`); wall
/// time on platforms without `CLOCK_THREAD_CPUTIME_ID`.
pub mod cpu {
    use std::time::Duration;

    #[cfg(target_os = "linux")]
    pub fn now() -> Duration {
        #[repr(C)]
        struct Timespec {
            tv_sec: i64,
            tv_nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut ts = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec through a valid pointer.
        let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[cfg(not(target_os = "linux"))]
    pub fn now() -> Duration {
        use std::sync::OnceLock;
        use std::time::Instant;
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed()
    }
}
