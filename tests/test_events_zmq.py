"""Publisher and subscriber over real ZMQ sockets on loopback."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from kvslots import SlotManager
from kvslots.errors import (
    ArgumentTypeError,
    DuplicateWorkerError,
    EventDecodeError,
    InvalidArgumentError,
    InvalidStateError,
    UnknownWorkerError,
)
from kvslots.events import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    from_raw,
)
from kvslots.events.protocol import END_SEQ, is_bind_endpoint, offset_endpoint_port, replay_request, seq_bytes
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber

LOCAL = "tcp://127.0.0.1:0"


def wait_until(pred: Callable[[], bool], sub: EventSubscriber | None = None, timeout: float = 30.0,
               state: Callable[[], object] | None = None):
    """Polls ``sub`` (or sleeps, when it runs its own thread) until ``pred()`` or timeout. The
    deadline is generous: it costs nothing when the condition holds, and a full suite run on 2
    cores once took longer than 5 s to deliver over loopback. ``state()`` goes into the failure
    message (a timeout that was seen once under load, and never again, must say where it stuck)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in time; {state() if state else ''}")
        if sub is not None:
            sub.poll_once(10)
        else:
            time.sleep(0.005)


def batch(i: int, medium: str = "CPU") -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i], None, [i, i], 2, None, medium, None)])


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches: list[tuple[object, int, KVEventBatch]] = []
        self.resets: list[tuple[object, int, int]] = []

    def on_batch(self, worker, seq, b) -> None:
        with self.lock:
            self.batches.append((worker, seq, b))

    def on_reset(self, worker, last, new) -> None:
        with self.lock:
            self.resets.append((worker, last, new))

    def seqs(self, worker="w") -> list[int]:
        with self.lock:
            return [s for w, s, _ in self.batches if w == worker]


@pytest.fixture
def closing():
    """Registers publishers/subscribers/sockets to close at the end, then checks no thread leaked."""
    before = {t.ident for t in threading.enumerate()}
    things: list = []
    yield things.append
    for t in reversed(things):
        if isinstance(t, EventPublisher):
            t.shutdown()
        elif isinstance(t, EventSubscriber):
            t.stop()
        else:
            t.close(linger=0)
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


def new_pair(closing, *, replay=True, start_seq=0, **pub_kw):
    pub = EventPublisher(LOCAL, LOCAL if replay else None, **pub_kw)
    closing(pub)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset, replay_timeout_ms=1000)
    closing(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, pub.topic, start_seq=start_seq)
    return pub, sub, rec


def sync_live(pub: EventPublisher, sub: EventSubscriber, rec: Recorder) -> int:
    """Publishes until one batch arrives on the live stream (so the SUB is connected); earlier
    ones come by replay. Returns how many were published."""
    n = 0
    deadline = time.monotonic() + 5
    while sub.counters["received"] == 0:
        assert time.monotonic() < deadline, "live stream never connected"
        pub.publish(batch(n))
        n += 1
        sub.poll_once(20)
    wait_until(lambda: rec.seqs()[-1:] == [n - 1] and sub.in_sync("w"), sub)
    return n


# ---- protocol helpers ---------------------------------------------------------------------


def test_offset_endpoint_port_and_bind_rule():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://10.0.0.1:5557", 1) == "tcp://10.0.0.1:5558"
    assert offset_endpoint_port("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(InvalidArgumentError) as e:
        offset_endpoint_port("udp://x:1", 1)
    assert isinstance(e.value, ValueError)  # the builtin it used to be still catches it
    assert offset_endpoint_port("tcp://h:\u00b2", 1) == "tcp://h:\u00b2"  # "²".isdigit(), but no port
    assert is_bind_endpoint("tcp://*:5557")
    assert is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("inproc://x")
    assert is_bind_endpoint("tcp://127.0.0.1:0")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


# ---- round trip ----------------------------------------------------------------------------


def test_round_trip_objects_and_rust_bytes(closing):
    pub, sub, rec = new_pair(closing, data_parallel_rank=3, topic="kv@w")
    m = SlotManager(64, 2)
    sent: list[KVEventBatch] = []
    for i in range(40):
        if i % 2:
            m.create(f"r{i}", [i, i + 1, i + 2, 7, 7])
            m.reserve(f"r{i}", 5)
            m.commit(f"r{i}", [i, i + 1, i + 2, 7, 7])
            payload = m.drain_events_msgpack(float(i), "CPU", pub.data_parallel_rank)
            pub.publish(payload)
            sent.append(decode_batch(payload))
        else:
            b = batch(i)
            pub.publish(b)  # rank None: the publisher fills in its own
            sent.append(b)
    assert pub.flush(5)
    wait_until(lambda: len(rec.seqs()) == 40, sub)
    assert rec.seqs() == list(range(40))
    got = [b for _, _, b in rec.batches]
    assert got == sent
    assert all(b.data_parallel_rank == 3 for b in got)
    c = sub.counters
    assert c["applied"] == 40 and c["malformed"] == c["resets"] == c["lost"] == 0
    assert pub.stats()["next_seq"] == 40


def test_subscriber_thread_multiple_publishers_and_failing_callback(closing):
    pubs = [EventPublisher(LOCAL, LOCAL) for _ in range(3)]
    for p in pubs:
        closing(p)
    rec = Recorder()

    def on_batch(worker, seq, b):
        if worker == 1 and seq == 2:
            raise RuntimeError("consumer bug")
        rec.on_batch(worker, seq, b)

    sub = EventSubscriber(on_batch)
    closing(sub)
    for i, p in enumerate(pubs):
        sub.add_publisher(i, p.endpoint, p.replay_endpoint, start_seq=0)
    sub.start()
    for n in range(5):
        for p in pubs:
            p.publish(batch(n))
    wait_until(lambda: sub.counters["applied"] == 15, state=lambda: (
        sub.counters, [(sub.publisher_status(i), sub.publisher_counters(i), p.stats) for i, p in enumerate(pubs)]))
    assert rec.seqs(0) == rec.seqs(2) == [0, 1, 2, 3, 4]
    assert rec.seqs(1) == [0, 1, 3, 4]
    assert sub.counters["callback_errors"] == 1
    assert sub.publisher_counters(1)["callback_errors"] == 1

    sub.remove_publisher(2)
    wait_until(lambda: 2 not in sub.publishers())
    with pytest.raises(UnknownWorkerError) as e:
        sub.remove_publisher(2)
    assert isinstance(e.value, KeyError)
    with pytest.raises(DuplicateWorkerError) as e:
        sub.add_publisher(0, pubs[0].endpoint)
    assert isinstance(e.value, ValueError)
    assert sorted(sub.publishers()) == [0, 1]


# ---- gaps, replay, restarts ------------------------------------------------------------------


def test_gap_forced_by_dropping_messages_is_healed_by_replay(closing):
    pub, sub, rec = new_pair(closing)
    n = sync_live(pub, sub, rec)
    before = sub.counters
    pub._test_drop_on_wire(n + 2, n + 3, n + 7)
    for i in range(n, n + 12):
        pub.publish(batch(i))
    wait_until(lambda: len(rec.seqs()) == n + 12, sub)
    assert rec.seqs() == list(range(n + 12))
    assert [b.ts for _, _, b in rec.batches] == [float(i) for i in range(n + 12)]
    after = sub.counters
    assert after["gaps"] - before["gaps"] >= 1
    assert after["replayed"] - before["replayed"] >= 3
    assert after["lost"] == 0 and after["resets"] == 0
    assert pub.stats()["dropped_on_wire"] == 3


def test_gap_without_replay_endpoint_is_counted_lost(closing):
    pub, sub, rec = new_pair(closing, replay=False, start_seq=None)
    n = sync_live(pub, sub, rec)
    first = rec.seqs()[0]
    pub._test_drop_on_wire(n + 1)
    for i in range(n, n + 4):
        pub.publish(batch(i))
    wait_until(lambda: len(rec.seqs()) == n - first + 3, sub)
    assert rec.seqs()[-3:] == [n, n + 2, n + 3]
    assert sub.counters["gaps"] == 1 and sub.counters["lost"] == 1


def test_late_subscriber_catches_up_from_start_seq(closing):
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=5)
    closing(pub)
    for i in range(8):
        pub.publish(batch(i))
    assert pub.flush(5)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch)
    closing(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0)
    wait_until(lambda: sub.counters["replay_requests"] == 1 and sub.next_seq("w") == 8, sub)
    # Only the last 5 are still buffered: 0..2 are reported lost, 3..7 replayed.
    assert rec.seqs() == [3, 4, 5, 6, 7]
    assert sub.counters["lost"] == 3 and sub.counters["replayed"] == 5


def test_publisher_restart_is_detected(closing):
    pub1 = EventPublisher(LOCAL, LOCAL)
    closing(pub1)
    ep, rep = pub1.endpoint, pub1.replay_endpoint
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset, replay_timeout_ms=1000)
    closing(sub)
    sub.add_publisher("w", ep, rep, start_seq=0)
    n = sync_live(pub1, sub, rec)
    for i in range(n, 100):  # a long first life, so the new stream restarts well below it
        pub1.publish(batch(i))
    wait_until(lambda: len(rec.seqs()) == 100, sub)
    pub1.shutdown()

    # Same endpoints (bound: a host:port address would connect by vLLM's rule), seqs from 0.
    pub2 = EventPublisher(ep, rep, bind=True)
    closing(pub2)
    k = 0
    deadline = time.monotonic() + 5
    while not rec.resets:
        assert time.monotonic() < deadline, "restart never detected"
        pub2.publish(batch(1000 + k))
        k += 1
        sub.poll_once(20)
    (worker, last, new), = rec.resets
    assert worker == "w" and last == 99 and new < k
    for i in range(3):
        pub2.publish(batch(1000 + k + i))
    k += 3
    wait_until(lambda: rec.seqs()[100:] == list(range(k)), sub)
    # Everything of the second life arrives once, in order (the start by replay).
    assert [b.ts for _, _, b in rec.batches[100:]] == [float(1000 + i) for i in range(k)]
    assert sub.counters["resets"] == 1


# ---- options for consumers that must never miss a batch (the indexer) -----------------------


def test_raw_payloads_waiting_and_signals(closing):
    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    for i in range(3):
        pub.publish(batch(i))
    pub.publish(b"\x92\x00\x00")  # msgpack, not a batch: the consumer says so
    assert pub.flush(5)
    got: list[tuple[int, bytes]] = []
    counted: dict[str, int] = {}

    def on_batch(worker, seq, payload):
        assert isinstance(payload, bytes)
        if payload == b"\x92\x00\x00":
            raise EventDecodeError("not a batch")
        got.append((seq, payload))

    def on_count(worker, name, n):
        counted[name] = counted.get(name, 0) + n

    sub = EventSubscriber(on_batch, decode=False, on_count=on_count)
    closing(sub)
    sub.start()
    # wait=: back once the catch-up replay is done, everything before it applied.
    assert sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=5)
    assert [s for s, _ in got] == [0, 1, 2] and decode_batch(got[2][1]).ts == 2.0
    st = sub.publisher_status("w")
    assert st["next_seq"] == 4 and st["malformed"] == 1 and st["applied"] == 3
    assert st["last_live_seq"] is None and not st["replaying"] and st["in_sync"]
    assert counted == {k: v for k, v in sub.counters.items() if v}

    assert sub.remove_publisher("w", wait=5)
    pub.publish(batch(9))
    assert pub.flush(5)
    time.sleep(0.05)
    assert len(got) == 3  # no callback once remove_publisher(wait=) returned

    with pytest.raises(InvalidArgumentError) as e:  # a connection that cannot be made: wait= says so
        sub.add_publisher("bad", "tcp://-bad_host:1", wait=5)
    assert isinstance(e.value.__cause__, zmq.ZMQError) and "-bad_host" in str(e.value)
    assert sub.publishers() == []


def test_resync_on_loss_when_resuming_past_the_buffer(closing):
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=3)
    closing(pub)
    for i in range(10):
        pub.publish(batch(i))
    assert pub.flush(5)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset, resync_on_loss=True)
    closing(sub)
    # The consumer holds 0..4 (a shared index resuming from its cursor): 5 and 6 are gone, so
    # what it holds must be dropped and rebuilt from the buffer (7..9).
    assert sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=5, wait=5)
    assert rec.resets == [("w", 4, 7)] and rec.seqs() == [7, 8, 9]
    c = sub.counters
    assert c["resyncs"] == 1 and c["lost"] == 2 and c["resets"] == 1

    # From nothing (start_seq=0), what precedes the buffer is no loss.
    rec2 = Recorder()
    sub2 = EventSubscriber(rec2.on_batch, rec2.on_reset, resync_on_loss=True)
    closing(sub2)
    assert sub2.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=5)
    assert rec2.resets == [] and rec2.seqs() == [7, 8, 9] and sub2.counters["gaps"] == 0


def test_resuming_below_start_seq_is_a_restart(closing):
    xpub, ep, _ = raw_xpub(closing)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset)
    closing(sub)
    # A consumer that resumes at 50, from a publisher that never showed it 49 or later: a live
    # 3 is a new publisher instance, not a batch lagging behind a replay.
    sub.add_publisher("w", ep, start_seq=50)
    subscribed(xpub, sub)
    xpub.send_multipart([b"", seqb(49), encode_batch(batch(49))])  # the last one we hold
    xpub.send_multipart([b"", seqb(50), encode_batch(batch(50))])
    wait_until(lambda: rec.seqs() == [50], sub)
    assert sub.counters["duplicates"] == 1 and rec.resets == []

    xpub, ep, _ = raw_xpub(closing)
    sub2 = EventSubscriber(rec.on_batch, rec.on_reset)
    closing(sub2)
    sub2.add_publisher("v", ep, start_seq=50)
    subscribed(xpub, sub2)
    xpub.send_multipart([b"", seqb(3), encode_batch(batch(3))])
    wait_until(lambda: rec.resets == [("v", 49, 3)], sub2)
    wait_until(lambda: rec.seqs("v") == [3], sub2)


def test_reset_on_reconnect_catches_a_restart_already_past_our_seq(closing):
    pub1 = EventPublisher(LOCAL, LOCAL)
    closing(pub1)
    ep, rep = pub1.endpoint, pub1.replay_endpoint
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset, replay_timeout_ms=1000, reset_on_reconnect=True)
    closing(sub)
    sub.add_publisher("w", ep, rep, start_seq=0)
    n = sync_live(pub1, sub, rec)
    pub1.shutdown()

    # The new instance publishes more than the old one did before we hear from it: its
    # numbers are past ours, so only the lost connection tells us it is not the old one.
    pub2 = EventPublisher(ep, rep, bind=True)
    closing(pub2)
    for i in range(n + 5):
        pub2.publish(batch(1000 + i))
    assert pub2.flush(5)
    k = n + 5
    deadline = time.monotonic() + 5
    while not rec.resets:
        assert time.monotonic() < deadline, "restart never detected"
        pub2.publish(batch(1000 + k))
        k += 1
        sub.poll_once(20)
    assert rec.resets[0][:2] == ("w", n - 1)
    wait_until(lambda: rec.seqs()[n:] == list(range(k)), sub)
    assert [b.ts for _, _, b in rec.batches[n:]] == [float(1000 + i) for i in range(k)]
    assert sub.counters["resets"] == 1


# ---- hostile input ---------------------------------------------------------------------------


def raw_xpub(closing) -> tuple[zmq.Socket, str, zmq.Context]:
    """A bound XPUB: unlike PUB, it tells us when the subscriber's subscription has arrived."""
    ctx = zmq.Context()
    closing(_Ctx(ctx))
    sock = ctx.socket(zmq.XPUB)
    closing(sock)
    sock.bind(LOCAL)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), ctx


class _Ctx:
    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx

    def close(self, linger=0) -> None:
        self.ctx.term()


def subscribed(xpub: zmq.Socket, sub: EventSubscriber) -> None:
    wait_until(lambda: xpub.poll(0) != 0, sub)
    assert xpub.recv()[:1] == b"\x01"


def raw_publisher_and_subscriber(closing) -> tuple[zmq.Socket, EventSubscriber, Recorder]:
    """A raw XPUB standing for a publisher, and a subscriber to it as worker "w", subscribed."""
    xpub, ep, _ = raw_xpub(closing)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset)
    closing(sub)
    sub.add_publisher("w", ep)
    subscribed(xpub, sub)
    return xpub, sub, rec


def seqb(n: int) -> bytes:
    return n.to_bytes(8, "big")


# A batch whose event tag is not UTF-8, and one whose extra_keys nest 100,000 deep: msgspec
# raises UnicodeDecodeError and RecursionError for these, not DecodeError.
BAD_UTF8_BATCH = b"\x93\x00\x91\x81\xa4type\xa2\xff\xfe\xc0"
DEEP_BATCH = (b"\x93\x00\x91\x87\xa4type\xabBlockStored\xacblock_hashes\x90\xb1parent_block_hash\xc0"
              b"\xa9token_ids\x90\xaablock_size\x01\xa7lora_id\xc0\xaaextra_keys\x91" + b"\x91" * 100_000 + b"\xc0\xc0")


def test_frames_with_bad_utf8_or_deep_nesting_are_counted_malformed(closing):
    """A peer's batch with a string that is not UTF-8, or nested past the recursion limit, is
    counted malformed and skipped; poll_once raised UnicodeDecodeError / RecursionError."""
    xpub, sub, rec = raw_publisher_and_subscriber(closing)
    xpub.send_multipart([b"", seqb(0), BAD_UTF8_BATCH])
    xpub.send_multipart([b"", seqb(1), DEEP_BATCH])
    xpub.send_multipart([b"", seqb(2), encode_batch(batch(2))])
    wait_until(lambda: rec.seqs() == [2], sub)
    c = sub.counters
    assert c["malformed"] == 2 and c["applied"] == 1 and c["received"] == 3


def test_garbage_frames_are_counted_and_skipped(closing):
    xpub, sub, rec = raw_publisher_and_subscriber(closing)
    good = [encode_batch(batch(i)) for i in range(4)]
    xpub.send_multipart([b"only-topic"])
    xpub.send_multipart([b"", seqb(0)])
    xpub.send_multipart([b"", seqb(0), good[0], b"extra"])
    xpub.send_multipart([b"", b"\x00" * 7, good[0]])
    xpub.send_multipart([b"", seqb(0), b"\xc1 not msgpack"])  # uses up seq 0
    xpub.send_multipart([b"", seqb(1), msgspec.msgpack.encode({"a": 1})])  # wrong schema
    xpub.send_multipart([b"", seqb(2), good[2]])
    xpub.send_multipart([b"", seqb(3), good[3]])
    wait_until(lambda: rec.seqs() == [2, 3], sub)
    c = sub.counters
    assert c["malformed"] == 6 and c["received"] == 4 and c["applied"] == 2
    assert c["gaps"] == c["resets"] == c["lost"] == 0

    # Duplicates: the same batch again under the same number is dropped.
    xpub.send_multipart([b"", seqb(3), good[3]])
    xpub.send_multipart([b"", seqb(2), good[2]])
    xpub.send_multipart([b"", seqb(4), encode_batch(batch(4))])
    wait_until(lambda: rec.seqs() == [2, 3, 4], sub)
    assert sub.counters["duplicates"] == 2 and sub.counters["resets"] == 0

    # A different batch under an old number: the publisher restarted.
    xpub.send_multipart([b"", seqb(0), encode_batch(batch(100))])
    wait_until(lambda: rec.resets == [("w", 4, 0)], sub)
    assert rec.seqs()[-1] == 0 and rec.batches[-1][2].ts == 100.0


@pytest.mark.parametrize("style", ["vllm-0.32", "older"])
def test_replay_socket_formats_garbage_and_timeout(closing, style):
    xpub, ep, ctx = raw_xpub(closing)
    router = ctx.socket(zmq.ROUTER)
    closing(router)
    router.bind(LOCAL)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, replay_timeout_ms=300)
    closing(sub)
    sub.add_publisher("w", ep, router.getsockopt_string(zmq.LAST_ENDPOINT))
    subscribed(xpub, sub)

    def reply(ident: bytes, seq: bytes, payload: bytes) -> None:
        topic = [b""] if style == "vllm-0.32" else []
        router.send_multipart([ident, b"", *topic, seq, payload])

    # Gap 1: healed by a replay that also carries garbage.
    xpub.send_multipart([b"", seqb(0), encode_batch(batch(0))])
    xpub.send_multipart([b"", seqb(2), encode_batch(batch(2))])
    wait_until(lambda: router.poll(0) != 0, sub)
    ident, empty, start = router.recv_multipart()
    assert empty == b"" and int.from_bytes(start, "big") == 1
    router.send_multipart([ident, b"junk"])
    router.send_multipart([ident, b"", b"short", b"x"])
    reply(ident, seqb(0), encode_batch(batch(0)))  # already applied: duplicate
    reply(ident, seqb(1), encode_batch(batch(1)))
    reply(ident, seqb(2), encode_batch(batch(2)))
    reply(ident, END_SEQ, b"")
    wait_until(lambda: rec.seqs() == [0, 1, 2] and sub.in_sync("w"), sub)
    c = sub.counters
    assert c["replayed"] == 2 and c["malformed"] == 2 and c["duplicates"] == 2
    assert c["lost"] == 0 and c["replay_failures"] == 0

    # Gap 2: the replay socket never answers; after the timeout the gap is given up as lost.
    xpub.send_multipart([b"", seqb(5), encode_batch(batch(5))])
    wait_until(lambda: rec.seqs() == [0, 1, 2, 5], sub, timeout=3)
    c = sub.counters
    assert c["replay_failures"] == 1 and c["lost"] == 2 and c["gaps"] == 2


def test_replies_dropped_by_the_router_are_asked_again(closing):
    # vLLM's ROUTER keeps ZMQ's default send high-water mark, so a long replay can lose replies
    # (its end marker too). They are still in the publisher's buffer: nothing is lost.
    xpub, ep, ctx = raw_xpub(closing)
    router = ctx.socket(zmq.ROUTER)
    closing(router)
    router.setsockopt(zmq.SNDHWM, 50)
    router.bind(LOCAL)
    payloads = [encode_batch(batch(i)) for i in range(400)]
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset, replay_timeout_ms=200, resync_on_loss=True)
    closing(sub)
    sub.add_publisher("w", ep, router.getsockopt_string(zmq.LAST_ENDPOINT))
    subscribed(xpub, sub)
    xpub.send_multipart([b"", seqb(0), payloads[0]])
    wait_until(lambda: rec.seqs() == [0], sub)
    xpub.send_multipart([b"", seqb(399), payloads[399]])

    def serve() -> bool:
        while router.poll(0):
            ident, _, start = router.recv_multipart()
            for i in range(int.from_bytes(start, "big"), 400):
                router.send_multipart([ident, b"", b"", seqb(i), payloads[i]], zmq.NOBLOCK)
            router.send_multipart([ident, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
        return rec.seqs() == list(range(400)) and sub.in_sync("w")

    wait_until(serve, sub, timeout=20)
    c = sub.counters
    assert c["lost"] == c["resets"] == c["replay_failures"] == 0 and c["replay_requests"] >= 1


def test_replay_protocol_on_the_wire(closing):
    pub = EventPublisher(LOCAL, LOCAL, topic="kv")
    closing(pub)
    payloads = [encode_batch(batch(i)) for i in range(5)]
    for p in payloads:
        pub.publish(p)
    assert pub.flush(5)
    ctx = zmq.Context()
    closing(_Ctx(ctx))
    dealer = ctx.socket(zmq.DEALER)
    closing(dealer)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", b"\x00\x00"])  # malformed: ignored, the publisher carries on
    dealer.send_multipart([b"", seqb(3)])
    got = []
    while True:
        assert dealer.poll(5000), "no replay reply"
        got.append(dealer.recv_multipart())
        if got[-1][2] == END_SEQ:
            break
    assert got == [
        [b"", b"kv", seqb(3), payloads[3]],
        [b"", b"kv", seqb(4), payloads[4]],
        [b"", b"", END_SEQ, b""],
    ]
    assert pub.stats()["replay_malformed"] == 1 and pub.stats()["replayed"] == 2


def test_connect_mode_publisher_reaches_a_binding_subscriber(closing):
    ctx = zmq.Context()
    closing(_Ctx(ctx))
    sub = ctx.socket(zmq.SUB)
    closing(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOCAL)
    ep = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    assert not is_bind_endpoint(ep)
    pub = EventPublisher(ep, data_parallel_rank=0)  # connects
    closing(pub)
    assert pub.endpoint == ep
    deadline = time.monotonic() + 5
    i = 0
    while not sub.poll(20):
        assert time.monotonic() < deadline
        pub.publish(batch(i))
        i += 1
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and len(seq) == 8 and decode_batch(payload).data_parallel_rank == 0


def test_publish_rejects_wrong_types_and_closed_publisher(closing):
    pub = EventPublisher(LOCAL)
    closing(pub)
    with pytest.raises(ArgumentTypeError):
        pub.publish("not a batch")  # type: ignore[arg-type]
    pub.publish(bytearray(encode_batch(batch(0))))
    assert pub.flush(5) and pub.stats()["published"] == 1
    pub.shutdown()
    pub.shutdown()  # idempotent
    b = KVEventBatch(1.0, [], None)
    with pytest.raises(InvalidStateError) as e:
        pub.publish(b)
    assert isinstance(e.value, RuntimeError) and b.data_parallel_rank is None  # untouched


def test_stop_from_a_callback_and_poll_after_stop(closing):
    pub, _, _ = new_pair(closing)
    sub_holder: list[EventSubscriber] = []

    def on_batch(worker, seq, b):
        sub_holder[0].stop()  # from the poll thread itself

    sub = EventSubscriber(on_batch)
    sub_holder.append(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0)
    sub.start()
    with pytest.raises(InvalidStateError):
        sub.poll_once(0)  # the subscriber runs its own thread
    with pytest.raises(InvalidStateError):
        sub.start()
    pub.publish(batch(0))
    wait_until(lambda: not any(t.name == "kvslots-event-subscriber" for t in threading.enumerate()))
    with pytest.raises(InvalidStateError):
        sub.poll_once(0)
    for call in (sub.start, lambda: sub.add_publisher("v", pub.endpoint)):
        with pytest.raises(InvalidStateError):
            call()
    sub.stop()  # idempotent


# ---- hostile arguments: a kvslots error, nothing opened or changed --------------------------


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


class _RaisingEvents(list):
    def __iter__(self):
        raise ZeroDivisionError("boom")


@pytest.mark.parametrize(
    ("call", "cls"),
    [
        (lambda: from_raw(("X",), None), EventDecodeError),
        (lambda: from_raw((), None), EventDecodeError),
        (lambda: from_raw(("BlockStored", [1]), None), EventDecodeError),
        (lambda: from_raw(("BlockRemoved", [1], 2), None), EventDecodeError),
        (lambda: from_raw(("AllBlocksCleared", 1), None), EventDecodeError),
        (lambda: from_raw(("BlockRemoved", [-1]), None, hashes_as_bytes=True), EventDecodeError),
        (lambda: from_raw(("AllBlocksCleared",), None, structs=object()), EventDecodeError),
        (lambda: from_raw(None, None), ArgumentTypeError),
        # A medium or flag of the wrong type went into the struct: encoded, then undecodable.
        (lambda: from_raw(("BlockRemoved", [1]), 5), ArgumentTypeError),
        (lambda: from_raw(("BlockRemoved", [1]), b"CPU"), ArgumentTypeError),
        (lambda: from_raw(("BlockRemoved", [1]), "\ud800"), InvalidArgumentError),
        (lambda: from_raw(("BlockRemoved", [1]), None, hashes_as_bytes="yes"), ArgumentTypeError),
        (lambda: decode_batch(b"\xc1"), EventDecodeError),
        (lambda: decode_batch(b"\x92\x00\x00"), EventDecodeError),  # msgpack, not a batch
        (lambda: decode_batch("x"), ArgumentTypeError),
        (lambda: decode_batch(memoryview(b"\x93\x00\x90\xc0\xc0")[::2]), ArgumentTypeError),  # not contiguous
        (lambda: decode_batch(BAD_UTF8_BATCH), EventDecodeError),  # was UnicodeDecodeError
        (lambda: decode_batch(DEEP_BATCH), EventDecodeError),  # was RecursionError
        (lambda: encode_batch(None), ArgumentTypeError),
        (lambda: encode_batch(KVEventBatch(0.0, [BlockStored([1], None, [object()], 2, None, None, None)])),
         ArgumentTypeError),
        (lambda: encode_batch(KVEventBatch(0.0, [BlockStored([2**70], None, [1], 2, None, None, None)])),
         InvalidArgumentError),
        # Nesting past the recursion limit (or circular) was a RecursionError, an events object
        # whose __iter__ raises its own error.
        (lambda: encode_batch(KVEventBatch(0.0, [BlockStored([1], None, [1], 1, None, None, None,
                                                             extra_keys=[(_nested(100_000),)])])),
         InvalidArgumentError),
        (lambda: encode_batch(KVEventBatch(0.0, _RaisingEvents())), ArgumentTypeError),
        (lambda: external_block_hash(None), ArgumentTypeError),
        (lambda: external_block_hash("ab"), ArgumentTypeError),
        (lambda: offset_endpoint_port("tcp://h:5", "1"), ArgumentTypeError),
        (lambda: offset_endpoint_port("tcp://h:" + "9" * 5000, 1), InvalidArgumentError),  # was ValueError
        (lambda: is_bind_endpoint(None), ArgumentTypeError),
        (lambda: seq_bytes(-1), InvalidArgumentError),
        (lambda: replay_request("x"), ArgumentTypeError),
    ],
)
def test_codec_and_protocol_raise_kvslots_errors(call, cls):
    with pytest.raises(cls) as e:
        call()
    assert type(e.value) is cls


def test_codec_still_reads_what_it_should():
    assert from_raw(("AllBlocksCleared",), None) == AllBlocksCleared()
    ev = from_raw(("BlockStored", [1], None, [1, 2], 2, None, [[7]]), "CPU", hashes_as_bytes=True)
    assert ev.block_hashes == [(1).to_bytes(8, "big")] and ev.lookahead_token_ids == [[7]]
    assert decode_batch(bytearray(encode_batch(batch(3)))) == batch(3)
    assert external_block_hash(b"\x01" * 9) == int.from_bytes(b"\x01" * 8, "big")
    assert external_block_hash(-1) == 2**64 - 1


_GOOD_STORED = ("BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, [[9], []])


@pytest.mark.parametrize(("item", "value", "named"), [
    (1, ["x", 2], "block_hashes[0]"), (1, [1, -1], "block_hashes[1]"), (1, [2**64, 2], "block_hashes[0]"),
    (1, [True, 2], "block_hashes[0]"), (1, [1.0, 2], "block_hashes[0]"), (1, "ab", "block_hashes"),
    (2, -5, "parent_block_hash"), (2, "p", "parent_block_hash"), (3, [5, 6, 7, 2**32], "token_ids[3]"),
    (3, [5, None, 7, 8], "token_ids[1]"), (3, {5: 6}, "token_ids"), (4, -1, "block_size"), (4, 2**32, "block_size"),
    (4, 2.0, "block_size"),
    (4, False, "block_size"), (5, -1, "lora_id"), (5, "l", "lora_id"), (6, [[9]], "lookahead_token_ids"),
    (6, "ab", "lookahead_token_ids"), (6, [[9], [1, 2]], "lookahead_token_ids[1]"),
    (6, [[9], [2**32 - 1]], "lookahead_token_ids[1][0]"), (6, [[9], 3], "lookahead_token_ids[1]"),
])
def test_from_raw_checks_the_tuples_items(item, value, named):
    # Only the tuple's shape was checked: a string token or a negative hash went into the
    # struct, and out in a batch no subscriber could decode.
    raw = list(_GOOD_STORED)
    raw[item] = value
    with pytest.raises(EventDecodeError, match=re.escape(named)) as e:
        from_raw(tuple(raw), "CPU")
    assert type(e.value) is EventDecodeError and "\n" not in str(e.value)
    with pytest.raises(EventDecodeError, match="block_hashes"):
        from_raw(("BlockRemoved", [1, -2]), None)
    ok = from_raw(_GOOD_STORED, "CPU")
    assert ok.block_hashes == [1, 2] and ok.lookahead_token_ids == [[9], []]
    assert from_raw(("BlockStored", (2**64 - 1,), 0, (0, 2**32 - 1), 2, 0, None), None).block_size == 2


@pytest.mark.parametrize(
    ("kwargs", "cls", "fragment"),
    [
        ({"buffer_steps": 0}, InvalidArgumentError, "buffer_steps"),
        ({"buffer_steps": 2**40}, InvalidArgumentError, "buffer_steps"),
        ({"endpoint": "udp://127.0.0.1:1"}, InvalidArgumentError, "must start with tcp://"),
        ({"endpoint": 5}, ArgumentTypeError, "endpoint must be a str"),
        ({"endpoint": "tcp://127.0.0.1:99999"}, InvalidArgumentError, "past 65535"),
        ({"endpoint": "tcp://127.0.0.1:65535", "data_parallel_rank": 1}, InvalidArgumentError, "past 65535"),
        # int() refuses a port of 4300 digits or more: that ValueError escaped.
        ({"endpoint": "tcp://127.0.0.1:" + "9" * 5000}, InvalidArgumentError, "past 65535"),
        ({"replay_endpoint": "tcp://127.0.0.1:" + "1" * 5000}, InvalidArgumentError, "past 65535"),
        ({"replay_endpoint": "udp://x:1"}, InvalidArgumentError, "replay_endpoint"),
        # ZMQ reads a C string: it bound tcp://127.0.0.1:0, or ipc:///tmp/kvs, silently.
        ({"endpoint": "tcp://127.0.0.1:0\x00:5557"}, InvalidArgumentError, "NUL"),
        ({"endpoint": "ipc:///tmp/kvslots-nul\x00x"}, InvalidArgumentError, "NUL"),
        ({"replay_endpoint": "tcp://127.0.0.1:0\x00"}, InvalidArgumentError, "replay_endpoint"),
        ({"topic": "\ud800"}, InvalidArgumentError, "topic must be valid Unicode"),
        ({"topic": b"kv"}, ArgumentTypeError, "topic must be a str"),
        ({"hwm": 2**64}, InvalidArgumentError, "hwm must be in [1, 1000000]"),
        ({"hwm": -1}, InvalidArgumentError, "hwm"),
        ({"max_queue_size": 0}, InvalidArgumentError, "max_queue_size"),
        ({"data_parallel_rank": -1}, InvalidArgumentError, "data_parallel_rank"),
        ({"data_parallel_rank": "1"}, ArgumentTypeError, "data_parallel_rank"),
        ({"bind": "yes"}, ArgumentTypeError, "bind must be a bool"),
        ({"linger_ms": 1.5}, ArgumentTypeError, "linger_ms"),
        ({"linger_ms": -2}, InvalidArgumentError, "linger_ms"),
        # Only ZMQ can tell: its error becomes the cause, every socket is closed.
        ({"endpoint": "tcp://-bad_host:1"}, InvalidArgumentError, "cannot open the event publisher"),
        ({"replay_endpoint": "tcp://no-such-host.invalid:1"}, InvalidArgumentError, "cannot open the event publisher"),
        # No host holds a space or a newline: refused before ZMQ (kvslots serve passed one on to vLLM).
        ({"endpoint": "tcp://no such host:1"}, InvalidArgumentError, "spaces or control characters"),
        ({"replay_endpoint": "tcp://a\nb:1"}, InvalidArgumentError, "spaces or control characters"),
    ],
)
def test_publisher_arguments_raise_kvslots_errors_and_leak_nothing(closing, kwargs, cls, fragment):
    ctx = zmq.Context()
    kwargs = {"endpoint": LOCAL, **kwargs}
    with pytest.raises(cls) as e:
        EventPublisher(context=ctx, **kwargs)
    assert type(e.value) is cls and fragment in str(e.value)
    # term() waits for every socket of the context: one left open would hang it.
    t = threading.Thread(target=ctx.term)
    t.start()
    t.join(5)
    assert not t.is_alive(), "a socket was left open"


def test_publisher_context_of_the_wrong_type(closing):
    with pytest.raises(ArgumentTypeError):
        EventPublisher(LOCAL, context="ctx")  # type: ignore[arg-type]


def test_publish_and_flush_arguments(closing):
    pub = EventPublisher(LOCAL)
    closing(pub)
    mv = memoryview(b"abc")
    mv.release()
    with pytest.raises(InvalidArgumentError):
        pub.publish(mv)
    for bad in ("x", None, 3):
        with pytest.raises(ArgumentTypeError):
            pub.publish(bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        pub.flush("x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pub.flush(float("nan"))
    with pytest.raises(ArgumentTypeError):
        pub.shutdown("x")  # type: ignore[arg-type]

    class RankRaises(msgspec.Struct):
        ts: float

        @property
        def data_parallel_rank(self):
            raise ZeroDivisionError("boom")

    with pytest.raises(ArgumentTypeError, match="data_parallel_rank"):  # was ZeroDivisionError
        pub.publish(RankRaises(0.0))
    assert pub.stats()["queued"] == 0 and pub.next_seq == 0
    assert pub.flush(float("inf")) and pub.flush(-1)


@pytest.mark.parametrize(
    ("kwargs", "cls", "fragment"),
    [
        ({"replay_max_attempts": 0}, InvalidArgumentError, "replay_max_attempts"),
        ({"replay_max_attempts": 1.0}, ArgumentTypeError, "replay_max_attempts"),
        ({"replay_max_rate": 0}, InvalidArgumentError, "replay_max_rate"),
        ({"replay_max_rate": float("inf")}, InvalidArgumentError, "replay_max_rate"),
        ({"replay_backoff_ms": 10, "replay_backoff_max_ms": 5}, InvalidArgumentError, "replay_backoff_max_ms"),
        ({"replay_timeout_ms": 0}, InvalidArgumentError, "replay_timeout_ms"),
        ({"replay_timeout_ms": "x"}, ArgumentTypeError, "replay_timeout_ms"),
        ({"replay_max_wait_ms": float("nan")}, InvalidArgumentError, "replay_max_wait_ms"),
        ({"hwm": 2**64}, InvalidArgumentError, "hwm"),
        ({"decode": "no"}, ArgumentTypeError, "decode must be a bool"),
        ({"on_reset": 5}, ArgumentTypeError, "on_reset must be callable"),
        ({"on_count": 5}, ArgumentTypeError, "on_count must be callable"),
        ({"thread_name": None}, ArgumentTypeError, "thread_name"),
        ({"context": 1}, ArgumentTypeError, "context"),
    ],
)
def test_subscriber_arguments_raise_kvslots_errors(closing, kwargs, cls, fragment):
    with pytest.raises(cls) as e:
        EventSubscriber(lambda *a: None, **kwargs)
    assert type(e.value) is cls and fragment in str(e.value)
    with pytest.raises(ArgumentTypeError):
        EventSubscriber(None)  # type: ignore[arg-type]


def test_subscriber_calls_with_hostile_arguments_change_nothing(closing):
    sub = EventSubscriber(lambda *a: None)
    closing(sub)
    ep = "tcp://127.0.0.1:1"
    cases = [
        (lambda: sub.add_publisher("w", ep, start_seq=-1), InvalidArgumentError),
        (lambda: sub.add_publisher("w", ep, start_seq=1.5), ArgumentTypeError),
        (lambda: sub.add_publisher("w", "udp://127.0.0.1:1"), InvalidArgumentError),
        (lambda: sub.add_publisher("w", ep, "udp://127.0.0.1:2"), InvalidArgumentError),
        (lambda: sub.add_publisher("w", "tcp://127.0.0.1:" + "9" * 5000), InvalidArgumentError),  # was ValueError
        (lambda: sub.add_publisher("w", None), ArgumentTypeError),  # type: ignore[arg-type]
        (lambda: sub.add_publisher("w", ep + "\x00junk"), InvalidArgumentError),  # connected to ep
        (lambda: sub.add_publisher("w", ep, "ipc:///tmp/x\x00y"), InvalidArgumentError),
        (lambda: sub.add_publisher("w", ep, topic=5), ArgumentTypeError),  # type: ignore[arg-type]
        (lambda: sub.add_publisher("w", ep, topic="\ud800"), InvalidArgumentError),
        (lambda: sub.add_publisher([], ep), ArgumentTypeError),
        (lambda: sub.add_publisher("w", ep, wait="x"), ArgumentTypeError),
        (lambda: sub.remove_publisher("nope"), UnknownWorkerError),
        (lambda: sub.remove_publisher([]), ArgumentTypeError),
        (lambda: sub.publisher_status("nope"), UnknownWorkerError),
        (lambda: sub.publisher_counters("nope"), UnknownWorkerError),
        (lambda: sub.next_seq("nope"), UnknownWorkerError),
        (lambda: sub.in_sync("nope"), UnknownWorkerError),
        (lambda: sub.poll_once(-1), InvalidArgumentError),  # ZMQ would wait forever
        (lambda: sub.poll_once("x"), ArgumentTypeError),
        (lambda: sub.stop("x"), ArgumentTypeError),
    ]
    for call, cls in cases:
        with pytest.raises(cls) as e:
            call()
        assert type(e.value) is cls
        assert sub.publishers() == [] and sub.counters == dict.fromkeys(sub.counters, 0)
    assert sub.add_publisher("w", ep) and sub.poll_once(1) == 0
    assert sub.next_seq("w") is None
    assert sub.remove_publisher("w", wait=float("inf"))  # infinity: as long as it takes


class _EqRaises:
    """A worker id that hashes, and raises when compared with a key of equal hash."""

    def __hash__(self):
        return 1

    def __eq__(self, other):
        raise ZeroDivisionError("boom")


def test_worker_ids_whose_eq_raises_are_typed_and_change_nothing(closing):
    """A worker id whose __eq__ raises once compared with another key of its hash: add, remove
    and the queries raised that ZeroDivisionError; now ArgumentTypeError, nothing changed, and
    the publisher already added still works (the poll thread never compares worker ids)."""
    pub, sub, rec = new_pair(closing)
    first = _EqRaises()
    assert sub.add_publisher(first, pub.endpoint, pub.replay_endpoint, pub.topic, start_seq=0)
    for call in (lambda: sub.add_publisher(_EqRaises(), pub.endpoint), lambda: sub.remove_publisher(1),
                 lambda: sub.next_seq(_EqRaises()), lambda: sub.publisher_status(_EqRaises()),
                 lambda: sub.in_sync(1)):
        with pytest.raises(ArgumentTypeError, match="cannot be used as a key"):
            call()
        assert sub.publishers() == ["w", first]
    pub.publish(batch(0))

    def got(worker):
        with rec.lock:
            return [s for w, s, _ in rec.batches if w is worker]

    wait_until(lambda: got(first) == [0] and got("w") == [0], sub)
    assert sub.remove_publisher(first, wait=5.0)
    assert sub.publishers() == ["w"]


class _LyingStr(str):
    """A str subclass whose own methods lie (pyzmq and the checks called them)."""

    def encode(self, *args, **kwargs):
        return 5

    def startswith(self, *args):
        return True


def test_str_subclasses_are_read_by_their_text(closing):
    """Endpoints and topics that are str subclasses with lying methods: a udp:// endpoint
    passed the scheme check, and pyzmq raised TypeError on the encode() result (add_publisher
    left the publisher listed, never opened). Their text is what counts now."""
    with pytest.raises(InvalidArgumentError, match="must start with tcp://"):
        EventPublisher(_LyingStr("udp://127.0.0.1:1"))
    pub = EventPublisher(_LyingStr(LOCAL), _LyingStr(LOCAL), topic=_LyingStr("kv"))
    closing(pub)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, rec.on_reset)
    closing(sub)
    with pytest.raises(InvalidArgumentError, match="must start with tcp://"):
        sub.add_publisher("x", _LyingStr("udp://127.0.0.1:1"))
    assert sub.add_publisher("w", _LyingStr(pub.endpoint), _LyingStr(pub.replay_endpoint), _LyingStr("kv"),
                             start_seq=0, wait=5.0)
    assert sub.publishers() == ["w"]
    pub.publish(batch(0))
    wait_until(lambda: rec.seqs() == [0], sub)


def test_add_publisher_on_a_terminated_context_is_typed_and_not_listed(closing):
    """Making the SUB socket on a context the caller terminated raised ZMQError out of
    add_publisher (the publisher stayed listed, never opened); now InvalidArgumentError with
    ZMQ's error as its cause, as a failed connect is."""
    ctx = zmq.Context()
    ctx.term()
    sub = EventSubscriber(lambda *a: None, context=ctx)
    closing(sub)
    with pytest.raises(InvalidArgumentError, match="cannot connect") as e:
        sub.add_publisher("w", "tcp://127.0.0.1:1", wait=5.0)
    assert isinstance(e.value.__cause__, zmq.ZMQError)
    assert sub.publishers() == []
    assert sub.add_publisher("v", "tcp://127.0.0.1:1") and sub.poll_once(1) == 0  # without wait: dropped
    assert sub.publishers() == []


def test_a_flood_of_bad_frames_logs_a_bounded_number_of_lines(closing, caplog):
    """A publisher sending bad batches and restarting streams at will wrote one warning per frame
    (137,000 lines in 3 s through the indexer); now at most a burst per publisher and kind in each
    period, the counters still counting every one, and other publishers still logged."""
    import logging

    from kvslots import _ratelog

    xpub, sub, rec = raw_publisher_and_subscriber(closing)
    with caplog.at_level(logging.INFO, logger="kvslots.events.subscriber"):
        for i in range(300):
            xpub.send_multipart([b"", seqb(2 * i), b"\x92\x01"])  # not a batch
            xpub.send_multipart([b"", seqb(2 * i + 1), b"\xc1"])  # undecodable
        for i in range(300):  # a stream that starts over, again and again
            xpub.send_multipart([b"", seqb(0), encode_batch(batch(1000 + i))])
        wait_until(lambda: sub.counters["malformed"] == 600 and sub.counters["resets"] >= 290, sub)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvslots.events.subscriber"]
    malformed = [m for m in lines if "not a batch" in m or "undecodable" in m]
    resets = [m for m in lines if "starts over" in m]
    assert len(malformed) == _ratelog.BURST and len(resets) == _ratelog.BURST, lines
    assert "left out for up to" in malformed[-1]

    limiter = _ratelog.RateLimitedLog(logging.getLogger("kvslots.test.ratelog"), burst=2, period_s=0.2)
    with caplog.at_level(logging.INFO, logger="kvslots.test.ratelog"):
        caplog.clear()
        got = [limiter.log(logging.WARNING, "a", "m %d", i) for i in range(5)]
        assert got == [True, True, False, False, False] and limiter.log(logging.WARNING, "b", "other")
        time.sleep(0.25)
        assert limiter.log(logging.WARNING, "a", "again")
        assert caplog.records[-1].getMessage() == "again (3 such messages were left out before this one)"


def test_str_subclasses_hiding_a_lone_surrogate_are_refused_everywhere():
    """_args.text reads a subclass by its text, so an encode() that lies cannot hide a lone
    surrogate from any caller (the endpoint rules of the protocol and serve's included)."""
    from kvslots.events.protocol import is_ipv6, offset_endpoint_port, vllm_binds

    bad = _LyingStr("tcp://127.0.0.1:5557\udcff")
    for call in (lambda: vllm_binds(bad), lambda: is_ipv6(bad), lambda: offset_endpoint_port(bad, 1),
                 lambda: EventPublisher(LOCAL, topic=_LyingStr("kv\udcff"))):
        with pytest.raises(InvalidArgumentError, match="lone surrogates"):
            call()
    assert vllm_binds(_LyingStr("tcp://127.0.0.1:5557")) is False  # read as text: no '*' in it


class _Foreign(msgspec.Struct, array_like=True):  # vLLM's own KVEventBatch, as far as publish sees
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _FrozenForeign(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


def _circular() -> list:
    x: list = []
    x.append(x)
    return x


@pytest.mark.parametrize("make, err", [
    (lambda: KVEventBatch(1.0, [object()]), ArgumentTypeError),
    (lambda: KVEventBatch(1.0, [BlockStored([2**70], None, [1], 1, None, "CPU", None)]), InvalidArgumentError),
    (lambda: KVEventBatch(1.0, [BlockStored([1], None, [1], 1, None, "CPU", None, extra_keys=[_circular()])]),
     InvalidArgumentError),
    (lambda: _Foreign(1.0, [1j]), ArgumentTypeError),
    (lambda: _FrozenForeign(1.0, [object()]), ArgumentTypeError),
], ids=["object", "int-past-64-bits", "circular", "foreign-struct", "frozen-foreign-struct"])
def test_publish_refuses_a_batch_that_cannot_be_encoded(closing, make, err):
    # It was queued, then dropped by the sender thread and counted in errors: the caller never knew.
    pub, sub, rec = new_pair(closing, data_parallel_rank=2)
    b = make()
    with pytest.raises(err, match="cannot be encoded"):
        pub.publish(b)
    assert b.data_parallel_rank is None  # untouched
    st = pub.stats()
    assert st["queued"] == 0 and st["errors"] == 0 and pub.next_seq == 0
    pub.publish(batch(0))  # the next batch takes seq 0: no gap for the subscriber
    assert pub.flush(5)
    wait_until(lambda: rec.seqs() == [0], sub)
    assert pub.stats()["errors"] == 0 and pub.stats()["published"] == 1


def test_publish_encodes_foreign_and_frozen_structs_with_its_rank(closing):
    pub, sub, rec = new_pair(closing, data_parallel_rank=2)
    ev = BlockStored([5], None, [1, 2], 2, None, "CPU", None)
    a, f = _Foreign(1.0, [ev]), _FrozenForeign(2.0, [ev])
    pub.publish(a)
    pub.publish(f)
    assert a.data_parallel_rank == 2 and f.data_parallel_rank is None  # in place where it can be
    a.events.clear()  # what was published is what publish() saw
    assert pub.flush(5)
    wait_until(lambda: rec.seqs() == [0, 1], sub)
    got = [b for _, _, b in rec.batches]
    assert [(b.ts, b.events, b.data_parallel_rank) for b in got] == [(1.0, [ev], 2), (2.0, [ev], 2)]


# Run in a child: it lowers its own descriptor limit. Each publisher with a replay socket takes
# about 4 descriptors (SUB, monitor pair, DEALER); 120 of them cannot fit under 256.
_FD_EXHAUSTION = r"""
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from kvslots.errors import KVSlotsError
from kvslots.events.subscriber import EventSubscriber
sub = EventSubscriber(lambda *a: None)
sub.start()
refused = 0
for i in range(120):
    try:
        sub.add_publisher(f"w{i}", f"tcp://127.0.0.1:{20000 + i}", f"tcp://127.0.0.1:{21000 + i}", wait=5)
    except KVSlotsError:
        refused += 1
t0 = time.monotonic()
sub.stop()
print(f"refused={refused} stop_s={time.monotonic() - t0:.1f} thread_alive={sub._thread.is_alive()}")
"""


def test_running_out_of_descriptors_refuses_publishers_and_stop_still_returns():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "python"))
    out = subprocess.run([sys.executable, "-c", _FD_EXHAUSTION], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in line.split())
    # Some publishers were refused at add_publisher (the limit was reached), none broke the
    # loop, and stop() closed what was open instead of waiting for ever in ctx.term().
    assert int(fields["refused"]) > 0, line
    assert fields["thread_alive"] == "False", line
    assert float(fields["stop_s"]) < 10, line
    assert "event subscriber loop error" not in out.stderr, out.stderr[-3000:]


# Publishers and subscribers made in a loop until the limit: libzmq aborted the process ('Too many
# open files (src/epoll.cpp:38)') when a new context could not start its threads. Each kind in a
# child of its own, under a few limits.
_FD_LOOP = r"""
import resource, sys, zmq
limit, kind = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
from kvslots.errors import OutOfDescriptorsError
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber
shared = zmq.Context()
def make(i):
    if kind == "pub":
        return EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0" if i % 2 else None,
                              context=shared if i % 3 == 0 else None)
    s = EventSubscriber(lambda *a: None)
    try:
        s.add_publisher("w", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", wait=5)
    except BaseException:
        s.stop()
        raise
    return s
def close(o):
    o.shutdown() if kind == "pub" else o.stop()
made, err = [], None
for i in range(400):
    try:
        made.append(make(i))
    except OutOfDescriptorsError as e:
        err = e
        break
assert err is not None and err.errno == 24 and isinstance(err, OSError), err
for o in made:
    close(o)
close(make(1))  # what was given back can be used again
print(f"made={len(made)}")
"""


@pytest.mark.parametrize("kind", ["pub", "sub"])
def test_objects_made_in_a_loop_until_the_fd_limit_raise_instead_of_aborting(kind):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "python"))
    for limit in (40, 64, 100):
        out = subprocess.run([sys.executable, "-c", _FD_LOOP, str(limit), kind], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, (limit, out.returncode, out.stderr[-3000:])
        assert int(out.stdout.split("made=")[1]) > 0, (limit, out.stdout)


# ---- stop / shutdown that give up waiting, polls from several threads -----------------------


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def _fds_back_to(baseline: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while _open_fds() > baseline:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _Gate:
    """An on_batch that holds the polling thread inside the callback until released."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.active = 0
        self.overlaps = 0
        self.lock = threading.Lock()

    def __call__(self, worker, seq, b) -> None:
        with self.lock:
            self.active += 1
            self.overlaps += self.active > 1
        self.inside.set()
        self.release.wait(30)
        with self.lock:
            self.active -= 1


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_stop_that_does_not_wait_still_closes_every_socket(closing):
    # stop(timeout=0) returned before the poll thread ended and nothing closed its sockets, its
    # wake-up pipe or its context afterwards (a second stop() returns at once): 4 descriptors
    # leaked per subscriber. The thread now closes them as it ends.
    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    baseline = _open_fds()
    subs = []
    for _ in range(3):
        gate = _Gate()  # holds the poll thread in a callback: it cannot end before stop() returns
        sub = EventSubscriber(gate)
        subs.append(sub)
        sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=pub.next_seq, wait=10)
        sub.start()
        pub.publish(batch(0))
        assert gate.inside.wait(30)
        sub.stop(timeout=0)
        sub.stop()  # idempotent
        gate.release.set()
    assert _fds_back_to(baseline), f"{_open_fds() - baseline} descriptors left open"
    for sub in subs:
        sub._thread.join(30)
        assert not sub._thread.is_alive()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_shutdown_that_does_not_wait_still_closes_every_socket(closing):
    # shutdown(timeout=0) left the wake-up pipe and the context open unless shutdown was called
    # again: 3 descriptors per publisher. The sender thread now closes them as it ends.
    baseline = _open_fds()
    for _ in range(3):
        pub = EventPublisher(LOCAL, LOCAL)
        for i in range(50):
            pub.publish(batch(i))
        pub.shutdown(timeout=0)
    assert _fds_back_to(baseline), f"{_open_fds() - baseline} descriptors left open"


def _poll_in_thread(sub: EventSubscriber, gate: _Gate) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            while not gate.inside.is_set():
                out.append(sub.poll_once(20))
        except Exception as e:  # noqa: BLE001 - reported by the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_poll_once_from_a_second_thread_is_a_concurrent_use_error(closing):
    # Two threads in poll_once used the same ZMQ sockets at once: libzmq aborted the process
    # ("Bad address (src/fq.cpp:56)") within seconds, and callbacks ran on two threads at once.
    from kvslots.errors import ConcurrentUseError

    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    gate = _Gate()
    sub = EventSubscriber(gate)
    closing(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=10)
    for i in range(3):
        pub.publish(batch(i))
    t, out = _poll_in_thread(sub, gate)
    try:
        assert gate.inside.wait(30)
        with pytest.raises(ConcurrentUseError):
            sub.poll_once(0)
        with pytest.raises(ConcurrentUseError):
            sub.start()  # its thread would poll beside the other one
        # add_publisher(wait=...) polls too when there is no poll thread: it waits its turn
        # (here it times out, the other poll being held) instead of polling beside it.
        assert sub.add_publisher("v", pub.endpoint, wait=0.2) is False
        assert gate.overlaps == 0
    finally:
        gate.release.set()
        t.join(30)
    assert not t.is_alive() and not any(isinstance(x, BaseException) for x in out), out
    wait_until(lambda: sub.next_seq("w") == 3, sub)
    assert gate.overlaps == 0


def test_poll_once_from_its_own_callback_is_a_concurrent_use_error(closing):
    from kvslots.errors import ConcurrentUseError

    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    seen: list = []
    holder: list[EventSubscriber] = []

    def on_batch(worker, seq, b) -> None:
        try:
            holder[0].poll_once(0)
        except Exception as e:  # noqa: BLE001
            seen.append(type(e))
        else:
            seen.append(None)

    sub = EventSubscriber(on_batch)
    holder.append(sub)
    closing(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=10)
    pub.publish(batch(0))
    wait_until(lambda: seen, sub)
    assert seen == [ConcurrentUseError]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_stop_while_another_thread_polls_closes_after_that_poll(closing):
    # stop() closed the sockets under a poll_once running in another thread; it now leaves that
    # to the poll, which closes them as it returns.
    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    baseline = _open_fds()
    gate = _Gate()
    sub = EventSubscriber(gate)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=10)
    pub.publish(batch(0))
    t, out = _poll_in_thread(sub, gate)
    try:
        assert gate.inside.wait(30)
        sub.stop(timeout=0.05)
        assert _open_fds() > baseline  # still open: the other thread is inside its poll
    finally:
        gate.release.set()
        t.join(30)
    assert not t.is_alive() and not any(isinstance(x, BaseException) for x in out), out
    assert _fds_back_to(baseline), f"{_open_fds() - baseline} descriptors left open"
    with pytest.raises(InvalidStateError):
        sub.poll_once(0)


class _NotABatch(msgspec.Struct):
    a: int = 1


@pytest.mark.parametrize("make", [
    lambda: AllBlocksCleared(),  # an event, not a batch of them
    lambda: _NotABatch(),
    lambda: KVEventBatch(1.0, [1, 2]),  # events that are no events
    lambda: KVEventBatch(1.0, "abc"),
    lambda: KVEventBatch(1.0, {"a": 1}),
    lambda: KVEventBatch("x", []),  # a ts that is no number
    lambda: KVEventBatch(1.0, [], "r"),  # a rank that is no int
    lambda: KVEventBatch(1.0, [], True),
    lambda: KVEventBatch(1.0, [BlockStored(["h"], None, [1], 1, None, "CPU", None)]),  # a str hash
    lambda: _Foreign(1.0, [{"type": "Nope"}]),
], ids=["event", "other-struct", "int-events", "str-events", "dict-events", "str-ts", "str-rank", "bool-rank",
        "str-hash", "unknown-event"])
def test_publish_refuses_a_struct_no_subscriber_can_decode(closing, make):
    # Each was encoded, numbered and sent: every subscriber (and vLLM's decoder) counted it
    # malformed, a hole in the stream the publisher's caller never heard of.
    pub, sub, rec = new_pair(closing, data_parallel_rank=2)
    b = make()
    before = msgspec.structs.asdict(b) if isinstance(b, msgspec.Struct) else None
    with pytest.raises(InvalidArgumentError, match="not a KVEventBatch|events must be a list"):
        pub.publish(b)
    assert msgspec.structs.asdict(b) == before  # untouched (a rank of None stays None)
    st = pub.stats()
    assert st["queued"] == 0 and st["errors"] == 0 and pub.next_seq == 0
    pub.publish(batch(0))
    assert pub.flush(5)
    wait_until(lambda: rec.seqs() == [0], sub)
    assert sub.counters["malformed"] == 0


class _ReprRaises:
    def __repr__(self):
        raise ZeroDivisionError("repr")


class _HashRaisesLater:
    """Hashes until armed (after add_publisher), then raises."""

    armed = False

    def __hash__(self):
        if self.armed:
            raise ZeroDivisionError("hash")
        return 7


def test_worker_ids_whose_repr_or_later_hash_raises_are_never_formatted_or_hashed_by_the_loop(closing, capsys,
                                                                                                caplog):
    # An error message formatted the id with repr(): remove_publisher / publisher_status of an
    # unknown id and a failed add_publisher(wait=...) raised the id's own ZeroDivisionError, and
    # a duplicate was an ArgumentTypeError saying it could not be hashed. The poll loop formatted
    # it into every log line (a logging traceback on stderr per malformed frame) and hashed it
    # into its log limiter's keys (a hash that raises there was an "event subscriber loop error"
    # and the rest of the round was dropped).
    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    sub = EventSubscriber(lambda *a: None)
    closing(sub)
    for call, cls in [
        (lambda: sub.remove_publisher(_ReprRaises()), UnknownWorkerError),
        (lambda: sub.publisher_status(_ReprRaises()), UnknownWorkerError),
        (lambda: sub.add_publisher(_ReprRaises(), "tcp://127.0.0.1:", wait=5), InvalidArgumentError),
    ]:
        with pytest.raises(cls) as e:
            call()
        # Named by its type (errors.short_repr: reprlib's form for a repr that raises).
        assert type(e.value) is cls and "<_ReprRaises " in str(e.value)
    w = _ReprRaises()
    sub.add_publisher(w, pub.endpoint, wait=10)
    with pytest.raises(DuplicateWorkerError):
        sub.add_publisher(w, pub.endpoint)
    raws = []
    for wid in (w, _HashRaisesLater()):
        raw = zmq.Context.instance().socket(zmq.PUB)
        closing(raw)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        if wid is w:
            sub.remove_publisher(w, wait=10)
        sub.add_publisher(wid, f"tcp://127.0.0.1:{port}", wait=10)
        raws.append(raw)
        if isinstance(wid, _HashRaisesLater):
            wid.armed = True
    capsys.readouterr()
    seq = iter(range(10**6))

    def send_undecodable() -> bool:  # each a log line of the poll loop
        n = next(seq)
        for raw in raws:
            raw.send_multipart([b"", n.to_bytes(8, "big"), b"\xc1"])
        return sub.counters["malformed"] >= 6

    with caplog.at_level(logging.INFO, logger="kvslots.events.subscriber"):
        wait_until(send_undecodable, sub)
    assert "loop error" not in caplog.text
    assert "Logging error" not in capsys.readouterr().err


@pytest.mark.parametrize("events", [
    lambda evs: iter(evs),
    lambda evs: (e for e in evs),
    lambda evs: reversed(evs),
], ids=["iterator", "generator", "reversed"])
def test_a_batch_whose_events_are_an_iterator_is_refused_not_cut(events):
    # The scan for vLLM 0.32's layout took the first event off an iterator and encoded the
    # rest: a batch of 3 events went out with 2, silently (publish() too).
    evs = [BlockStored([i], None, [i], 1, None, "CPU", None) for i in range(3)]
    with pytest.raises(ArgumentTypeError, match="^the batch cannot be encoded: events must be a list"):
        encode_batch(KVEventBatch(1.0, events(evs)))
    pub = EventPublisher(LOCAL)
    try:
        with pytest.raises(ArgumentTypeError, match="events must be a list"):
            pub.publish(KVEventBatch(1.0, events(evs)))
        assert pub.stats()["queued"] == 0 and pub.next_seq == 0
    finally:
        pub.shutdown()
    assert decode_batch(encode_batch(KVEventBatch(1.0, tuple(evs)))).events == evs  # a tuple is an array


def test_wake_racing_close_never_writes_to_a_reused_descriptor(monkeypatch):
    # close() closed the write end, then set it to -1: a wake() from another thread in between
    # (a publish() or add_publisher() racing a shutdown / stop, now done by the loop thread as
    # it ends) wrote its byte into whatever the OS had just given that descriptor number to.
    import os

    from kvslots.events import _wakeup

    wp = _wakeup.WakePipe()
    write_fd = wp._w
    reused: list[tuple[int, int]] = []
    real_close = os.close

    def close(fd: int) -> None:
        real_close(fd)
        if fd == write_fd and not reused:
            r, w = os.pipe()  # the lowest free numbers: the one just closed among them
            reused.append((r, w))
            t = threading.Thread(target=wp.wake)
            t.start()
            t.join(5)

    monkeypatch.setattr(_wakeup.os, "close", close)
    wp.close()
    monkeypatch.undo()
    (r, w) = reused[0]
    try:
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 16)  # nothing was written into the new pipe
    finally:
        os.close(r)
        os.close(w)
    wp.wake()  # closed: a no-op
    wp.close()  # idempotent


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_a_callback_raising_a_base_exception_does_not_end_the_poll_thread(closing, exc):
    # SystemExit (or a KeyboardInterrupt raised by hand) from on_batch / on_count / on_reset
    # ended the poll thread, silently for SystemExit: no batch was delivered after it.
    pub = EventPublisher(LOCAL, LOCAL)
    closing(pub)
    got: list[int] = []
    raised = {"count": False}

    def on_batch(worker, seq, b) -> None:
        got.append(seq)
        if seq == 1:
            raise exc("on_batch")

    def on_count(worker, name, n) -> None:
        if name == "applied" and len(got) == 3 and not raised["count"]:
            raised["count"] = True
            raise exc("on_count")

    sub = EventSubscriber(on_batch, on_count=on_count)
    closing(sub)
    sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=10)
    sub.start()
    for i in range(5):
        pub.publish(batch(i))
    wait_until(lambda: got == [0, 1, 2, 3, 4] and sub.in_sync("w"), state=lambda: (got, sub.counters))
    assert sub._thread.is_alive()
    assert sub.counters["callback_errors"] == 1 and sub.counters["applied"] == 5


def test_poll_once_lets_a_callbacks_keyboard_interrupt_through(closing):
    # On the caller's own thread, Ctrl-C is the caller's: not swallowed.
    pub, sub, rec = new_pair(closing)

    def on_batch(worker, seq, b) -> None:
        raise KeyboardInterrupt

    sub._on_batch = on_batch
    pub.publish(batch(0))
    with pytest.raises(KeyboardInterrupt):
        wait_until(lambda: False, sub)


def test_failing_on_count_and_on_reset_log_a_bounded_number_of_lines(closing, caplog):
    # on_batch's failures were rate-limited per publisher, on_count's and on_reset's were not:
    # with one of them failing, a publisher flooding bad frames (or seqs that keep starting
    # over) wrote a traceback per frame.
    def fail(*a) -> None:
        raise RuntimeError("callback down")

    sub = EventSubscriber(lambda *a: None, fail, on_count=fail)
    closing(sub)
    raw = zmq.Context.instance().socket(zmq.PUB)
    closing(raw)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub.add_publisher("w", f"tcp://127.0.0.1:{port}", wait=10)
    sent = iter(range(10**6))

    def flood() -> bool:
        n = next(sent)
        raw.send_multipart([b"garbage"])
        # 5, 4, 5, 4 with payloads never seen before: each 4 is a restart
        raw.send_multipart([b"", (5 - n % 2).to_bytes(8, "big"), b"\xc1" + n.to_bytes(4, "big")])
        return sub.counters["malformed"] >= 200 and sub.counters["resets"] >= 100

    with caplog.at_level(logging.ERROR, logger="kvslots.events.subscriber"):
        wait_until(flood, sub)
    for what in ("on_count callback failed", "on_reset callback failed"):
        lines = [r for r in caplog.records if r.getMessage().startswith(what)]
        assert 1 <= len(lines) <= 20, (what, len(lines))
