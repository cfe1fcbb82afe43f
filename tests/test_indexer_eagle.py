"""The EAGLE last-block rule of the indexer: a worker marked EAGLE scores the last block of its
matched prefix only when its engine serves it (from a host / disk block whose published successor
is the prompt's next token). Checked against a brute-force oracle, through the HTTP API, and with
the Redis backend (replicas score from the mirrored holder values)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from indexer_support import Oracle, RedisServer, TestPublisher, engine_hashes, have_redis, rust_lookup, wait_for

from kvslots._core import PrefixIndex
from kvslots.errors import ConfigError
from kvslots.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec
from kvslots.indexer.app import create_app

BS = 2
HOST = ("CPU", "STORAGE")


class EagleOracle(Oracle):
    """The brute-force oracle plus, per (worker, engine hash), the successor a host / disk store
    published (None: none published, or an empty list), and the last-block rule at lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.succ: dict[str, dict[int, int | None]] = {}
        self.eagle: set[str] = set()

    def add_worker(self, name: str, tier: str = "GPU") -> None:
        super().add_worker(name, tier)
        self.succ[name] = {}

    def apply(self, worker: str, events: list) -> None:
        m, succ = self.workers[worker], self.succ[worker]
        for ev in events:
            before = {h: v[0] for h, v in m.items()}
            super().apply(worker, [ev])
            for h in [h for h in succ if h not in m or before.get(h) != m[h][0]]:
                del succ[h]  # gone, or replaced by other content
            if isinstance(ev, BlockStored) and ev.token_ids:
                tier = ev.medium or self.default_tier[worker]
                la = ev.lookahead_token_ids
                if la is not None and tier in HOST:
                    for h, after in zip(ev.block_hashes, la, strict=True):
                        succ[h] = after[0] if after else None

    def lookup(self, tokens: list[int], bs: int, lora_id: int | None = None) -> dict[str, tuple]:
        out = super().lookup(tokens, bs, lora_id)
        for w in self.eagle & set(out):
            n = out[w][0]
            ident = (lora_id, bs, tuple(tuple(tokens[i * bs : (i + 1) * bs]) for i in range(n)))
            nxt = tokens[n * bs] if n * bs < len(tokens) else None
            served = any(
                ident == idt and tiers & set(HOST) and nxt is not None and self.succ[w].get(h) == nxt
                for h, (idt, tiers) in self.workers[w].items()
            )
            if not served:
                shorter = super().lookup(tokens[: (n - 1) * bs], bs, lora_id)
                if w in shorter:
                    out[w] = shorter[w]
                else:
                    del out[w]
        return out


def payload(events) -> bytes:
    return encode_batch(KVEventBatch(1.0, list(events), 0))


def matched(view: dict[str, tuple]) -> dict[str, tuple]:
    return {w: v for w, v in view.items() if v[0]}


BASE = [[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 2, 0, 1, 1], [1, 2, 0, 0, 0, 0, 1, 0]]

step = st.fixed_dictionaries({
    "worker": st.sampled_from(("a", "b")),
    "kind": st.sampled_from(["gpu", "host", "host", "host_plain", "remove"]),
    "base": st.integers(0, len(BASE) - 1),
    "blocks": st.integers(1, 4),
    "medium": st.sampled_from(HOST),
    "succ": st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=4, max_size=4),
    "first": st.integers(0, 3),
})


def build(s) -> list:
    tokens = BASE[s["base"]][: s["blocks"] * BS]
    hs = engine_hashes(7, tokens, BS)
    if s["kind"] == "gpu":
        return [BlockStored(hs, None, tokens, BS, None, None, None)]
    if s["kind"] == "remove":
        return [BlockRemoved(hs[min(s["first"], len(hs) - 1) :], s["medium"] if s["first"] % 2 else None)]
    la = None
    if s["kind"] == "host":
        la = [[] if x is None else [x] for x in s["succ"][: len(hs)]]
    return [BlockStored(hs, None, tokens, BS, None, s["medium"], None, lookahead_token_ids=la)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=20),
       queries=st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 8),
                                  st.lists(st.integers(0, 2), max_size=2)), min_size=1, max_size=6))
def test_eagle_scores_equal_the_oracle(steps, queries):
    ix = PrefixIndex(tier_weights={"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5})
    oracle = EagleOracle()
    for w in ("a", "b"):
        ix.add_worker(w)
        oracle.add_worker(w)
    ix.set_worker_eagle("a", True)
    oracle.eagle.add("a")
    for s in steps:
        events = build(s)
        ix.apply(s["worker"], payload(events))
        oracle.apply(s["worker"], events)
        assert ix.check_invariants() is None
    for base, n, extra in queries:
        tokens = BASE[base][:n] + extra
        assert matched(rust_lookup(ix, tokens, BS)) == oracle.lookup(tokens, BS), tokens
        # score_blocks (the Redis backend's path) decides from the mirrored holder values alike.
        holders = {}
        for key, w, value in ix.dump_holders():
            holders.setdefault(key, {})[w] = value
        keys = ix.chain_keys(tokens, BS)
        blocks = []
        for k in keys:
            if k not in holders:
                break
            blocks.append(holders[k])
        got = {w: (b, tuple(t), round(sc, 9)) for w, b, t, sc in ix.score_blocks(blocks, tokens, BS, ["a"])}
        assert matched(got) == oracle.lookup(tokens, BS), tokens


def test_score_blocks_needs_the_prompt_for_eagle_workers():
    ix = PrefixIndex()
    ix.add_worker("a")
    with pytest.raises(Exception, match="token_ids and block_size"):
        ix.score_blocks([{"a": 2}], eagle=["a"])
    with pytest.raises(Exception, match="eagle must be a list"):
        ix.score_blocks([{"a": 2}], [1, 2], 2, "a")
    # Without eagle workers the prompt is not needed; unknown names are harmless.
    assert ix.score_blocks([{"a": 2}]) == [("a", 1, [0, 1, 0], 0.8)]
    assert ix.score_blocks([{"a": 2}], [1, 2], 2, ["nobody"]) == [("a", 1, [0, 1, 0], 0.8)]
    with pytest.raises(Exception):
        ix.set_worker_eagle("a", 1)
    assert ix.worker_eagle("a") is False


def test_worker_spec_eagle_option():
    assert WorkerSpec.parse("w=tcp://h:1,eagle=true").eagle is True
    assert WorkerSpec.parse("w=tcp://h:1,eagle=False,tier=cpu").eagle is False
    assert WorkerSpec.parse("w=tcp://h:1").eagle is False
    for bad in ("w=tcp://h:1,eagle=yes", "w=tcp://h:1,eagle="):
        with pytest.raises(ConfigError, match="eagle"):
            WorkerSpec.parse(bad)
    assert WorkerSpec.from_dict({"name": "w", "endpoint": "tcp://h:1", "eagle": True}).eagle is True
    for bad in ("true", 1, None, [True]):
        with pytest.raises(ConfigError, match="eagle"):
            WorkerSpec.from_dict({"name": "w", "endpoint": "tcp://h:1", "eagle": bad})
    assert WorkerSpec("w", "tcp://h:1", eagle=True).to_dict()["eagle"] is True


P = list(range(100, 112))  # 3 blocks of 4
BS4 = 4


def _events(seed: int) -> list:
    hs = engine_hashes(seed, P, BS4)
    return [
        BlockStored(hs, None, P, BS4, None, "GPU", None),
        # Host copies: successors 104 and 108 (the prompt's own next tokens), none for block 2.
        BlockStored(hs, None, P, BS4, None, "CPU", None, lookahead_token_ids=[[104], [108], []]),
    ]


def _blocks(client: TestClient, tokens: list[int]) -> dict[str, int]:
    r = client.post("/score", json={"token_ids": tokens, "block_size": BS4})
    assert r.status_code == 200, r.text
    return {w: d["blocks"] for w, d in r.json()["workers"].items()}


def test_http_scores_and_admin_api_with_eagle_workers():
    pubs = {"e": TestPublisher(), "p": TestPublisher()}
    cfg = IndexerConfig(workers=[WorkerSpec("e", pubs["e"].endpoint, pubs["e"].replay_endpoint, eagle=True),
                                 WorkerSpec("p", pubs["p"].endpoint, pubs["p"].replay_endpoint)],
                        block_size=BS4, replay_timeout=1.0, capacity=None, admin_token="t" * 20)
    svc = IndexerService(cfg)
    svc.start()
    client = TestClient(create_app(svc))
    try:
        for name, pub in pubs.items():
            pub.publish(_events(1))
        wait_for(lambda: _blocks(client, P[:9]) == {"e": 2, "p": 2}, 5, "both streams applied")
        # The next token is another one: the EAGLE worker recomputes block 1, the other does not.
        assert _blocks(client, P[:8] + [0]) == {"e": 1, "p": 2}
        # Block 2 has no successor: a full match stops one short on the EAGLE worker.
        assert _blocks(client, P + [0]) == {"e": 2, "p": 3}
        got = {w["name"]: w["eagle"] for w in client.get("/workers").json()}
        assert got == {"e": True, "p": False}
        auth = {"Authorization": "Bearer " + "t" * 20}
        for bad in ("true", 1, None, [True]):
            r = client.post("/workers", json={"name": "x", "endpoint": "tcp://127.0.0.1:1", "eagle": bad},
                            headers=auth)
            assert r.status_code == 422, (bad, r.text)
        assert [w["name"] for w in client.get("/workers").json()] == ["e", "p"]
        r = client.post("/workers", json={"name": "x", "endpoint": "tcp://127.0.0.1:1", "eagle": True},
                        headers=auth)
        assert r.status_code == 201 and r.json()["eagle"] is True
        assert svc.backend.index.worker_eagle("x") is True
    finally:
        client.close()
        svc.stop()
        for pub in pubs.values():
            pub.close()


@pytest.mark.skipif(not have_redis(), reason="redis-server not installed (scripts/system-deps.txt)")
def test_redis_replicas_apply_the_rule_from_mirrored_successors():
    srv = RedisServer()
    pub = TestPublisher()
    ns = f"kvslots:test:{uuid.uuid4().hex[:8]}"
    made = []

    def replica():
        cfg = IndexerConfig(workers=[WorkerSpec("e", pub.endpoint, pub.replay_endpoint, eagle=True)],
                            backend="redis", redis_url=srv.url, redis_namespace=ns, block_size=BS4,
                            replay_timeout=1.0, capacity=None)
        svc = IndexerService(cfg)
        svc.start()
        client = TestClient(create_app(svc))
        made.append((svc, client))
        return svc, client

    try:
        a, ca = replica()
        wait_for(lambda: a.backend.is_writer, 5, "a writer")

        def live():
            pub.publish([])
            return a.sub.status().get("e", {}).get("last_live_seq") is not None
        wait_for(live, 10, "the writer to receive")
        pub.publish(_events(1))
        want = [[P[:9], 2], [P[:8] + [0], 1], [P + [0], 2]]

        def agrees(client):
            return all(_blocks(client, t)["e"] == n for t, n in want)
        wait_for(lambda: agrees(ca), 5, "the writer's scores")
        _, cb = replica()  # scores from Redis only
        wait_for(lambda: agrees(cb), 5, "a reading replica's scores")
        # A resync (a new epoch) rewrites the holder values with their successors.
        with a.backend._lock:
            a.backend._resync()
        wait_for(lambda: agrees(cb), 5, "scores after a resync")
        # The successor leaves with the host copy.
        pub.publish([BlockRemoved(engine_hashes(1, P, BS4)[1:2], "CPU")])
        want[0][1] = 1
        wait_for(lambda: agrees(cb), 5, "scores after the host copy left")
    finally:
        for svc, client in made:
            client.close()
            svc.stop()
        pub.close()
        srv.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")
    from kvslots._dev.tiny import build_tiny_models

    return build_tiny_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("chunk,variant", [(256, "same"), (256, "other_next"), (64, "same"), (64, "two_blocks")])
def test_scores_equal_the_connectors_hits(models, chunk, variant):
    """The connector's published events, fed to the index, score an EAGLE worker with exactly
    the prompt tokens vLLM's scheduler then computes from the host tier (a worker registered
    without `eagle` would claim the last block too)."""
    import copy
    import random

    import msgspec
    from vllm.distributed import kv_events as vke
    from vllm_harness import BLOCK_SIZE, DRAFT_BASE, Harness, engine_config

    cfg = engine_config(models["target"], models["eagle"], k=3, num_blocks=64, max_num_batched_tokens=chunk)
    cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": 256}
    h = Harness(copy.deepcopy(cfg), num_blocks=64, seed=13)
    h.connector._raw_events = True  # as with vLLM's ZMQ publisher: our wire bytes
    rng = random.Random(13)
    tokens = [rng.randrange(1, DRAFT_BASE) for _ in range(5 * BLOCK_SIZE + 7)]
    h.add("first", tokens, max_tokens=2)
    h.run_until_done()
    assert h.scheduler.reset_prefix_cache()  # hits now come from the host tier only

    ix = PrefixIndex()
    for w in ("eagle", "plain"):
        ix.add_worker(w)
    ix.set_worker_eagle("eagle", True)
    for w in ("eagle", "plain"):
        ix.apply(w, msgspec.msgpack.encode(vke.KVEventBatch(ts=0.0, events=h.events)))

    if variant == "other_next":  # same five blocks, another token after them
        tokens = tokens[: 5 * BLOCK_SIZE] + [tokens[5 * BLOCK_SIZE] % (DRAFT_BASE - 2) + 1] + tokens[5 * BLOCK_SIZE + 1 :]
    elif variant == "two_blocks":  # block 1 ended a 64-token prefill chunk: no successor recorded
        tokens = tokens[: 2 * BLOCK_SIZE + 3]
    scored = {w: b for w, b, _t, _s in ix.lookup(tokens, BLOCK_SIZE)}
    h.add("second", tokens, max_tokens=2)
    so = h.step()
    hit = [r for r in so.scheduled_new_reqs if r.req_id == "second"][0].num_computed_tokens
    assert scored["eagle"] * BLOCK_SIZE == hit
    assert scored["plain"] == len(tokens) // BLOCK_SIZE  # every full block is held
    if variant != "same":  # the last block is not served: only the EAGLE registration knows it
        assert scored["plain"] == scored["eagle"] + 1
    h.run_until_done()


def test_yaml_eagle_takes_booleans_and_the_docs_example_loads(tmp_path):
    import argparse
    import pathlib
    import re

    from kvslots.indexer.config import build_config

    docs = (pathlib.Path(__file__).parent.parent / "docs" / "indexer.md").read_text()
    example = re.search(r"```yaml\n(# indexer\.yaml\n.*?)```", docs, re.S).group(1)
    f = tmp_path / "indexer.yaml"
    f.write_text(example)
    cfg = build_config(argparse.Namespace(config=str(f)))
    assert {w.name: w.eagle for w in cfg.workers} == {"w0": False, "w0-host": False, "w1": True}
    assert cfg.workers[1].tier == "CPU" and cfg.capacity == 2_000_000
    f.write_text("workers:\n  - {name: w, endpoint: 'tcp://h:1', eagle: false}\n")
    assert build_config(argparse.Namespace(config=str(f))).workers[0].eagle is False
    for bad in ("'true'", "1", "0", "null", "[true]"):
        f.write_text(f"workers:\n  - {{name: w, endpoint: 'tcp://h:1', eagle: {bad}}}\n")
        with pytest.raises(ConfigError, match=r"workers\[0\]\.eagle: must be true or false"):
            build_config(argparse.Namespace(config=str(f)))
