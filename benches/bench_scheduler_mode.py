#!/usr/bin/env python
"""Scheduler mode (``--scheduler-cls kvslots.vllm.KVSlotsScheduler``) against vLLM's own KV cache
manager, side by side in one run.

  step      vLLM's real Scheduler on CPU, batch B (default 256) decoding, EAGLE K=3, fake model
            outputs (0.7 per-draft acceptance). The variants are interleaved (vLLM, kvslots,
            vLLM, kvslots, ...), --repeats times (default 7). Per repeat:
              - whole scheduler step (schedule() + update_from_output() + update_draft_token_ids())
                in steps/s, uninstrumented;
              - the KV manager's share of the step: time inside the manager's methods (each wrapped
                on the instance with a timer whose own cost is measured next to every call and
                subtracted, see ``Instrument``) over the step time of that instrumented run.
            Printed: median and spread (min..max) of the ratios kvslots / vLLM over the repeats.
            Targets: manager share at least 10x smaller, steps/s at least 1.4x.
  call      The decode-step allocate_slots call alone (the one vLLM's scheduler makes for every
            running request every step), on the thread's CPU clock without a per-call timer:
            both schedulers brought to batch-B EAGLE K=3 decoding as in `step`, then
            allocate_slots(request, 1, num_lookahead_tokens=3) over the batch (its slots are
            there already: the steady-state call of a step that adds no block), interleaved
            repeats. The instrumented share of `step` puts a timer around every call, whose
            cost on a loaded VM is close to kvslots' whole call; this one has none.
  capacity  An EAGLE trace (requests arriving over time, shared prefixes, acceptance 0.6, 0.7,
            0.8) with a dynamic speculative-decoding schedule (K 5 / 3 / 1 as the batch grows)
            through the real Scheduler in a pool small enough to preempt, once per manager (the
            fake outputs do not depend on the schedule, tests/sched_mode_harness.py): blocks held
            at peak, mean blocks held per step and preemptions. With a static K the two managers
            schedule identically (the control rows).
  pool      Building a pool of 1M blocks: time and resident memory per block, kvslots'
            DeviceKVManager vs vLLM's KVCacheManager (each in a fresh process, interleaved,
            --pool-repeats times; wall clock and CPU time), fresh and after every block has been
            allocated, registered and freed once (first repeat).

    PYTHONPATH=python .venv/bin/python benches/bench_scheduler_mode.py [step|call|capacity|pool|all]
        [--batch 256] [--steps 40] [--repeats 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# Steps are timed on the calling thread's CPU clock (the machines this runs on are shared; the
# Rust work runs on this thread), the instrumented runs on the wall clock (the wrapper's timer).
CLOCK = time.thread_time

MANAGER_METHODS = (
    "allocate_slots", "get_blocks", "get_block_ids", "free", "get_computed_blocks",
    "get_computed_blocks_for_connector", "new_step_starts", "take_events", "make_prefix_cache_stats",
    "record_prefix_cache_stats", "estimate_cached_tokens", "take_new_block_ids",
    "take_kv_cache_block_copies", "take_boundary_state_offloads", "cache_blocks",
    "remove_skipped_blocks", "finalize_partial_tail_offloads", "pop_blocks_for_free",
    "get_block_ids_for_computed_tokens", "truncate_computed_blocks", "finish_deferred",
)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x (min {min(xs):.2f}, max {max(xs):.2f})"


# ----------------------------------------------------------------------------------------- step
class Instrument:
    """Wraps the manager's methods on the instance; ``seconds`` is the time spent inside them,
    ``calls`` counts the calls per method.

    The timer's own cost is measured in place, call by call, not calibrated apart: each call is
    timed as ``t0 = clock(); fn(); t1 = clock(); t2 = clock()`` and counts ``(t1 - t0) - (t2 - t1)``.
    ``t2 - t1`` is one clock read under the same cache and load conditions as the call it corrects
    (a calibration on an empty method, run apart, was off by more than kvslots' whole decode call
    on a loaded machine). What stays counted is the call itself, made with the
    caller's call shape (see ``wrap``); until this was so, the wrapper's ``fn(*a, **kw)``
    re-dispatch added ~150-200 ns to every call, about a third of kvslots' decode call."""

    def __init__(self, manager: Any) -> None:
        self.ns = 0
        self.calls: dict[str, int] = {}
        self.ns_by: dict[str, int] = {}
        for name in MANAGER_METHODS:
            fn = getattr(manager, name, None)
            if fn is not None:
                self.calls[name] = 0
                self.ns_by[name] = 0
                setattr(manager, name, self.wrap(name, fn))

    @property
    def seconds(self) -> float:
        return max(self.ns, 0) * 1e-9

    def wrap(self, name: str, fn: Any) -> Any:
        pc = time.perf_counter_ns
        calls = self.calls
        ns_by = self.ns_by

        def w(*a, **kw):
            # The timed call keeps the caller's call shape: re-dispatching through a kwargs dict
            # (``fn(*a, **kw)``) costs a C method ~150-200 ns more than vLLM's own call site
            # does, which would be charged to the manager being measured. vLLM's per-request
            # call is ``allocate_slots(request, n, num_lookahead_tokens=k)``; the per-step calls
            # take no argument or one.
            if not kw:
                if not a:
                    t0 = pc()
                    r = fn()
                    t1 = pc()
                elif len(a) == 1:
                    a0 = a[0]
                    t0 = pc()
                    r = fn(a0)
                    t1 = pc()
                else:
                    t0 = pc()
                    r = fn(*a)
                    t1 = pc()
            elif len(a) == 2 and len(kw) == 1 and "num_lookahead_tokens" in kw:
                a0, a1, la = a[0], a[1], kw["num_lookahead_tokens"]
                t0 = pc()
                r = fn(a0, a1, num_lookahead_tokens=la)
                t1 = pc()
            else:
                t0 = pc()
                r = fn(*a, **kw)
                t1 = pc()
            t2 = pc()
            d = (t1 - t0) - (t2 - t1)
            self.ns += d
            ns_by[name] += d
            calls[name] += 1
            return r

        return w


def timer_cost_ns() -> float:
    """One clock read, as the in-place correction sees it on this machine (printed only)."""
    pc = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        acc = 0
        for _ in range(100_000):
            t1 = pc()
            t2 = pc()
            acc += t2 - t1
        best = min(best, acc / 100_000)
    return best


def build_scheduler(cfg: Any, num_blocks: int, kvslots: bool, batch: int, log_stats: bool) -> tuple[Any, random.Random]:
    from sched_mode_harness import Arrival, kv_cache_config, make_request
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvslots.vllm import KVSlotsScheduler

    cls = KVSlotsScheduler if kvslots else Scheduler
    sched = cls(vllm_config=cfg, kv_cache_config=kv_cache_config(num_blocks),
                structured_output_manager=StructuredOutputManager(cfg), block_size=16, log_stats=log_stats)
    rng = random.Random(0)
    shared = [rng.randrange(1, 5000) for _ in range(128)]
    for i in range(batch):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, 5000) for _ in range(rng.randrange(100, 400))]
        sched.add_request(make_request(Arrival(f"cmpl-{i:08x}-0000-4000-8000-bench0000{i:04d}", 0, prompt, 1_000_000), 16))
    return sched, random.Random(1)


def one_step(sched: Any, rng: random.Random, k: int) -> None:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    requests = sched.requests
    for rid in ids:
        spec = so.scheduled_spec_decode_tokens.get(rid)
        if not spec and requests[rid].is_prefill_chunk:
            sampled.append([])
            continue
        a = 0
        if spec:
            while a < len(spec) and rng.random() < 0.7:
                a += 1
        sampled.append((list(spec[:a]) if spec else []) + [rng.randrange(1, 5000)])
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled)
    sched.update_from_output(so, out)
    running = [r.request_id for r in sched.running if not r.is_prefill_chunk]
    sched.update_draft_token_ids(DraftTokenIds(running, [[rng.randrange(1, 5000) for _ in range(k)]
                                                         for _ in running]))


def step_run(cfg: Any, num_blocks: int, kvslots: bool, args: argparse.Namespace, instrument: bool) -> dict[str, float]:
    sched, rng = build_scheduler(cfg, num_blocks, kvslots, args.batch, args.log_stats)
    while any(r.is_prefill_chunk for r in sched.running) or len(sched.running) < args.batch:
        one_step(sched, rng, 3)
    for _ in range(args.warmup):
        one_step(sched, rng, 3)
    manager = sched.kv_cache_manager
    inst = Instrument(manager) if instrument else None
    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up
    clock = time.perf_counter if instrument else CLOCK
    t0 = clock()
    for _ in range(args.steps):
        one_step(sched, rng, 3)
    dt = clock() - t0
    gc.unfreeze()
    out = {"step_s": dt / args.steps}
    if inst is not None:
        out["manager_s"] = inst.seconds / args.steps
        out["calls"] = sum(inst.calls.values()) / args.steps
        out["by_method_us"] = {k: (inst.ns_by[k] / 1e3 / args.steps, inst.calls[k] / args.steps)
                               for k in inst.calls if inst.calls[k]}
    assert len(sched.running) == args.batch and not sched.waiting, "the batch must stay whole"
    return out


def step_bench(args: argparse.Namespace, models: dict) -> dict[str, Any]:
    from sched_mode_harness import engine_config

    num_blocks = args.batch * 80
    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=num_blocks, max_num_seqs=args.batch,
                        max_num_batched_tokens=max(8192, args.batch * 8), kv_events=args.kv_events)
    cfg.cache_config.num_gpu_blocks = num_blocks
    args.timer_ns = timer_cost_ns()
    res: dict[str, dict[str, list[float]]] = {v: {"sps": [], "share": [], "mgr_us": [], "step_ms": []}
                                              for v in ("vllm", "kvslots")}
    by_method: dict[str, dict[str, list[tuple[float, float]]]] = {"vllm": {}, "kvslots": {}}
    for rep in range(args.repeats):
        for variant in ("vllm", "kvslots"):  # interleaved: machine noise hits both alike
            kv = variant == "kvslots"
            plain = step_run(cfg, num_blocks, kv, args, instrument=False)
            timed = step_run(cfg, num_blocks, kv, args, instrument=True)
            mgr = timed["manager_s"]
            r = res[variant]
            r["sps"].append(1.0 / plain["step_s"])
            r["step_ms"].append(plain["step_s"] * 1e3)
            r["share"].append(mgr / timed["step_s"])
            r["mgr_us"].append(mgr * 1e6)
            for name, us_calls in timed["by_method_us"].items():
                by_method[variant].setdefault(name, []).append(us_calls)
        print(f"  repeat {rep + 1}/{args.repeats}: steps/s vLLM {res['vllm']['sps'][-1]:.1f}, kvslots "
              f"{res['kvslots']['sps'][-1]:.1f}; manager share vLLM {100 * res['vllm']['share'][-1]:.1f}%, "
              f"kvslots {100 * res['kvslots']['share'][-1]:.2f}%", flush=True)
    sps_ratio = [k / v for k, v in zip(res["kvslots"]["sps"], res["vllm"]["sps"])]
    share_ratio = [v / max(k, 1e-9) for k, v in zip(res["kvslots"]["share"], res["vllm"]["share"])]
    mgr_ratio = [v / max(k, 1e-9) for k, v in zip(res["kvslots"]["mgr_us"], res["vllm"]["mgr_us"])]
    print(f"\nvLLM Scheduler on CPU, batch {args.batch} decoding, EAGLE K=3, fake outputs, "
          f"{args.steps} steps x {args.repeats} interleaved repeats; steps/s on the thread's CPU clock, "
          f"manager share from an instrumented run (each call's clock read corrected in place; one read "
          f"costs about {args.timer_ns:.0f} ns here):")
    for v in ("vllm", "kvslots"):
        r = res[v]
        print(f"  {v:8s} step {statistics.median(r['step_ms']):7.3f} ms ({statistics.median(r['sps']):6.1f} steps/s), "
              f"KV manager {statistics.median(r['mgr_us']):8.1f} us/step = "
              f"{100 * statistics.median(r['share']):5.2f}% of the step")
    print("  where the manager time goes (median us/step, calls/step, ns/call):")
    for v in ("vllm", "kvslots"):
        rows = sorted(((statistics.median(u for u, _ in xs), statistics.median(c for _, c in xs), name)
                       for name, xs in by_method[v].items()), reverse=True)
        print(f"    {v:8s} " + "; ".join(f"{name} {us:.1f} us ({c:g} x {1e3 * us / c:.0f} ns)"
                                           for us, c, name in rows if us > 0.05))
    print(f"  KV-manager share of the step, vLLM / kvslots: {spread(share_ratio)}   (target >= 10x)")
    print(f"  KV-manager time per step,     vLLM / kvslots: {spread(mgr_ratio)}")
    print(f"  whole scheduler steps/s,   kvslots / vLLM:    {spread(sps_ratio)}   (target >= 1.4x)")
    return {"raw": res, "by_method": by_method, "share_ratio": share_ratio, "manager_time_ratio": mgr_ratio, "steps_per_s_ratio": sps_ratio,
            "timer_read_ns": args.timer_ns}


# ----------------------------------------------------------------------------------------- call
def call_bench(args: argparse.Namespace, models: dict) -> dict[str, Any]:
    from sched_mode_harness import engine_config

    nb = args.batch * 80
    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=nb, max_num_seqs=args.batch,
                        max_num_batched_tokens=max(8192, args.batch * 8), kv_events=args.kv_events)
    cfg.cache_config.num_gpu_blocks = nb
    scheds = {}
    for name in ("vllm", "kvslots"):
        sched, rng = build_scheduler(cfg, nb, name == "kvslots", args.batch, args.log_stats)
        while any(r.is_prefill_chunk for r in sched.running) or len(sched.running) < args.batch:
            one_step(sched, rng, 3)
        for _ in range(args.warmup):
            one_step(sched, rng, 3)
        scheds[name] = sched
    gc.collect()
    gc.freeze()
    loops = 20
    ns: dict[str, list[float]] = {"vllm": [], "kvslots": []}
    for _ in range(args.repeats):
        for name in ("vllm", "kvslots"):  # interleaved
            alloc = scheds[name].kv_cache_manager.allocate_slots
            reqs = list(scheds[name].running)
            t = CLOCK()
            for _ in range(loops):
                for r in reqs:
                    alloc(r, 1, num_lookahead_tokens=3)
            ns[name].append((CLOCK() - t) / loops / len(reqs) * 1e9)
    gc.unfreeze()
    ratio = [v / k for v, k in zip(ns["vllm"], ns["kvslots"])]
    print(f"\nDecode-step allocate_slots(request, 1, num_lookahead_tokens=3), batch {args.batch}, no block added, "
          f"{args.repeats} interleaved repeats x {loops} passes, thread CPU clock:")
    for name in ("vllm", "kvslots"):
        xs = ns[name]
        print(f"  {name:8s} {statistics.median(xs):7.0f} ns/call (min {min(xs):.0f}, max {max(xs):.0f})")
    print(f"  vLLM / kvslots: {spread(ratio)}")
    return {"ns_per_call": ns, "ratio": ratio}


# ------------------------------------------------------------------------------------- capacity
def capacity_bench(args: argparse.Namespace, models: dict) -> dict[str, Any]:
    from sched_mode_harness import Arrival, Run, Workload, engine_config

    dyn = {(1, 8): 5, (9, 24): 3, (25, 64): 1}
    rows = []
    for dynamic in (True, False):
        cfg = engine_config(models["target"], models["eagle"], k=5, num_blocks=8192, max_num_seqs=64,
                            max_num_batched_tokens=2048, dynamic_sd=dyn if dynamic else None, kv_events=False)
        for acceptance in (0.6, 0.7, 0.8):
            for seed in range(args.capacity_seeds):
                rng = random.Random(seed)
                prefixes = [[rng.randrange(1, 5000) for _ in range(rng.randrange(64, 256))] for _ in range(4)]
                arrivals = []
                for i in range(96):
                    pre = prefixes[rng.randrange(4)] if rng.random() < 0.6 else []
                    body = [rng.randrange(1, 5000) for _ in range(rng.randrange(32, 320))]
                    arrivals.append(Arrival(f"r{i}", rng.randrange(0, 60), pre + body, rng.randrange(32, 256)))
                wl = Workload(arrivals, acceptance=acceptance, seed=seed)
                row: dict[str, Any] = {"dynamic": dynamic, "acceptance": acceptance, "seed": seed}
                for pool, blocks in (("roomy", args.roomy_blocks), ("tight", args.capacity_blocks)):
                    a = Run(cfg, blocks, False, wl, check_every_step=False).run(max_steps=20_000)
                    b = Run(cfg, blocks, True, wl, check_every_step=False).run(max_steps=20_000)
                    assert a.outputs == b.outputs, "the same tokens come out"
                    row.update({f"{pool}_vllm_peak": a.peak_blocks, f"{pool}_kvslots_peak": b.peak_blocks,
                                f"{pool}_vllm_mean": statistics.mean(a.held_trace),
                                f"{pool}_kvslots_mean": statistics.mean(b.held_trace),
                                f"{pool}_vllm_preemptions": a.preemptions,
                                f"{pool}_kvslots_preemptions": b.preemptions,
                                f"{pool}_vllm_steps": a.steps, f"{pool}_kvslots_steps": b.steps})
                rows.append(row)
    print(f"\nFreed capacity: 96 requests arriving over 60 steps, 60% sharing one of 4 prefixes, EAGLE K<=5 "
          f"(dynamic: K 5/3/1 at batch 1-8/9-24/25-64), blocks of 16 tokens, {args.capacity_seeds} seeds per "
          f"row (sums). Roomy pool ({args.roomy_blocks} blocks, nothing preempted): blocks held; tight pool "
          f"({args.capacity_blocks} blocks): preemptions and steps.")
    print(f"  {'schedule':10s} {'accept':>6s} | {'roomy: peak held':>22s} | {'roomy: mean held':>22s} | "
          f"{'tight: preemptions':>18s} | {'tight: steps':>13s}")
    for dynamic in (True, False):
        for acceptance in (0.6, 0.7, 0.8):
            rs = [r for r in rows if r["dynamic"] == dynamic and r["acceptance"] == acceptance]
            s = {k: sum(r[k] for r in rs) for k in rs[0] if k not in ("dynamic", "acceptance", "seed")}
            print(f"  {'dynamic' if dynamic else 'static K=5':10s} {acceptance:6.1f} | "
                  f"vLLM {s['roomy_vllm_peak']:5d} kvslots {s['roomy_kvslots_peak']:5d} | "
                  f"vLLM {s['roomy_vllm_mean']:6.0f} kvslots {s['roomy_kvslots_mean']:6.0f} | "
                  f"vLLM {s['tight_vllm_preemptions']:3d} kvslots {s['tight_kvslots_preemptions']:3d} | "
                  f"{s['tight_vllm_steps']:5d} / {s['tight_kvslots_steps']:5d}")
    return {"rows": rows}


# ----------------------------------------------------------------------------------------- pool
POOL_CHILD = r"""
import gc, json, os, sys, time, resource
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
which, n = sys.argv[1], int(sys.argv[2])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.core.kv_cache_manager import KVCacheManager
from kvslots.vllm.scheduler import KVSlotsKVCacheManager
cfg = KVCacheConfig(num_blocks=n, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"],
      FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype=torch.float32))])
cls = KVSlotsKVCacheManager if which == "kvslots" else KVCacheManager
fill = sys.argv[3] == "fill"
gc.collect()
r0 = rss()
t0, c0 = time.perf_counter(), time.thread_time()
m = cls(kv_cache_config=cfg, max_model_len=1 << 30, scheduler_block_size=16, hash_block_size=16,
        enable_caching=True, use_eagle=True, log_stats=True)
dt, dc = time.perf_counter() - t0, time.thread_time() - c0
r1 = rss()
if not fill:
    print("POOL " + json.dumps({"build_s": dt, "build_cpu_s": dc, "rss_fresh": r1 - r0}))
    sys.exit(0)
# Use every block once: one request per 4096 blocks, its full blocks registered, then freed
# (every block ends cached, so all metadata and the registry are touched).
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
init_none_hash(sha256)
class R:
    pass
per = 4096
t1 = time.perf_counter()
for i in range((n - 1) // per):
    r = R()
    r.request_id = f"r{i}"; r.num_computed_tokens = 0; r.num_preemptions = 0
    r._all_token_ids = [0] * (per * 16); r.all_token_ids = r._all_token_ids
    r.block_hashes = [i.to_bytes(8, "big") * 3 + j.to_bytes(8, "big") for j in range(per)]
    r.status = None; r.num_prompt_tokens = per * 16; r.lora_request = None; r.skip_reading_prefix_cache = False
    r.num_in_flight_tokens = 0; r.num_output_placeholders = 0; r.mm_features = []; r.cache_salt = None
    r.prompt_embeds = None; r.session_id = None; r.num_tokens = per * 16; r.shared_prefix_boundary = 0
    r.num_tokens_with_spec = per * 16
    assert m.allocate_slots(r, per * 16) is not None
    m.free(r)
t_fill = time.perf_counter() - t1
r2 = rss()
print("POOL " + json.dumps({"build_s": dt, "build_cpu_s": dc, "rss_fresh": r1 - r0, "rss_used": r2 - r0,
                           "fill_s": t_fill}))
"""


def pool_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each build in a fresh process, interleaved (vLLM, kvslots, ...) over --pool-repeats; the
    first repeat also uses every block once (RSS after use, fill time)."""
    runs: dict[str, list[dict[str, float]]] = {}
    env = dict(os.environ)
    for rep in range(args.pool_repeats):
        for n in (100_000, 1_000_000):
            for which in ("vllm", "kvslots"):
                p = subprocess.run([sys.executable, "-c", POOL_CHILD, which, str(n), "fill" if rep == 0 else "build"],
                                   capture_output=True, text=True, env=env, timeout=1800)
                line = [l for l in p.stdout.splitlines() if l.startswith("POOL ")]
                assert p.returncode == 0 and line, p.stderr[-3000:]
                runs.setdefault(f"{which}-{n}", []).append(json.loads(line[0][5:]))
        print(f"  pool repeat {rep + 1}/{args.pool_repeats}: 1M blocks build vLLM "
              f"{runs['vllm-1000000'][-1]['build_s'] * 1e3:.0f} ms, kvslots "
              f"{runs['kvslots-1000000'][-1]['build_s'] * 1e3:.1f} ms wall "
              f"({runs['kvslots-1000000'][-1]['build_cpu_s'] * 1e3:.1f} ms CPU)", flush=True)

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"

    print(f"\nPool construction (fresh process each, {args.pool_repeats} interleaved repeats: median (min..max); "
          f"wall clock and the building thread's CPU time; RSS from /proc/self/statm):")
    out: dict[str, Any] = {"runs": runs}
    for n in (100_000, 1_000_000):
        v, k = runs[f"vllm-{n}"], runs[f"kvslots-{n}"]
        ratio = [a["build_s"] / max(b["build_s"], 1e-9) for a, b in zip(v, k)]
        print(f"  {n:>9,d} blocks: build ms wall vLLM {med([r['build_s'] * 1e3 for r in v])}, kvslots "
              f"{med([r['build_s'] * 1e3 for r in k])}; CPU vLLM {med([r['build_cpu_s'] * 1e3 for r in v])}, "
              f"kvslots {med([r['build_cpu_s'] * 1e3 for r in k])}; vLLM / kvslots wall {spread(ratio)}")
        print(f"  {'':>9s}         RSS/block fresh vLLM {med([r['rss_fresh'] / n for r in v])} B, kvslots "
              f"{med([r['rss_fresh'] / n for r in k])} B; after every block used once vLLM {v[0]['rss_used'] / n:.1f} B, "
              f"kvslots {k[0]['rss_used'] / n:.1f} B")
    k1 = runs["kvslots-1000000"]
    wall = statistics.median(r["build_s"] for r in k1)
    cpu = statistics.median(r["build_cpu_s"] for r in k1)
    print(f"  target: a 1M-block pool ready in under 50 ms: median {wall * 1e3:.1f} ms wall "
          f"({'met' if wall < 0.05 else 'MISSED'}), {cpu * 1e3:.1f} ms CPU ({'met' if cpu < 0.05 else 'MISSED'})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["step", "call", "capacity", "pool", "all"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM's stats on, as in a served engine (default on)")
    ap.add_argument("--kv-events", action="store_true", help="KV events on (both managers build them)")
    ap.add_argument("--capacity-seeds", type=int, default=3)
    ap.add_argument("--capacity-blocks", type=int, default=900, help="the tight pool")
    ap.add_argument("--roomy-blocks", type=int, default=8000, help="the pool nothing is preempted from")
    ap.add_argument("--pool-repeats", type=int, default=7)
    ap.add_argument("--models", default="/tmp/kvslots-tiny")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args()
    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(args.models)
    result: dict[str, Any] = {"argv": sys.argv[1:]}

    def save() -> None:  # after every part, so an interrupted run keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    for part, fn in (("step", lambda: step_bench(args, models)), ("call", lambda: call_bench(args, models)),
                     ("capacity", lambda: capacity_bench(args, models)), ("pool", lambda: pool_bench(args))):
        if args.what in (part, "all"):
            result[part] = fn()
            save()


if __name__ == "__main__":
    main()
