"""P/D block transfer throughput: kvslots' MooncakeTransport vs Mooncake's own batched read of
the same blocks, side by side.

A second process (this script with ``--peer``) holds a prefill worker's KV cache stand-in: one
segment per layer (target layers plus the drafter's), random bytes, registered with Mooncake.
This process pulls the same list of blocks, in the same interleaved repeat loop, with:
  (a) ``MooncakeTransport.read_blocks``: what the decode worker does (plans the batch from the
      two layouts and block ids, coalesces runs of consecutive ids, one batched read);
  (b) Mooncake raw: ``TransferEngine.batch_transfer_sync_read`` on a list of one entry per block
      per layer, built before the clock starts (Mooncake's own batched TCP throughput; the
      target: (a) >= 80% of it);
  (c) for context, a numpy copy of the same blocks inside one process.
Every read is checked byte-exact once before timing. Medians over the repeats, with the
min..max spread; GB/s = 1e9 bytes per second. Ratios are measured within one run, interleaved.

    python benches/bench_pd_transfer.py                   # the default configurations, 7 repeats
    python benches/bench_pd_transfer.py --quick           # small, to check it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("GLOG_minloglevel", "2")

from kvslots.vllm.pd import BlockLayout, MooncakeTransport  # noqa: E402

KiB = 1 << 10

# (name, layers incl. the drafter's, bytes per layer-block, blocks in the pool, blocks moved)
CONFIGS = [
    # Llama-3-8B-like on vLLM's CPU backend (8 KV heads, block_size 32, head_size 128, bf16):
    # 32 target layers + 1 EAGLE layer, a 1024-token prompt = 32 blocks.
    ("8B-like + EAGLE: 33 layers x 128 KiB, 32 blocks", 33, 128 * KiB, 40, 32),
    # A tiny model: 2 target + 1 draft layer of 16 KiB blocks, a 2048-token prompt.
    ("tiny + EAGLE: 3 layers x 16 KiB, 64 blocks", 3, 16 * KiB, 80, 64),
]
QUICK = [("quick: 3 layers x 16 KiB, 16 blocks", 3, 16 * KiB, 48, 16)]


def _peer_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def run_peer(layers: int, block_bytes: int, pool: int) -> None:
    buf = _peer_bytes(0, layers * pool * block_bytes)
    t = MooncakeTransport("127.0.0.1")
    layout = BlockLayout.from_buffer(buf.ctypes.data, block_bytes=block_bytes, num_blocks=pool, num_segments=layers)
    t.register(layout)
    print(json.dumps({"session": t.session_id, "layout": layout.to_wire()}), flush=True)
    sys.stdin.read()
    t.close()


def bench_config(name: str, layers: int, block_bytes: int, pool: int, moved: int, repeats: int,
                 consecutive: bool) -> dict[str, float]:
    peer = subprocess.Popen([sys.executable, __file__, "--peer", str(layers), str(block_bytes), str(pool)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(peer.stdout.readline())
        session, remote = info["session"], BlockLayout.from_wire(info["layout"])
        local_buf = np.zeros(layers * pool * block_bytes, dtype=np.uint8)
        t = MooncakeTransport("127.0.0.1")
        t.register(BlockLayout.from_buffer(local_buf.ctypes.data, block_bytes=block_bytes, num_blocks=pool,
                                           num_segments=layers))
        rng = np.random.default_rng(1)
        if consecutive:  # a fresh pool hands a prompt consecutive blocks on both sides
            src = np.arange(5, 5 + moved)
            dst = np.arange(pool - moved, pool)
        else:  # a long-running pool: scattered
            src = rng.choice(pool, moved, replace=False)
            dst = rng.choice(pool, moved, replace=False)
        # Mooncake raw: one entry per block per layer, lists built once, outside the clock.
        lp = [local_buf.ctypes.data + (s * pool + int(d)) * block_bytes for s in range(layers) for d in dst]
        rp = [remote.segments[s].addr + int(r) * block_bytes for s in range(layers) for r in src]
        ln = [block_bytes] * len(lp)
        eng = t.engine
        # numpy reference: the same block gather/scatter inside one process.
        ref_src = _peer_bytes(0, layers * pool * block_bytes).reshape(layers, pool, block_bytes)
        ref_dst = np.zeros_like(ref_src)

        def ours() -> None:
            t.read_blocks(session, remote, src, dst)

        def raw() -> None:
            rc = eng.batch_transfer_sync_read(session, lp, rp, ln)
            if rc != 0:
                raise RuntimeError(f"raw read failed: {rc}")

        def numpy_copy() -> None:
            ref_dst[:, dst] = ref_src[:, src]

        expect = ref_src[:, src]
        for f in (ours, raw):
            local_buf[:] = 0
            f()
            got = local_buf.reshape(layers, pool, block_bytes)[:, dst]
            assert np.array_equal(got, expect), f"{f.__name__}: bytes differ"
        fns = {"ours": ours, "raw": raw, "numpy": numpy_copy}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        t.close()
    finally:
        peer.stdin.close()
        peer.wait(30)
    nbytes = layers * moved * block_bytes
    ratios = [r / o for o, r in zip(times["ours"], times["raw"])]  # ours' throughput / raw's, per repeat
    out = {f"{k}_gbps": nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    out.update({f"{k}_gbps_min": nbytes / max(v) / 1e9 for k, v in times.items()})
    out.update({f"{k}_gbps_max": nbytes / min(v) / 1e9 for k, v in times.items()})
    out["ratio"] = statistics.median(ratios)
    out["ratio_min"], out["ratio_max"] = min(ratios), max(ratios)
    out["nbytes"] = nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="one small configuration, 7 repeats")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--peer", nargs=3, type=int, metavar=("LAYERS", "BLOCK_BYTES", "POOL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        run_peer(*args.peer)
        return
    if args.repeats < 7:
        ap.error("--repeats must be >= 7 (medians of fewer are noise on a shared machine)")
    print(f"P/D block transfer over Mooncake TCP on loopback, {args.repeats} interleaved repeats, median [min..max]")
    print(f"{'configuration':58} {'ids':11} {'ours GB/s':>20} {'raw GB/s':>20} {'numpy GB/s':>20} {'ours/raw':>18}")
    results = []
    for cfg in (QUICK if args.quick else CONFIGS):
        for consecutive in (False, True):
            r = bench_config(*cfg, repeats=args.repeats, consecutive=consecutive)
            ids = "consecutive" if consecutive else "scattered"
            results.append({"config": cfg[0], "ids": ids, **r})

            def col(k: str) -> str:
                return f"{r[k + '_gbps']:.2f} [{r[k + '_gbps_min']:.2f}..{r[k + '_gbps_max']:.2f}]"

            print(f"{cfg[0]:58} {ids:11} {col('ours'):>20} {col('raw'):>20} {col('numpy'):>20} "
                  f"{r['ratio']:.2f} [{r['ratio_min']:.2f}..{r['ratio_max']:.2f}]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
