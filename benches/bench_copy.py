"""Block copy bandwidth: BlockCopier vs a plain memcpy of the same bytes, side by side.

For each configuration, scattered device blocks are stored into scattered host blocks
(device -> host) and loaded back (host -> device), timed against, in the same run and in the
same interleaved repeat loop:
  (a) a plain contiguous copy of the same total bytes: torch ``dst.copy_(src)`` on 1-D uint8
      tensors (the reference of the target: BlockCopier >= 80% of it); libc memcpy of the same
      bytes is shown too, for context;
  (b) naive torch indexing: ``index_select`` + ``index_copy_`` per layer segment.
Medians of the repeats; GB/s = 1e9 bytes per second. On a shared VM the absolute bandwidth can
move by 2x between runs; the ratios are measured within one run, interleaved, and are the result.

    python benches/bench_copy.py                  # CPU (vLLM's CPU backend layout)
    python benches/bench_copy.py --device cuda    # GPU: vs a pinned host<->device copy
    python benches/bench_copy.py --per-call       # the fixed cost of one copy_blocks call

``--per-call``: ``kvslots._core.copy_blocks`` of one 64-byte block between two registered
regions, torch tensors and numpy arrays, microseconds per call (what each call pays besides
its bytes: argument checks, re-reading each region's memory, holding a tensor's storage);
median and range of the repeats. Compare builds by running it against each, interleaved.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvslots.vllm.transfer import BlockCopier

KiB, MiB = 1 << 10, 1 << 20

# (name, number of blocks copied, per-layer block shape after the block dim, layers).
# bf16 [num_kv_heads, block_size, 2*head_size] as vLLM's CPU backend lays a block out.
CONFIGS = [
    ("128 KiB blocks, 1 layer", 4096, (8, 32, 256), 1),
    ("128 KiB blocks, 8 layers x 16 KiB", 4096, (2, 32, 128), 8),
    ("32 KiB blocks, 1 layer", 4096, (4, 32, 128), 1),
    # Llama-3-8B-like on vLLM's CPU backend: 32 layers, 8 KV heads, block_size 32, head_size 128
    ("4 MiB blocks, 32 layers x 128 KiB", 128, (8, 32, 256), 32),
]


def median_times(fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Runs every function once to warm up, then `repeats` rounds interleaving all of them (so
    drift on a shared machine hits every method alike); returns each one's median seconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    sync()
    for _ in range(repeats):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def naive(layers: list[torch.Tensor], host: torch.Tensor, dev_idx, host_idx, to_host: bool, as_rows: bool) -> Callable[[], None]:
    """index_select + index_copy_ per layer, the obvious torch code. ``as_rows=False``: each layer
    in its own dtype and shape (its slice of the host rows viewed as [num_host_blocks,
    *block_shape]); ``as_rows=True``: blocks viewed as rows of int64, torch's fastest case."""
    views, a = [], 0
    for t in layers:
        bb = t[0].numel() * t.element_size()
        hv = host[:, a : a + bb]
        if as_rows:
            views.append((t.reshape(-1).view(torch.int64).view(t.shape[0], -1), hv.view(torch.int64)))
        else:
            views.append((t, hv.view(t.dtype).view(host.shape[0], *t.shape[1:])))
        a += bb

    def run():
        for t, hv in views:
            if to_host:
                hv.index_copy_(0, host_idx, t.index_select(0, dev_idx).to(hv.device))
            else:
                t.index_copy_(0, dev_idx, hv.index_select(0, host_idx).to(t.device))

    return run


def bench_config(name, nblk, block_shape, nlayers, device, repeats, threads_list, naive_blocks, rng):
    n_dev = nblk + nblk // 2  # device blocks to pick from: ids are a random subset
    layers = {
        f"layer.{i}": torch.empty((n_dev, *block_shape), dtype=torch.bfloat16, device=device).normal_()
        for i in range(nlayers)
    }
    segs = [t.reshape(-1).view(torch.uint8).view(n_dev, -1) for t in layers.values()]
    dev_ids = rng.permutation(n_dev)[:nblk]
    host_ids = rng.permutation(nblk)
    back_ids = rng.permutation(n_dev)[:nblk]

    copiers = {}
    if device == "cpu":
        for th in threads_list:
            copiers[f"BlockCopier threads={th}"] = BlockCopier(layers, n_dev, nblk, threads=th)
    else:
        copiers["BlockCopier (side stream)"] = BlockCopier(layers, n_dev, nblk)
    first = next(iter(copiers.values()))
    total = nblk * first.bytes_per_block
    host = torch.empty_like(first.host)
    host.fill_(0)

    # (a) the same bytes, contiguous. On CUDA: pinned host <-> device.
    if device == "cpu":
        a = torch.empty(total, dtype=torch.uint8).fill_(1)
        b = torch.empty(total, dtype=torch.uint8).fill_(2)
        base = {"memcpy: torch copy_": (lambda: b.copy_(a), lambda: a.copy_(b))}
        base["memcpy: libc"] = (
            lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), total),
            lambda: ctypes.memmove(a.data_ptr(), b.data_ptr(), total),
        )
        sync = lambda: None  # noqa: E731
    else:
        d = torch.empty(total, dtype=torch.uint8, device=device).fill_(1)
        h = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(2)
        base = {"pinned copy: torch copy_": (lambda: h.copy_(d, non_blocking=True), lambda: d.copy_(h, non_blocking=True))}
        sync = torch.cuda.synchronize

    results = {}
    naive_fns: dict[str, dict] = {"device->host": {}, "host->device": {}}
    for direction, to_host in (("device->host", True), ("host->device", False)):
        fns = {k: (v[0] if to_host else v[1]) for k, v in base.items()}
        for k, c in copiers.items():
            fns[k] = (lambda c=c: c.store(dev_ids, host_ids)) if to_host else (lambda c=c: c.load(host_ids, back_ids))
        # Naive indexing is 10-100x slower: timed on the first blocks only (a rate in GB/s of its
        # own bytes, at least 64 MiB so that it does not run from cache), so the run stays short.
        k = min(nblk, max(naive_blocks, -(-64 * MiB // first.bytes_per_block)))  # >= 64 MiB: out of cache
        nd = torch.as_tensor((dev_ids if to_host else back_ids)[:k], device=device)
        nh = torch.as_tensor(host_ids[:k])
        for label, rows in (("dtype", False), ("int64 rows", True)):
            f = naive(list(layers.values()), host, nd, nh, to_host, rows)
            naive_fns[direction][f"naive index_select+index_copy_ ({label}, {k} blocks)"] = (f, k / nblk)
        results[direction] = median_times(fns, repeats, sync)
        for key, (f, frac) in naive_fns[direction].items():
            results[direction][key] = median_times({key: f}, min(repeats, 3), sync)[key] / frac

    # The copies must be right, not just fast: compare with plain torch indexing.
    c = first
    c.store(dev_ids, host_ids)
    c.synchronize()
    h = c.host.cpu()
    sample = rng.choice(nblk, size=min(64, nblk), replace=False)
    want = torch.cat([s[torch.as_tensor(dev_ids[sample], device=device)].cpu() for s in segs], dim=1)
    assert torch.equal(h[torch.as_tensor(host_ids[sample])], want), f"{name}: wrong bytes stored"
    for s in segs:
        s.zero_()
    c.load(host_ids, back_ids)
    c.synchronize()
    got = torch.cat([s[torch.as_tensor(back_ids[sample], device=device)].cpu() for s in segs], dim=1)
    assert torch.equal(got, want), f"{name}: wrong bytes loaded"
    return total, first.num_segments, results


def per_call(repeats: int, calls: int = 20000) -> None:
    from kvslots import _core

    n = 1 << 16
    for kind, make in (("torch", lambda v: torch.full((n,), v, dtype=torch.uint8)),
                       ("numpy", lambda v: np.full(n, v, dtype=np.uint8))):
        rs = _core.BlockRegion(make(1), block_bytes=64, num_blocks=n // 64)
        rd = _core.BlockRegion(make(0), block_bytes=64, num_blocks=n // 64)
        ids = [3]
        f = _core.copy_blocks
        for _ in range(calls // 10):
            f(rs, rd, ids, ids)
        res = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                f(rs, rd, ids, ids)
            res.append((time.perf_counter() - t0) / calls * 1e6)
        print(f"copy_blocks per call, {kind} regions: {statistics.median(res):.2f} us "
              f"(median of {repeats}; {min(res):.2f} to {max(res):.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", default="1,2", help="BlockCopier threads to compare (CPU)")
    p.add_argument("--naive-blocks", type=int, default=256, help="blocks the naive indexing copies")
    p.add_argument("--configs", default="all", help="comma-separated config indexes, or 'all'")
    p.add_argument("--per-call", action="store_true", help="only the fixed cost of one copy_blocks call")
    args = p.parse_args()
    if args.per_call:
        per_call(args.repeats)
        return
    threads_list = [int(t) for t in args.threads.split(",")]
    configs = CONFIGS if args.configs == "all" else [CONFIGS[int(i)] for i in args.configs.split(",")]
    rng = np.random.default_rng(0)

    print(f"torch {torch.__version__}, device {args.device}, torch threads {torch.get_num_threads()}, "
          f"repeats {args.repeats} (median), scattered block ids")
    ref_key = "memcpy: torch copy_" if args.device == "cpu" else "pinned copy: torch copy_"
    for name, nblk, shape, nlayers in configs:
        total, nseg, results = bench_config(name, nblk, shape, nlayers, args.device, args.repeats, threads_list, args.naive_blocks, rng)
        print(f"\n== {name}: {nblk} blocks, {nseg} segment(s), {total / MiB:.0f} MiB per copy")
        for direction, times in results.items():
            ref = times[ref_key]
            libc = times.get("memcpy: libc")
            for k, t in times.items():
                gbs = total / t / 1e9
                extra = f"   {libc / t:5.2f}x libc memcpy" if libc else ""
                print(f"  {direction:13s} {k:54s} {gbs:6.2f} GB/s   {ref / t:5.2f}x {ref_key}{extra}")


if __name__ == "__main__":
    main()
