#!/usr/bin/env python
"""The engine's own figures, each against its target (issue 3), measured side by side:

  ffi      the batch API's ns per request-step vs the pure-Rust criterion figure on the very same
           trace (B=256, K=3; the Rust bench regenerates the trace bit for bit and both sides'
           digests and counters must agree)                               target: within 2x
  hash     block hashing, ns per token: kvslots (xxh3, through the Python API and in the engine
           alone) vs vLLM's default request block hasher on the same tokens  target: >= 20x cheaper
  memory   engine metadata per block (the accounting, and measured: RSS of a pool whose every
           block is registered) and per request (measured RSS); vLLM's BlockPool per block
                                                                           target: <= 32 B/block
  pool     building a pool of 1M blocks, vs vLLM's BlockPool of 1M blocks   target: < 10 ms
  rss      RSS over 1M request lifecycles (create / reserve / commit / finish)  target: flat

  PYTHONPATH=python .venv/bin/python benches/bench_engine.py [--quick] [--no-cargo]

Without vLLM importable the vLLM columns are skipped. --no-cargo reads criterion's last results
(target/criterion) instead of running `cargo bench`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_slots  # noqa: E402
import slots_trace  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
PAGE = os.sysconf("SC_PAGE_SIZE")
results: list[dict[str, Any]] = []


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def cpu() -> int:
    return time.thread_time_ns()


def report(name: str, value: str, target: str, met: bool | None, **extra: Any) -> None:
    verdict = "" if met is None else ("MET" if met else "MISSED")
    print(f"  {name:<44} {value:<44} {target:<22} {verdict}")
    results.append({"name": name, "value": value, "target": target, "met": met, **extra})


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def criterion_ns(group: str, bench: str) -> float | None:
    """criterion's median time per iteration, ns (None when there is no result)."""
    p = target_dir() / "criterion" / group / bench / "new" / "estimates.json"
    if not p.exists():
        return None
    return json.loads(p.read_text())["median"]["point_estimate"]


def run_cargo(steps: int) -> None:
    print(f"running: cargo bench -p kvslots-core --bench engine (KVSLOTS_BENCH_STEPS={steps}) ...", flush=True)
    env = dict(os.environ, KVSLOTS_BENCH_STEPS=str(steps))
    out = subprocess.run(["cargo", "bench", "-p", "kvslots-core", "--bench", "engine"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit("cargo bench failed")


# ---- ffi: batch API vs pure Rust ---------------------------------------------------------------


def ffi(steps: int, repeats: int) -> None:
    print(f"\nffi: batch API vs pure Rust, B=256 K=3, {steps} steps (the last {steps - steps // 4} timed, "
          f"thread CPU time, median of {repeats})")
    trace = slots_trace.generate(slots_trace.TraceConfig(batch=256, k=3, steps=steps))
    warmup = steps // 4
    timed = slots_trace.request_steps_from(trace, warmup)
    bench_slots.clock = time.thread_time_ns
    for pool, blocks in (("roomy", trace.roomy_blocks), ("tight", trace.tight_blocks)):
        side = target_dir() / "kvslots-bench" / f"step_b256_k3_{pool}.json"
        rust_ns = criterion_ns("step_b256_k3", pool)
        if rust_ns is None or not side.exists():
            report(f"batch API vs pure Rust ({pool})", "no criterion result (run without --no-cargo)", "<= 2x", None)
            continue
        meta = json.loads(side.read_text())
        if meta["steps"] != steps or meta["digest"] != trace.digest or meta["timed_request_steps"] != timed:
            raise SystemExit(f"the Rust bench replayed another trace ({side}: steps {meta['steps']}, digest "
                             f"{meta['digest']}); run cargo bench with KVSLOTS_BENCH_STEPS={steps}")
        runs = []
        for _ in range(repeats):
            r = bench_slots.run_batch(trace, blocks, False, warmup)
            runs.append(r.ns)
            check = r.check
        for key in ("allocated_blocks", "registered_blocks", "evicted_blocks", "committed_tokens",
                    "prefix_hit_tokens", "events"):
            if check[key] != meta[key]:
                raise SystemExit(f"Python and Rust did different work on the same trace: {key} "
                                 f"{check[key]} vs {meta[key]}")
        py = statistics.median(runs) / timed
        rust = rust_ns / timed
        report(f"batch API vs pure Rust ({pool})", f"{py:.0f} vs {rust:.0f} ns/req-step = {py / rust:.2f}x",
               "<= 2x", py / rust <= 2.0, python_ns=py, rust_ns=rust)


# ---- hash: kvslots vs vLLM ---------------------------------------------------------------------


def hashing(num_requests: int, have_vllm: bool) -> None:
    print(f"\nhash: block hashing of the same prompt tokens ({num_requests} prompts of the trace, block size 16)")
    import kvslots

    trace = slots_trace.generate(slots_trace.TraceConfig(batch=num_requests, k=3, steps=1))
    prompts = [r.prompt[: r.prompt.size // 16 * 16] for r in trace.requests[:num_requests]]
    tokens = sum(p.size for p in prompts)
    # kvslots through the Python API: commit of whole prompts with prefix caching off, so the
    # engine hashes every block (and copies the tokens) but registers nothing.
    runs = []
    for _ in range(5):
        m = kvslots.SlotManager(tokens // 16 + 16, 16, enable_prefix_caching=False)
        for i, p in enumerate(prompts):
            m.create(f"h{i}", p, match_prefix=False)
            m.reserve(f"h{i}", p.size)
        t0 = cpu()
        for i, p in enumerate(prompts):
            m.commit(f"h{i}", p)
        runs.append(cpu() - t0)
    api = statistics.median(runs) / tokens
    engine_block = criterion_ns("hash", "block_16")
    engine = None if engine_block is None else engine_block / 16
    report("kvslots xxh3 via the Python API (commit)", f"{api:.2f} ns/token", "", None, ns_per_token=api)
    if engine is not None:
        report("kvslots xxh3 in the engine (criterion)", f"{engine:.2f} ns/token", "", None, ns_per_token=engine)
    if not have_vllm:
        report("vLLM's block hasher", "skipped (vLLM not importable)", ">= 20x", None)
        return
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    default = bench_slots.vllm_default_hash_name()
    for name in dict.fromkeys([default, "xxhash"]):
        fn = get_hash_fn_by_name(name)
        init_none_hash(fn)
        hasher = get_request_block_hasher(16, fn)
        params = SamplingParams(max_tokens=1)
        runs = []
        for _ in range(3):
            reqs = [Request(request_id=f"h{i}", prompt_token_ids=p.tolist(), sampling_params=params,
                            pooling_params=None, block_hasher=None) for i, p in enumerate(prompts)]
            gc.collect()
            t0 = cpu()
            for r in reqs:
                r.block_hashes.extend(hasher(r))
            runs.append(cpu() - t0)
            assert all(len(r.block_hashes) == p.size // 16 for r, p in zip(reqs, prompts))
        v = statistics.median(runs) / tokens
        label = "vLLM's default block hasher" if name == default else "vLLM's block hasher"
        if name == default:
            vs = f"{v:.1f} ns/token = {v / api:.0f}x the API" + (f", {v / engine:.0f}x the engine" if engine else "")
            report(f"{label} ({name})", vs, ">= 20x cheaper", v / api >= 20, ns_per_token=v)
        else:
            report(f"{label} ({name}, not the default)", f"{v:.1f} ns/token = {v / api:.0f}x the API", "", None,
                   ns_per_token=v)
    bench_slots._vllm_hasher.clear()  # init_none_hash was changed: rebuild for later users


# ---- memory ------------------------------------------------------------------------------------


def memory(num_blocks: int, num_requests: int, have_vllm: bool) -> None:
    import kvslots

    print(f"\nmemory: metadata per block ({num_blocks:,} blocks, every one registered) and per request "
          f"({num_requests:,} live requests); RSS measured in fresh processes")
    report("kvslots metadata per block (accounting)", f"{kvslots.SlotManager.metadata_bytes_per_block()} B",
           "<= 32 B", kvslots.SlotManager.metadata_bytes_per_block() <= 32)
    # A fresh interpreter per measurement: memory freed by whatever ran before would be reused
    # without showing in RSS.
    def child(what: str) -> dict[str, float]:
        out = subprocess.run([sys.executable, __file__, "--memory-child", what, str(num_blocks), str(num_requests)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    k = child("kvslots")
    report("kvslots measured per block (RSS)", f"{k['per_block']:.1f} B (built: {k['built']:.2f} B; "
           f"{k['registered']:,} registered)", "<= 32 B", k["per_block"] <= 32, bytes=k["per_block"])
    q = child("kvslots-requests")
    report("kvslots measured per live request (RSS)", f"{q['per_request']:.0f} B (33 tokens, 3 blocks)", "", None,
           bytes=q["per_request"])
    if have_vllm:
        v = child("vllm")
        report("vLLM BlockPool per block (RSS, before caching)", f"{v['per_block']:.0f} B", "", None,
               bytes=v["per_block"])


def memory_child(what: str, num_blocks: int, num_requests: int) -> None:
    """Prints one JSON line: RSS deltas measured in this (fresh) process."""
    if what == "kvslots-requests":
        memory_child_requests(num_requests)
        return
    if what == "vllm":
        from vllm.v1.core.block_pool import BlockPool

        n = min(num_blocks, 1_000_000)
        gc.collect()
        v0 = rss()
        pool = BlockPool(n, True, 16)
        print(json.dumps({"per_block": (rss() - v0) / n}))
        del pool
        return
    import kvslots

    rng = np.random.default_rng(1)
    base = rng.integers(0, 32000, 1 << 22, dtype=np.uint32)
    gc.collect()
    r0 = rss()
    m = kvslots.SlotManager(num_blocks, 16)
    r1 = rss()
    per = 64  # blocks per request: each fills and registers 64, then finishes (cached)
    for i in range(num_blocks // per):
        off = int(rng.integers(0, base.size - per * 16))
        p = base[off: off + per * 16 + 1]
        rid = f"m{i}"
        matched = m.create(rid, p)
        m.reserve(rid, p.size - matched)
        m.commit(rid, p[matched:])
        m.finish(rid)
        m.discard_events()
    r2 = rss()
    registered = len(m.registered_hashes())
    print(json.dumps({"per_block": (r2 - r0) / num_blocks, "built": (r1 - r0) / num_blocks,
                      "registered": registered}))


def memory_child_requests(num_requests: int) -> None:
    """Live requests of 33 tokens (2 full blocks + 1) in a fresh process; prefix caching off so
    the registry does not grow with them (their blocks are still hashed), events dropped."""
    import kvslots

    base = np.random.default_rng(1).integers(0, 32000, num_requests * 40 + 40, dtype=np.uint32)
    prompts = [base[i * 40: i * 40 + 33] for i in range(num_requests)]
    rids = [f"q{i}" for i in range(num_requests)]
    m = kvslots.SlotManager(4 * num_requests, 16, enable_prefix_caching=False)
    gc.collect()
    r0 = rss()
    for rid, p in zip(rids, prompts):
        m.create(rid, p)
        m.reserve(rid, p.size)
        m.commit(rid, p)
        m.discard_events()
    print(json.dumps({"per_request": (rss() - r0) / num_requests}))


# ---- pool construction ------------------------------------------------------------------------


def pool_build(have_vllm: bool) -> None:
    import kvslots

    print("\npool: building a pool of 1M blocks (thread CPU time; median)")
    runs = []
    for _ in range(20):
        t0 = cpu()
        m = kvslots.SlotManager(1_000_000, 16)
        runs.append(cpu() - t0)
        del m
    ks = statistics.median(runs) / 1e6
    crit = criterion_ns("pool", "new_1m")
    extra = "" if crit is None else f" (engine alone: {crit / 1e6:.2f} ms)"
    report("kvslots SlotManager(1M blocks)", f"{ks:.3f} ms{extra}", "< 10 ms", ks < 10, ms=ks)
    if have_vllm:
        from vllm.v1.core.block_pool import BlockPool

        for n in (200_000, 1_000_000):
            runs = []
            for _ in range(3):
                gc.collect()
                t0 = cpu()
                pool = BlockPool(n, True, 16)
                runs.append(cpu() - t0)
                del pool
            v = statistics.median(runs) / 1e6
            ratio = f" = {v / ks:,.0f}x kvslots' 1M" if n == 1_000_000 else ""
            report(f"vLLM BlockPool({n:,})", f"{v:.0f} ms{ratio}", "", None, ms=v)


# ---- RSS over request lifecycles --------------------------------------------------------------


def lifecycles(total: int, every: int) -> None:
    import kvslots

    print(f"\nrss: {total:,} request lifecycles (create with prefix match, reserve, commit, finish; "
          f"a pool of 200k blocks, so the registry churns and cached blocks are evicted)")
    rng = np.random.default_rng(2)
    base = rng.integers(0, 32000, 1 << 22, dtype=np.uint32)
    shared = base[:256]
    m = kvslots.SlotManager(200_000, 16)
    offs = rng.integers(256, base.size - 600, total)
    lens = rng.integers(64, 512, total)
    share = rng.random(total) < 0.3
    samples = []
    print(f"    {0:>9,} lifecycles  RSS {rss() / 2**20:8.1f} MiB (the process, vLLM imported or not)", flush=True)
    t0 = time.perf_counter()
    for i in range(total):
        off, n = int(offs[i]), int(lens[i])
        p = np.concatenate([shared, base[off: off + n]]) if share[i] else base[off: off + n]
        rid = f"L{i}"
        matched = m.create(rid, p, lookahead=3)
        m.reserve(rid, p.size - matched + 4)
        m.commit(rid, p[matched:])
        m.finish(rid)
        if i % 1000 == 999:
            m.discard_events()
        if (i + 1) % every == 0:
            samples.append((i + 1, rss()))
            print(f"    {i + 1:>9,} lifecycles  RSS {samples[-1][1] / 2**20:8.1f} MiB", flush=True)
    secs = time.perf_counter() - t0
    s = m.stats()
    warm = samples[0][1]
    growth = max(r for _, r in samples) - warm
    report(f"RSS after {samples[0][0]:,} .. {total:,} lifecycles",
           f"{warm / 2**20:.1f} -> {samples[-1][1] / 2**20:.1f} MiB (max growth {growth / 2**20:.2f} MiB)",
           "flat", growth <= 2**20, growth_bytes=growth)
    print(f"    ({secs:.1f} s; {s['registered_blocks']:,} blocks registered, {s['evicted_blocks']:,} evicted, "
          f"{s['prefix_hit_tokens']:,} prefix-hit tokens)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller counts (CI)")
    p.add_argument("--no-cargo", action="store_true", help="use criterion's last results instead of running it")
    p.add_argument("--steps", type=int, default=512, help="steps of the B=256 K=3 trace (ffi)")
    p.add_argument("--only", nargs="+", choices=["ffi", "hash", "memory", "pool", "rss"])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--memory-child", nargs=3, metavar=("WHAT", "BLOCKS", "REQUESTS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        what, blocks, reqs = args.memory_child
        memory_child(what, int(blocks), int(reqs))
        return 0
    have_vllm = bench_slots.vllm_available() is None
    if not have_vllm:
        print("vLLM not importable: its columns are skipped (run with vLLM's interpreter)")
    only = set(args.only or ["ffi", "hash", "memory", "pool", "rss"])
    if not args.no_cargo and only & {"ffi", "hash", "pool"}:
        run_cargo(args.steps)
    print(f"  {'figure':<44} {'measured':<44} {'target':<22}")
    if "ffi" in only:
        ffi(args.steps, 3 if args.quick else 5)
    if "hash" in only:
        hashing(100 if args.quick else 400, have_vllm)
    if "memory" in only:
        memory(1 << 19 if args.quick else 1 << 21, 20_000 if args.quick else 100_000, have_vllm)
    if "pool" in only:
        pool_build(have_vllm)
    if "rss" in only:
        total = 200_000 if args.quick else 1_000_000
        lifecycles(total, total // 10)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
