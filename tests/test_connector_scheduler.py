"""The KVSlotsConnector with vLLM's real Scheduler, driven step by step with fake model outputs
and simulated EAGLE acceptance, a scheduler-side and worker-side connector instances, and KV
caches as CPU tensors (see vllm_harness)."""

from __future__ import annotations

import copy
import random

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from kvslots._dev.tiny import build_tiny_models  # noqa: E402

from vllm_harness import BLOCK_SIZE, DRAFT_BASE, Harness, engine_config  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_tiny_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def eagle_cfg(models):
    return engine_config(models["target"], models["eagle"], k=3, num_blocks=64)


def harness(cfg, *, num_blocks=64, extra=None, **kw) -> Harness:
    cfg = copy.deepcopy(cfg)
    cfg.kv_transfer_config.kv_connector_extra_config = dict(extra or {"host_cache_blocks": 512})
    return Harness(cfg, num_blocks=num_blocks, **kw)


def prompt(rng: random.Random, n: int, prefix: list[int] | None = None) -> list[int]:
    p = list(prefix or [])
    return p + [rng.randrange(1, DRAFT_BASE) for _ in range(n - len(p))]


def full_verified_hashes(h: Harness, req) -> list[int]:
    from kvslots.events import external_block_hash

    n = min(req.num_computed_tokens // BLOCK_SIZE, len(req.block_hashes))
    return [external_block_hash(x) for x in req.block_hashes[:n]]


def test_host_tier_holds_exactly_the_verified_blocks(eagle_cfg):
    h = harness(eagle_cfg, seed=1)
    rng = random.Random(1)
    shared = prompt(rng, 70)
    reqs = [h.add(f"r{i}", prompt(rng, 40 + 23 * i, shared if i % 2 else None), max_tokens=60) for i in range(5)]
    h.run_until_done()
    checked = h.check_host_tier()
    expected = set()
    for r in reqs:
        expected.update(full_verified_hashes(h, r))
    assert set(h.sched_side.host.registered_hashes()) == expected
    assert checked == len(expected) > 10
    assert sum(h.accepted.values()) > 0, "some drafts were accepted"
    host = h.sched_side.host
    assert host.num_held == 0 and host.num_storing == 0, "every pin and store completed"


def test_rollback_across_block_boundary_and_changing_k(eagle_cfg):
    # Prompt ends 2 tokens before a block boundary: every decode step straddles it, and with
    # acceptance 0.5 and K drawn per step from 0..3 the rollbacks cross it again and again.
    h = harness(eagle_cfg, seed=2, acceptance=0.5)
    rng = random.Random(2)
    r = h.add("r", prompt(rng, BLOCK_SIZE * 2 - 2), max_tokens=3 * BLOCK_SIZE)
    steps = 0
    while h.scheduler.has_requests():
        h.step(draft_len=rng.randrange(0, 4))
        steps += 1
        # After every step: the host tier never holds a block past the verified tokens.
        h.check_host_tier()
        assert set(h.sched_side.host.registered_hashes()) <= set(full_verified_hashes(h, r))
    assert set(h.sched_side.host.registered_hashes()) == set(full_verified_hashes(h, r))
    assert steps > 10


def test_preemption_and_resume(eagle_cfg):
    # 12 device blocks for 4 requests of up to 4 blocks each: vLLM must preempt.
    h = harness(eagle_cfg, num_blocks=12, seed=3)
    rng = random.Random(3)
    reqs = [h.add(f"p{i}", prompt(rng, 50), max_tokens=60) for i in range(4)]
    h.run_until_done(max_steps=2000)
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must cause preemption"
    # Every host block holds exactly its tokens: the preempted requests' blocks were copied in
    # the step that preempted them, before any forward reused them.
    h.check_host_tier()
    expected = set().union(*(full_verified_hashes(h, r) for r in reqs))
    assert expected <= set(h.sched_side.host.registered_hashes())
    assert h.sched_side.host.num_held == 0
    stats = h.sched_side.stats
    assert stats["preempted_stored_blocks"] > 0, "preempted requests' blocks were stored"
    assert stats["hit_tokens"] > 0, "resumed requests were served from the host tier"


def test_preempted_request_is_stored_before_its_blocks_are_reused(eagle_cfg):
    """The step that preempts a request stores its full verified blocks; on resume the request
    is served from the host tier instead of recomputing them."""
    # Whether a victim still has unstored verified blocks when it is preempted depends on the
    # schedule, which differs between vLLM versions: try workloads until one has (each of them
    # checked in full).
    for seed, n_reqs, n_prompt, n_out in ((8, 3, 70, 80), (3, 4, 50, 60), (9, 3, 70, 80)):
        h = harness(eagle_cfg, num_blocks=12, seed=seed)
        rng = random.Random(seed)
        reqs = [h.add(f"q{i}", prompt(rng, n_prompt), max_tokens=n_out) for i in range(n_reqs)]
        preempted_at = None
        for _ in range(2000):
            if not h.scheduler.has_requests():
                break
            before = h.sched_side.stats["preempted_stored_blocks"]
            so = h.step()
            if so.preempted_req_ids:
                preempted_at = preempted_at or so
                stored = h.sched_side.stats["preempted_stored_blocks"] - before
                # The preempting step's own metadata carries the victims' blocks (copied first).
                assert len(so.kv_connector_metadata.store_device_blocks) >= stored
        assert preempted_at is not None, "the test must cause preemption"
        h.check_host_tier()
        assert h.sched_side.host.num_held == 0
        assert not h.scheduler.has_requests() and all(r.is_finished() for r in reqs)
        if h.sched_side.stats["preempted_stored_blocks"] > 0:
            break
    assert h.sched_side.stats["preempted_stored_blocks"] > 0, "no workload stored a victim's blocks"


def _store_then_reset_device_cache(h: Harness, tokens: list[int]):
    first = h.add("first", tokens, max_tokens=2)
    h.run_until_done()
    assert h.scheduler.reset_prefix_cache(), "device prefix cache reset"
    return first


@pytest.mark.parametrize("drop,next_token_matches", [(True, True), (True, False), (False, False)])
def test_external_hit_serves_eagle_last_block_on_successor_match_and_loads_exact_kv(eagle_cfg, drop,
                                                                                    next_token_matches):
    h = harness(eagle_cfg, extra={"host_cache_blocks": 256, "eagle_block_drop": drop}, seed=4)
    rng = random.Random(4)
    tokens = prompt(rng, BLOCK_SIZE * 5 + 7)
    first = _store_then_reset_device_cache(h, tokens)
    stored_blocks = len(h.sched_side.host.registered_hashes())
    assert stored_blocks == 5
    # Each host block recorded the token after it (the draft KV at its last position used it).
    host = h.sched_side.host
    hashes = full_verified_hashes(h, first)
    assert [host.successor(x) for x in hashes[:5]] == [tokens[(i + 1) * BLOCK_SIZE] for i in range(5)]
    if not next_token_matches:
        # Same five blocks, another token after them: the EAGLE rule recomputes the last one.
        tokens = tokens[: 5 * BLOCK_SIZE] + [(tokens[5 * BLOCK_SIZE] % (DRAFT_BASE - 2)) + 1] + tokens[5 * BLOCK_SIZE + 1:]
    second = h.add("second", tokens, max_tokens=2)
    so = h.step()
    expected_hit = (stored_blocks - 1 if drop and not next_token_matches else stored_blocks) * BLOCK_SIZE
    new = [r for r in so.scheduled_new_reqs if r.req_id == "second"][0]
    assert new.num_computed_tokens == expected_hit
    # The loaded device blocks hold the original tokens, in every layer.
    blocks = h.scheduler.kv_cache_manager.get_block_ids("second")[0]
    for name, t in h.kv[0].items():
        for i in range(expected_hit // BLOCK_SIZE):
            assert t[blocks[i], 0, :, 0].tolist() == [float(x) for x in tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]]
    h.run_until_done()
    assert second.num_computed_tokens > 0


def test_abort_during_load_releases_every_pin(eagle_cfg):
    h = harness(eagle_cfg, seed=5)
    rng = random.Random(5)
    tokens = prompt(rng, BLOCK_SIZE * 4 + 3)
    _store_then_reset_device_cache(h, tokens)
    h.add("victim", tokens, max_tokens=20)
    h.step(abort={"victim"})  # scheduled with a host load, aborted before its output is used
    host = h.sched_side.host
    assert host.num_held == 0, "the load's pins were released"
    h.add("again", tokens, max_tokens=4)
    h.run_until_done()
    h.check_host_tier()
    assert host.num_held == 0 and not h.sched_side.has_pending_work()


def test_tensor_parallel_store_visible_only_after_every_rank(eagle_cfg):
    h = harness(eagle_cfg, num_workers=2, seed=6)
    h.sched_side.expected_workers = 2
    rng = random.Random(6)
    h.add("tp", prompt(rng, BLOCK_SIZE * 3 + 1), max_tokens=8)
    # Run until a store is in flight, then deliver only rank 0's ack by hand.
    for _ in range(20):
        so = h.scheduler.schedule()
        meta = so.kv_connector_metadata
        metas = []
        for w in h.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            metas.append(w.build_connector_worker_meta())
            w.clear_connector_metadata()
        if len(meta.store_device_blocks):
            h.sched_side.complete(metas[0])
            assert h.sched_side.host.registered_hashes() == [], "one rank is not enough"
            h.sched_side.complete(metas[1])
            assert len(h.sched_side.host.registered_hashes()) == len(meta.store_device_blocks)
            h.events.extend(h.connector.take_events())  # stepping by hand: drain them ourselves
            h.check_host_tier()  # both ranks' shards hold the right tokens
            return
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(so.num_scheduled_tokens)
        for rid, n in so.num_scheduled_tokens.items():
            req = h.scheduler.requests[rid]
            h.write_kv(rid, req.num_computed_tokens - n, list(req.all_token_ids[req.num_computed_tokens - n:req.num_computed_tokens]))
        h.scheduler.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                             sampled_token_ids=[[7] for _ in ids]))
    pytest.fail("no store was planned")


def test_events_decode_as_vllm_events(eagle_cfg):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    import msgspec

    h = harness(eagle_cfg, seed=7)
    h.add("e", prompt(random.Random(7), BLOCK_SIZE * 2 + 5), max_tokens=4)
    h.run_until_done()
    stored = [e for e in h.events if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "CPU" for e in stored)
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=h.events))
    assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == h.events
    from kvslots.events import decode_batch

    ours = decode_batch(payload)
    assert [e.block_hashes for e in ours.events] == [e.block_hashes for e in h.events]


def test_finished_request_blocks_are_stored_before_reuse(eagle_cfg):
    # 8 device blocks (7 usable). "a" verifies its third block in its last step; "b" cannot be
    # scheduled until "a" finishes, then takes every free block, "a"'s included, and overwrites
    # them in its prefill forward. "a"'s last block must reach the host tier intact.
    h = harness(eagle_cfg, num_blocks=8, acceptance=1.0, seed=8)
    rng = random.Random(8)
    a = h.add("a", prompt(rng, 90), max_tokens=8)
    h.step()
    b = h.add("b", prompt(rng, 5 * BLOCK_SIZE + 3), max_tokens=2)
    h.run_until_done()
    assert a.num_computed_tokens >= 3 * BLOCK_SIZE
    assert set(full_verified_hashes(h, a)) <= set(h.sched_side.host.registered_hashes())
    assert h.check_host_tier() >= 3 + 5
    assert b.num_computed_tokens > 5 * BLOCK_SIZE


def test_failed_copies_are_reported_and_never_published(eagle_cfg):
    h = harness(eagle_cfg, seed=9)
    rng = random.Random(9)
    tokens = prompt(rng, BLOCK_SIZE * 4 + 3)
    _store_then_reset_device_cache(h, tokens)
    stored = h.sched_side.host.registered_hashes()
    copier = h.workers[0]._worker.copier

    def broken(*a, **k):
        raise RuntimeError("injected copy failure")

    # A failing load: vLLM gets the device block ids to recompute, the host pins are released.
    copier.load = broken
    h.add("load-fails", tokens, max_tokens=2)
    so = h.scheduler.schedule()
    w = h.workers[0]
    w.handle_preemptions(so.kv_connector_metadata)
    w.bind_connector_metadata(so.kv_connector_metadata)
    w.start_load_kv(None)
    errors = w.get_block_ids_with_load_errors()
    assert errors and errors == set(so.kv_connector_metadata.loads[0].device_blocks)
    h.sched_side.complete(w.build_connector_worker_meta())
    assert h.sched_side.host.num_held == 0 and h.sched_side.stats["failed_loads"] == 1
    w.clear_connector_metadata()
    # A failing store: the host block is given back and no BlockStored is published for it.
    copier.store = broken
    before = len(h.events)
    h.add("store-fails", prompt(rng, BLOCK_SIZE * 3 + 1), max_tokens=4)
    for _ in range(6):
        h.step()
    assert h.sched_side.stats["failed_stores"] > 0
    assert h.sched_side.host.registered_hashes() == stored
    assert not [e for e in h.events[before:] if type(e).__name__ == "BlockStored"]
    assert h.sched_side.host.num_held == 0 and h.sched_side.host.num_storing == 0
