"""The CUDA copy path of the KVSlotsConnector's BlockCopier, torch only (no vLLM needed): a pinned
host pool, a side stream and events, on vLLM's CUDA flash-attention block layout
([2, num_blocks, block_size, num_kv_heads, head_size] per layer, K and V segments).

Three checks, printed with their figures:
  1. bytes: scattered device blocks stored to scattered host blocks and loaded back into other
     device blocks are byte-exact (every copied block of every segment compared on the GPU);
  2. bandwidth: BlockCopier store / load of those blocks against a plain pinned <-> device copy
     of the same bytes (torch ``copy_(non_blocking=True)``), interleaved repeats, medians;
     target >= 80% of the plain copy;
  3. overlap: a load on the side stream while the default stream runs matmuls: the wall time
     of both together against each alone (overlapped = close to the longer of the two), with
     BlockCopier's side stream at default priority and, as a variant, at high priority.

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


def median_times(fns, repeats):
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
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

    # 2. bandwidth
    d = torch.empty(total, dtype=torch.uint8, device=dev).fill_(1)
    h = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(2)
    for direction, ours, plain in (
        ("device->host", lambda: c.store(dev_ids, host_ids), lambda: h.copy_(d, non_blocking=True)),
        ("host->device", lambda: c.load(host_ids, back_ids), lambda: d.copy_(h, non_blocking=True)),
    ):
        r = median_times({"BlockCopier": ours, "plain pinned copy": plain}, args.repeats)
        gbs = {k: total / v[0] / 1e9 for k, v in r.items()}
        spread = {k: f"{total / v[2] / 1e9:.1f}-{total / v[1] / 1e9:.1f}" for k, v in r.items()}
        print(f"2. {direction}: BlockCopier {gbs['BlockCopier']:.1f} GB/s ({spread['BlockCopier']}), plain pinned copy "
              f"{gbs['plain pinned copy']:.1f} GB/s ({spread['plain pinned copy']}): "
              f"{gbs['BlockCopier'] / gbs['plain pinned copy']:.2f}x (target >= 0.80)")

    # 3. overlap: loads on the side stream while the default stream computes
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

    def load():
        c.load(host_ids, back_ids)

    def both():
        c.load(host_ids, back_ids)  # queued on the side stream, returns at once
        compute()

    # The load's scatter kernels wait behind the matmuls for SMs; a high-priority side stream lets
    # their thread blocks go first. Measured here as a variant before it becomes the default.
    streams = {"default-priority stream": c._stream,
               "high-priority stream": torch.cuda.Stream(dev, priority=-1)}  # negative: higher

    def on(stream, fn):
        def run():
            c._stream = stream
            fn()
        return run

    fns = {}
    for name, s in streams.items():
        fns[f"load, {name}"] = on(s, load)
        fns[f"both, {name}"] = on(s, both)
    fns["compute"] = compute
    r = median_times(fns, args.repeats)
    tc = r["compute"][0]
    for name in streams:
        tl, tb = r[f"load, {name}"][0], r[f"both, {name}"][0]
        hidden = (tc + tl - tb) / min(tc, tl)
        print(f"3. overlap, {name}: compute alone {tc * 1e3:.1f} ms ({n_mm} fp16 8192^2 matmuls), load alone "
              f"{tl * 1e3:.1f} ms, both {tb * 1e3:.1f} ms (serial would be {(tc + tl) * 1e3:.1f}): "
              f"{hidden:.0%} of the shorter one hidden")
    c.synchronize()
    c._stream = streams["default-priority stream"]
    ok = all(torch.equal(v[:, torch.as_tensor(back_ids, device=dev)], ref[k]) for k, v in layers.items())
    print(f"   bytes after the overlapped loads: {'EXACT' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
