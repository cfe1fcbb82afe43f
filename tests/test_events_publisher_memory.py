"""What settings and peers can make an event publisher hold, bounded: the replay buffer's bytes
(buffer_steps alone pinned any amount), hwm's queue per stalled subscriber (up to 2**31-1
messages, or 0, ZMQ's no limit, was taken) and the replays in progress; and what such bounds
must not cost the subscribers that read."""

from __future__ import annotations

import time

import pytest
import zmq

from kvslots.errors import InvalidArgumentError
from kvslots.events import BlockRemoved, KVEventBatch, encode_batch
from kvslots.events.protocol import REPLAY_END, parse_replay_reply, replay_request
from kvslots.events import publisher as pubmod
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber

LOCAL = "tcp://127.0.0.1:0"
MAX_HWM = getattr(pubmod, "MAX_HWM", 1_000_000)  # (the old code had none: its tests fail, not the import)

def test_a_peer_holding_many_subscriptions_does_not_reset_the_others():
    # 17e4654's XPUB made the live socket again past 1,024 distinct subscriptions; a SUB re-sends
    # all of its own at each reconnect, so one idle peer holding 1,100 made it again and again,
    # and a subscriber like the indexer's (reset_on_reconnect) dropped its entries at each.
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, topic="kv", context=ctx)
    got, resets = [], []
    sub = EventSubscriber(lambda w, seq, b: got.append(seq), lambda w, last, new: resets.append(new),
                          resync_on_loss=True, reset_on_reconnect=True, context=ctx)
    peer = ctx.socket(zmq.SUB)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 0)  # else ZMQ sends at most 1,000 subscriptions per (re)connect
    one = encode_batch(KVEventBatch(0.0, [BlockRemoved([1, 2, 3], None)]))
    try:
        sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, topic="kv", wait=5)
        sub.start()
        for i in range(1100):
            peer.setsockopt(zmq.SUBSCRIBE, b"x%d" % i)
        peer.setsockopt(zmq.SUBSCRIBE, b"kv")
        peer.connect(pub.endpoint)
        # Until the subscriber has one: a batch published before its subscription reached the
        # PUB is not sent (the CI rehearsal's loaded run got 149 of 150, the first missing).
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline, pub.stats()
            pub.publish(one)
            time.sleep(0.02)
        for _ in range(150):  # 3 s: the old code made the socket again ~20 times meanwhile
            pub.publish(one)
            time.sleep(0.02)
        assert pub.flush(10)
        expected = list(range(got[0], pub.stats()["published"]))
        deadline = time.monotonic() + 10
        while len(got) < len(expected):
            assert time.monotonic() < deadline, (len(got), len(expected), pub.stats())
            time.sleep(0.01)
        assert resets == [] and got == expected and len(expected) >= 150, (resets, len(got))
        # the peer itself is served too (its subscriptions are within the bound per frame)
        n = 0
        while peer.poll(0):
            peer.recv_multipart()
            n += 1
        assert n > 100, n
    finally:
        sub.stop()
        peer.close()
        pub.shutdown()
        ctx.term()


def _served_with_prefix(ctx, pub, n: int) -> bool:
    """Whether a SUB subscribed to the topic and to an ``n``-byte prefix of it is served."""
    one = encode_batch(KVEventBatch(0.0, [BlockRemoved([1], None)]))
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"kv")
    s.setsockopt(zmq.SUBSCRIBE, b"kv" + b"x" * (n - 2))
    s.connect(pub.endpoint)
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pub.publish(one)
            if s.poll(20):
                return True
        return False
    finally:
        s.close()


def test_the_subscription_size_that_drops_a_peer():
    # The figure the docs give: a ZMTP 3.1 peer (libzmq >= 4.3) sends a SUBSCRIBE command, 10
    # bytes more than the prefix, so a prefix past 246 bytes plus the topic's length drops it
    # (not 256, as the constant's comment said: that is a ZMTP 3.0 flag byte and prefix).
    if zmq.zmq_version_info() < (4, 3):
        pytest.skip("ZMTP 3.0 subscriptions")
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, topic="kv", context=ctx)
    try:
        most = pubmod.SUBSCRIPTION_MAX_FRAME - 10 + 2
        assert _served_with_prefix(ctx, pub, most)
        assert not _served_with_prefix(ctx, pub, most + 1)
    finally:
        pub.shutdown()
        ctx.term()


def _replay_from(pub: EventPublisher, ctx: zmq.Context, start: int) -> list[int]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    try:
        d.send_multipart(replay_request(start))
        got = []
        while True:
            assert d.poll(5000), "no replay answer"
            seq, _ = parse_replay_reply(d.recv_multipart())
            if seq == REPLAY_END:
                return got
            got.append(seq)
    finally:
        d.close()


def test_the_replay_buffer_keeps_at_most_buffer_bytes():
    one = encode_batch(KVEventBatch(0.0, [BlockRemoved(list(range(2**40, 2**40 + 1000)), None)]))
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=1000, buffer_bytes=5 * len(one) + 10, context=ctx)
    try:
        for _ in range(100):
            pub.publish(one)
        assert pub.flush(10)
        assert _replay_from(pub, ctx, 0) == list(range(95, 100))  # the newest five
        # one batch bigger than the bound is still kept (the newest)
        big = encode_batch(KVEventBatch(0.0, [BlockRemoved(list(range(2**40, 2**40 + 10_000)), None)]))
        pub.publish(big)
        assert pub.flush(10)
        assert _replay_from(pub, ctx, 0) == [100]
    finally:
        pub.shutdown()
        ctx.term()


@pytest.mark.parametrize("kwargs, what", [
    # one range, one check, one message (2**31 said "must be in [1, 2**31-1]", refused past 10**6)
    ({"hwm": MAX_HWM + 1}, rf"hwm must be in \[1, {MAX_HWM}\], got {MAX_HWM + 1}$"),
    ({"hwm": 2**31 - 1}, rf"hwm must be in \[1, {MAX_HWM}\], got 2147483647$"),
    ({"hwm": 2**31}, rf"hwm must be in \[1, {MAX_HWM}\], got 2147483648$"),
    ({"hwm": 0}, rf"hwm must be in \[1, {MAX_HWM}\], got 0$"),  # ZMQ's "no limit"
    ({"buffer_bytes": 0}, "buffer_bytes"),
    ({"buffer_bytes": 2**40 + 1}, "buffer_bytes"),
])
def test_settings_past_their_bound_are_refused(kwargs, what):
    with pytest.raises(InvalidArgumentError, match=f"^{what}"):
        EventPublisher(LOCAL, **kwargs)
    EventPublisher(LOCAL, hwm=MAX_HWM, buffer_bytes=2**40).shutdown()  # the bounds themselves


#: Batches a peer that reads nothing takes anyway (into the kernel's buffers: ~160 of these
#: 18 KB ones); the replay tests buffer more, so that such a peer's replay stays in progress.
BIG = encode_batch(KVEventBatch(0.0, [BlockRemoved(list(range(2**40, 2**40 + 2000)), None)]))


def _stalled_peers(ctx, endpoint, n):
    out = []
    for _ in range(n):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 1)
        d.connect(endpoint)
        d.send_multipart(replay_request(0))
        out.append(d)
    return out


def _wait_for(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.01)


def test_replays_in_progress_are_capped(monkeypatch):
    # Peers asking for a replay and reading nothing each held up to REPLAY_HWM batches in their
    # queue, with no bound on their number. Past MAX_REPLAYS a request is refused while every
    # peer took something within REPLAY_EVICT_AFTER_S: 152bc5c evicted one at every request, and
    # an evicted replay's batches stay queued until its peer leaves (800 peers: +506 MiB, not
    # +103). (4 slots, for each stalled peer's kernel buffers.)
    monkeypatch.setattr(pubmod, "MAX_REPLAYS", 4)
    monkeypatch.setattr(pubmod, "MAX_WAITING_REPLAYS", 4, raising=False)
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=500, context=ctx)
    stalled = []
    try:
        for _ in range(500):
            pub.publish(BIG)
        assert pub.flush(10)
        stalled = _stalled_peers(ctx, pub.replay_endpoint, 1)
        _wait_for(lambda: pub.stats()["replayed"] > 0, pub.stats)
        time.sleep(0.2)  # its queue and kernel buffers fill: what one such peer takes
        one = pub.stats()["replayed"]
        stalled += _stalled_peers(ctx, pub.replay_endpoint, 11)
        _wait_for(lambda: pub.stats()["replay_requests"] >= 12, pub.stats)
        time.sleep(0.2)
        st = pub.stats()
        # 4 in progress, 4 waiting for a slot, 4 not answered
        assert st.get("replay_busy") == 4 and st["replay_evicted"] == 0 and len(pub._replays) == 4, st
        # what is queued for them: 4 peers' worth (the old code: 12 peers' worth)
        assert st["replayed"] <= 4 * one * 1.25, (st, one)
        # once their peers took nothing for REPLAY_EVICT_AFTER_S, the waiting ones get the slots...
        monkeypatch.setattr(pubmod, "REPLAY_EVICT_AFTER_S", 0.3, raising=False)  # (1 s: scaled down)
        time.sleep(0.5)
        st = pub.stats()
        assert st["replay_evicted"] == 4 and st["replayed"] <= 8 * one * 1.25, (st, one)
        # ...and a reading peer is answered in full
        assert _replay_from(pub, ctx, 0) == list(range(500))
        assert pub.stats()["replay_evicted"] == 5
    finally:
        for d in stalled:
            d.close()
        pub.shutdown()
        ctx.term()


def test_a_reading_replay_completes_under_a_flood_of_new_peers(monkeypatch):
    # 152bc5c evicted the replay whose peer took something longest ago at every request past
    # MAX_REPLAYS, and a new replay counts from its creation: a flood of requests from new routing
    # ids evicted a subscriber's replay while it read at full speed, again at each of its retries,
    # until it gave the gap up (1,312 of 20,000 replayed in the reviewer's run).
    import threading
    monkeypatch.setattr(pubmod, "MAX_REPLAYS", 4)
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, topic="kv", buffer_steps=10_000, context=ctx)
    small = encode_batch(KVEventBatch(0.0, [BlockRemoved(list(range(2**40, 2**40 + 100)), None)]))
    got, resets = [], []
    sub = EventSubscriber(lambda w, seq, b: got.append(seq), lambda w, last, new: resets.append(new),
                          replay_timeout_ms=500, resync_on_loss=True, context=ctx)
    stop = threading.Event()

    def flood():  # 4 new peers every 20 ms, each asking and never reading
        prev: list = []
        while not stop.is_set():
            cur = _stalled_peers(ctx, pub.replay_endpoint, 4)
            for d in prev:
                d.close()
            prev = cur
            stop.wait(0.02)
        for d in prev:
            d.close()

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, topic="kv", wait=5)
        sub.start()
        _wait_for(lambda: got or pub.publish(small) or time.sleep(0.05), lambda: "no first batch", 5)
        first = pub.next_seq
        flooder.start()
        time.sleep(0.3)
        pub._test_drop_on_wire(*range(first, first + 5000))
        for _ in range(5001):
            pub.publish(small)
        assert pub.flush(10)
        last = pub.next_seq - 1
        _wait_for(lambda: got[-1] >= last, lambda: (len(got), pub.stats(), sub.counters), 15)
        assert got[got.index(first - 1):] == list(range(first - 1, last + 1)) and resets == []
        # one request: the replay was never cut
        assert sub.counters["replay_requests"] == 1 and sub.counters.get("lost", 0) == 0, sub.counters
    finally:
        stop.set()
        if flooder.is_alive():
            flooder.join(5)
        sub.stop()
        pub.shutdown()
        ctx.term()


def test_a_gap_heals_while_non_reading_peers_re_request(monkeypatch):
    # Peers that ask again and again and never read held every replay slot: a subscriber's
    # request was left unanswered and its gap given up (lost 12 of 12 in the reviewer's run).
    # Now it waits until a slot's peer took nothing for REPLAY_EVICT_AFTER_S (1 s, below the
    # default replay_timeout_ms of 2 s: scaled down here with it).
    monkeypatch.setattr(pubmod, "MAX_REPLAYS", 4)
    monkeypatch.setattr(pubmod, "REPLAY_EVICT_AFTER_S", 0.2, raising=False)
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, topic="kv", context=ctx)
    got, resets = [], []
    sub = EventSubscriber(lambda w, seq, b: got.append(seq), lambda w, last, new: resets.append(new),
                          replay_timeout_ms=500, resync_on_loss=True, context=ctx)
    stalled = []
    try:
        for _ in range(400):
            pub.publish(BIG)
        assert pub.flush(10)
        stalled = _stalled_peers(ctx, pub.replay_endpoint, 4)
        sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, topic="kv", wait=5)
        sub.start()
        deadline = time.monotonic() + 5
        while not got:  # the subscriber's first batch: it starts from there
            assert time.monotonic() < deadline
            pub.publish(BIG)
            time.sleep(0.05)
        first = got[0]
        for _ in range(3):
            for d in stalled:  # asking again (refused while their replays are in progress)
                d.send_multipart(replay_request(0))
            assert pub.flush(10)
            pub._test_drop_on_wire(pub.next_seq)
            for _ in range(3):
                pub.publish(BIG)
            time.sleep(0.2)
        assert pub.flush(10)
        last = pub.next_seq - 1
        deadline = time.monotonic() + 5
        while not got or got[-1] < last:
            assert time.monotonic() < deadline, (got, pub.stats(), sub.counters)
            time.sleep(0.01)
        assert got == list(range(first, last + 1)) and resets == [], (got, resets, pub.stats())
        assert pub.stats()["replay_evicted"] >= 1
    finally:
        sub.stop()
        for d in stalled:
            d.close()
        pub.shutdown()
        ctx.term()
