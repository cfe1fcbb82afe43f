"""Encode rate of KV event batches: the Rust encoder vs msgspec, on the same events, in one run.

    python benches/bench_events.py [--events 20000] [--batch-events 64 2000 0] [--block-size 16]

A SlotManager workload queues the events (BlockStored runs of 1-8 blocks, BlockRemoved from
evictions), split into batches of ``--batch-events`` events (one engine step's worth; 0 = all in
one batch). For each batch size the sides alternate within each round (``--rounds``, default 7):

* rust            ``SlotManager.events_msgpack``: each queued log straight to msgpack bytes;
* msgspec         ``msgspec.msgpack.Encoder.encode`` of the same batches as prebuilt structs
                  in vLLM 0.32's layout (what vLLM's own publisher does per batch);
* msgspec+build   building the structs from the event tuples, then ``kvslots.events.encode_batch``
                  (the Python path that the Rust encoder replaces).

The bytes are checked equal before timing. Printed: each side's median events/s over the rounds
with their spread, and the median of the per-round ratios with their spread (a round's sides run
back to back, so the machine's noise moves both).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec

from kvslots import SlotManager
from kvslots.events import MEDIUM_CPU, KVEventBatch, encode_batch, from_raw
from kvslots.events.codec import _wire_event


POOL_BLOCKS = 256  # small enough that every batch size sees evictions (BlockRemoved)


def workload(n_events: int, batch_events: int, block_size: int, seed: int = 0) -> list[SlotManager]:
    """Managers whose queued logs are the batches (the same events for the same seed)."""
    rng = random.Random(seed)
    managers: list[SlotManager] = []
    m = SlotManager(POOL_BLOCKS, block_size)
    total = 0
    i = 0
    while total < n_events:
        rid = f"r{i}"
        i += 1
        # A shared system prompt of 2 blocks plus a unique tail of 1..8 blocks.
        tail = [rng.randrange(32000) for _ in range(rng.randint(1, 8) * block_size + 1)]
        prompt = [7] * (2 * block_size) + tail
        before = m.num_pending_events()
        m.create(rid, prompt)
        m.reserve(rid, len(prompt) - m.slot_info(rid).committed)
        m.commit(rid, prompt[m.slot_info(rid).committed :])
        m.finish(rid)  # blocks go to the cache; later requests evict them (BlockRemoved)
        total += m.num_pending_events() - before
        if batch_events and m.num_pending_events() >= batch_events:
            managers.append(m)
            m = SlotManager(POOL_BLOCKS, block_size)
            for _ in range(rng.randint(0, 3)):  # vary the cache state between batches
                rng.random()
    if m.num_pending_events():
        managers.append(m)
    return managers


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def run(n_events: int, batch_events: int, block_size: int, rounds: int) -> None:
    ts, rank = time.time(), 0
    rust_side = workload(n_events, batch_events, block_size)
    raws = [m.drain_raw_events() for m in workload(n_events, batch_events, block_size)]
    # In vLLM 0.32's layout (a fixmap per BlockStored), as vLLM 0.32 and the Rust encoder write it.
    structs = [[_wire_event(from_raw(r, MEDIUM_CPU)) for r in raw] for raw in raws]
    enc = msgspec.msgpack.Encoder()
    for m, evs in zip(rust_side, structs, strict=True):
        assert m.events_msgpack(ts, MEDIUM_CPU, rank) == enc.encode(KVEventBatch(ts, evs, rank))

    def rust() -> None:
        for m in rust_side:
            m.events_msgpack(ts, MEDIUM_CPU, rank)

    def msgspec_only() -> None:
        for evs in structs:
            enc.encode(KVEventBatch(ts, evs, rank))

    def msgspec_build() -> None:
        for raw in raws:
            encode_batch(KVEventBatch(ts, [from_raw(r, MEDIUM_CPU) for r in raw], rank))

    sides = {"rust": rust, "msgspec": msgspec_only, "msgspec+build": msgspec_build}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(timed(fn, 3))

    count = sum(len(r) for r in raws)
    stored = sum(1 for raw in raws for r in raw if r[0] == "BlockStored")
    blocks = sum(len(r[1]) for raw in raws for r in raw if r[0] == "BlockStored")
    size = "all" if not batch_events else f"~{batch_events}"
    print(
        f"{count} events in {len(raws)} batches of {size} events "
        f"(BlockStored {stored} with {blocks} blocks of {block_size} tokens, "
        f"BlockRemoved {count - stored})"
    )
    for name in sides:
        rates = sorted(count / t / 1e6 for t in times[name])
        print(f"  {name:14s} {statistics.median(rates):7.2f} M events/s ({rates[0]:.2f}-{rates[-1]:.2f})")
    for peer in ("msgspec", "msgspec+build"):
        # A round's ratio: the peer's time over rust's, both measured back to back.
        ratios = sorted(p / r for p, r in zip(times[peer], times["rust"], strict=True))
        print(f"  ratio rust / {peer:14s} {statistics.median(ratios):5.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--batch-events", type=int, nargs="+", default=[64, 2000, 0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    for b in args.batch_events:
        run(args.events, b, args.block_size, args.rounds)


if __name__ == "__main__":
    main()
