#!/usr/bin/env python
"""Trace-driven benchmark: one speculative-decoding workload replayed through

  batch      kvslots SlotManager.step: one call per engine step for the whole batch (numpy arrays)
  per-req    kvslots per-request calls: commit / rollback / reserve for every request, every step
  reference  kvslots.slots.reference.ReferenceSlotManager (pure Python; slow, so capped: see --reference-max-batch)
  vllm       vLLM's own v1 KVCacheManager, driven as vLLM's scheduler drives it for EAGLE

and printed as ns per request-step (median of --repeats runs) with the ratio to vLLM measured in
the same run. The trace (benches/slots_trace.py) is generated once per (B, K) from the seed and
replayed identically by every implementation; two pool sizes: "roomy" (nothing is ever evicted)
and "tight" (the peak of held blocks plus a little, so finished requests' cached blocks are
evicted all the time).

What is timed, per engine step (everything else -- building the pool, building vLLM's Request
objects, which also hashes their prompts, the trace's numpy arrays -- is outside the timed loop):

  kvslots    finish() per finished request; step(slot_ids, num_accepted, accepted_tokens,
             num_rejected, num_new_tokens) once (slot ids gathered from a per-request array with
             one numpy take); the event log dropped (discard_events) or turned into Python
             objects (--events publish); per admitted request create() + slot_id() + reserve()
             + commit(prompt[matched:]) (prefix match, prefill, commit of the prompt).
  vllm       free() per finished request; per running request what update_from_output does
             (num_computed_tokens -= rejected, append the accepted + bonus tokens to the Request,
             which hashes newly full blocks, set spec_token_ids); new_step_starts();
             allocate_slots(req, 1 + K, num_lookahead_tokens=K) per running request;
             per admitted request get_computed_blocks() + allocate_slots(req, prompt - hit, hit,
             blocks, num_lookahead_tokens=K); take_events() with --events publish.

Run with vLLM's interpreter so (d) is measured:
  PYTHONPATH=python .venv/bin/python benches/bench_slots.py --quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slots_trace  # noqa: E402
from slots_trace import Trace, TraceConfig  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

IMPLS = ("batch", "per-req", "reference", "vllm")

# The clock every implementation is timed with: the calling thread's CPU time by default (the
# machines this runs on are shared; the Rust work runs on the same thread with the GIL released,
# so it is counted), or wall time.
clock = time.thread_time_ns


class Timer:
    """Times the steps from ``warmup`` on: call ``at(i)`` at the top of step ``i``."""

    __slots__ = ("warmup", "t0")

    def __init__(self, warmup: int) -> None:
        self.warmup, self.t0 = warmup, clock()

    def at(self, i: int) -> None:
        if i == self.warmup:
            # As vLLM's engine does after start-up: move what exists now (the trace, the
            # Requests) out of the collector's generations, so its collections only look at
            # what the timed steps create.
            gc.collect()
            gc.freeze()
            self.t0 = clock()

    def stop(self) -> int:
        ns = clock() - self.t0
        gc.unfreeze()
        return ns


def _tqdm(total: int, disable: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, disable=disable, unit="run", dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # the progress bar is a nicety
        class _Null:
            def update(self, n: int = 1) -> None: ...
            def set_description(self, s: str) -> None: ...
            def write(self, s: str) -> None:
                print(s, file=sys.stderr)
            def close(self) -> None: ...
        return _Null()


# ---- results ----------------------------------------------------------------------------------


@dataclass
class RunResult:
    ns: int  # nanoseconds of the timed steps (after the warm-up)
    check: dict[str, Any] = field(default_factory=dict)  # what the run did, for the cross-check


def _final_shape(blocks_of: Callable[[str], int], trace: Trace, running: list[int]) -> list[int]:
    return [blocks_of(trace.requests[r].rid) for r in running]


def _running_at_end(trace: Trace) -> list[int]:
    last = trace.steps[-1]
    return last.batch.tolist() + last.admits


# ---- (a) kvslots batch API --------------------------------------------------------------------


def run_batch(trace: Trace, num_blocks: int, publish: bool, warmup: int) -> RunResult:
    import kvslots

    cfg = trace.cfg
    k = cfg.k
    m = kvslots.SlotManager(num_blocks, cfg.block_size)
    reqs = trace.requests
    slot_of = np.zeros(len(reqs), dtype=np.uint64)
    new_full = np.full(cfg.batch, 1 + k, dtype=np.uint32)
    steps = [(s.finishes, s.batch, s.num_accepted, s.accepted_tokens, s.num_rejected, new_full[: s.batch.size], s.admits)
             for s in trace.steps]
    rids = [r.rid for r in reqs]
    prompts = [r.prompt for r in reqs]
    drain = m.drain_raw_events if publish else m.discard_events
    finish, step, create, slot_id, reserve, commit = m.finish, m.step, m.create, m.slot_id, m.reserve, m.commit
    events = 0
    gc.collect()
    timer = Timer(warmup)
    for i, (finishes, batch, acc, toks, rej, new, admits) in enumerate(steps):
        timer.at(i)
        for r in finishes:
            finish(rids[r])
        if batch.size:
            step(slot_of.take(batch), acc, toks, rej, new)
        for r in admits:
            rid, prompt = rids[r], prompts[r]
            matched = create(rid, prompt, lookahead=k)
            slot_of[r] = slot_id(rid)
            reserve(rid, prompt.size - matched)
            commit(rid, prompt[matched:])
        ev = drain()
        events += ev if isinstance(ev, int) else len(ev)
    ns = timer.stop()
    return RunResult(ns, _kvslots_check(m, trace, events))


def _kvslots_check(m: Any, trace: Trace, events: int) -> dict[str, Any]:
    problem = m.check_invariants() if trace.cfg.batch <= 256 else None
    if problem:
        raise AssertionError(f"invariant broken after the replay: {problem}")
    s = m.stats()
    return {
        "prefix_hit_tokens": s["prefix_hit_tokens"],
        "allocated_blocks": s["allocated_blocks"],
        "registered_blocks": s["registered_blocks"],
        "evicted_blocks": s["evicted_blocks"],
        "committed_tokens": s["committed_tokens"],
        "events": events,
        "final_blocks": _final_shape(lambda rid: len(m.block_table(rid)), trace, _running_at_end(trace)),
        "final_tokens": [m.slot_info(trace.requests[r].rid).committed + m.slot_info(trace.requests[r].rid).pending
                         for r in _running_at_end(trace)],
    }


# ---- (b) kvslots per-request API --------------------------------------------------------------


def run_per_request(trace: Trace, num_blocks: int, publish: bool, warmup: int) -> RunResult:
    import kvslots

    cfg = trace.cfg
    k = cfg.k
    m = kvslots.SlotManager(num_blocks, cfg.block_size)
    reqs = trace.requests
    rids = [r.rid for r in reqs]
    prompts = [r.prompt for r in reqs]
    steps = []
    for s in trace.steps:
        offs = np.concatenate([[0], np.cumsum(s.num_accepted, dtype=np.int64)])
        toks = [s.accepted_tokens[offs[j]:offs[j + 1]] for j in range(s.batch.size)]
        steps.append((s.finishes, list(zip([rids[r] for r in s.batch.tolist()], s.num_accepted.tolist(),
                                           toks, s.num_rejected.tolist())), s.admits))
    drain = m.drain_raw_events if publish else m.discard_events
    finish, create, reserve, commit, rollback = m.finish, m.create, m.reserve, m.commit, m.rollback
    new = 1 + k
    events = 0
    gc.collect()
    timer = Timer(warmup)
    for i, (finishes, batch, admits) in enumerate(steps):
        timer.at(i)
        for r in finishes:
            finish(rids[r])
        for rid, a, toks, rej in batch:
            if a:
                commit(rid, toks)
            if rej:
                rollback(rid, rej)
            reserve(rid, new)
        for r in admits:
            rid, prompt = rids[r], prompts[r]
            matched = create(rid, prompt, lookahead=k)
            reserve(rid, prompt.size - matched)
            commit(rid, prompt[matched:])
        ev = drain()
        events += ev if isinstance(ev, int) else len(ev)
    ns = timer.stop()
    return RunResult(ns, _kvslots_check(m, trace, events))


# ---- (c) pure-Python reference ----------------------------------------------------------------


def run_reference(trace: Trace, num_blocks: int, publish: bool, warmup: int) -> RunResult:
    from kvslots.slots.reference import ReferenceSlotManager

    cfg = trace.cfg
    k = cfg.k
    m = ReferenceSlotManager(num_blocks, cfg.block_size)
    reqs = trace.requests
    rids = [r.rid for r in reqs]
    prompts = [r.prompt.tolist() for r in reqs]
    slot_of = [0] * len(reqs)
    steps = [(s.finishes, s.batch.tolist(), s.num_accepted.tolist(), s.accepted_tokens.tolist(),
              s.num_rejected.tolist(), [1 + k] * s.batch.size, s.admits) for s in trace.steps]
    events = 0
    gc.collect()
    timer = Timer(warmup)
    for i, (finishes, batch, acc, toks, rej, new, admits) in enumerate(steps):
        timer.at(i)
        for r in finishes:
            m.finish(rids[r])
        if batch:
            m.step([slot_of[r] for r in batch], acc, toks, rej, new)
        for r in admits:
            rid, prompt = rids[r], prompts[r]
            matched = m.create(rid, prompt, lookahead=k)
            slot_of[r] = m.slot_id(rid)
            m.reserve(rid, len(prompt) - matched)
            m.commit(rid, prompt[matched:])
        events += len(m.drain_raw_events())
    ns = timer.stop()
    s = m.stats()
    return RunResult(ns, {
        "prefix_hit_tokens": s["prefix_hit_tokens"], "allocated_blocks": s["allocated_blocks"],
        "registered_blocks": s["registered_blocks"], "evicted_blocks": s["evicted_blocks"],
        "committed_tokens": s["committed_tokens"], "events": events,
        "final_blocks": _final_shape(lambda rid: len(m.block_table(rid)), trace, _running_at_end(trace)),
    })


# ---- (d) vLLM's KVCacheManager ----------------------------------------------------------------


def vllm_available() -> str | None:
    """None when vLLM's v1 KVCacheManager can be imported, else why not."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not measured"
        return f"{type(e).__name__}: {e}"
    return None


def vllm_default_hash_name() -> str:
    from vllm.config import CacheConfig

    return CacheConfig().prefix_caching_hash_algo


def vllm_kv_cache_config(num_blocks: int, block_size: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=["model.layers.0.self_attn.attn"],
                                        layer_stride=page * num_blocks, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


_vllm_hasher: dict[int, Any] = {}


def vllm_block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher with vLLM's default hash function, as the engine core makes it."""
    if block_size not in _vllm_hasher:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(vllm_default_hash_name())
        init_none_hash(fn)
        _vllm_hasher[block_size] = get_request_block_hasher(block_size, fn)
    return _vllm_hasher[block_size]


def run_vllm(trace: Trace, num_blocks: int, publish: bool, warmup: int) -> RunResult:
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request, RequestStatus

    cfg = trace.cfg
    k, bs = cfg.k, cfg.block_size
    max_model_len = cfg.prompt_max + cfg.output_max + 4 * k + 2 * bs
    # One more block than kvslots: vLLM keeps block 0 as its null block.
    m = KVCacheManager(vllm_kv_cache_config(num_blocks + 1, bs), max_model_len=max_model_len,
                       scheduler_block_size=bs, hash_block_size=bs, enable_caching=True,
                       use_eagle=True, enable_kv_cache_events=publish)
    hasher = vllm_block_hasher(bs)
    params = SamplingParams(max_tokens=cfg.output_max + k, ignore_eos=True)
    reqs: dict[int, Any] = {}
    for s in trace.steps:
        for r in s.admits:
            q = trace.requests[r]
            reqs[r] = Request(request_id=q.rid, prompt_token_ids=q.prompt.tolist(), sampling_params=params,
                              pooling_params=None, block_hasher=hasher)
    steps = [(s.finishes, [reqs[r] for r in s.batch.tolist()], s.num_rejected.tolist(), s.after_prefill.tolist(),
              s.appended, [reqs[r] for r in s.admits]) for s in trace.steps]
    drafts = [0] * k  # the drafter's proposals: only their number matters to the manager
    new = 1 + k
    running_status = RequestStatus.RUNNING
    allocate, free, get_computed, new_step = m.allocate_slots, m.free, m.get_computed_blocks, m.new_step_starts
    take_events = m.take_events
    hit_tokens = events = 0
    prefill: dict[int, int] = {}
    gc.collect()
    timer = Timer(warmup)
    for i, (finishes, batch, rej, after_prefill, appended, admits) in enumerate(steps):
        timer.at(i)
        # update_from_output() of step s - 1: roll back rejected drafts, append the new tokens.
        for r in finishes:
            free(reqs[r])
        for j, req in enumerate(batch):
            if after_prefill[j]:
                req.num_in_flight_tokens -= prefill.pop(id(req))
            else:
                req.num_in_flight_tokens -= new
                req.num_computed_tokens -= rej[j]
            req.append_output_token_ids(appended[j])
            req.spec_token_ids = drafts
        # schedule(): the running requests first, then the waiting ones.
        new_step()
        for req in batch:
            if allocate(req, new, num_lookahead_tokens=k) is None:
                raise RuntimeError(f"vLLM ran out of blocks for {req.request_id} (pool sized too small)")
            req.num_computed_tokens += new
            req.num_in_flight_tokens += new
        for req in admits:
            computed, hit, _ = get_computed(req)
            n = req.num_tokens - hit
            if allocate(req, n, hit, computed, num_lookahead_tokens=k) is None:
                raise RuntimeError(f"vLLM ran out of blocks admitting {req.request_id}")
            req.status = running_status
            req.num_computed_tokens = hit + n
            req.num_in_flight_tokens += n
            prefill[id(req)] = n
            hit_tokens += hit
        if publish:
            events += len(take_events())
    ns = timer.stop()
    running = _running_at_end(trace)
    return RunResult(ns, {
        "prefix_hit_tokens": hit_tokens,
        "events": events,
        "final_blocks": [len(m.get_block_ids(trace.requests[r].rid)[0]) for r in running],
        "final_tokens": [reqs[r].num_computed_tokens for r in running],
    })


RUNNERS: dict[str, Callable[[Trace, int, bool, int], RunResult]] = {
    "batch": run_batch, "per-req": run_per_request, "reference": run_reference, "vllm": run_vllm,
}


# ---- driver ----------------------------------------------------------------------------------


@dataclass
class Row:
    batch: int
    k: int
    pool: str
    num_blocks: int
    steps: int
    request_steps: int
    impl: str
    runs_ns: list[int]
    check: dict[str, Any]

    @property
    def ns_per_request_step(self) -> float:
        return statistics.median(self.runs_ns) / self.request_steps

    @property
    def best_ns_per_request_step(self) -> float:
        return min(self.runs_ns) / self.request_steps


def cross_check(rows: list[Row], out: Callable[[str], None]) -> None:
    """Says how the implementations' work compares on one trace (same admissions and steps by
    construction; same block counts per request expected)."""
    by = {r.impl: r.check for r in rows}
    if "batch" in by and "per-req" in by:
        a, b = by["batch"], by["per-req"]
        same = all(a[x] == b[x] for x in ("allocated_blocks", "registered_blocks", "evicted_blocks",
                                          "committed_tokens", "final_blocks"))
        if not same:
            raise AssertionError("the batch and per-request APIs did different work on the same trace")
    if "batch" in by and "reference" in by:
        a, b = by["batch"], by["reference"]
        if any(a[x] != b[x] for x in ("allocated_blocks", "registered_blocks", "evicted_blocks", "final_blocks")):
            raise AssertionError("the Rust engine and the reference model did different work on the same trace")
    if "batch" in by and "vllm" in by:
        a, v = by["batch"], by["vllm"]
        if a["final_tokens"] != v["final_tokens"]:
            raise AssertionError("kvslots and vLLM end the trace with different token counts per request")
        diff = sum(x != y for x, y in zip(a["final_blocks"], v["final_blocks"]))
        out(f"    same work: {len(a['final_blocks'])} running requests end with the same tokens; "
            f"block tables equal in length for {len(a['final_blocks']) - diff}; "
            f"prefix-hit tokens kvslots {a['prefix_hit_tokens']} vs vLLM {v['prefix_hit_tokens']} "
            f"(vLLM's EAGLE drop: one block less per hit); kvslots: {a['allocated_blocks']} blocks allocated, "
            f"{a['registered_blocks']} registered, {a['evicted_blocks']} evicted, {a['events']} events")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--pool", choices=["roomy", "tight"], nargs="+", default=["roomy", "tight"])
    p.add_argument("--steps", type=int, default=512, help="engine steps per trace")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps at the start of the trace (default: a quarter of --steps)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: the thread's CPU time (default; robust on a shared machine); wall: perf_counter")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--impl", choices=IMPLS, nargs="+", default=list(IMPLS))
    p.add_argument("--reference-max-batch", type=int, default=64,
                   help="run the (slow) pure-Python reference only up to this batch size")
    p.add_argument("--reference-repeats", type=int, default=1)
    p.add_argument("--events", choices=["discard", "publish"], default="discard",
                   help="discard: kvslots drops its event log each step, vLLM runs without KV events "
                        "(its default); publish: both hand their events to Python every step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="B=64,256, K=3, 128 steps, 3 repeats (CI)")
    p.add_argument("--plot", metavar="PNG", help="write a bar chart (matplotlib)")
    p.add_argument("--from-json", metavar="PATH",
                   help="measure nothing: plot (--plot) the rows of an earlier --json run, e.g. with an "
                        "interpreter that has matplotlib when vLLM's has not")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(open(args.from_json).read())
        if not args.plot:
            p.error("--from-json needs --plot")
        plot([_SavedRow(**r) for r in saved["rows"]], args.plot, saved["args"]["events"])
        return 0
    if args.quick:
        args.batch, args.k, args.steps, args.repeats = [64, 256], [3], 128, 3
    warmup = args.steps // 4 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps); got {warmup}")
    global clock
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns

    impls = list(args.impl)
    why_no_vllm = vllm_available() if "vllm" in impls else None
    if why_no_vllm:
        print(f"vLLM not importable ({why_no_vllm}): run with vLLM's interpreter to measure (d)", file=sys.stderr)
        impls.remove("vllm")
    publish = args.events == "publish"

    plan = []
    for b in args.batch:
        for k in args.k:
            for pool in args.pool:
                for impl in impls:
                    if impl == "reference" and b > args.reference_max_batch:
                        continue
                    n = args.reference_repeats if impl == "reference" else args.repeats
                    plan.append((b, k, pool, impl, n))
    bar = _tqdm(sum(x[-1] for x in plan), args.no_progress)
    rows: list[Row] = []
    lines: list[str] = []
    traces: dict[tuple[int, int], Trace] = {}

    def out(s: str) -> None:
        lines.append(s)
        bar.write(s)

    hdr = f"{'B':>5} {'K':>2} {'pool':>6} {'impl':>10} {'ns/req-step':>12} {'best':>10} {'vs vLLM':>9}"
    out(f"kvslots vs vLLM KVCacheManager: {args.steps} steps per trace, the last {args.steps - warmup} timed "
        f"({args.clock} time), median of {args.repeats} runs (reference: {args.reference_repeats}, "
        f"B <= {args.reference_max_batch}), events: {args.events}")
    out(hdr)
    for b in args.batch:
        for k in args.k:
            key = (b, k)
            if key not in traces:
                bar.set_description(f"trace B={b} K={k}")
                traces.clear()
                traces[key] = slots_trace.generate(TraceConfig(batch=b, k=k, steps=args.steps, seed=args.seed))
            trace = traces[key]
            timed = slots_trace.request_steps_from(trace, warmup)
            for pool in args.pool:
                nblocks = trace.roomy_blocks if pool == "roomy" else trace.tight_blocks
                group: list[Row] = []
                for impl in impls:
                    if impl == "reference" and b > args.reference_max_batch:
                        continue
                    reps = args.reference_repeats if impl == "reference" else args.repeats
                    runs, check = [], {}
                    for _ in range(reps):
                        bar.set_description(f"B={b} K={k} {pool} {impl}")
                        res = RUNNERS[impl](trace, nblocks, publish, warmup)
                        runs.append(res.ns)
                        check = res.check
                        bar.update(1)
                    group.append(Row(b, k, pool, nblocks, args.steps, timed, impl, runs, check))
                vref = next((r for r in group if r.impl == "vllm"), None)
                for r in group:
                    ratio = "" if vref is None else f"{vref.ns_per_request_step / r.ns_per_request_step:8.1f}x"
                    if r.impl == "vllm":
                        ratio = "   1.0x"
                    out(f"{b:>5} {k:>2} {pool:>6} {r.impl:>10} {r.ns_per_request_step:>12,.0f} "
                        f"{r.best_ns_per_request_step:>10,.0f} {ratio:>9}")
                cross_check(group, out)
                rows.extend(group)
    bar.close()
    print("ratio = vLLM's ns per request-step / this implementation's, both medians from this run "
          "(higher: faster than vLLM)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [
                {"batch": r.batch, "k": r.k, "pool": r.pool, "num_blocks": r.num_blocks, "steps": r.steps,
                 "request_steps": r.request_steps, "impl": r.impl, "runs_ns": r.runs_ns,
                 "ns_per_request_step": r.ns_per_request_step,
                 "check": {x: v for x, v in r.check.items() if x not in ("final_blocks", "final_tokens")}}
                for r in rows]}, f, indent=1)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            hint = f" --json {args.json}" if args.json else " --json PATH"
            print(f"matplotlib is not importable here: no plot. Rerun with{hint}, then "
                  f"`python benches/bench_slots.py --from-json PATH --plot {args.plot}` with an interpreter that has it",
                  file=sys.stderr)
        else:
            plot(rows, args.plot, args.events)
    return 0


@dataclass
class _SavedRow:
    """A row of a --json file, for --from-json."""

    batch: int
    k: int
    pool: str
    impl: str
    ns_per_request_step: float
    num_blocks: int = 0
    steps: int = 0
    request_steps: int = 0
    runs_ns: list[int] = field(default_factory=list)
    check: dict[str, Any] = field(default_factory=dict)


def plot(rows: list[Any], path: str, events: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r.batch, r.k, r.pool) for r in rows}, key=lambda c: (c[0], c[1], c[2] != "roomy"))
    impls = [i for i in IMPLS if any(r.impl == i for r in rows)]
    at = {(r.batch, r.k, r.pool, r.impl): r.ns_per_request_step for r in rows}
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(configs) + 2), 5.5))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        for c, (b, k, pool) in enumerate(configs):
            ns = at.get((b, k, pool, impl))
            if ns is None:
                continue
            x = c + (n - (len(impls) - 1) / 2) * width
            ax.bar(x, ns, width, color=f"C{n}", label=impl if c == 0 or (b, k, pool, impl) not in at else None)
            vllm = at.get((b, k, pool, "vllm"))
            if vllm is not None and impl != "vllm":
                ax.annotate(f"{vllm / ns:.0f}x", (x, ns), ha="center", va="bottom", fontsize=7)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    ax.legend(seen.values(), seen.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_yscale("log")
    ax.set_ylim(bottom=10)
    ax.set_ylabel("ns per request-step (median, log scale)")
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"B={b} K={k}\n{p}" for b, k, p in configs], fontsize=8)
    ax.set_title(f"Same EAGLE trace through kvslots and vLLM's KVCacheManager (events: {events})\n"
                 "labels: speed-up over vLLM, measured in the same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
