"""Scheduler mode under served traffic: ``kvslots serve --slot-manager kvslots`` (the Rust core
allocates the device blocks) against ``--slot-manager vllm`` (vLLM's own KV cache manager),
driven by vLLM's own serving benchmark, side by side.

Everything but the slot manager is ``bench_served.py``'s set-up (its ``Server``, client, dataset
and metrics): EAGLE K=3, 96 device blocks of 32 tokens, fp32, eager, dataset ``prefix_repetition``
(8 prefixes of 1,024 tokens, 64-token suffixes, 64 output tokens). The connector is off on both
servers unless ``--connector`` is given (then both run the KVSlotsConnector). Each round runs
both servers back to back on the same prompts, fresh processes, the order alternating from one
round to the next; the ratios are kvslots / vllm per round, printed as the median and the
min-max range.

    PYTHONPATH=python python benches/bench_served_sched.py --rounds 4
    PYTHONPATH=python python benches/bench_served_sched.py --models real --rounds 2 --json r.json

Scheduler mode is meant to cost nothing here: a served engine's step is mostly the forward
pass, so what this shows is that taking over vLLM's allocator does not slow a live server, and
that both servers schedule alike (preemptions, prefix hits, acceptance).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_served as bs  # noqa: E402  (the served set-up lives there, once)

MANAGERS = ("vllm", "kvslots")


def one(models: dict, spec: bs.ModelSpec, manager: str, seed: int, args: argparse.Namespace, logdir: str) -> dict:
    a = copy.copy(args)
    a.slot_manager = manager
    if args.profile:
        a.profile = os.path.join(args.profile, manager)
    r = bs.one_run(models, spec, "kvslots" if args.connector else "none", seed, a, logdir)
    r["manager"] = manager
    return r


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}x ({min(xs):.3f}-{max(xs):.3f})"


def report(name: str, runs: list[dict]) -> dict:
    by = {m: [r for r in runs if r["manager"] == m] for m in MANAGERS}
    pairs = [(a, b) for a in by["vllm"] for b in by["kvslots"] if a["round"] == b["round"]]
    tps = [b["output_tps"] / a["output_tps"] for a, b in pairs]
    ttft = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in pairs]
    tpot = [b["mean_tpot_ms"] / a["mean_tpot_ms"] for a, b in pairs if a.get("mean_tpot_ms") and b.get("mean_tpot_ms")]
    print(f"\n== {name}: median over {len(pairs)} rounds (min-max)")
    for m in MANAGERS:
        rs = by[m]
        if not rs:
            continue
        print(f"  --slot-manager {m:8s} output tok/s {statistics.median(r['output_tps'] for r in rs):8.2f} "
              f"({min(r['output_tps'] for r in rs):.2f}-{max(r['output_tps'] for r in rs):.2f}), "
              f"mean TTFT {statistics.median(r['mean_ttft_ms'] for r in rs):7.0f} ms, "
              f"preemptions {sum(r['preemptions'] for r in rs):.0f}, "
              f"device-cached prompt tokens {sum(r['device_tokens'] for r in rs):,.0f}, "
              f"accepted/draft {sum(r['accepted'] for r in rs):,.0f}/{sum(r['drafts'] for r in rs):,.0f}, "
              f"failed {sum(r['failed'] for r in rs)}")
    if pairs:
        print(f"  kvslots / vllm: output tok/s {spread(tps)}, mean TTFT {spread(ttft)}"
              + (f", mean TPOT {spread(tpot)}" if tpot else ""))
        print("    per round (tok/s, TTFT): " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(tps, ttft)))
    return {"tps_ratios": tps, "ttft_ratios": ttft, "tpot_ratios": tpot}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, real")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, help="override the model's number of prompts")
    ap.add_argument("--concurrency", type=int, help="override the model's max concurrency")
    ap.add_argument("--seed", type=int, default=0, help="seed of round 0 (round r uses seed + r)")
    ap.add_argument("--connector", action="store_true", help="both servers run the KVSlotsConnector")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--host-cache-gb", type=float, default=1.0)
    ap.add_argument("--model-root", default="/tmp/kvslots-served-models")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--profile", metavar="DIR", help="cProfile both servers' engine core and worker loops "
                    "(DIR/vllm, DIR/kvslots; summarize with benches/profiling/summarize.py)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    # What bench_served's Server and one_run read from their namespace.
    args.env = args.env_none = args.env_kvslots = None
    logdir = args.logdir or tempfile.mkdtemp(prefix="kvslots-served-sched-")
    os.makedirs(logdir, exist_ok=True)
    out: dict = {"runs": {}, "summary": {}, "connector": args.connector, "uptime_before": bs._uptime()}
    print(f"bench_served_sched: connector {'on' if args.connector else 'off'} on both; logs in {logdir}; "
          f"load before: {out['uptime_before']}", flush=True)
    for name in args.models.split(","):
        base = bs.MODELS[name]
        spec = bs.ModelSpec(name, base.dims, args.prompts or base.prompts, args.concurrency or base.concurrency)
        models = bs.build_models(spec, args.model_root)
        runs: list[dict] = []
        for rnd in range(args.rounds):
            seed = args.seed + rnd
            for manager in (MANAGERS if rnd % 2 == 0 else MANAGERS[::-1]):
                r = one(models, spec, manager, seed, args, logdir)
                r["round"] = rnd
                runs.append(r)
                print(f"  {name} round {rnd} {manager:8s}: {r['output_tps']:8.2f} tok/s, mean TTFT "
                      f"{r['mean_ttft_ms']:8.0f} ms, preemptions {r['preemptions']:.0f}, failed {r['failed']}, "
                      f"{r['duration_s']:.0f} s; load {bs._uptime()}", flush=True)
        out["runs"][name] = runs
        out["summary"][name] = report(name, runs)
        bs._save(out, args.json)
    out["uptime_after"] = bs._uptime()
    print(f"\nload after: {out['uptime_after']}")
    bs._save(out, args.json)


if __name__ == "__main__":
    main()
