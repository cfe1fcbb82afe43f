"""The CUDA copy path of the KVSlotsConnector's BlockCopier, torch only (no vLLM needed): a pinned
host pool, a side stream and events, on vLLM's CUDA flash-attention block layout
([2, num_blocks, block_size, num_kv_heads, head_size] per layer, K and V segments).

Four checks, printed with their figures:
  1. bytes: scattered device blocks stored to scattered host blocks and loaded back into other
     device blocks are byte-exact (every copied block of every segment compared on the GPU);
  2. bandwidth: BlockCopier store / load of those blocks against a plain pinned <-> device copy
     of the same bytes (torch ``copy_(non_blocking=True)``), interleaved repeats, medians;
     target >= 80% of the plain copy (also staged with one run of host rows: one bus copy);
  3. overlap: a load on the side streams while the default stream runs matmuls: the wall time
     of both together against each alone (overlapped = close to the longer of the two).
  4. fence: a load and then a forward stand-in (per layer: a few small kernels, launch-bound as
     an eager forward is) queued after ``synchronize()`` (the host waits for the load) against
     after ``fence()`` (the compute stream waits on the device): wall time until both are done.
Sections 1-3 run two variants side by side for each copy size: staged (the fused Triton kernel
gathers / scatters through the staging buffers, bus copies per run of host blocks) and direct
(one fused launch straight between the layers and the pinned host region); BlockCopier stores
directly up to ``DIRECT_MAX_BYTES`` and always loads staged (the direct variant's loads call its
private direct path).

    python benches/bench_cuda_copy.py [--layers 32] [--blocks 4096] [--copy 16,64,256,1024] [--repeats 9]

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
    p.add_argument("--copy", default="16,64,256,1024", help="blocks copied per store / load (comma-separated sizes)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    sizes = [int(x) for x in args.copy.split(",")]
    BlockCopier = _block_copier()
    from kvslots.vllm import transfer

    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda}")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (2, args.blocks, args.block_size, args.kv_heads, args.head_size)
    layers = {f"layer.{i}": torch.randn(shape, generator=g, device=dev, dtype=torch.float16)
              for i in range(args.layers)}
    c = BlockCopier(layers, args.blocks, 2 * max(sizes))  # the second half: the consecutive-row variant
    assert c.host.is_pinned(), "the host pool is pinned"
    default_direct = c._direct_max_bytes
    print(f"{args.layers} layers {list(shape)} fp16, {c.num_segments} segments, {c.bytes_per_block / 1024:.0f} KiB "
          f"per block; fused kernel: {'yes' if c._fused is not None else 'NO'}; direct stores up to "
          f"{default_direct / 2**20:.0f} MiB (DIRECT_MAX_BYTES {transfer.DIRECT_MAX_BYTES / 2**20:.0f} MiB)")
    drv = c._driver  # the CUDA driver issue path; the torch-issue variants turn it off
    print(f"CUDA driver issue path: {'yes, copies of up to %d blocks' % drv.max_ids if drv is not None else 'NO'}")
    variants = {"staged": -1}
    if default_direct > 0:
        variants["direct"] = 1 << 62
    else:
        print("direct copies unavailable here: staged only")

    def using(limit, fn, driver=True):
        def run():
            c._direct_max_bytes = limit
            c._driver = drv if driver else None
            return fn()
        return run

    def store_fn(name, dev_ids, host_ids):
        return using(variants[name], lambda: c.store(dev_ids, host_ids))

    def load_fn(name, host_ids, dev_ids):
        if name == "direct":  # BlockCopier never loads directly: its private path, for the record
            return lambda: c._copy_direct(*c._check(dev_ids, host_ids, to_host=False), False,
                                          len(dev_ids) * c.bytes_per_block)
        return using(variants[name], lambda: c.load(host_ids, dev_ids))

    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    for _ in range(3):
        a @ a  # cuBLAS set-up out of the timing
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    one_mm = time.perf_counter() - t0

    for n in sizes:
        rng = np.random.default_rng(n)
        perm = rng.permutation(args.blocks)  # loads never write a block that stores read
        dev_ids, back_ids = perm[:n], perm[n : 2 * n]
        host_ids = rng.permutation(max(sizes))[:n]
        run_ids = np.arange(max(sizes), max(sizes) + n)  # one run of host rows: one bus copy per chunk
        total = n * c.bytes_per_block
        print(f"\n== {n} scattered blocks = {total / 2**20:.0f} MiB per copy "
              f"(default: stores {'direct' if total <= default_direct else 'staged'}, loads staged)")
        back_dev = torch.as_tensor(back_ids, device=dev)

        # 1. bytes, each variant: store, wipe the targets, load back elsewhere
        want = {k: v[:, torch.as_tensor(dev_ids, device=dev)].clone() for k, v in layers.items()}
        for name in variants:
            c.host[torch.as_tensor(host_ids)] = 0
            store_fn(name, dev_ids, host_ids)().wait()
            for v in layers.values():
                v[:, back_dev] = 0
            load_fn(name, host_ids, back_ids)()
            c.synchronize()
            bad = [k for k, v in layers.items() if not torch.equal(v[:, back_dev], want[k])]
            print(f"1. bytes, {name}: {n} blocks x {c.num_segments} segments stored and loaded back: "
                  f"{'EXACT' if not bad else 'WRONG in ' + ', '.join(bad[:3])}")

        # 2. bandwidth against plain pinned copies of the same bytes, interleaved
        d = torch.empty(total, dtype=torch.uint8, device=dev).fill_(1)
        h = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(2)
        fns = {"plain device->host": lambda: h.copy_(d, non_blocking=True),
               "plain host->device": lambda: d.copy_(h, non_blocking=True)}
        for name in variants:
            fns[f"store, {name}"] = store_fn(name, dev_ids, host_ids)
            fns[f"load, {name}"] = load_fn(name, host_ids, back_ids)
        fns["store, staged, consecutive host rows"] = using(-1, lambda: c.store(dev_ids, run_ids))
        fns["load, staged, consecutive host rows"] = using(-1, lambda: c.load(run_ids, back_ids))
        if drv is not None:  # the same copies issued through torch (the path before the driver's)
            fns["store, default, torch issue"] = using(default_direct, lambda: c.store(dev_ids, host_ids), False)
            fns["load, staged, torch issue"] = using(-1, lambda: c.load(host_ids, back_ids), False)
        r = median_times(fns, args.repeats, sync=c.synchronize)
        c._driver = drv
        if drv is not None:
            for direction, key, plain in (("device->host", "store, default", "plain device->host"),
                                          ("host->device", "load, staged", "plain host->device")):
                ours, p_ = r[f"{key}, torch issue"], r[plain]
                print(f"2. {direction}, {key.split(', ')[1]}, torch issue: BlockCopier {total / ours[0] / 1e9:.1f} GB/s "
                      f"({total / ours[2] / 1e9:.1f}-{total / ours[1] / 1e9:.1f}): {p_[0] / ours[0]:.2f}x "
                      f"of the plain copy")
        for name in [*variants, "staged, consecutive host rows"]:
            for direction, key in (("device->host", "store"), ("host->device", "load")):
                ours, plain = r[f"{key}, {name}"], r[f"plain {direction}"]
                print(f"2. {direction}, {name}: BlockCopier {total / ours[0] / 1e9:.1f} GB/s "
                      f"({total / ours[2] / 1e9:.1f}-{total / ours[1] / 1e9:.1f}), plain pinned copy "
                      f"{total / plain[0] / 1e9:.1f} GB/s ({total / plain[2] / 1e9:.1f}-{total / plain[1] / 1e9:.1f}): "
                      f"{plain[0] / ours[0]:.2f}x (target >= 0.80)")
        del d, h

        # 3. overlap: a load on the side stream while the default stream runs matmuls about as long
        c._direct_max_bytes = -1
        t0 = time.perf_counter()
        c.load(host_ids, back_ids)
        c.synchronize()
        n_mm = max(1, round((time.perf_counter() - t0) / one_mm))

        def compute():
            for _ in range(n_mm):
                a @ a

        issue = {}

        def both(name):
            load = load_fn(name, host_ids, back_ids)

            def run():
                t = time.perf_counter()
                load()
                issue.setdefault(name, []).append(time.perf_counter() - t)
                compute()
            return run

        fns = {"compute": compute}
        for name in variants:
            fns[f"load, {name}"] = load_fn(name, host_ids, back_ids)
            fns[f"both, {name}"] = both(name)
        r = median_times(fns, args.repeats, sync=c.synchronize)
        tc = r["compute"][0]
        for name in variants:
            tl, tb = r[f"load, {name}"][0], r[f"both, {name}"][0]
            lo_b, hi_b = r[f"both, {name}"][1], r[f"both, {name}"][2]
            hidden = (tc + tl - tb) / min(tc, tl)
            ti = statistics.median(issue[name])
            print(f"3. overlap, {name}: compute alone {tc * 1e3:.2f} ms ({n_mm} fp16 8192^2 matmuls), load alone "
                  f"{tl * 1e3:.2f} ms, both {tb * 1e3:.2f} ms ({lo_b * 1e3:.2f}-{hi_b * 1e3:.2f}; serial would be "
                  f"{(tc + tl) * 1e3:.2f}): {hidden:.0%} of the shorter one hidden; load() returned after "
                  f"{ti * 1e3:.3f} ms (median)")
        c.synchronize()
        for name in variants:  # bytes after the overlapped loads, each variant
            for v in layers.values():
                v[:, back_dev] = 0
            load_fn(name, host_ids, back_ids)()
            compute()
            c.synchronize()
            ok = all(torch.equal(v[:, back_dev], want[k]) for k, v in layers.items())
            print(f"   bytes after a load beside matmuls, {name}: {'EXACT' if ok else 'WRONG'}")

        # 4. the forward queued after the load: host waits (synchronize) or the stream does (fence)
        c._direct_max_bytes = default_direct
        xs = [torch.randn(64, 4096, device=dev, dtype=torch.float16) for _ in range(2)]
        ws = [torch.randn(4096, 4096, device=dev, dtype=torch.float16) for _ in range(args.layers)]

        def forward():
            x = xs[0]
            for w in ws:  # per layer: a few small kernels, as an eager decode / short prefill
                y = torch.nn.functional.silu(x @ w)
                x = (y + x) * 0.5
            return x

        def load_then(wait):
            def run():
                c.load(host_ids, back_ids)
                wait()
                forward()
            return run

        fns = {"forward alone": forward, "load alone": lambda: c.load(host_ids, back_ids),
               "load, synchronize, forward": load_then(c.synchronize),
               "load, fence, forward": load_then(c.fence)}
        r = median_times(fns, args.repeats, sync=c.synchronize)
        f = {k: f"{v[0] * 1e3:.2f} ms ({v[1] * 1e3:.2f}-{v[2] * 1e3:.2f})" for k, v in r.items()}
        print("4. " + "; ".join(f"{k} {v}" for k, v in f.items()) +
              f"; fence / synchronize {r['load, fence, forward'][0] / r['load, synchronize, forward'][0]:.2f}x")
        c.synchronize()


if __name__ == "__main__":
    main()
