"""Batches captured from a real vLLM 0.32 run (scripts/capture_vllm_kv_events.py: tiny random
Llama on CPU, prefix-cache hits, evictions), replayed by a publisher into the indexer."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient
from indexer_support import Oracle, TestPublisher, score_view, wait_for

from kvslots._core import PrefixIndex
from kvslots.events import BlockRemoved, BlockStored, decode_batch
from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec
from kvslots.indexer.app import create_app

FIXTURE = Path(__file__).parent / "data" / "vllm_kv_events.msgpack"


@pytest.fixture(scope="module")
def capture():
    return msgspec.msgpack.decode(FIXTURE.read_bytes())


def oracle_of(capture) -> Oracle:
    o = Oracle()
    o.add_worker("vllm")
    for _, _, payload in capture["frames"]:
        o.apply("vllm", decode_batch(payload).events)
    return o


def queries(capture):
    bs = capture["block_size"]
    for p in capture["prompts"]:
        for n in range(1, len(p) // bs + 1):
            yield p[: n * bs]


def test_capture_is_what_vllm_sends(capture):
    assert capture["vllm_version"].startswith("0.32")
    kinds = {type(ev).__name__ for _, _, p in capture["frames"] for ev in decode_batch(p).events}
    assert {"BlockStored", "BlockRemoved"} <= kinds
    assert [s for s, _, _ in capture["frames"]] == list(range(len(capture["frames"])))
    ev = next(ev for _, _, p in capture["frames"] for ev in decode_batch(p).events if isinstance(ev, BlockStored))
    assert ev.medium == "GPU" and ev.group_idx == 0


def test_rust_index_reads_vllm_batches(capture):
    ix = PrefixIndex()
    ix.add_worker("vllm")
    skipped = 0
    for _, _, payload in capture["frames"]:
        st = ix.apply("vllm", payload)
        assert st.invalid_events == st.unknown_events == st.unknown_medium_events == 0
        skipped += st.unresolved_blocks
    oracle = oracle_of(capture)
    bs = capture["block_size"]
    hits = 0
    for q in queries(capture):
        got = {w: (b, tuple(t), round(s, 9)) for w, b, t, s in ix.lookup(q, bs)}
        assert got == oracle.lookup(q, bs)
        hits += bool(got)
    assert hits > 0
    removed = sum(len(ev.block_hashes) for _, _, p in capture["frames"] for ev in decode_batch(p).events
                  if isinstance(ev, BlockRemoved))
    assert ix.stats()["removed_blocks"] + skipped == removed


@pytest.mark.parametrize("late", [False, True], ids=["live", "late-joiner-replay"])
def test_service_replaying_a_vllm_capture(capture, late):
    pub = TestPublisher(topic="kv")
    svc = client = None
    try:
        if late:  # everything already published: the indexer learns it from the replay buffer
            for _, _, payload in capture["frames"]:
                pub.publish_raw(payload)
        cfg = IndexerConfig(workers=[WorkerSpec("vllm", pub.endpoint, pub.replay_endpoint, topic="kv")],
                            block_size=capture["block_size"], replay_timeout=1.0)
        svc = IndexerService(cfg)
        svc.start()
        client = TestClient(create_app(svc))
        if not late:
            for _, _, payload in capture["frames"]:
                pub.publish_raw(payload)
        n = len(capture["frames"])
        wait_for(lambda: svc.sub.status()["vllm"]["applied_seq"] >= n - 1 or pub.publish_raw(_empty()) < 0,
                 10, "the capture to be applied")
        oracle = oracle_of(capture)
        for q in queries(capture):
            r = client.post("/score", json={"token_ids": q}).json()
            assert score_view(r) == oracle.lookup(q, capture["block_size"])
    finally:
        if client is not None:
            client.close()
        if svc is not None:
            svc.stop()
        pub.close()


def _empty() -> bytes:
    # An empty batch nudges a subscriber that missed the tail (ZMQ slow joiner) into a replay.
    return msgspec.msgpack.encode([0.0, [], 0])
