"""Disk tier: block writes and reads vs a plain sequential file copy, and the time to first token
of a repeated 2k-token prompt served from disk vs recomputed (host tier beside it).

    python benches/bench_disk.py io   [--dir DIR] [--block-kib 1024] [--blocks 128] [--repeats 7]
    python benches/bench_disk.py ttft [--dir DIR] [--prompt 2048] [--repeats 7]

io: in each interleaved repeat, (a) the disk tier writes N whole blocks through its background
writer (``DiskStore.submit`` then ``flush``, which ends with fdatasync) and reads them back
(``read_into``, 16 blocks a call, checksums verified), (b) a plain sequential copy of the same
bytes: one file written in 8 MiB chunks then fdatasync, and read back in 8 MiB chunks. Ratios
are kvslots / plain per repeat. The page cache is not dropped (no root here): reads come from
memory for both, which the ratio compares like for like.

ttft: one vLLM engine on CPU (tiny random-weight Llama, block size 32, the KVSlotsConnector with a
160-block host tier and a disk tier). Each repeat uses fresh random prompts: recompute (a prompt
never seen), host (a prompt computed, the device prefix cache reset), disk (a prompt computed,
then pushed out of the host tier by three others, the device cache reset). TTFT =
``generate`` with ``max_tokens=1``. Median and min-max of the repeats; ratios against recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

# numpy's OpenBLAS worker threads took ~6% of this process's samples spinning in
# blas_thread_server (perf), on a 2-core machine where the tier's writer and reader threads need
# the second core: one BLAS thread, set before numpy loads it (nothing here uses BLAS).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

MiB = 1 << 20


def summary(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3g} (min {min(xs):.3g}, max {max(xs):.3g})"


def drop_pages(path: str) -> None:
    """Evicts the file's pages from the page cache, so the next read comes from the device.
    POSIX_FADV_DONTNEED drops clean pages of a file one may open, no root needed (both files were
    written and fdatasync'ed, so their pages are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_io(args: argparse.Namespace) -> None:
    from kvslots._core import DiskStore

    bpb = args.block_kib * 1024
    n = args.blocks
    d = args.dir or tempfile.mkdtemp(prefix="kvslots-bench-disk-")
    os.makedirs(d, exist_ok=True)
    store = DiskStore(os.path.join(d, "tier.kvs"), num_slots=n, block_size=32, num_layers=1, bytes_per_block=bpb,
                      dtype="uint8", fingerprint=1, queue_len=n)
    data = np.random.default_rng(0).integers(0, 256, (n, bpb), dtype=np.uint8)
    out = np.empty((16, bpb), np.uint8)
    plain = os.path.join(d, "plain.bin")
    total = n * bpb
    res: dict[str, list[float]] = {k: [] for k in ("kv_w", "plain_w", "kv_r", "plain_r", "kv_rc", "plain_rc")}
    tier_file = os.path.join(d, "tier.kvs")

    def kv_read() -> float:
        t0 = time.perf_counter()
        for lo in range(0, n, 16):
            k = min(16, n - lo)
            bad = store.read_into(list(range(lo, lo + k)), [1000 + i for i in range(lo, lo + k)], out[:k])
            assert not bad
        return total / (time.perf_counter() - t0) / 1e9

    def plain_read() -> float:
        t0 = time.perf_counter()
        with open(plain, "rb", buffering=0) as f:
            mv = memoryview(bytearray(8 * MiB))
            while f.readinto(mv):
                pass
        return total / (time.perf_counter() - t0) / 1e9
    for rep in range(args.repeats):
        # (a) the disk tier
        t0 = time.perf_counter()
        for i in range(n):
            assert store.submit(i, data[i], 1000 + i, [i] * 32)
        store.flush()
        res["kv_w"].append(total / (time.perf_counter() - t0) / 1e9)
        assert all(ok for _, ok in store.take_done())
        res["kv_r"].append(kv_read())
        drop_pages(tier_file)
        res["kv_rc"].append(kv_read())
        # (b) a plain sequential copy of the same bytes
        buf = data.reshape(-1)
        t0 = time.perf_counter()
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT, 0o644)
        for lo in range(0, total, 8 * MiB):
            os.write(fd, buf[lo:lo + 8 * MiB])
        os.fdatasync(fd)
        os.close(fd)
        res["plain_w"].append(total / (time.perf_counter() - t0) / 1e9)
        res["plain_r"].append(plain_read())
        drop_pages(plain)
        res["plain_rc"].append(plain_read())
    wr = [a / b for a, b in zip(res["kv_w"], res["plain_w"])]
    rr = [a / b for a, b in zip(res["kv_r"], res["plain_r"])]
    rc = [a / b for a, b in zip(res["kv_rc"], res["plain_rc"])]
    print(f"disk I/O, {n} blocks of {args.block_kib} KiB ({total / MiB:.0f} MiB), {args.repeats} repeats, GB/s:")
    for k, label in (("kv_w", "kvslots write"), ("plain_w", "plain write"), ("kv_r", "kvslots read"),
                     ("plain_r", "plain read"), ("kv_rc", "kvslots read, cold"), ("plain_rc", "plain read, cold")):
        print(f"  {label:20s} {summary(res[k])}")
    print(f"  write ratio kvslots/plain: {summary(wr)}   (target >= 0.7)")
    print(f"  read ratio kvslots/plain, page cache:  {summary(rr)}   (target >= 0.7)")
    print(f"  read ratio kvslots/plain, from the device (pages dropped): {summary(rc)}   (target >= 0.7)")
    print("RESULT " + json.dumps({"write_ratio": wr, "read_ratio": rr, "cold_read_ratio": rc, **res}))


def bench_ttft(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kvslots._dev.tiny import build_tiny_models

    root = tempfile.mkdtemp(prefix="kvslots-bench-ttft-")
    models = build_tiny_models(os.path.join(root, "models"))
    disk = args.dir or os.path.join(root, "disk")
    llm = LLM(model=models["target"], dtype="float32", block_size=32, max_model_len=args.prompt + 64,
              max_num_seqs=4, enable_prefix_caching=True, seed=0, enforce_eager=True,
              distributed_executor_backend="uni", max_num_batched_tokens=args.prompt + 64,
              kv_transfer_config={"kv_connector": "KVSlotsConnector", "kv_role": "kv_both",
                                  "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"host_cache_blocks": 160, "disk_path": disk,
                                                                "disk_blocks": 1024}})
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    one = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(0)
    fresh = lambda: [rng.randrange(3, 900) for _ in range(args.prompt)]

    def ttft(p: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)
        return time.perf_counter() - t0

    def settle() -> None:  # engine steps: deferred stores run, the writer's reports arrive
        for _ in range(2):
            time.sleep(0.2)
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], one, use_tqdm=False)

    ttft(fresh())  # warm-up
    res: dict[str, list[float]] = {"recompute": [], "host": [], "disk": []}
    hits = {"host": [], "disk": []}
    for rep in range(args.repeats):
        res["recompute"].append(ttft(fresh()))
        p = fresh()
        ttft(p)
        settle()  # a finished request's blocks are stored at the next steps
        for _ in range(3):  # 3 x 64 blocks push p out of the 160-block host tier, onto disk
            ttft(fresh())
            settle()
        settle()
        assert llm.reset_prefix_cache()
        d0 = conn._disk_sched.stats["hit_tokens"]
        res["disk"].append(ttft(p))
        hits["disk"].append(conn._disk_sched.stats["hit_tokens"] - d0)
        q = fresh()
        ttft(q)
        settle()
        assert llm.reset_prefix_cache()
        h0 = conn._sched.stats["hit_tokens"]
        res["host"].append(ttft(q))
        hits["host"].append(conn._sched.stats["hit_tokens"] - h0)
    print(f"TTFT of a repeated {args.prompt}-token prompt, tiny model on CPU, {args.repeats} repeats, ms:")
    for k in res:
        print(f"  {k:9s} {summary([x * 1e3 for x in res[k]])}")
    for k in ("disk", "host"):
        r = [a / b for a, b in zip(res[k], res["recompute"])]
        print(f"  {k}/recompute: {summary(r)}   tokens served from {k} per repeat: {hits[k]}")
    print("RESULT " + json.dumps({"ttft_s": res, "hit_tokens": hits}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["io", "ttft"])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    bench_io(args) if args.what == "io" else bench_ttft(args)


if __name__ == "__main__":
    sys.exit(main())
