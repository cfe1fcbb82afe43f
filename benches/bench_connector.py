"""KVSlotsConnector benchmarks, each measured side by side with its peer in the same run.

  scheduler   vLLM's real Scheduler at batch B (default 256 and 1024), EAGLE K=3, decode steps
              with fake outputs and 0.7 per-draft acceptance: time of schedule() +
              update_from_output() per step with no connector, a do-nothing connector and the
              KVSlotsConnector, interleaved in one process (none, null, kvslots, none, ...), thread
              CPU time by default. Our own share is (kvslots - null) / none, per repeat; the
              median and the spread over repeats are printed. Target: at most 3%.
              ``--modes none,kvslots,kvslots-disk`` adds the connector with its disk tier on (idle:
              this workload never evicts from the host tier), for the disk tier's no-regression
              check. KV events are on with vLLM's ZMQ publisher by default (``--events zmq``: the
              connector hands it msgspec.Raw wire bytes); ``--events capture`` builds vLLM's
              structs (a publisher of another kind), ``--events off`` has no reader.
  e2e         the real CPU engine on the tiny model (in-process, one worker thread): decode
              tokens/s with vs without the connector (target >= 97%), and time to first token for
              a repeated 2k-token prompt served from the host tier vs recomputed (target <= 0.5x);
              engine pairs interleaved, median and spread of the per-pair ratios. ``--disk`` adds a
              third engine, the connector with its disk tier on, and its decode ratio to the
              engine without a connector (the disk tier's no-regression check).
  worker      the worker-side hooks vLLM's model runner calls each step (and per attention layer),
              on steps with nothing to copy: KVSlotsConnector vs a do-nothing connector.

    python benches/bench_connector.py scheduler [--batch 256 1024] [--steps 200] [--repeats 9] [--modes ...] [--events ...]
    python benches/bench_connector.py e2e [--prompt-len 2048] [--disk]
    python benches/bench_connector.py worker [--steps 20000] [--layers 3]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def scheduler_bench(args: argparse.Namespace) -> None:
    from kvslots._dev.tiny import build_tiny_models

    models = build_tiny_models(args.models)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    for batch in args.batch:
        _scheduler_bench_one(args, models, batch, clock)


def _scheduler_bench_one(args: argparse.Namespace, models: dict, batch: int, clock) -> None:
    from tqdm import tqdm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_harness import BLOCK_SIZE, DRAFT_BASE, Harness, engine_config, kv_cache_config, make_request

    num_blocks = batch * 40
    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=num_blocks, max_num_seqs=batch,
                        max_num_batched_tokens=batch * 8 + 2048)

    def run(mode: str, seed: int) -> float:
        rng = random.Random(seed)
        c = copy.deepcopy(cfg)
        c.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": num_blocks * 2}
        if mode == "kvslots-disk":  # the disk tier on (idle here: the host tier never evicts)
            c.kv_transfer_config.kv_connector_extra_config.update(
                disk_path=tempfile.mkdtemp(prefix="kvslots-bench-disk-"), disk_blocks=num_blocks * 2)
            c.kv_transfer_config.kv_load_failure_policy = "recompute"  # as kvslots serve sets it
        hook_time = [0.0, 0]  # seconds, calls
        per_hook: dict[str, float] = {}
        if mode.startswith("kvslots"):
            h = Harness(c, num_blocks=num_blocks, seed=seed, log_stats=args.log_stats)
            sched, workers = h.scheduler, h.workers
            # vLLM's ZMQ publisher encodes each batch (on its thread, in this process) and keeps
            # no events: so does this one, on the step's thread, so the step time counts it (the
            # hooks do not); the harness's capture would keep every event for a long run's GC.
            sched.kv_event_publisher = _DropPublisher()
            if args.events == "off":  # nobody reads KV events: vLLM's publisher is off
                h.connector._vllm_events = False
                h.connector._sched.planner.events_wanted = False
            else:  # zmq: vLLM's own publisher, fed msgspec.Raw; capture: structs (other publishers)
                from kvslots.vllm.compat import features

                h.connector._raw_events = args.events == "zmq" and not features().block_stored_lookahead
            # Timed with the step's clock (thread CPU time: wall clock counts other processes on
            # a shared machine). thread_time is a system call on this VM (0.5-3.4 us measured):
            # its cost is taken out of the hooks' figure and out of kvslots' step time below.
            _time_hooks(h.connector, hook_time, per_hook, clock, clock_cost)
        else:
            if mode == "none":
                c.kv_transfer_config = None
            else:  # vLLM's own connector plumbing around a connector that does nothing
                c.kv_transfer_config.kv_connector = "NullConnector"
                c.kv_transfer_config.kv_connector_module_path = __name__
            c.cache_config.num_gpu_blocks = num_blocks
            sched = Scheduler(vllm_config=c, kv_cache_config=kv_cache_config(num_blocks),
                              structured_output_manager=StructuredOutputManager(c), block_size=BLOCK_SIZE,
                              log_stats=args.log_stats)
            workers = []
        for i in range(batch):
            sched.add_request(make_request(f"r{i}", [rng.randrange(1, DRAFT_BASE) for _ in range(rng.randrange(200, 600))],
                                           max_tokens=10_000))
        # As vLLM's engine core does after start-up (freeze_gc_heap): the set-up's objects are
        # not scanned by every collection. Same for every mode.
        gc.collect()
        gc.freeze()
        timed = 0.0
        step, decoding_since = 0, None
        while decoding_since is None or step < decoding_since + args.warmup + args.steps:
            if decoding_since is None and sched.running and not any(r.is_prefill_chunk for r in sched.running) \
                    and len(sched.running) == batch:
                decoding_since = step  # steady state: every request decoding
            step += 1
            t0 = clock()
            so = sched.schedule()
            t_sched = clock() - t0
            worker_meta = None
            for w in workers:  # worker side: not scheduler time
                w.handle_preemptions(so.kv_connector_metadata)
                w.bind_connector_metadata(so.kv_connector_metadata)
                w.start_load_kv(None)
                worker_meta = w.build_connector_worker_meta()
                w.clear_connector_metadata()
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                spec = so.scheduled_spec_decode_tokens.get(rid, [])
                a = 0
                while a < len(spec) and spec[a] >= 0 and rng.random() < 0.7:
                    a += 1
                sampled.append(list(spec[:a]) + [rng.randrange(1, DRAFT_BASE)])
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled,
                                    kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=worker_meta))
            t0 = clock()
            sched.update_from_output(so, out)
            t_update = clock() - t0
            running = [r.request_id for r in sched.running]
            sched.update_draft_token_ids(DraftTokenIds(running, [[rng.randrange(DRAFT_BASE, 2 * DRAFT_BASE) for _ in range(3)]
                                                                 for _ in running]))
            if decoding_since is not None and step == decoding_since + args.warmup:
                hook_time[0] = 0.0  # the timed steps only
                hook_time[1] = 0
                per_hook.clear()
            if decoding_since is not None and step > decoding_since + args.warmup:
                timed += t_sched + t_update
        gc.unfreeze()
        if mode.startswith("kvslots"):
            # The wrappers' own clock calls (two per hook call) ran inside the timed steps.
            timed -= 2 * clock_cost * hook_time[1]
            hooks_by_mode.setdefault(mode, []).append(hook_time[0] / args.steps)
            for name, t in per_hook.items():
                split_by_mode.setdefault(mode, {}).setdefault(name, []).append(t / args.steps)
            for conn in (h.connector, *h.workers):  # the disk tier's threads and file
                conn.shutdown()
        return timed / args.steps

    clock_cost = _clock_cost(clock)
    modes = args.modes.split(",")
    # Per kvslots mode, per run: time inside the connector's scheduler-side hooks per step, and per hook.
    hooks_by_mode: dict[str, list[float]] = {}
    split_by_mode: dict[str, dict[str, list[float]]] = {}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in tqdm(range(args.repeats), desc=f"scheduler B={batch}", disable=not args.progress):
        # Interleaved, and the order rotates each repeat, to spread machine noise over all three.
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            times[mode].append(run(mode, rep))
    clock_name = "thread CPU time" if args.clock == "cpu" else "wall clock"
    clock_name += f" (one clock call {clock_cost * 1e6:.2f} us, taken out of the hooks' figures)"
    print(f"vLLM Scheduler, batch {batch}, EAGLE K=3, {args.steps} decode steps x {args.repeats} interleaved repeats, "
          f"{clock_name}; median (min-max) of the repeats:")
    for mode, label in (("none", "without connector"), ("null", "do-nothing connector"), ("kvslots", "KVSlotsConnector"),
                        ("kvslots-disk", "KVSlotsConnector + disk tier")):
        if mode in times:
            t = times[mode]
            print(f"  {label:28s} {statistics.median(t) * 1e3:8.3f} ms/step ({min(t) * 1e3:.3f}-{max(t) * 1e3:.3f})")
    for mode, hooks in hooks_by_mode.items():
        tag = "" if mode == "kvslots" else f" ({mode})"
        if "none" in times:
            direct = [100 * hk / b for hk, b in zip(hooks, times["none"])]
            print(f"  inside KVSlots' hooks{tag:8s} {statistics.median(hooks) * 1e6:7.1f} us/step = "
                  f"{statistics.median(direct):.2f}% of the step without connector (per-repeat median; "
                  f"{min(direct):.2f} to {max(direct):.2f}): timed directly, the least noisy figure")
        else:
            print(f"  inside KVSlots' hooks{tag:8s} {statistics.median(hooks) * 1e6:7.1f} us/step")
        for name, ts in sorted(split_by_mode[mode].items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"    {name:30s} {statistics.median(ts) * 1e6:7.1f} us/step ({min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})")
    hooks, hook_split = hooks_by_mode.get("kvslots", []), split_by_mode.get("kvslots", {})
    if not all(m in times for m in ("none", "null", "kvslots")):
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"batch": batch, "clock": args.clock, "steps": args.steps, "times": times,
                                    "hooks": hooks_by_mode, "hook_split": split_by_mode,
                                    "events": args.events}) + "\n")
        return
    # Per repeat: the three runs of one repeat ran back to back, so their differences share noise.
    own = [100 * (c - n) / b for b, n, c in zip(times["none"], times["null"], times["kvslots"])]
    plumbing = [100 * (n / b - 1) for b, n in zip(times["none"], times["null"])]
    total = [100 * (c / b - 1) for b, c in zip(times["none"], times["kvslots"])]
    b, n, c = (statistics.median(times[m]) for m in ("none", "null", "kvslots"))
    print(f"  vLLM's connector plumbing    {statistics.median(plumbing):+6.1f}% of the step (per-repeat median; "
          f"{min(plumbing):+.1f} to {max(plumbing):+.1f})")
    print(f"  KVSlotsConnector in all      {statistics.median(total):+6.1f}% ({min(total):+.1f} to {max(total):+.1f})")
    print(f"  KVSlots' own work            {statistics.median(own):+6.1f}% of the scheduler step (per-repeat median; "
          f"{min(own):+.1f} to {max(own):+.1f}); from the medians {100 * (c - n) / b:+.1f}%   (target <= +3%)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"batch": batch, "clock": args.clock, "steps": args.steps, "times": times,
                                "own_pct": own, "hooks": hooks, "hook_split": hook_split,
                                "events": args.events}) + "\n")


class _DropPublisher:
    """vLLM's ZmqEventPublisher without the socket: encodes each batch as it does, then drops it
    (keeping the events would make a long run's GC pay for them)."""

    def __init__(self) -> None:
        import msgspec

        self._pack = msgspec.msgpack.Encoder()

    def publish(self, batch) -> None:
        self._pack.encode(batch)

    def shutdown(self) -> None:
        pass


#: The connector methods vLLM's scheduler calls (scheduler side).
_SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                    "update_connector_output", "request_finished", "take_events", "has_pending_push_work",
                    "get_external_cache_hit_sources", "get_kv_connector_stats")


def _clock_cost(clock) -> float:
    """One call of ``clock``, measured: the median gap between two back-to-back calls."""
    gaps = []
    for _ in range(2001):
        t0 = clock()
        gaps.append(clock() - t0)
    return statistics.median(gaps)


def _time_hooks(connector, acc: list, per_hook: dict[str, float], clock, cost: float) -> None:
    """Wraps the connector's scheduler-side methods (on the instance) to add their time to
    acc[0], their calls to acc[1] and their time to per_hook[name]. A measured interval holds
    about one clock call (the end of the first, the start of the second): ``cost`` is taken off."""
    for name in _SCHEDULER_HOOKS:
        fn = getattr(connector, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = clock()
            try:
                return _fn(*a, **kw)
            finally:
                dt = max(clock() - t0 - cost, 0.0)
                acc[0] += dt
                acc[1] += 1
                per_hook[_name] = per_hook.get(_name, 0.0) + dt

        setattr(connector, name, timed)


def _null_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvslots.vllm.connector.metadata import KVSlotsMetadata

    class NullConnector(KVConnectorBase_V1):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return KVSlotsMetadata(step=0)

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    return NullConnector


def __getattr__(name: str):  # lets vLLM's factory load NullConnector from this module lazily
    if name == "NullConnector":
        return _null_connector_class()
    raise AttributeError(name)


def worker_bench(args: argparse.Namespace) -> None:
    """The worker-side hooks vLLM 0.32's model runner calls each step (kv_connector_model_runner_mixin
    and the per-layer maybe_transfer_kv_layer wrapper), in its order, on steps with nothing to copy:
    KVSlotsConnector vs a do-nothing connector, interleaved, thread CPU time per step."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvslots._dev.tiny import build_tiny_models
    from kvslots.vllm.connector import KVSlotsConnector
    from kvslots.vllm.connector.metadata import EMPTY_METADATA

    from vllm_harness import BLOCK_SIZE, HEAD, HEADS, engine_config, kv_cache_config

    models = build_tiny_models(args.models)
    num_blocks = 256
    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=num_blocks)
    cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": num_blocks}
    kcc = kv_cache_config(num_blocks)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    caches = {n: torch.zeros(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD) for n in layers}
    conns = {"kvslots": KVSlotsConnector(cfg, KVConnectorRole.WORKER, kcc),
             "null": _null_connector_class()(cfg, KVConnectorRole.WORKER, kcc)}
    conns["kvslots"].register_kv_caches(caches)
    meta = {"kvslots": EMPTY_METADATA, "null": conns["null"].build_connector_meta(None)}
    finished: set[str] = set()
    attn_metadata = object()  # vLLM skips the layer hooks when a layer has no attention metadata

    def steps(c, m, n: int) -> float:
        t0 = time.thread_time()
        for _ in range(n):
            c.handle_preemptions(m)
            c.bind_connector_metadata(m)
            c.start_load_kv(None)  # no sync loads: after the forward
            for name in layers:  # maybe_transfer_kv_layer, per attention layer
                if c.has_connector_metadata():
                    c.wait_for_layer_load(name)
                    c.save_kv_layer(name, caches[name], attn_metadata)
            c.wait_for_save()
            c.get_transfer_results(finished)
            c.get_block_ids_with_load_errors()
            c.get_kv_connector_stats()
            c.get_kv_connector_kv_cache_events()
            c.build_connector_worker_meta()
            c.clear_connector_metadata()
        return (time.thread_time() - t0) / n

    times: dict[str, list[float]] = {m: [] for m in conns}
    for rep in range(args.repeats):
        for mode in (("null", "kvslots") if rep % 2 == 0 else ("kvslots", "null")):
            times[mode].append(steps(conns[mode], meta[mode], args.steps))
    med = statistics.median
    print(f"worker-side connector hooks, steps with nothing to copy, {args.layers} attention layers, "
          f"{args.steps} steps x {args.repeats} interleaved repeats, thread CPU time; median (min-max):")
    for mode, label in (("null", "do-nothing connector"), ("kvslots", "KVSlotsConnector")):
        t = times[mode]
        print(f"  {label:22s} {med(t) * 1e6:7.2f} us/step ({min(t) * 1e6:.2f}-{max(t) * 1e6:.2f})")
    own = [k - n for k, n in zip(times["kvslots"], times["null"])]
    print(f"  KVSlots' own           {med(own) * 1e6:+7.2f} us/step ({min(own) * 1e6:+.2f} to {max(own) * 1e6:+.2f})")


def e2e_bench(args: argparse.Namespace) -> None:
    runner = os.path.join(HERE, "..", "tests", "engine_run.py")

    # Both engines get the core reservation vLLM makes without a connector, as `kvslots serve`
    # sets it: otherwise vLLM's CPU backend reserves one more core for any connector and the
    # ratio measures that reservation, not the connector (--vllm-reservation keeps it).
    env = dict(os.environ)
    if not args.vllm_reservation:
        from kvslots.vllm.cpu_cores import connector_cpu_env

        env.update(connector_cpu_env())

    def run(**spec):
        spec = {"models": args.models, **spec}
        p = subprocess.run([sys.executable, runner, json.dumps(spec)], capture_output=True, text=True, timeout=1200,
                           env=env)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            raise SystemExit(p.stdout[-2000:] + p.stderr[-4000:])
        return json.loads(line[-1][7:])

    # Engines: no connector (False), the connector (True) and, with --disk, the connector with
    # its disk tier on ("disk"; idle here: this workload never evicts from the host tier).
    kinds: list = [False, True] + (["disk"] if args.disk else [])
    runs: dict = {k: [] for k in kinds}
    for rep in range(args.repeats):  # interleaved engines, the order rotating
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            runs[kind].append(run(method="eagle", connector=bool(kind), disk=kind == "disk",
                                  prompt_len=args.prompt_len, timing=True, decode_tokens=args.decode_tokens))
        # Each group as it completes: a run stopped early keeps what it measured.
        b, c = runs[False][-1], runs[True][-1]
        line = (f"  pair {rep}: decode tokens/s {b['decode_tps']:.1f} without, {c['decode_tps']:.1f} with "
                f"(ratio {c['decode_tps'] / b['decode_tps']:.3f})")
        if args.disk:
            d = runs["disk"][-1]
            line += f", {d['decode_tps']:.1f} with the disk tier (ratio {d['decode_tps'] / b['decode_tps']:.3f})"
        print(line + f"; repeated-prompt TTFT {b['ttft_repeat_s'] * 1e3:.1f} / {c['ttft_repeat_s'] * 1e3:.1f} ms",
              flush=True)
    med = statistics.median
    tps = [c["decode_tps"] / b["decode_tps"] for b, c in zip(runs[False], runs[True])]
    ttft = [c["ttft_repeat_s"] / b["ttft_repeat_s"] for b, c in zip(runs[False], runs[True])]
    bt, ct = [r["decode_tps"] for r in runs[False]], [r["decode_tps"] for r in runs[True]]
    bf, cf = [r["ttft_repeat_s"] for r in runs[False]], [r["ttft_repeat_s"] for r in runs[True]]
    print(f"real vLLM CPU engine, tiny Llama + EAGLE K=3, block 32; {args.repeats} engine "
          f"{'triples' if args.disk else 'pairs'}, interleaved (each engine: best of 3 runs); median (min-max):")
    print(f"  decode tokens/s      without {med(bt):8.1f} ({min(bt):.1f}-{max(bt):.1f})   with {med(ct):8.1f} "
          f"({min(ct):.1f}-{max(ct):.1f})")
    print(f"    ratio per pair     {med(tps):.3f} ({min(tps):.3f}-{max(tps):.3f}) (target >= 0.97)")
    # Pairs alternate which engine runs first (even pairs: without first): a slowdown of whichever
    # runs first multiplies one group's ratios by f and the other's by 1/f; their geometric mean
    # cancels it.
    # (With --disk the three engines rotate instead, and this split does not apply.)
    g_without, g_with = (tps[0::2], tps[1::2]) if not args.disk else ([], [])
    first = [(b if i % 2 == 0 else c)["decode_tps"] / (c if i % 2 == 0 else b)["decode_tps"]
             for i, (b, c) in enumerate(zip(runs[False], runs[True]))]
    if not args.disk:
        print(f"    first engine / second engine of a pair: {med(first):.3f} ({min(first):.3f}-{max(first):.3f}) "
              f"(position effect, either mode)")
    if g_without and g_with:
        print(f"    pairs without first {med(g_without):.3f}, with first {med(g_with):.3f}; position-balanced "
              f"ratio {(med(g_without) * med(g_with)) ** 0.5:.3f}")
    if args.disk:
        dt = [r["decode_tps"] for r in runs["disk"]]
        dr = [d["decode_tps"] / b["decode_tps"] for b, d in zip(runs[False], runs["disk"])]
        spilled = runs["disk"][-1].get("disk", {}).get("disk_spilled_blocks")
        print(f"  with the disk tier   {med(dt):8.1f} ({min(dt):.1f}-{max(dt):.1f})   ratio to without "
              f"{med(dr):.3f} ({min(dr):.3f}-{max(dr):.3f}) (target >= 0.97; {spilled} blocks spilled)")
    print(f"  TTFT, repeated {args.prompt_len}-token prompt after a device cache reset:")
    print(f"    recomputed (no connector)  {med(bf) * 1e3:8.1f} ms ({min(bf) * 1e3:.1f}-{max(bf) * 1e3:.1f})")
    print(f"    from the host tier         {med(cf) * 1e3:8.1f} ms ({min(cf) * 1e3:.1f}-{max(cf) * 1e3:.1f})   "
          f"ratio {med(ttft):.2f} ({min(ttft):.2f}-{max(ttft):.2f}) (target <= 0.5; "
          f"{runs[True][-1]['connector']['loaded_blocks']} blocks loaded)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="which", required=True)
    s = sub.add_parser("scheduler")
    s.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--repeats", type=int, default=9)
    s.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="thread CPU time (default: other processes on a shared machine count less) or wall clock")
    s.add_argument("--json", metavar="FILE", help="append each batch's per-repeat times to FILE (JSON lines)")
    s.add_argument("--progress", action="store_true", help="show a progress bar")
    s.add_argument("--events", choices=("zmq", "capture", "off"), default="zmq",
                   help="zmq: KV events on with vLLM's ZMQ publisher (the connector hands it each event's wire "
                        "bytes, msgspec.Raw); capture: a publisher of another kind (vLLM's event structs are "
                        "built); off: no reader. Each batch is encoded as vLLM's publisher does; vLLM's own "
                        "device-tier events stay off in every mode")
    s.add_argument("--log-stats", action="store_true", help="vLLM's stats on (same for every peer)")
    s.add_argument("--modes", default="none,null,kvslots",
                   help="which peers to run (comma-separated): none, null (a do-nothing connector), kvslots, "
                        "kvslots-disk (with the disk tier on)")
    e = sub.add_parser("e2e")
    e.add_argument("--prompt-len", type=int, default=2048)
    e.add_argument("--decode-tokens", type=int, default=256)
    e.add_argument("--repeats", type=int, default=7)
    e.add_argument("--disk", action="store_true",
                   help="a third engine in each group: the connector with its disk tier on (decode ratio)")
    e.add_argument("--vllm-reservation", action="store_true",
                   help="leave VLLM_CPU_NUM_OF_RESERVED_CPU unset: vLLM's CPU backend then reserves one more "
                        "core for the connector engine (measures that reservation, not the connector)")
    w = sub.add_parser("worker")
    w.add_argument("--steps", type=int, default=20000)
    w.add_argument("--repeats", type=int, default=7)
    w.add_argument("--layers", type=int, default=3, help="attention layers (the tiny model + EAGLE head: 3)")
    for p in (s, e, w):
        p.add_argument("--models", default="/tmp/kvslots-tiny")
    args = ap.parse_args()
    {"scheduler": scheduler_bench, "e2e": e2e_bench, "worker": worker_bench}[args.which](args)


if __name__ == "__main__":
    main()
