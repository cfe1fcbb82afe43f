"""The connector's fast event path: for vLLM's own ZMQ publisher, take_events hands over each
host-tier event as ``msgspec.Raw`` wire bytes (``ConnectorPlanner.drain_events_raw``) instead of
vLLM's structs. What vLLM publishes must be byte for byte what it publishes from the structs."""

from __future__ import annotations

import copy
import random

import msgspec
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvslots import KVSlotsError  # noqa: E402
from kvslots._core import ConnectorPlanner  # noqa: E402
from kvslots._dev.tiny import build_tiny_models  # noqa: E402
from kvslots.vllm.compat import features  # noqa: E402
from kvslots.vllm.connector import KVSlotsConnector  # noqa: E402

from vllm_harness import BLOCK_SIZE, DRAFT_BASE, Harness, engine_config, kv_cache_config  # noqa: E402

BS = 4
ENC = msgspec.msgpack.Encoder()  # what vLLM's ZmqEventPublisher encodes a batch with
DEC = msgspec.msgpack.Decoder(KVEventBatch)
LAYOUT_032 = not features().block_stored_lookahead

#: One chain of promoted blocks: (hashes, tokens per block, successor or None, lora id or None).
chains = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4, unique=True),
        st.lists(st.integers(0, 2**32 - 1), min_size=4 * BS, max_size=4 * BS),
        st.one_of(st.none(), st.integers(0, 2**32 - 2)),
        st.one_of(st.none(), st.integers(0, 2**63)),
    ),
    max_size=6,
)


def _fill(p: ConnectorPlanner, chain_list, clear_after: int | None) -> None:
    """Queues BlockStored (promotions), BlockRemoved (evictions of a small tier) and, at
    ``clear_after``, AllBlocksCleared."""
    for k, (hashes, toks, succ, lora) in enumerate(chain_list):
        taken = p.begin_promote(hashes)
        if taken:
            idx = [i for i, _ in taken]
            # A contiguous run from the first taken index (the rest stays unstored).
            run = [taken[0]]
            for i, b in taken[1:]:
                if i != run[-1][0] + 1:
                    break
                run.append((i, b))
            rest = [t for t in taken if t not in run]
            if rest:
                p.abort_promote([hashes[i] for i, _ in rest], [b for _, b in rest])
            first = run[0][0]
            p.complete_promote([hashes[i] for i, _ in run], [b for _, b in run],
                               toks[: len(run) * BS], [succ] * len(run),
                               parent_hash=hashes[first - 1] if first else None, lora_id=lora)
            assert idx
        if clear_after == k:
            p.clear()


@settings(max_examples=120, deadline=None)
@given(chains, st.one_of(st.none(), st.integers(0, 5)), st.floats(allow_nan=False),
       st.one_of(st.none(), st.integers(-5, 2**31)), st.booleans())
def test_raw_events_are_the_batch_bytes_vllm_would_publish(chain_list, clear_after, ts, rank, as_bytes):
    p = ConnectorPlanner(BS, 6, False)  # 6 host blocks: longer runs evict (BlockRemoved)
    _fill(p, chain_list, clear_after)
    n = p.num_pending_events()
    batch = p.events_msgpack(ts, "CPU", rank, as_bytes)  # the queue stays
    structs = DEC.decode(batch).events
    raw = p.drain_events_raw(msgspec.Raw, "CPU", as_bytes)
    assert p.num_pending_events() == 0 and len(raw) == n == len(structs)
    assert all(isinstance(r, msgspec.Raw) for r in raw)
    # vLLM's publisher encodes KVEventBatch(ts, events, rank): Raw items are written verbatim.
    assert ENC.encode(KVEventBatch(ts, raw, rank)) == batch
    if LAYOUT_032:  # vLLM's own encoding of its structs: the same bytes
        assert ENC.encode(KVEventBatch(ts, structs, rank)) == batch
    assert [msgspec.msgpack.decode(bytes(r)) for r in raw] == [msgspec.msgpack.decode(ENC.encode(s))
                                                               for s in structs]


def test_drain_events_raw_hostile_arguments_leave_the_queue():
    p = ConnectorPlanner(BS, 8, False)
    _fill(p, [([1, 2], list(range(2 * BS)), None, None)], None)
    p.clear()
    assert p.num_pending_events() == 2

    calls = []

    def raises_on_second(b):
        calls.append(b)
        if len(calls) == 2:
            raise ValueError("boom")
        return b

    with pytest.raises(ValueError):
        p.drain_events_raw(raises_on_second)
    assert p.num_pending_events() == 2  # nothing drained
    for args in [(5,), (msgspec.Raw, 7), (msgspec.Raw, "\udcff"), (msgspec.Raw, "CPU", "yes")]:
        with pytest.raises(KVSlotsError):
            p.drain_events_raw(*args)
        assert p.num_pending_events() == 2
    got = p.drain_events_raw(bytes, None)  # any callable; medium None is written as nil
    assert len(got) == 2 and all(type(b) is bytes for b in got) and p.num_pending_events() == 0
    assert p.drain_events_raw(msgspec.Raw) == []


@pytest.fixture(scope="module")
def eagle_cfg(tmp_path_factory):
    models = build_tiny_models(str(tmp_path_factory.mktemp("tiny")))
    return engine_config(models["target"], models["eagle"], k=3, num_blocks=64)


@pytest.mark.parametrize("publisher,enabled,raw", [("zmq", True, LAYOUT_032), ("null", True, False),
                                                   ("zmq", False, False)])
def test_raw_path_only_for_vllms_zmq_publisher(eagle_cfg, publisher, enabled, raw):
    cfg = copy.deepcopy(eagle_cfg)
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=enabled, publisher=publisher)
    c = KVSlotsConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(64))
    assert c._raw_events is raw and c._vllm_events is (enabled and publisher != "null")


@pytest.mark.parametrize("eagle_rule", [False, True])
def test_engine_steps_publish_the_same_bytes_raw_or_structs(eagle_cfg, eagle_rule):
    """Two identical scheduler runs, one taking events as structs, one as Raw: every step's
    published batch (as vLLM's publisher encodes it) is byte for byte the same. With the EAGLE
    rule the host tier's BlockStored carry their successors (lookahead_token_ids, vLLM 0.33's
    field): the raw bytes keep them, vLLM 0.32's structs cannot, and the rest is the same."""
    batches = {}
    for raw in (False, True):
        cfg = copy.deepcopy(eagle_cfg)
        cfg.kv_transfer_config.kv_connector_extra_config = {"host_cache_blocks": 6,  # evicts
                                                            "eagle_block_drop": eagle_rule}
        h = Harness(cfg, num_blocks=64, seed=3)
        h.connector._raw_events = raw
        published: list[bytes] = []

        class Pub:
            def publish(self, batch):
                published.append(ENC.encode(KVEventBatch(1.0, batch.events, 0)))

            def shutdown(self):
                pass

        h.scheduler.kv_event_publisher = Pub()
        rng = random.Random(3)
        shared = [rng.randrange(1, DRAFT_BASE) for _ in range(BLOCK_SIZE * 3)]
        for i in range(4):
            h.add(f"q{i}", shared + [rng.randrange(1, DRAFT_BASE) for _ in range(BLOCK_SIZE + 3)], max_tokens=40)
        h.run_until_done()
        h.connector.reset_cache()  # AllBlocksCleared
        h.add("again", shared + [1] * 5, max_tokens=2)
        h.run_until_done()
        batches[raw] = published
    if eagle_rule and LAYOUT_032:
        from kvslots.events import decode_batch

        def ours(bs, strip):
            evs = [e for b in bs for e in decode_batch(b).events]
            return [msgspec.structs.replace(e, lookahead_token_ids=None) if strip and hasattr(e, "lookahead_token_ids")
                    else e for e in evs]

        raw_events = ours(batches[True], strip=False)
        stored = [e for e in raw_events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
        assert stored and all(e.lookahead_token_ids is not None for e in stored)
        assert any(la for e in stored for la in e.lookahead_token_ids)  # some successor recorded
        assert ours(batches[True], strip=True) == ours(batches[False], strip=False)
    else:
        assert batches[True] == batches[False]
    events = [e for b in batches[False] for e in DEC.decode(b).events]
    assert sum(isinstance(e, BlockStored) for e in events) >= 4
    assert len({type(e).__name__ for e in events}) == 3  # stored, removed and cleared all seen


def test_vllms_zmq_publisher_sends_the_struct_bytes_for_raw_events():
    """vLLM's real ZmqEventPublisher, fed the connector's Raw events: what it sends (read back by
    its replay socket, as a late consumer does) is what it sends for the same events as structs."""
    import time

    import zmq
    from ports import free_port
    from vllm.distributed.kv_events import ZmqEventPublisher

    p = ConnectorPlanner(BS, 6, False)
    _fill(p, [([11, 12, 13], list(range(100, 100 + 3 * BS)), 7, None),
              ([21, 22, 23, 24], list(range(4 * BS)), None, 5)], clear_after=None)
    p.clear()
    structs = DEC.decode(p.events_msgpack(0.0, "CPU")).events
    raw = p.drain_events_raw(msgspec.Raw, "CPU")
    assert len(raw) == len(structs) >= 3
    rport = free_port()
    # Rank 0: vLLM offsets both ports by the data-parallel rank.
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{free_port()}",
                            replay_endpoint=f"tcp://*:{rport}", topic="kv")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        pub.publish(KVEventBatch(ts=1.0, events=list(structs)))
        pub.publish(KVEventBatch(ts=1.0, events=raw))
        deadline = time.monotonic() + 30
        while len(pub._buffer) < 2:  # both encoded by its thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(30_000)
            f = dealer.recv_multipart()
            if f[2] == ZmqEventPublisher.END_SEQ:
                break
            frames.append(f[3])
        assert len(frames) == 2
        if LAYOUT_032:
            assert frames[0] == frames[1]
        got = DEC.decode(frames[1])
        assert got.events == structs and got.data_parallel_rank == 0
    finally:
        dealer.close(linger=0)
        pub.shutdown()
