"""Where a 16-block CUDA load's host time goes on the driver issue path: marks at the entry (and exit) of
the copier's steps and of each driver call, medians over 50 calls, each after a synchronize and a 1 ms sleep
(the GPU idle, as between steps). Wrapping adds about 1 us per mark. Torch only, like bench_cuda_copy.py.

    python benches/profiling/cuda_load_marks.py

Ran on a lent H200 on 2026-11-28: benches/results/cuda_driver_issue_h200.txt (call 3).
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_cuda_copy import _block_copier  # noqa: E402


def main() -> None:
    BlockCopier = _block_copier()
    dev = torch.device("cuda")
    layers = {f"layer.{i}": torch.randn(2, 1024, 16, 8, 128, device=dev, dtype=torch.float16) for i in range(32)}
    c = BlockCopier(layers, 1024, 64)
    drv = c._driver
    assert drv is not None
    rng = np.random.default_rng(0)
    back = rng.permutation(1024)[16:32]
    for label, hosts in (("scattered rows", rng.permutation(64)[:16]), ("consecutive rows", np.arange(16))):
        marks = []
        def mark(name):
            marks.append((name, time.perf_counter()))
        def wrap(obj, attr, name, both=False):
            f = getattr(obj, attr)
            @functools.wraps(f)
            def g(*a, **k):
                mark(name + " >")
                r = f(*a, **k)
                if both:
                    mark(name + " <")
                return r
            setattr(obj, attr, g)
            return f
        saved = [(c, "_check", wrap(c, "_check", "_check", True)), (c, "_copy", wrap(c, "_copy", "_copy")),
                 (drv, "copy", wrap(drv, "copy", "path.copy")), (drv, "_take_slot", wrap(drv, "_take_slot", "take_slot", True)),
                 (drv._d, "htod", wrap(drv._d, "htod", "htod")), (drv._d, "wait", wrap(drv._d, "wait", "wait")),
                 (drv._d, "record", wrap(drv._d, "record", "record")), (drv, "_scatter", wrap(drv, "_scatter", "launch", True)),
                 (drv, "_compute", wrap(drv, "_compute", "compute"))]
        rel = {}
        for rep in range(60):
            marks.clear(); torch.cuda.synchronize()
            time.sleep(0.001)
            t0 = time.perf_counter(); c.load(hosts, back); t1 = time.perf_counter()
            c.synchronize()
            if rep < 10:
                continue
            seen = {}
            for name, t in marks:
                k = seen.get(name, 0); seen[name] = k + 1
                rel.setdefault(f"{name} #{k}", []).append(t - t0)
            rel.setdefault("return", []).append(t1 - t0)
        for obj, attr, f in saved:
            setattr(obj, attr, f)
        print(f"== 16-block load, {label}: marks, median us after the call")
        for k, v in sorted(rel.items(), key=lambda kv: statistics.median(kv[1])):
            if k.endswith("#0") or k == "return" or "launch" in k:
                print(f"  {statistics.median(v) * 1e6:8.1f}  {k}")


if __name__ == "__main__":
    main()
