"""Served disaggregated prefill/decode against one aggregated server with the same cores, driven
by vLLM's own serving benchmark (the client, model, dataset and metrics of bench_served.py).

Each round runs both set-ups back to back (the order alternates between rounds), each on fresh
servers:

  pd          ``kvslots serve --is-prefill-worker`` bound to the first half of ``--cores``,
              ``kvslots serve --role decode`` to the second half (``VLLM_CPU_OMP_THREADS_BIND``:
              two CPU servers both bind core 0 by default, see docs/pd.md), ``kvslots proxy`` in
              front (unbound). The KV of target and EAGLE layers moves over Mooncake (TCP, loopback).
  aggregated  one ``kvslots serve`` (connector on, vLLM's KV manager, the same host tier) bound
              to all of ``--cores``.

Both: EAGLE K=3, fp32, eager, ``--device-blocks`` device blocks of 32 tokens, dataset
``prefix_repetition`` (bench_served.py's), output tokens ``--ignore-eos``. Printed: output tok/s and
mean TTFT of every run, the median per set-up with the min-max spread, and the per-round ratios
pd / aggregated. From the decode server's /metrics: prompt tokens it pulled
(``external_kv_transfer``) and computed itself; from the proxy: requests disaggregated and
recomputed.

On a 2-core machine this measures correctness and overhead of the split (one core each against
two cores for one server), not a speed-up: disaggregation pays when prefill and decode contend
for the same accelerator, and here they do not share one.

    PYTHONPATH=python python benches/bench_pd_served.py --models real --rounds 3       # the measurement
    PYTHONPATH=python python benches/bench_pd_served.py --models tiny --rounds 1 --prompts 8 --concurrency 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench_served import (BLOCK, MODELS, ROOT, ModelSpec, Server, _rounds, _save, _uptime, build_models, free_port,
                          med, run_client)

SETUPS = ("aggregated", "pd")


class RoleServer(Server):
    """``kvslots serve`` in a P/D role (or aggregated), or ``kvslots proxy``, bound to ``cores``."""

    def __init__(self, argv: list[str], cores: str | None, log_path: str, health_path: str = "/health") -> None:
        self.port = free_port()
        self.health_path = health_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if p)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvslots", *argv, "--port", str(self.port)], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthz(self) -> dict:
        with urllib.request.urlopen(self.url + "/healthz", timeout=10) as r:
            return json.load(r)


def serve_argv(models: dict[str, str], args: argparse.Namespace, role: list[str]) -> list[str]:
    spec = {"method": "eagle", "model": models["eagle"], "num_speculative_tokens": 3}
    ev, replay = free_port(), free_port()
    return ["serve", models["target"], *role, "--speculative-config", json.dumps(spec),
            "--host-cache-gb", str(args.host_cache_gb),
            "--kv-events-endpoint", f"tcp://[::ffff:127.0.0.1]:{ev}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", "-q",
            "--", "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(args.device_blocks), "--max-model-len", "2048",
            "--max-num-seqs", str(args.max_num_seqs), "--seed", "0", "--disable-uvicorn-access-log"]


def core_sets(n: int) -> tuple[str, str, str]:
    """(prefill, decode, aggregated) bindings of cores 0..n-1: halves, and all."""
    if n < 2:
        raise SystemExit("--cores: at least 2 (one for each P/D worker)")
    half = n // 2
    rng = lambda a, b: str(a) if a == b else f"{a}-{b}"  # noqa: E731
    return rng(0, half - 1), rng(half, n - 1), rng(0, n - 1)


def one_run(models: dict[str, str], spec: ModelSpec, setup: str, seed: int, args: argparse.Namespace,
            logdir: str) -> dict:
    pre_cores, dec_cores, all_cores = core_sets(args.cores)
    tag = f"{spec.name}-{setup}-{seed}-{int(time.time())}"
    servers: list[RoleServer] = []
    try:
        if setup == "aggregated":
            front = RoleServer(serve_argv(models, args, ["--slot-manager", "vllm"]), all_cores,
                               os.path.join(logdir, f"{tag}.log"))
            servers.append(front)
            decode = front
        else:
            pd_port = free_port()
            prefill = RoleServer(serve_argv(models, args, ["--is-prefill-worker", "--pd-port", str(pd_port)]),
                                 pre_cores, os.path.join(logdir, f"{tag}-prefill.log"))
            decode = RoleServer(serve_argv(models, args, ["--role", "decode"]), dec_cores,
                                os.path.join(logdir, f"{tag}-decode.log"))
            servers += [prefill, decode]
            for s in servers:
                s.wait_ready(args.start_timeout)
            front = RoleServer(["proxy", "--prefill", prefill.url, "--decode", decode.url], None,
                               os.path.join(logdir, f"{tag}-proxy.log"), health_path="/healthz")
            servers.append(front)
        for s in servers:
            s.wait_ready(args.start_timeout)
        before = decode.metrics()
        r = run_client(front, models["target"], spec, seed)
        time.sleep(1.5)  # the engine's last stats reach /metrics
        after = decode.metrics()
        proxy = front.healthz() if setup == "pd" else {}
    finally:
        for s in reversed(servers):
            s.stop()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "setup": setup, "seed": seed,
        "output_tps": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
        "median_ttft_ms": r["median_ttft_ms"], "mean_tpot_ms": r.get("mean_tpot_ms"),
        "completed": r["completed"], "failed": r.get("failed", spec.prompts - r["completed"]),
        "duration_s": r["duration"],
        # prompt tokens of the server that decoded: pulled from the prefill worker / computed there
        "pulled_tokens": d.get("vllm:prompt_tokens_by_source{external_kv_transfer}", 0.0),
        "local_tokens": d.get("vllm:prompt_tokens_by_source{local_compute}", 0.0),
        "disaggregated": proxy.get("disaggregated", 0), "recomputed": proxy.get("recomputed", 0),
        "decode_errors": proxy.get("decode_errors", 0),
        "accepted": d.get("vllm:spec_decode_num_accepted_tokens", 0.0),
        "drafts": d.get("vllm:spec_decode_num_draft_tokens", 0.0),
        "logs": [s.log.name for s in servers],
    }


def summarize(name: str, runs: list[dict]) -> dict:
    by = {m: [r for r in runs if r["setup"] == m] for m in SETUPS}
    s: dict = {"model": name}
    for m in SETUPS:
        rs = by[m]
        s[m] = {k: med([r[k] for r in rs]) for k in ("output_tps", "mean_ttft_ms", "pulled_tokens", "local_tokens")}
        s[m]["tps_range"] = (min(r["output_tps"] for r in rs), max(r["output_tps"] for r in rs)) if rs else None
        s[m]["ttft_range"] = (min(r["mean_ttft_ms"] for r in rs), max(r["mean_ttft_ms"] for r in rs)) if rs else None
        s[m]["failed"] = sum(r["failed"] for r in rs)
        s[m]["recomputed"] = sum(r["recomputed"] for r in rs)
    pairs = [(a, b) for a in by["aggregated"] for b in by["pd"] if a["seed"] == b["seed"]]
    s["tps_ratios"] = [b["output_tps"] / a["output_tps"] for a, b in pairs]
    s["ttft_ratios"] = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in pairs]
    return s


def print_summary(s: dict, spec: ModelSpec, args: argparse.Namespace) -> None:
    print(f"\n== {s['model']}: {spec.prompts} prompts, concurrency {spec.concurrency}, EAGLE K=3, {args.cores} cores; "
          f"median of {len(s['tps_ratios'])} rounds (min-max)")
    print(f"  {'setup':11s} {'output tok/s':>22s} {'mean TTFT ms':>24s} {'pulled / local prompt tokens':>30s} "
          f"failed recomputed")
    for m in SETUPS:
        x = s[m]
        if x["tps_range"] is None:
            continue
        print(f"  {m:11s} {x['output_tps']:8.2f} ({x['tps_range'][0]:6.2f}-{x['tps_range'][1]:6.2f}) "
              f"{x['mean_ttft_ms']:9.0f} ({x['ttft_range'][0]:6.0f}-{x['ttft_range'][1]:6.0f}) "
              f"{x['pulled_tokens']:14,.0f} / {x['local_tokens']:9,.0f}   {x['failed']:6d} {x['recomputed']:6d}")
    if s["tps_ratios"]:
        tr, fr = s["tps_ratios"], s["ttft_ratios"]
        print(f"  pd / aggregated: output tok/s {med(tr):.3f}x ({min(tr):.3f}-{max(tr):.3f}), "
              f"mean TTFT {med(fr):.3f}x ({min(fr):.3f}-{max(fr):.3f})")
        print("    per round (tok/s / TTFT): " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(tr, fr)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="real", help="comma-separated: tiny, real")
    ap.add_argument("--rounds", type=_rounds, default=_rounds("3"),
                    help="rounds per model: N for every model, or per model as tiny=2,real=3")
    ap.add_argument("--first", choices=SETUPS, default="aggregated", help="set-up run first in round 0")
    ap.add_argument("--prompts", type=int, help="override the model's number of prompts")
    ap.add_argument("--concurrency", type=int, help="override the model's max concurrency")
    ap.add_argument("--seed", type=int, default=0, help="seed of round 0 (round r uses seed + r)")
    ap.add_argument("--cores", type=int, default=min(2, os.cpu_count() or 2),
                    help="cores in all: the aggregated server gets them all, each P/D worker half")
    ap.add_argument("--device-blocks", type=int, default=512,
                    help="device blocks of each server (the prefill worker holds a request's blocks until the "
                         "decode worker pulled them)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--host-cache-gb", type=float, default=0.5)
    ap.add_argument("--model-root", default="/tmp/kvslots-served-models")
    ap.add_argument("--logdir", default=None, help="server logs (default: a temporary directory)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", metavar="FILE", help="write every run and the summaries")
    args = ap.parse_args()
    core_sets(args.cores)
    logdir = args.logdir or tempfile.mkdtemp(prefix="kvslots-pd-served-")
    os.makedirs(logdir, exist_ok=True)
    out: dict = {"runs": {}, "summary": {}, "uptime_before": _uptime(), "cores": args.cores}
    print(f"bench_pd_served: {args.cores} cores; logs in {logdir}; load before: {out['uptime_before']}", flush=True)
    for name in args.models.split(","):
        spec = MODELS[name]
        if args.prompts or args.concurrency:
            spec = ModelSpec(spec.name, spec.dims, args.prompts or spec.prompts, args.concurrency or spec.concurrency)
        models = build_models(spec, args.model_root)
        runs: list[dict] = []
        order = list(SETUPS) if args.first == "aggregated" else list(reversed(SETUPS))
        for rnd in range(args.rounds.get(name, args.rounds.get("*", 3))):
            seed = args.seed + rnd
            for setup in (order if rnd % 2 == 0 else order[::-1]):
                r = one_run(models, spec, setup, seed, args, logdir)
                runs.append(r)
                print(f"  {name} round {rnd} {setup:10s}: {r['output_tps']:8.2f} tok/s, mean TTFT "
                      f"{r['mean_ttft_ms']:8.0f} ms, pulled/local prompt tokens {r['pulled_tokens']:,.0f}/"
                      f"{r['local_tokens']:,.0f}, failed {r['failed']}, recomputed {r['recomputed']}, "
                      f"{r['duration_s']:.0f} s; load {_uptime()}", flush=True)
        s = summarize(name, runs)
        s["prompts"], s["concurrency"] = spec.prompts, spec.concurrency
        print_summary(s, spec, args)
        out["runs"][name], out["summary"][name] = runs, s
        _save(out, args.json)
    out["uptime_after"] = _uptime()
    print(f"\nload after: {out['uptime_after']}")
    _save(out, args.json)


if __name__ == "__main__":
    main()
