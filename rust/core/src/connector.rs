//! The scheduler side of the KVSlotsConnector: the host tier ([`HostCache`]) plus a mirror of
//! every request vLLM schedules, planned in one call per engine step.
//!
//! vLLM owns the device blocks. Each step the planner is told what vLLM's scheduler output
//! already holds (the device block ids newly given to each request, how many tokens each has
//! computed and is scheduled to compute, who was preempted) and plans, for the whole batch:
//!
//! - **stores**: block `i` of a request once all its positions hold verified KV
//!   (`(i + 1) * block_size <= verified`). The scheduler output's computed-token counts (an upper
//!   bound of the verified ones) say which requests can have a new full block: only those few
//!   *candidates* are read further. Stores of a request are never planned in the step it is
//!   first scheduled or resumed (its prefix hit may be on blocks another request computes in
//!   that very step);
//! - **preempted requests**: their full verified blocks are stored in the step that preempts
//!   them, before any forward reuses the freed device blocks (the copies run first in the step);
//! - **finished requests**: their last blocks are stored at the start of the next step;
//! - **loads** of host hits, planned when vLLM allocated the device blocks.
//!
//! EAGLE-family drafters: the draft KV at a block's last position depends on the token after the
//! block. Each stored block records that *successor* when its stored draft KV was written with
//! it, and the last block of a host hit is served only when the request's next token is the
//! recorded successor (otherwise it is recomputed, as vLLM does for its local hits). vLLM's
//! padded drafter writes the last position of a partial prefill chunk with a stand-in token (the
//! prompt's last token), so a block whose last position ended such a chunk records no successor.
//!
//! The planner is pure Rust; the binding reads vLLM's objects (token ids, block hashes, counts)
//! and calls it. Hashes are vLLM's own block hashes in their 64-bit external form.

use std::collections::{BTreeMap, HashMap};

use foldhash::fast::RandomState;

use crate::cache::{HostCache, NO_SUCCESSOR};
use crate::error::{Result, SlotError};
use crate::pool::BlockId;

/// Index of a mirrored request inside the planner (stable while the request is tracked).
pub type ReqSlot = u32;

#[derive(Debug, Clone, Copy)]
pub struct PlannerConfig {
    pub block_size: usize,
    pub num_host_blocks: usize,
    /// EAGLE-family drafter: the successor rule applies to the last block of a hit. With
    /// `eagle_block_drop` off, the last block is served like any other (draft models, n-gram,
    /// no speculation).
    pub eagle: bool,
    /// Worker ranks that must ack a step before its stores become visible.
    pub expected_workers: u32,
    /// The most tokens a decoding request verifies in one step (1 + K); informational.
    pub max_decode_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlannerStats {
    /// Tokens served from the host tier (sum of planned loads).
    pub hit_tokens: u64,
    pub loaded_blocks: u64,
    pub stored_blocks: u64,
    /// Of `stored_blocks`: blocks of preempted requests.
    pub preempted_stored_blocks: u64,
    pub failed_loads: u64,
    pub failed_stores: u64,
    /// Last blocks of EAGLE hits served because the next token matched the recorded successor.
    pub last_blocks_served: u64,
    /// Last blocks of EAGLE hits not served (no or another successor): recomputed.
    pub last_blocks_dropped: u64,
    /// Requests read for stores (the candidates), over all steps.
    pub checked: u64,
}

/// One step's copies, for the workers: stores first (device -> host), then loads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub step: u64,
    pub store_device: Vec<BlockId>,
    pub store_host: Vec<BlockId>,
    /// (request slot, device blocks, host blocks) per load.
    pub loads: Vec<(ReqSlot, Vec<BlockId>, Vec<BlockId>)>,
}

#[derive(Debug, Clone, Default)]
struct StepOps {
    loads: Vec<Vec<BlockId>>,
    acks: u32,
    failed_store_blocks: Vec<BlockId>,
    has_stores: bool,
}

#[derive(Debug, Clone)]
struct Load {
    device: Vec<BlockId>,
    host: Vec<BlockId>,
}

/// What the per-step mirror reads of every scheduled request, packed (one cache line holds two).
#[derive(Debug, Clone, Copy, Default)]
struct Hot {
    prompt_len: usize,
    /// Verified tokens at which the next block to store is full: `(next_block + 1) * bs`.
    store_at: usize,
    /// The step in which it was last first scheduled (new or resumed): no stores then.
    first_step: u64,
    /// While prefilling: num_computed + scheduled at its last scheduled step, the most positions
    /// whose KV that step can have written (usize::MAX once decoding: vLLM's count is exact).
    computed_hi: usize,
    /// Once decoding: the request cannot be a store candidate while the planner's scheduled-token
    /// sum (`ConnectorPlanner::cum`) is below this, so its computed count need not be read.
    read_at: u64,
}

#[derive(Debug, Clone, Default)]
struct Req {
    id: String,
    live: bool,
    lora: Option<u64>,
    /// vLLM's device block ids of the request, as its scheduler output gave them.
    blocks: Vec<BlockId>,
    /// External hashes of the request's first blocks (as many as were read so far).
    hashes: Vec<u64>,
    /// Blocks below were already considered for storing.
    next_block: usize,
    /// Blocks whose last position ended a partial prefill chunk (draft KV with a stand-in token).
    bad_tails: Vec<usize>,
    load: Option<Load>,
    local_blocks: usize,
    hit_blocks: usize,
}

pub struct ConnectorPlanner {
    cfg: PlannerConfig,
    cache: HostCache,
    ids: HashMap<String, ReqSlot, RandomState>,
    reqs: Vec<Req>,
    hot: Vec<Hot>,
    free_slots: Vec<ReqSlot>,
    step: u64,
    inflight: BTreeMap<u64, StepOps>,
    /// Loads planned since the last step was built (slots).
    planned: Vec<ReqSlot>,
    /// Stores of finished requests, copied at the start of the next step.
    deferred_dev: Vec<BlockId>,
    deferred_host: Vec<BlockId>,
    /// This step's stores so far.
    out_dev: Vec<BlockId>,
    out_host: Vec<BlockId>,
    scratch: Vec<(usize, BlockId)>,
    succ: Vec<u32>,
    /// The sum over built steps of the most tokens any request was scheduled in that step: a
    /// request's computed count grows by at most this much between two steps.
    cum: u64,
    stats: PlannerStats,
}

impl ConnectorPlanner {
    pub fn new(cfg: PlannerConfig) -> Result<Self> {
        if cfg.expected_workers == 0 {
            return Err(SlotError::invalid(
                None,
                "expected_workers must be at least 1",
            ));
        }
        let mut cache = HostCache::new(cfg.num_host_blocks, cfg.block_size)?;
        // With the EAGLE rule, a router needs the successors to know which last blocks of a
        // hit can be served: the host tier publishes them.
        cache.set_publish_successors(cfg.eagle);
        Ok(ConnectorPlanner {
            cfg: PlannerConfig {
                max_decode_tokens: cfg.max_decode_tokens.max(1),
                ..cfg
            },
            cache,
            ids: HashMap::default(),
            reqs: Vec::new(),
            hot: Vec::new(),
            free_slots: Vec::new(),
            step: 0,
            inflight: BTreeMap::new(),
            planned: Vec::new(),
            deferred_dev: Vec::new(),
            deferred_host: Vec::new(),
            out_dev: Vec::new(),
            out_host: Vec::new(),
            scratch: Vec::new(),
            succ: Vec::new(),
            cum: 0,
            stats: PlannerStats::default(),
        })
    }

    pub fn cache(&self) -> &HostCache {
        &self.cache
    }
    pub fn cache_mut(&mut self) -> &mut HostCache {
        &mut self.cache
    }
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }
    pub fn stats(&self) -> PlannerStats {
        self.stats
    }
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Worker ranks that must ack a step from now on: at least 1, as at construction.
    pub fn set_expected_workers(&mut self, n: u32) -> Result<()> {
        if n == 0 {
            return Err(SlotError::invalid(None, "expected_workers must be at least 1"));
        }
        self.cfg.expected_workers = n;
        Ok(())
    }
    pub fn num_tracked(&self) -> usize {
        self.ids.len()
    }
    pub fn slot_of(&self, request_id: &str) -> Option<ReqSlot> {
        self.ids.get(request_id).copied()
    }
    pub fn request_id(&self, slot: ReqSlot) -> &str {
        &self.reqs[slot as usize].id
    }
    /// The device block ids mirrored for a request.
    pub fn device_blocks(&self, slot: ReqSlot) -> &[BlockId] {
        &self.reqs[slot as usize].blocks
    }
    /// How many of the request's block hashes the planner holds.
    pub fn known_hashes(&self, slot: ReqSlot) -> usize {
        self.reqs[slot as usize].hashes.len()
    }
    /// Appends the request's next block hashes (external form), in order.
    pub fn extend_hashes(&mut self, slot: ReqSlot, hashes: &[u64]) {
        self.reqs[slot as usize].hashes.extend_from_slice(hashes);
    }
    pub fn hashes(&self, slot: ReqSlot) -> &[u64] {
        &self.reqs[slot as usize].hashes
    }
    /// Blocks of the request already considered for storing.
    pub fn next_block(&self, slot: ReqSlot) -> usize {
        self.reqs[slot as usize].next_block
    }
    pub fn has_pending_work(&self) -> bool {
        !self.inflight.is_empty() || !self.deferred_dev.is_empty()
    }

    /// Starts (or restarts, with `fresh`: a new request under a known id) mirroring a request.
    pub fn track(
        &mut self,
        request_id: &str,
        prompt_len: usize,
        lora: Option<u64>,
        fresh: bool,
    ) -> ReqSlot {
        if let Some(&s) = self.ids.get(request_id) {
            if !fresh {
                return s;
            }
            self.untrack(s);
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.reqs.push(Req::default());
                self.hot.push(Hot::default());
                (self.reqs.len() - 1) as ReqSlot
            }
        };
        let next_step = self.step + 1;
        self.hot[slot as usize] = Hot {
            prompt_len,
            store_at: self.cfg.block_size,
            first_step: next_step,
            computed_hi: 0,
            read_at: 0,
        };
        let r = &mut self.reqs[slot as usize];
        r.id.clear();
        r.id.push_str(request_id);
        r.live = true;
        r.lora = lora;
        r.blocks.clear();
        r.hashes.clear();
        r.next_block = 0;
        r.bad_tails.clear();
        r.load = None;
        r.local_blocks = 0;
        r.hit_blocks = 0;
        self.ids.insert(request_id.to_owned(), slot);
        slot
    }

    fn untrack(&mut self, slot: ReqSlot) {
        self.drop_load(slot);
        let r = &mut self.reqs[slot as usize];
        if r.live {
            r.live = false;
            self.ids.remove(&r.id);
            self.free_slots.push(slot);
        }
    }

    fn drop_load(&mut self, slot: ReqSlot) {
        if let Some(l) = self.reqs[slot as usize].load.take() {
            // The blocks were pinned by begin_load: releasing cannot fail.
            let _ = self.cache.end_load(&l.host);
        }
    }

    /// A host-tier lookup for a waiting request. `max_blocks`: the request's full blocks that
    /// may be served (never the whole prompt); `local_blocks`: vLLM's own (block-aligned) hit.
    /// The request's hashes must be known up to `max_blocks`. `next_token(p)` is the request's
    /// token at position `p`, if known. Returns the tokens to load beyond the local hit.
    pub fn lookup(
        &mut self,
        slot: ReqSlot,
        local_blocks: usize,
        max_blocks: usize,
        next_token: impl Fn(usize) -> Option<u32>,
    ) -> usize {
        let bs = self.cfg.block_size;
        let r = &self.reqs[slot as usize];
        let max_blocks = max_blocks.min(r.hashes.len());
        if max_blocks <= local_blocks {
            return 0;
        }
        let mut hit = self.cache.match_prefix(&r.hashes[..max_blocks]);
        if self.cfg.eagle && hit > 0 {
            let succ = self.cache.successor(r.hashes[hit - 1]);
            if succ != NO_SUCCESSOR && next_token(hit * bs) == Some(succ) {
                self.stats.last_blocks_served += 1;
            } else {
                hit -= 1;
                self.stats.last_blocks_dropped += 1;
            }
        }
        if hit <= local_blocks {
            return 0;
        }
        let r = &mut self.reqs[slot as usize];
        r.local_blocks = local_blocks;
        r.hit_blocks = hit;
        (hit - local_blocks) * bs
    }

    /// Pins the host blocks of a request's external hit (`num_external_tokens` right after its
    /// local hit, as answered by [`Self::lookup`]) for a load into `device_blocks` (the
    /// request's whole block table as vLLM allocated it). A second call for the same request
    /// keeps the first plan.
    pub fn plan_load(
        &mut self,
        slot: ReqSlot,
        device_blocks: &[BlockId],
        num_external_tokens: usize,
    ) -> Result<()> {
        let bs = self.cfg.block_size;
        let r = &self.reqs[slot as usize];
        if r.load.is_some() || num_external_tokens == 0 {
            return Ok(());
        }
        let n = num_external_tokens / bs;
        let lo = r.local_blocks;
        if lo + n > r.hit_blocks || lo + n > device_blocks.len() || lo + n > r.hashes.len() {
            return Err(load_error(&r.id, n, lo, r.hit_blocks, device_blocks.len()));
        }
        let host = self.cache.begin_load(&r.id, &r.hashes[lo..lo + n])?;
        let device = device_blocks[lo..lo + n].to_vec();
        self.reqs[slot as usize].load = Some(Load { device, host });
        self.planned.push(slot);
        self.stats.hit_tokens += num_external_tokens as u64;
        Ok(())
    }

    /// Whether a request not tracked yet (so without a hit) may be planned a load of
    /// `num_external_tokens` into `device_blocks` blocks: the error [`Self::plan_load`] would
    /// give once it is tracked, checked before tracking it.
    pub fn check_new_load(
        &self,
        request_id: &str,
        device_blocks: usize,
        num_external_tokens: usize,
    ) -> Result<()> {
        let n = num_external_tokens / self.cfg.block_size;
        if n > 0 {
            return Err(load_error(request_id, n, 0, 0, device_blocks));
        }
        Ok(())
    }

    /// Starts building a step: its number. Then, per preempted request, [`Self::store`] and
    /// [`Self::after_preemption`]; per scheduled request, [`Self::mirror`], and [`Self::store`]
    /// for the candidates; then [`Self::end_step`].
    pub fn begin_step(&mut self) -> u64 {
        self.step += 1;
        self.out_dev.clear();
        self.out_host.clear();
        // Finished requests' stores planned for this step.
        std::mem::swap(&mut self.out_dev, &mut self.deferred_dev);
        std::mem::swap(&mut self.out_host, &mut self.deferred_host);
        self.step
    }

    /// Whether [`Self::mirror`] needs the request's scheduled tokens (it is prefilling).
    #[inline]
    pub fn prefilling(&self, slot: ReqSlot, num_computed: usize) -> bool {
        num_computed < self.hot[slot as usize].prompt_len
    }

    /// Mirrors one scheduled request: `new_blocks` appended to its device block table (or
    /// replacing it, `replace`: new or resumed), `num_computed` tokens computed before this
    /// step (vLLM's count: verified ones, plus the in-flight ones under async scheduling) and,
    /// while prefilling, `scheduled` tokens scheduled in it; `first`: first scheduled (new or
    /// resumed). Returns whether the request is a store candidate: it may have a new full
    /// verified block (read its exact verified count, then [`Self::store`]). A decoding request
    /// that got no new block touches only its packed entry.
    #[inline]
    pub fn mirror(
        &mut self,
        slot: ReqSlot,
        new_blocks: &[BlockId],
        replace: bool,
        num_computed: usize,
        scheduled: Option<usize>,
        first: bool,
    ) -> bool {
        let bs = self.cfg.block_size;
        let step = self.step;
        let h = &mut self.hot[slot as usize];
        if first {
            h.first_step = step;
        }
        let prefilling = num_computed < h.prompt_len;
        let mut bad_tail = None;
        if prefilling {
            let end = num_computed + scheduled.unwrap_or(0);
            h.computed_hi = end;
            if end < h.prompt_len && end % bs == 0 && end > 0 {
                bad_tail = Some(end / bs - 1);
            }
        } else {
            h.computed_hi = usize::MAX;
        }
        let candidate = Self::is_candidate(h, step, num_computed, first, h.store_at);
        // Its computed count grows by at most the step's largest scheduled count per step: no
        // need to read it again before the sum of those reaches the next block's end.
        h.read_at = self
            .cum
            .saturating_add(h.store_at.saturating_sub(num_computed) as u64);
        if replace || !new_blocks.is_empty() || bad_tail.is_some() {
            let r = &mut self.reqs[slot as usize];
            if replace {
                r.blocks.clear();
            }
            r.blocks.extend_from_slice(new_blocks);
            if let Some(b) = bad_tail {
                // A partial prefill chunk ends on this block boundary: vLLM's padded drafter
                // writes the draft KV at its last position with a stand-in for the next token.
                if !r.bad_tails.contains(&b) {
                    r.bad_tails.push(b);
                }
            }
        }
        if candidate {
            self.stats.checked += 1;
        }
        candidate
    }

    #[inline]
    fn is_candidate(h: &Hot, step: u64, num_computed: usize, first: bool, store_at: usize) -> bool {
        !first && h.first_step != step && num_computed >= store_at
    }

    /// What [`Self::mirror`] will return for the request in the next step (not begun yet), so
    /// that a caller can read everything a step needs before changing anything; `preempted`:
    /// [`Self::after_preemption`] comes first in that step.
    #[inline]
    pub fn candidate_next(&self, slot: ReqSlot, num_computed: usize, first: bool, preempted: bool) -> bool {
        let h = &self.hot[slot as usize];
        let store_at = if preempted { self.cfg.block_size } else { h.store_at };
        Self::is_candidate(h, self.step + 1, num_computed, first, store_at)
    }

    /// Whether a scheduled request can be mirrored without its computed count: it is decoding
    /// and cannot have a new full block yet (then [`Self::append_blocks`] replaces
    /// [`Self::mirror`]; it is not a candidate). Exact: never true of a would-be candidate,
    /// given [`Self::note_max_scheduled`] after each step's mirroring.
    #[inline]
    pub fn skippable(&self, slot: ReqSlot) -> bool {
        let h = &self.hot[slot as usize];
        h.computed_hi == usize::MAX && self.cum < h.read_at
    }

    /// Appends the device blocks vLLM gave a [`Self::skippable`] request this step.
    #[inline]
    pub fn append_blocks(&mut self, slot: ReqSlot, new_blocks: &[BlockId]) {
        if !new_blocks.is_empty() {
            self.reqs[slot as usize]
                .blocks
                .extend_from_slice(new_blocks);
        }
    }

    /// The most tokens vLLM scheduled for any one request in the step being built (call once
    /// per step, after the mirroring): bounds how far computed counts can move by the next.
    pub fn note_max_scheduled(&mut self, max_scheduled: usize) {
        self.cum = self.cum.saturating_add(max_scheduled as u64);
    }

    /// The blocks `(lo, hi)` of a request that may be stored now: full of `verified` tokens,
    /// with hashes known to vLLM (`num_hashes`) and device blocks mirrored, not stored yet.
    pub fn storable(
        &self,
        slot: ReqSlot,
        verified: usize,
        num_hashes: usize,
    ) -> Option<(usize, usize)> {
        let r = &self.reqs[slot as usize];
        let full = (verified / self.cfg.block_size)
            .min(num_hashes)
            .min(r.blocks.len());
        (full > r.next_block).then_some((r.next_block, full))
    }

    /// Begins storing blocks `next_block..hi` of a request as part of this step (or of the next
    /// one: `deferred`, for finished requests). The request's hashes must be known up to `hi`;
    /// `tokens` are its tokens from position `next_block * block_size` on, at least through
    /// block `hi - 1` (one more gives the last block's successor). `device_blocks`: the blocks
    /// to copy from (default: the mirrored table). Returns the number of blocks taken.
    pub fn store(
        &mut self,
        slot: ReqSlot,
        hi: usize,
        tokens: &[u32],
        device_blocks: Option<&[BlockId]>,
        deferred: bool,
    ) -> Result<usize> {
        let bs = self.cfg.block_size;
        let step = if deferred { self.step + 1 } else { self.step };
        let r = &self.reqs[slot as usize];
        let lo = r.next_block;
        if hi <= lo {
            return Ok(0);
        }
        let dev = device_blocks.unwrap_or(&r.blocks);
        if hi > r.hashes.len() || hi > dev.len() || tokens.len() < (hi - lo) * bs {
            return Err(SlotError::invalid(
                Some(&r.id),
                format!(
                    "cannot store blocks {lo}..{hi}: {} hashes, {} device blocks, {} tokens",
                    r.hashes.len(),
                    dev.len(),
                    tokens.len()
                ),
            ));
        }
        self.succ.clear();
        for i in lo..hi {
            let at = (i + 1 - lo) * bs;
            let s = if r.bad_tails.contains(&i) {
                NO_SUCCESSOR
            } else {
                tokens.get(at).copied().unwrap_or(NO_SUCCESSOR)
            };
            self.succ.push(s);
        }
        self.scratch.clear();
        let parent = if lo > 0 { Some(r.hashes[lo - 1]) } else { None };
        self.cache.begin_store_run_into(
            step,
            &r.hashes[lo..hi],
            parent,
            &tokens[..(hi - lo) * bs],
            r.lora,
            Some(&self.succ),
            &mut self.scratch,
        )?;
        let (out_dev, out_host) = if deferred {
            (&mut self.deferred_dev, &mut self.deferred_host)
        } else {
            (&mut self.out_dev, &mut self.out_host)
        };
        for &(i, hb) in &self.scratch {
            out_dev.push(dev[lo + i]);
            out_host.push(hb);
        }
        let n = self.scratch.len();
        self.stats.stored_blocks += n as u64;
        self.reqs[slot as usize].next_block = hi;
        self.hot[slot as usize].store_at = (hi + 1) * bs;
        Ok(n)
    }

    /// A preempted request: the most tokens whose KV its last scheduled step can have written
    /// (while prefilling; usize::MAX once decoding: the caller takes the minimum with what vLLM
    /// verified), and its mirrored device blocks, which vLLM has just freed. Store them with
    /// [`Self::store`] (`device_blocks` = None) in this step, then [`Self::after_preemption`].
    pub fn preempted_computed(&self, slot: ReqSlot) -> usize {
        self.hot[slot as usize].computed_hi
    }

    /// Forgets a preempted request's device blocks and planned load; it is looked at again
    /// from the step it resumes in.
    pub fn after_preemption(&mut self, slot: ReqSlot, stored: usize) {
        self.drop_load(slot);
        self.stats.preempted_stored_blocks += stored as u64;
        let r = &mut self.reqs[slot as usize];
        r.blocks.clear();
        r.next_block = 0;
        r.bad_tails.clear();
        let h = &mut self.hot[slot as usize];
        h.computed_hi = 0;
        h.store_at = self.cfg.block_size;
    }

    /// A finished request: plan the stores of its last verified blocks (with [`Self::store`],
    /// `deferred`) before this, then forget it.
    pub fn finish(&mut self, slot: ReqSlot) {
        self.untrack(slot);
    }

    /// Ends the step: the plan for the workers.
    pub fn end_step(&mut self, plan: &mut StepPlan) {
        plan.step = self.step;
        plan.store_device.clear();
        plan.store_host.clear();
        plan.store_device.extend_from_slice(&self.out_dev);
        plan.store_host.extend_from_slice(&self.out_host);
        plan.loads.clear();
        let mut ops = StepOps {
            has_stores: !self.out_dev.is_empty(),
            ..StepOps::default()
        };
        for slot in std::mem::take(&mut self.planned) {
            let r = &mut self.reqs[slot as usize];
            if let Some(l) = r.load.take() {
                self.stats.loaded_blocks += l.host.len() as u64;
                ops.loads.push(l.host.clone());
                plan.loads.push((slot, l.device, l.host));
            }
        }
        if ops.has_stores || !ops.loads.is_empty() {
            self.inflight.insert(self.step, ops);
        }
    }

    /// The workers' report for `step`: `acks` ranks done, host blocks whose store failed, loads
    /// that failed. Once every rank acked, the step's stores become visible (failed runs are
    /// given back) and its loads unpin their host blocks. Returns the blocks registered.
    pub fn complete(
        &mut self,
        step: u64,
        acks: u32,
        failed_store_blocks: &[BlockId],
        failed_loads: u64,
    ) -> Result<usize> {
        let Some(ops) = self.inflight.get_mut(&step) else {
            return Ok(0);
        };
        ops.acks += acks;
        ops.failed_store_blocks
            .extend_from_slice(failed_store_blocks);
        self.stats.failed_loads += failed_loads;
        if ops.acks < self.cfg.expected_workers {
            return Ok(0);
        }
        let mut ops = self.inflight.remove(&step).expect("present");
        ops.failed_store_blocks.sort_unstable();
        ops.failed_store_blocks.dedup();
        self.stats.failed_stores += ops.failed_store_blocks.len() as u64;
        let done = self.cache.complete_step(step, &ops.failed_store_blocks)?;
        for blocks in &ops.loads {
            self.cache.end_load(blocks)?;
        }
        Ok(done)
    }
}

/// A load of `n` blocks after `lo` local ones that the request's hit or block table cannot take.
fn load_error(request_id: &str, n: usize, lo: usize, hit: usize, device: usize) -> SlotError {
    SlotError::invalid(
        Some(request_id),
        format!("{n} external blocks asked after {lo} local ones, but {hit} hit and {device} device blocks"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::KvEvent;

    fn planner(eagle: bool) -> ConnectorPlanner {
        ConnectorPlanner::new(PlannerConfig {
            block_size: 4,
            num_host_blocks: 16,
            eagle,
            expected_workers: 1,
            max_decode_tokens: 4,
        })
        .unwrap()
    }

    fn step_with(p: &mut ConnectorPlanner, f: impl FnOnce(&mut ConnectorPlanner)) -> StepPlan {
        p.begin_step();
        f(p);
        let mut plan = StepPlan::default();
        p.end_step(&mut plan);
        plan
    }

    #[test]
    fn candidate_next_is_what_mirror_returns_in_the_next_step() {
        // Each (computed, first, preempted first) over a few steps, with stores in between:
        // read before the step begins, candidate_next agrees with mirror's answer in it.
        let mut p = planner(false);
        let a = p.track("a", 6, None, false);
        p.extend_hashes(a, &[11, 12, 13, 14, 15, 16]);
        let toks: Vec<u32> = (100..130).collect();
        let cases = [
            (0, true, false),
            (6, false, false),
            (7, false, false),
            (9, false, true),
            (9, true, false),
            (13, false, false),
            (17, false, false),
            (18, false, false),
        ];
        for (k, &(nc, first, preempt)) in cases.iter().enumerate() {
            let want = p.candidate_next(a, nc, first, preempt);
            step_with(&mut p, |p| {
                if preempt {
                    p.after_preemption(a, 0);
                }
                let got = p.mirror(a, &[k as u32], first, nc, Some(1), first);
                assert_eq!(got, want, "case {k}");
                if got {
                    if let Some((_, hi)) = p.storable(a, nc, 6) {
                        p.store(a, hi, &toks[p.next_block(a) * 4..], None, false).unwrap();
                    }
                }
            });
        }
    }

    #[test]
    fn stores_verified_blocks_once_with_successors_and_serves_eagle_last_block_on_match() {
        let mut p = planner(true);
        let a = p.track("a", 10, None, false);
        p.extend_hashes(a, &[11, 12]);
        let toks: Vec<u32> = (100..110).collect();
        // Step 1: first scheduled, prefill of all 10 tokens: nothing stored yet.
        let plan = step_with(&mut p, |p| {
            assert!(
                !p.mirror(a, &[7, 8, 9], true, 0, Some(10), true),
                "first scheduled: no store"
            );
        });
        assert!(plan.store_device.is_empty());
        // Step 2: 10 verified: blocks 0 and 1 (tokens 0..8) stored, successors 104 and 108.
        let plan = step_with(&mut p, |p| {
            assert!(p.mirror(a, &[], false, 10, None, false), "a candidate");
            assert_eq!(p.storable(a, 10, 2), Some((0, 2)));
            assert_eq!(p.store(a, 2, &toks, None, false).unwrap(), 2);
        });
        // Step 3: nothing new can be full: not a candidate.
        step_with(&mut p, |p| {
            assert!(!p.mirror(a, &[], false, 11, None, false))
        });
        assert_eq!((plan.store_device, plan.store_host.len()), (vec![7, 8], 2));
        assert_eq!(p.complete(plan.step, 1, &[], 0).unwrap(), 2);
        assert_eq!(p.cache().successor(12), 108);
        let ev = p.cache_mut().events_mut().drain();
        assert!(
            matches!(&ev[0], KvEvent::BlockStored { block_hashes, successors, .. }
                if block_hashes == &vec![11, 12] && successors == &Some(vec![104, 108])),
            "the EAGLE planner publishes the successors: {ev:?}"
        );

        // Another request with the same two blocks and the same next token: both served.
        let b = p.track("b", 12, None, false);
        p.extend_hashes(b, &[11, 12]);
        assert_eq!(p.lookup(b, 0, 2, |pos| toks.get(pos).copied()), 8);
        // A different next token: the last block is recomputed.
        let c = p.track("c", 12, None, false);
        p.extend_hashes(c, &[11, 12]);
        assert_eq!(
            p.lookup(c, 0, 2, |pos| if pos == 8 { Some(5) } else { None }),
            4
        );
        assert_eq!(p.stats().last_blocks_served, 1);
        assert_eq!(p.stats().last_blocks_dropped, 1);
        // Without the EAGLE rule the last block is served whatever follows.
        let mut q = planner(false);
        let x = q.track("x", 10, None, false);
        q.extend_hashes(x, &[11]);
        assert_eq!(q.lookup(x, 0, 1, |_| None), 0, "nothing stored");
    }

    #[test]
    fn partial_prefill_chunk_end_records_no_successor() {
        let mut p = planner(true);
        let a = p.track("a", 12, None, false);
        p.extend_hashes(a, &[1, 2, 3]);
        let toks: Vec<u32> = (0..12).collect();
        // A first chunk of 8 tokens ends at block 2's start.
        step_with(&mut p, |p| {
            p.mirror(a, &[0, 1], true, 0, Some(8), true);
        });
        let plan = step_with(&mut p, |p| {
            assert!(p.mirror(a, &[2], false, 8, Some(4), false));
            assert_eq!(p.storable(a, 8, 3), Some((0, 2)));
            p.store(a, 2, &toks, None, false).unwrap();
        });
        p.complete(plan.step, 1, &[], 0).unwrap();
        assert_eq!(p.cache().successor(1), 4);
        assert_eq!(
            p.cache().successor(2),
            NO_SUCCESSOR,
            "its last position ended a partial chunk"
        );
        let ev = p.cache_mut().events_mut().drain();
        assert!(
            matches!(&ev[..], [KvEvent::BlockStored { successors: Some(s), .. }]
                if s == &vec![4, NO_SUCCESSOR]),
            "{ev:?}"
        );
    }

    #[test]
    fn without_the_eagle_rule_events_carry_no_successors() {
        let mut p = planner(false);
        assert!(!p.cache().publishes_successors());
        let a = p.track("a", 8, None, false);
        p.extend_hashes(a, &[1, 2]);
        let toks: Vec<u32> = (0..9).collect();
        step_with(&mut p, |p| {
            p.mirror(a, &[0, 1], true, 0, Some(8), true);
        });
        let plan = step_with(&mut p, |p| {
            assert!(p.mirror(a, &[], false, 8, None, false));
            p.store(a, 2, &toks, None, false).unwrap();
        });
        p.complete(plan.step, 1, &[], 0).unwrap();
        let ev = p.cache_mut().events_mut().drain();
        assert!(
            matches!(&ev[..], [KvEvent::BlockStored { block_hashes, successors: None, .. }]
                if block_hashes == &vec![1, 2]),
            "{ev:?}"
        );
    }

    #[test]
    fn preempted_and_finished_requests_store_and_loads_pin_until_acked() {
        let mut p = planner(false);
        let a = p.track("a", 4, None, false);
        p.extend_hashes(a, &[1, 2, 3]);
        let toks: Vec<u32> = (0..12).collect();
        step_with(&mut p, |p| {
            p.mirror(a, &[5, 6, 7], true, 0, Some(4), true);
        });
        // 8 computed after this step.
        step_with(&mut p, |p| {
            p.mirror(a, &[], false, 4, None, false);
        });
        // Preempted in step 3: its two full verified blocks are stored in step 3 itself.
        let plan = step_with(&mut p, |p| {
            let hi = p.preempted_computed(a).min(9);
            let (_, full) = p.storable(a, hi, 3).unwrap();
            let n = p.store(a, full, &toks, None, false).unwrap();
            p.after_preemption(a, n);
        });
        assert_eq!(plan.store_device, vec![5, 6]);
        p.complete(plan.step, 1, &[], 0).unwrap();
        assert_eq!(p.stats().preempted_stored_blocks, 2);
        // Resumed with a host hit of both blocks into new device blocks.
        assert_eq!(p.lookup(a, 0, 2, |_| None), 8);
        p.plan_load(a, &[9, 10, 11], 8).unwrap();
        assert_eq!(p.cache().pool().num_held(), 2, "pinned");
        let plan = step_with(&mut p, |p| {
            p.mirror(a, &[9, 10, 11], true, 8, None, true);
        });
        assert_eq!(plan.loads, vec![(a, vec![9, 10], plan.loads[0].2.clone())]);
        // Finished: its third block is stored at the start of the next step (the first two
        // are in the host tier already).
        assert_eq!(p.store(a, 3, &toks, Some(&[9, 10, 11]), true).unwrap(), 1);
        p.finish(a);
        assert!(p.has_pending_work());
        p.complete(plan.step, 1, &[], 0).unwrap();
        assert_eq!(
            p.cache().pool().num_held(),
            1,
            "load unpinned; the deferred store holds one"
        );
        let plan = step_with(&mut p, |_| {});
        assert_eq!(plan.store_device, vec![11]);
        p.complete(plan.step, 1, &[], 0).unwrap();
        assert!(!p.has_pending_work());
        assert_eq!(p.cache().pool().num_held(), 0);
        assert_eq!(p.num_tracked(), 0);
        p.cache().pool().check().unwrap();
    }
}
