"""Small CUDA copies (16 blocks = 32 MiB of a 32-layer model): BlockCopier of a base tree against
this tree's, in one process, and where a small copy's time goes on the GPU.

1. bytes: this tree's store then load byte-exact, every segment;
2. A/B: plain pinned copies, the base tree's store / load and this tree's, interleaved call by
   call over the same layers (two copiers, each with its own host pool); ``--rounds`` rounds of
   ``--repeats`` calls each; per round the median of each, then the median of the rounds' shares
   of a plain pinned copy with their min-max;
3. timeline: torch.profiler over calls of each copy of this tree (its trace, CPU and GPU
   timestamps on one clock): from the call to the first GPU operation, the bus copies (count,
   their sum, the gaps between them), the kernels and the wait before each, and the call to the
   last GPU operation's end. The profiler adds host time; the GPU intervals are what it shows;
4. pieces: host time of a stream switch and a cross-stream wait, torch's way and this tree's.

    python benches/profiling/cuda_small_copies.py --base DIR [--copy 16,64] [--rounds 5] [--repeats 15]

``DIR`` holds the base tree's ``python/kvslots/vllm/transfer.py`` (loaded beside this tree's,
sharing its ``_fused_copy``, ``_core`` and errors). Runs with torch only, as bench_cuda_copy.py.

Ran on a lent H100 on 2026-11-27: benches/results/cuda_small_copies_h100.txt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_cuda_copy import _block_copier, median_times  # noqa: E402


def _base_copier(base: pathlib.Path):
    path = base / "python" / "kvslots" / "vllm" / "transfer.py"
    spec = importlib.util.spec_from_file_location("kvslots.vllm._transfer_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.BlockCopier


def _spread(values):
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def ab(fns: dict, plain_of: dict, nbytes: int, rounds: int, repeats: int, sync) -> None:
    """Interleaved timing in rounds; prints each copy's share of its plain pinned copy per round."""
    shares = {k: [] for k in fns if k not in plain_of.values()}
    medians = {k: [] for k in fns}
    for _ in range(rounds):
        med = {k: v[0] for k, v in median_times(fns, repeats, sync).items()}
        for k, v in med.items():
            medians[k].append(v)
        for k in shares:
            shares[k].append(med[plain_of[k]] / med[k])
    for k in fns:
        ms = statistics.median(medians[k])
        line = f"  {k:44s} {ms * 1e3:7.3f} ms  {nbytes / ms / 1e9:5.1f} GB/s"
        if k in shares:
            line += f"  share of the plain copy {_spread(shares[k])}"
        print(line)


def timeline(c, fns: dict, calls: int, sync) -> None:
    """Per copy, medians over ``calls`` profiled calls of the intervals of its GPU operations."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for f in fns.values():
        f()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for name, f in fns.items():
                sync()
                time.sleep(0.002)  # the GPU idle before each call
                with record_function(f"call|{name}"):
                    f()
                sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    calls_ = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"].split("|", 1)[1]) for e in events
                    if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("call|"))
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e.get("cat"), e["name"], (e.get("args") or {}).get("bytes", 0))
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    stats: dict[str, dict[str, list[float]]] = {}
    for i, (t0, t1, name) in enumerate(calls_):
        nxt = calls_[i + 1][0] if i + 1 < len(calls_) else float("inf")
        ops = [g for g in gpu if t0 <= g[0] < nxt]
        if not ops:
            continue
        s = stats.setdefault(name, {})

        def add(key, v, s=s):
            s.setdefault(key, []).append(v)

        add("host: call returns after", t1 - t0)
        add("call -> first GPU op starts", ops[0][0] - t0)
        add("call -> last GPU op ends", max(o[1] for o in ops) - t0)
        bus = [o for o in ops if o[2] == "gpu_memcpy" and o[4] >= 1 << 16]  # not the ids uploads
        if bus:
            add("bus copies (count)", len(bus))
            add("bus copies, sum of their times", sum(o[1] - o[0] for o in bus))
            add("bus copies, first start -> last end", bus[-1][1] - bus[0][0])
            add("bus copies, sum of gaps between them",
                sum(max(0.0, b[0] - a[1]) for a, b in zip(bus, bus[1:])))
        kernels = [o for o in ops if o[2] == "kernel"]
        for j, k in enumerate(kernels):
            before = [o[1] for o in ops if o[1] <= k[0] + 0.5 and o is not k]
            add(f"kernel {j + 1}: time", k[1] - k[0])
            if before:
                add(f"kernel {j + 1}: starts after the op before it ends", k[0] - max(before))
        if bus and kernels:
            add("last bus copy ends -> last op ends", max(o[1] for o in ops) - bus[-1][1])
    for name, s in stats.items():
        print(f"  {name} ({len(s['host: call returns after'])} calls; medians, microseconds)")
        for key, v in s.items():
            print(f"    {statistics.median(v):9.1f}  {key}")


def pieces(c, calls: int) -> None:
    from kvslots.vllm import transfer

    s = c._kernel_streams[0]
    ev = torch.cuda.Event()
    cur = torch.cuda.current_stream()
    ev.record(cur)  # its handle exists from here

    def torch_ctx():
        with torch.cuda.stream(s):
            pass

    def ours_ctx():
        with transfer._OnStream(s):
            pass

    fns = {"with torch.cuda.stream(s): pass": torch_ctx, "with _OnStream(s): pass": ours_ctx,
           "s.wait_stream(current)": lambda: s.wait_stream(cur),
           "event.record(current); s.wait_event(event)": lambda: (ev.record(cur), s.wait_event(ev))}
    drv = getattr(c, "_driver", None)
    if drv is not None:  # the same wait through the driver, on the same handles
        d, h_ev, h_s = drv._d, ev.cuda_event, s.cuda_stream
        raw = torch._C._cuda_getCurrentRawStream

        def driver_wait():
            d.record(h_ev, raw(cur.device_index))
            d.wait(h_s, h_ev)
        fns["driver: cuEventRecord(current); cuStreamWaitEvent(s)"] = driver_wait
    times = {k: [] for k in fns}
    for _ in range(calls // 10):
        torch.cuda.synchronize()
        for k, f in fns.items():
            for _ in range(10):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    for k, v in times.items():
        print(f"  {statistics.median(v) * 1e6:7.1f} us  {k}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=pathlib.Path, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--copy", default="16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--timeline-calls", type=int, default=20)
    args = p.parse_args()
    sizes = [int(x) for x in args.copy.split(",")]
    New = _block_copier()
    Base = _base_copier(args.base)
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda}")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (2, args.blocks, 16, 8, 128)
    layers = {f"layer.{i}": torch.randn(shape, generator=g, device=dev, dtype=torch.float16)
              for i in range(args.layers)}
    hosts = max(sizes)
    new, base = New(layers, args.blocks, hosts), Base(layers, args.blocks, hosts)
    print(f"{args.layers} layers {list(shape)} fp16, {new.bytes_per_block >> 10} KiB per block; fused kernel: "
          f"{'yes' if new._fused is not None else 'NO'}; direct stores up to {new._direct_max_bytes >> 20} MiB "
          f"(base {base._direct_max_bytes >> 20} MiB); CUDA driver issue path: "
          f"{'yes' if getattr(new, '_driver', None) is not None else 'NO'}")

    def sync():
        new.synchronize()
        base.synchronize()
        torch.cuda.synchronize()

    for n in sizes:
        rng = np.random.default_rng(n)
        perm = rng.permutation(args.blocks)
        dev_ids, back_ids = perm[:n], perm[n: 2 * n]
        host_ids = rng.permutation(hosts)[:n]
        total = n * new.bytes_per_block
        print(f"\n== {n} scattered blocks to / from scattered host rows = {total >> 20} MiB per copy")

        want = {k: v[:, torch.as_tensor(dev_ids, device=dev)].clone() for k, v in layers.items()}
        back_dev = torch.as_tensor(back_ids, device=dev)
        new.host[torch.as_tensor(host_ids)] = 0
        new.store(dev_ids, host_ids).wait()
        for v in layers.values():
            v[:, back_dev] = 0
        new.load(host_ids, back_ids)
        new.synchronize()
        bad = [name for name, v in layers.items() if not torch.equal(v[:, back_dev], want[name])]
        print(f"1. bytes, store then load: {'EXACT' if not bad else 'WRONG in ' + ', '.join(bad[:3])}")

        d = torch.empty(total, dtype=torch.uint8, device=dev).fill_(1)
        h = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(2)
        fns = {"plain device->host": lambda: h.copy_(d, non_blocking=True),
               "plain host->device": lambda: d.copy_(h, non_blocking=True),
               "store, base": lambda: base.store(dev_ids, host_ids),
               "store, new": lambda: new.store(dev_ids, host_ids),
               "load, base": lambda: base.load(host_ids, back_ids),
               "load, new": lambda: new.load(host_ids, back_ids)}
        plain_of = {k: "plain device->host" if k.startswith("store") else "plain host->device"
                    for k in fns if not k.startswith("plain")}
        print(f"2. A/B, {args.rounds} rounds of {args.repeats} interleaved calls")
        ab(fns, plain_of, total, args.rounds, args.repeats, sync)

        print(f"3. timeline, {args.timeline_calls} profiled calls each")
        tl = {k: fns[k] for k in ("plain host->device", "load, new", "plain device->host", "store, new",
                                  "load, base", "store, base")}
        try:
            timeline(new, tl, args.timeline_calls, sync)
        except Exception as e:  # the profiler missing CUPTI, say: the rest still runs
            print(f"  timeline failed: {type(e).__name__}: {e}")
        del d, h
    print("\n4. pieces, host time per call (median of 500)")
    pieces(new, 500)


if __name__ == "__main__":
    main()
