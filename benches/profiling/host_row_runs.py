"""Runs of adjacent host rows per load from the host tier under eviction (one bus copy per run
on the CUDA path, see docs/connector.md "Where a small copy's time goes").

A prefix_repetition-like trace through ``HostCache``: each request picks one of ``P`` prompts of
34 blocks, loads its longest cached prefix, and stores the rest in steps of up to 16 blocks.
Prints, per host-tier size and prompt count, the runs per full 34-block load (median, max).

    python benches/profiling/host_row_runs.py [--base DIR]

``--base DIR``: a directory holding another build's ``kvslots`` package (e.g. a worktree's
``python/``), measured in the same run for comparison.

On 2026-11-27, before and after rows were handed out in ascending order along a store's chain
(1024 / 512 / 2048 host blocks, 64 / 64 / 128 prompts): median 13 / 14 / 8 runs per 34-block
load before, 8 / 6 / 7 after; with no eviction (4096 blocks, 8 prompts) 1 run either way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys

CASES = ((4096, 8), (1024, 64), (512, 64), (2048, 128))


def runs(rows: list[int]) -> int:
    rows = sorted(rows)
    return (len(rows) > 0) + sum(b != a + 1 for a, b in zip(rows, rows[1:]))


def trace(num_blocks: int, prompts: int, requests: int = 2000, seed: int = 1) -> list[int]:
    from kvslots._core import HostCache

    rnd = random.Random(seed)
    cache = HostCache(num_blocks, 32)
    step = 0
    full = []
    for r in range(requests):
        p = rnd.randrange(prompts)
        hashes = [p * 1000 + i + 1 for i in range(34)]
        hit = cache.match_prefix(hashes)
        if hit:
            rows = cache.begin_load(f"r{r}", hashes[:hit])
            if hit == len(hashes):
                full.append(runs(rows))
            cache.end_load(rows)
        parent = hashes[hit - 1] if hit else None
        for i in range(hit, len(hashes), 16):
            chunk = hashes[i : i + 16]
            step += 1
            cache.begin_store_run(step, chunk, parent, [1] * (32 * len(chunk)))
            cache.complete_step(step)
            parent = chunk[-1]
    return full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="directory holding another build's kvslots package")
    ap.add_argument("--print-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.print_only:
        for n, p in CASES:
            full = trace(n, p)
            print(f"  {n:5d} host blocks, {p:3d} prompts: runs per 34-block load "
                  f"median {statistics.median(full):g}, max {max(full)} ({len(full)} loads)")
        return
    trees = [("this tree", None)] + ([("base", args.base)] if args.base else [])
    for name, path in trees:
        print(name)
        env_path = [path] if path else []
        # One process per tree: two builds of kvslots._core cannot share one.
        code = f"import sys; sys.path[:0] = {env_path!r}; sys.argv = ['x', '--print-only']; " \
               f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"
        subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    main()
