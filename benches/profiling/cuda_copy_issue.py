"""Where the host time of a small CUDA copy goes: BlockCopier's issue path, piece by piece.

A copy of a few blocks is bound by the time the calling thread takes to queue it, not by the
bus (benches/bench_cuda_copy.py prints ``load() returned after``). This times each step the
path takes, alone, as the median of many calls (the GPU drained between batches), then
cProfile's view of whole ``store`` / ``load`` calls.

    python benches/profiling/cuda_copy_issue.py [--layers 32] [--copy 16] [--calls 200]

Ran on a lent H200 and H100 on 2026-11-27: benches/results/cuda_copy_issue_{h200,h100}.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_cuda_copy import _block_copier  # noqa: E402


def per_call(fn, calls: int, sync) -> float:
    """Median host time of one ``fn()`` call, in microseconds (batches of 10, drained between)."""
    times = []
    for _ in range(calls // 10):
        sync()
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


def enter_and_leave(stream) -> None:
    with torch.cuda.stream(stream):
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--copy", type=int, default=16)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    BlockCopier = _block_copier()
    dev = torch.device("cuda")
    shape = (2, args.blocks, 16, 8, 128)
    layers = {f"layer.{i}": torch.zeros(shape, device=dev, dtype=torch.float16) for i in range(args.layers)}
    c = BlockCopier(layers, args.blocks, 4 * args.copy)
    n = args.copy
    rng = np.random.default_rng(0)
    dev_ids = rng.permutation(args.blocks)[:n]
    host_ids = rng.permutation(4 * n)[:n]
    sync = c.synchronize
    s = c._kernel_streams[0]
    stage = torch.empty((c._chunk, c.bytes_per_block), dtype=torch.uint8, device=dev)
    idx = torch.as_tensor(dev_ids, device=dev)
    row = c.host[0:1]
    ev = torch.cuda.Event()
    limit = c._direct_max_bytes
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; {args.layers} layers, {n} blocks of "
          f"{c.bytes_per_block >> 10} KiB; host time per call, median of {args.calls}, microseconds")

    def staged(fn):
        def run():
            c._direct_max_bytes = -1
            fn()
            c._direct_max_bytes = limit
        return run

    pieces = {
        "store(), staged": staged(lambda: c.store(dev_ids, host_ids)),
        "load(), staged": staged(lambda: c.load(host_ids, dev_ids)),
        "store(), direct": lambda: c.store(dev_ids, host_ids),
        "_check (ids, bounds, duplicates)": lambda: c._check(dev_ids, host_ids, to_host=False),
        "ids: from_numpy + pin_memory + upload": lambda: torch.from_numpy(dev_ids).pin_memory().to(
            dev, non_blocking=True),
        "one bus copy (2-D slices + copy_ non_blocking)": lambda: stage[0:1].copy_(row, non_blocking=True),
        "fused kernel launch (staged)": lambda: c._fused.move(stage[:n], idx, to_stage=True),
        "fused kernel: address table check": lambda: c._fused._table(),
        "stream.wait_stream": lambda: s.wait_stream(torch.cuda.current_stream()),
        "event record + stream wait_event": lambda: (ev.record(s), s.wait_event(ev)),
        "with torch.cuda.stream(s): pass": lambda: enter_and_leave(s),
        "torch.cuda.Event()": torch.cuda.Event,
    }
    for name, fn in pieces.items():
        fn()
        sync()
        print(f"{per_call(fn, args.calls, sync):9.1f}  {name}")
    torch.cuda.synchronize()

    for name, fn in (("load(), staged", pieces["load(), staged"]), ("store(), direct", pieces["store(), direct"])):
        prof = cProfile.Profile()
        for _ in range(args.calls // 10):
            sync()
            prof.enable()
            for _ in range(10):
                fn()
            prof.disable()
        sync()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        text = out.getvalue()
        print(f"\n== cProfile, {args.calls} x {name}, by own time\n" + text[text.find("   ncalls"):].rstrip())


if __name__ == "__main__":
    main()
