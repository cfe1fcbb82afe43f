"""GPU time of the direct fused store (layers -> pinned host rows) by launch configuration, against
a plain pinned copy of the same bytes: is the kernel's write rate to host memory what keeps small
direct stores under the copy engine's?

    python benches/profiling/direct_kernel_configs.py [--layers 32] [--copy 16,64,1024]

CUDA events around each launch alone (no host issue time), medians of 15, configurations
interleaved. WORDS is 8-byte words per program (BlockCopier uses 1024), warps per program
Triton's num_warps (default 4).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_cuda_copy import _block_copier  # noqa: E402

CONFIGS = [(1024, 4), (1024, 8), (2048, 8), (512, 4), (4096, 16), (256, 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--copy", default="16,64,1024")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    sizes = [int(x) for x in args.copy.split(",")]
    BlockCopier = _block_copier()
    from kvslots.vllm._fused_copy import _kernel

    dev = torch.device("cuda")
    shape = (2, args.blocks, 16, 8, 128)
    layers = {f"layer.{i}": torch.randn(shape, device=dev, dtype=torch.float16) for i in range(args.layers)}
    c = BlockCopier(layers, args.blocks, max(sizes))
    f = c._fused
    assert f is not None
    base = torch.tensor([c.host.data_ptr()], dtype=torch.int64, device=dev)
    kernel = _kernel()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; {args.layers} layers, "
          f"{c.bytes_per_block >> 10} KiB per block; GPU time (CUDA events), median of {args.repeats}")
    for n in sizes:
        rng = np.random.default_rng(n)
        idx = torch.as_tensor(rng.permutation(args.blocks)[:n], device=dev)
        rows = torch.as_tensor(rng.permutation(max(sizes))[:n], device=dev)
        nbytes = n * c.bytes_per_block
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        want = {k: v[:, idx].clone() for k, v in layers.items()}

        def launch(words, warps):
            grid = (n, len(f._segments), -(-f._max_words // words))
            kernel[grid](base, f._row_words, idx, f._table(), f._words, f._offsets, rows, base,
                         TO_STAGE=True, WORDS=words, DIRECT=True, num_warps=warps)

        fns = {"plain copy": lambda: h.copy_(d, non_blocking=True)}
        for words, warps in CONFIGS:
            fns[f"direct WORDS={words} warps={warps}"] = (lambda w=words, nw=warps: launch(w, nw))
        for fn in fns.values():  # compile and warm
            fn()
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                times[k].append(e0.elapsed_time(e1) / 1e3)
        # bytes of the last launch, every config wrote the same rows
        torch.cuda.synchronize()
        ok = all(torch.equal(torch.cat([c.host_block_view(int(r))[k].unsqueeze(1) for r in rows.tolist()], 1)
                             .to(dev), want[k]) for k in list(layers)[:2])
        plain = statistics.median(times["plain copy"])
        print(f"\n== {n} blocks = {nbytes >> 20} MiB (bytes {'EXACT' if ok else 'WRONG'}, first two layers)")
        for k, v in times.items():
            m = statistics.median(v)
            print(f"  {k:28s} {m * 1e3:8.3f} ms ({min(v) * 1e3:.3f}-{max(v) * 1e3:.3f})  "
                  f"{nbytes / m / 1e9:6.1f} GB/s  {plain / m:.2f}x of the plain copy")


if __name__ == "__main__":
    main()
