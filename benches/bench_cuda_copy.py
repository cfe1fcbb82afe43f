"""The CUDA copy path of the KVSlotsConnector's BlockCopier, torch only (no vLLM needed): a pinned
host pool, a side stream and events, on vLLM's CUDA flash-attention block layout
([2, num_blocks, block_size, num_kv_heads, head_size] per layer, K and V segments).

Three checks, printed with their figures:
  1. bytes: scattered device blocks stored to scattered host blocks and loaded back into other
     device blocks are byte-exact (every copied block of every segment compared on the GPU);
  2. bandwidth: BlockCopier store / load of those blocks against a plain pinned <-> device copy
     of the same bytes (torch ``copy_(non_blocking=True)``), interleaved repeats, medians;
     target >= 80% of the plain copy;
  3. overlap: a load on the side streams while the default stream runs matmuls: the wall time
     of both together against each alone (overlapped = close to the longer of the two).
Sections 2 and 3 run three variants side by side: per-layer torch gather / scatter kernels on
the bus-copy stream (one stream, the path before 2026-11-27), the same kernels spread over four
high-priority streams, and BlockCopier's fused Triton kernel on one high-priority stream (its
default where Triton is installed).

    python benches/bench_cuda_copy.py [--layers 32] [--blocks 4096] [--copy 1024] [--repeats 9]

Runs where kvslots' package cannot be imported whole (a GPU machine with torch only): it loads
``kvslots._core`` and ``kvslots.vllm.transfer`` without the package's ``__init__`` modules.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
import types

import numpy as np
import torch


def _block_copier():
    try:
        from kvslots.vllm.transfer import BlockCopier

        return BlockCopier
    except ImportError:
        pass
    root = pathlib.Path(__file__).resolve().parents[1] / "python" / "kvslots"
    for name, path in (("kvslots", root), ("kvslots.vllm", root / "vllm")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
    from kvslots.vllm.transfer import BlockCopier

    return BlockCopier


def median_times(fns, repeats, sync):
    """Median, min and max wall time of each function, interleaved; ``sync`` waits for the
    copier's side streams too (``torch.cuda.synchronize`` alone would as well, device-wide)."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            sync()
            torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096, help="device blocks per layer")
    p.add_argument("--copy", type=int, default=1024, help="blocks copied per store / load")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--staging-mib", type=int, default=None, help="BlockCopier's staging buffer (default: its own)")
    args = p.parse_args()
    BlockCopier = _block_copier()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda}")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (2, args.blocks, args.block_size, args.kv_heads, args.head_size)
    layers = {f"layer.{i}": torch.randn(shape, generator=g, device=dev, dtype=torch.float16)
              for i in range(args.layers)}
    kw = {} if args.staging_mib is None else {"staging_bytes": args.staging_mib << 20}
    c = BlockCopier(layers, args.blocks, args.copy, **kw)
    assert c.host.is_pinned(), "the host pool is pinned"
    rng = np.random.default_rng(0)
    dev_ids = rng.permutation(args.blocks)[: args.copy]
    host_ids = rng.permutation(args.copy)
    back_ids = rng.permutation(args.blocks)[: args.copy]
    total = args.copy * c.bytes_per_block
    print(f"staging buffer: {'default' if args.staging_mib is None else str(args.staging_mib) + ' MiB'}")
    print(f"{args.layers} layers {list(shape)} fp16, {c.num_segments} segments, "
          f"{c.bytes_per_block / 1024:.0f} KiB per block, {args.copy} scattered blocks = {total / 2**20:.0f} MiB per copy")

    # 1. bytes
    want = {k: v[:, torch.as_tensor(dev_ids, device=dev)].clone() for k, v in layers.items()}
    c.store(dev_ids, host_ids).wait()
    for v in layers.values():
        v.zero_()
    c.load(host_ids, back_ids)
    c.synchronize()
    bad = [k for k, v in layers.items() if not torch.equal(v[:, torch.as_tensor(back_ids, device=dev)], want[k])]
    untouched = torch.ones(args.blocks, dtype=torch.bool)
    untouched[torch.as_tensor(back_ids)] = False
    idx = torch.nonzero(untouched).flatten().to(dev)
    stray = [k for k, v in layers.items() if bool(v[:, idx].any())]
    print(f"1. bytes: {args.copy} blocks x {c.num_segments} segments stored and loaded back: "
          f"{'EXACT' if not bad else 'WRONG in ' + ', '.join(bad)}; blocks outside the load untouched: "
          f"{'yes' if not stray else 'NO: ' + ', '.join(stray)}")

    # 2 and 3. Three ways to run the copies, interleaved in one set of repeats: per-layer torch
    # kernels on the bus-copy stream (one stream, as before 2026-11-27), per-layer torch kernels
    # spread over KERNEL_STREAMS high-priority streams, and one fused Triton kernel per chunk on
    # one high-priority stream (BlockCopier's default where Triton is installed). Each variant
    # keeps its own events.
    from kvslots.vllm import transfer

    def kernel_state(streams, fused):
        return streams, [[torch.cuda.Event() for _ in streams] for _ in c._staging], fused

    fused = c._fused
    default = (c._kernel_streams, c._kernels_done, fused)
    per_layer = [torch.cuda.Stream(dev, priority=-100) for _ in range(transfer.KERNEL_STREAMS)]
    variants = {
        "one stream": kernel_state([c._stream], None),
        f"per-layer kernels on {len(per_layer)} side streams": kernel_state(per_layer, None),
    }
    if fused is not None:
        variants["fused kernel on 1 side stream"] = default
    else:
        print("Triton is not installed: no fused-kernel variant")

    def using(state, fn):
        def run():
            c._kernel_streams, c._kernels_done, c._fused = state
            fn()
        return run

    d = torch.empty(total, dtype=torch.uint8, device=dev).fill_(1)
    h = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(2)
    fns = {"plain device->host": lambda: h.copy_(d, non_blocking=True),
           "plain host->device": lambda: d.copy_(h, non_blocking=True)}
    for name, s in variants.items():
        fns[f"store, {name}"] = using(s, lambda: c.store(dev_ids, host_ids))
        fns[f"load, {name}"] = using(s, lambda: c.load(host_ids, back_ids))
    r = median_times(fns, args.repeats, sync=c.synchronize)
    for name in variants:
        for direction, key in (("device->host", "store"), ("host->device", "load")):
            ours, plain = r[f"{key}, {name}"], r[f"plain {direction}"]
            print(f"2. {direction}, {name}: BlockCopier {total / ours[0] / 1e9:.1f} GB/s "
                  f"({total / ours[2] / 1e9:.1f}-{total / ours[1] / 1e9:.1f}), plain pinned copy "
                  f"{total / plain[0] / 1e9:.1f} GB/s ({total / plain[2] / 1e9:.1f}-{total / plain[1] / 1e9:.1f}): "
                  f"{plain[0] / ours[0]:.2f}x (target >= 0.80)")

    # 3. overlap: loads on the side streams while the default stream computes
    c._kernel_streams, c._kernels_done, c._fused = default
    c.load(host_ids, back_ids)
    c.synchronize()
    ref = {k: v[:, torch.as_tensor(back_ids, device=dev)].clone() for k, v in layers.items()}
    for v in layers.values():
        v[:, torch.as_tensor(back_ids, device=dev)] = 0
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    for _ in range(3):
        a @ a  # cuBLAS set-up out of the timing
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    c.load(host_ids, back_ids)
    c.synchronize()
    n_mm = max(1, round((time.perf_counter() - t0) / one))  # compute about as long as a load

    def compute():
        for _ in range(n_mm):
            a @ a

    issue = {}

    def both(name):
        def run():
            t = time.perf_counter()
            c.load(host_ids, back_ids)  # queued on the side streams
            issue.setdefault(name, []).append(time.perf_counter() - t)
            compute()
        return run

    fns = {"compute": compute}
    for name, s in variants.items():
        fns[f"load, {name}"] = using(s, lambda: c.load(host_ids, back_ids))
        fns[f"both, {name}"] = using(s, both(name))
    r = median_times(fns, args.repeats, sync=c.synchronize)
    tc = r["compute"][0]
    for name in variants:
        tl, tb = r[f"load, {name}"][0], r[f"both, {name}"][0]
        lo_b, hi_b = r[f"both, {name}"][1], r[f"both, {name}"][2]
        hidden = (tc + tl - tb) / min(tc, tl)
        ti = statistics.median(issue[name])
        # The matmuls are queued only once load() returns, so both together take at least
        # max(load, issue + compute) however well the GPU overlaps them.
        bound = max(tl, ti + tc)
        print(f"3. overlap, {name}: compute alone {tc * 1e3:.1f} ms ({n_mm} fp16 8192^2 matmuls), load alone "
              f"{tl * 1e3:.1f} ms, both {tb * 1e3:.1f} ms ({lo_b * 1e3:.1f}-{hi_b * 1e3:.1f}; serial would be "
              f"{(tc + tl) * 1e3:.1f}): {hidden:.0%} of the shorter one hidden; load() returned after "
              f"{ti * 1e3:.2f} ms (median), so fully overlapped would take {bound * 1e3:.1f} ms: both took "
              f"{tb / bound:.2f}x that")
    c.synchronize()
    c._kernel_streams, c._kernels_done, c._fused = default
    ok = all(torch.equal(v[:, torch.as_tensor(back_ids, device=dev)], ref[k]) for k, v in layers.items())
    print(f"   bytes after the overlapped loads: {'EXACT' if ok else 'WRONG'}")

if __name__ == "__main__":
    main()
