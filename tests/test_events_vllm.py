"""Interop with vLLM itself: its msgspec structs, and its ZmqEventPublisher on real sockets.

These tests import vLLM from the running environment and are skipped (with the reason shown by
``-ra``) only when it cannot be imported.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from vllm.distributed import kv_events as vke
except ImportError as exc:  # only a missing vLLM skips; any other failure is an error
    pytest.skip(f"vLLM is not importable here: {exc!r}", allow_module_level=True)

from kvslots import SlotManager
from kvslots._core import encode_event_batch
from kvslots.events import BlockStored, decode_batch, encode_batch, from_raw
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber

from test_events_wire import mediums, ranks, raw_events

from kvslots.vllm.compat import features
from ports import free_port

#: vLLM 0.32 writes BlockStored with a fixmap header, as kvslots does (0.33: map16).
LAYOUT_032 = not features().block_stored_lookahead
vllm_decoder = msgspec.msgpack.Decoder(vke.KVEventBatch)
vllm_encoder = msgspec.msgpack.Encoder()


def vllm_structs(raw, medium, as_bytes):
    """vLLM's own structs for the raw tuples, as the connector builds them (``from_raw``)."""
    return [from_raw(ev, medium, hashes_as_bytes=as_bytes, structs=vke) for ev in raw]


@settings(max_examples=150, deadline=None)
@given(raw_events, st.floats(allow_nan=False), mediums, ranks, st.booleans())
def test_rust_bytes_are_vllm_bytes(raw, ts, medium, rank, as_bytes):
    ours = encode_event_batch(
        raw, ts, medium=medium, data_parallel_rank=rank, hashes_as_bytes=as_bytes
    )
    expected = vllm_structs(raw, medium, as_bytes)
    theirs = vllm_encoder.encode(vke.KVEventBatch(ts, expected, rank))
    if LAYOUT_032:
        assert ours == theirs
    else:
        # vLLM 0.33's BlockStored has 15 fields: msgspec gives it a map16 header where ours (the
        # 0.32 layout) is a fixmap; the same values otherwise, which both decoders read.
        assert decode_batch(ours) == decode_batch(theirs)
        assert len(ours) == len(theirs) - 2 * sum(ev[0] == "BlockStored" for ev in raw)
    got = vllm_decoder.decode(ours)
    assert got.events == expected and got.ts == ts and got.data_parallel_rank == rank


def test_manager_batches_decode_with_vllm():
    m = SlotManager(16, 4)
    for i in range(3):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9 + i]
        m.create(f"r{i}", prompt, lora_id=7)
        m.reserve(f"r{i}", len(prompt) - m.slot_info(f"r{i}").committed)
        m.commit(f"r{i}", prompt[m.slot_info(f"r{i}").committed :])
    hashes = m.block_hashes("r0")
    batch = vllm_decoder.decode(m.drain_events_msgpack(123.0, vke.MEDIUM_CPU, 1))
    assert batch.ts == 123.0 and batch.data_parallel_rank == 1
    (ev,) = batch.events  # r1 and r2 share r0's two full blocks
    assert isinstance(ev, vke.BlockStored)
    assert ev.block_hashes == hashes and ev.parent_block_hash is None
    assert ev.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and ev.block_size == 4
    assert ev.lora_id == 7 and ev.medium == "CPU" and ev.lora_name is None
    assert ev.extra_keys is None and ev.group_idx is None


def test_vllm_batches_decode_with_ours():
    evs = [
        vke.BlockStored(
            block_hashes=[b"\x01" * 32, 5],
            parent_block_hash=2**64 - 1,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium=vke.MEDIUM_GPU,
            lora_name="adapter",
            extra_keys=[("adapter",), None],
            group_idx=1,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=None,
            locality="LOCAL",
            ownership=None,
            session_id="s1",
        ),
        vke.BlockRemoved(block_hashes=[5], medium=vke.MEDIUM_GPU, group_idx=1),
        vke.AllBlocksCleared(),
    ]
    payload = vllm_encoder.encode(vke.KVEventBatch(ts=9.5, events=evs, data_parallel_rank=2))
    ours = decode_batch(payload)
    assert ours.ts == 9.5 and ours.data_parallel_rank == 2
    stored, removed, cleared = ours.events
    assert isinstance(stored, BlockStored)
    for name in vke.BlockStored.__struct_fields__:
        assert getattr(stored, name) == getattr(evs[0], name), name
    assert removed.block_hashes == [5] and removed.group_idx == 1
    assert type(cleared).__name__ == "AllBlocksCleared"
    # Re-encoding what we decoded gives vLLM's bytes back (0.33: the same values; its
    # BlockStored header is map16, ours without lookahead tokens the 0.32 fixmap).
    if LAYOUT_032:
        assert encode_batch(ours) == payload
    else:
        assert vllm_decoder.decode(encode_batch(ours)) == vllm_decoder.decode(payload)


def test_our_subscriber_reads_vllm_zmq_publisher():
    port, rport = free_port(), free_port()
    pub = vke.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{rport}",
        buffer_steps=100,
        topic="kv",
    )
    got = []
    sub = EventSubscriber(lambda w, s, b: got.append((s, b)), replay_timeout_ms=3000)
    try:
        sent = []
        for i in range(5):  # published before we connect: these come back by replay
            b = vke.KVEventBatch(ts=float(i), events=vllm_structs(
                [("BlockStored", [i], None, [i, i], 2, None)], vke.MEDIUM_GPU, False))
            pub.publish(b)
            sent.append(vllm_encoder.encode(b))
        # vLLM's publisher sends from a thread: wait until it has sent (and buffered) these five,
        # or, on a loaded machine, they go out live after we connect and nothing is replayed.
        deadline = time.monotonic() + 10
        while pub._event_queue.unfinished_tasks:
            assert time.monotonic() < deadline, "vLLM's publisher thread sent nothing"
            time.sleep(0.01)
        sub.add_publisher("vllm", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", "kv",
                          start_seq=0)
        deadline = time.monotonic() + 10
        i = 5
        while sub.counters["received"] < 3:  # then live
            assert time.monotonic() < deadline, sub.counters
            b = vke.KVEventBatch(ts=float(i), events=[vke.BlockRemoved(block_hashes=[i],
                                                                       medium="GPU")])
            pub.publish(b)
            sent.append(vllm_encoder.encode(b))
            i += 1
            sub.poll_once(30)
        while len(got) < len(sent) or not sub.in_sync("vllm"):
            assert time.monotonic() < deadline, sub.counters
            sub.poll_once(30)
        assert [s for s, _ in got] == list(range(len(sent)))
        # vLLM's publisher filled in its rank before encoding; otherwise the same batches.
        if LAYOUT_032:
            assert [encode_batch(b) for _, b in got] == [
                vllm_encoder.encode(vllm_decoder.decode(p)) for p in sent
            ]
        else:
            assert [vllm_decoder.decode(encode_batch(b)) for _, b in got] == [
                vllm_decoder.decode(p) for p in sent
            ]
        assert all(b.data_parallel_rank == 0 for _, b in got)
        c = sub.counters
        assert c["replayed"] >= 5 and c["lost"] == c["malformed"] == c["resets"] == 0
    finally:
        sub.stop()
        pub.shutdown()


def test_vllm_style_consumer_reads_our_publisher():
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        m = SlotManager(8, 2)
        m.create("a", [1, 2, 3, 4, 5])
        m.reserve("a", 5)
        m.commit("a", [1, 2, 3, 4, 5])
        pub.publish(m.drain_events_msgpack(1.0, vke.MEDIUM_CPU, pub.data_parallel_rank))
        pub.publish(vke.KVEventBatch(ts=2.0, events=[vke.AllBlocksCleared()]))  # a vLLM struct
        assert pub.flush(5)
        # Everything was published before this consumer connected: read it all by replay,
        # with vLLM's decoder, exactly as a vLLM-events consumer does.
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(5000)
            f = dealer.recv_multipart()
            if f[2] == vke.ZmqEventPublisher.END_SEQ:
                assert f == [b"", b"", vke.ZmqEventPublisher.END_SEQ, b""]
                break
            frames.append(f)
        assert [(f[1], int.from_bytes(f[2], "big")) for f in frames] == [(b"kv", 0), (b"kv", 1)]
        first, second = (vllm_decoder.decode(f[3]) for f in frames)
        assert isinstance(first.events[0], vke.BlockStored)
        assert first.events[0].medium == "CPU" and first.data_parallel_rank == 0
        assert first.events[0].block_hashes == m.block_hashes("a")
        assert isinstance(second.events[0], vke.AllBlocksCleared) and second.ts == 2.0

        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        deadline = time.monotonic() + 5
        while not sub.poll(20):
            assert time.monotonic() < deadline
            pub.publish(vke.KVEventBatch(ts=3.0, events=[]))
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") >= 2
        assert vllm_decoder.decode(payload).events == []
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        pub.shutdown()
