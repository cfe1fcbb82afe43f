"""What settings and peers can make an event publisher hold, bounded: distinct subscriptions on
its live socket (ZMQ keeps each until its peer leaves: 30,000 of 1 KB grew a publisher by
1.4 GB), the replay buffer's bytes (buffer_steps alone pinned any amount) and hwm's queue per
stalled subscriber (up to 2**31-1 messages was taken). The publisher runs in a child process,
so that a peer's own memory does not count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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

CHILD = textwrap.dedent("""
    import sys, time
    from kvslots.events.publisher import EventPublisher
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    pub = EventPublisher("tcp://127.0.0.1:0", topic="kv")
    print(pub.endpoint, flush=True)
    base = rss()
    for line in sys.stdin:
        pub.publish(b"\\x93\\x00\\x90\\x00")
        pub.flush()
        print(rss() - base, pub.stats().get("subscription_resets"), flush=True)
""")


def test_distinct_subscriptions_do_not_pile_up():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.XSUB)  # sends subscriptions as they are, 200 distinct bytes each
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 0)
    try:
        endpoint = child.stdout.readline().strip()
        peer.connect(endpoint)
        rng = iter(range(10**9))
        deadline = time.monotonic() + 20
        while True:  # 20,000 distinct subscriptions: 190 MB of the publisher's on the old code
            for _ in range(20_000):
                peer.send(b"\x01" + next(rng).to_bytes(8, "big") * 25)
            time.sleep(1.0)
            child.stdin.write("rss\n")
            child.stdin.flush()
            grown, resets = child.stdout.readline().split()
            if resets != "0" or time.monotonic() > deadline:
                break
        assert int(grown) < 60 * 2**20, f"the publisher grew by {int(grown) >> 20} MiB"
        assert resets not in ("None", "0"), resets  # made again past MAX_SUBSCRIPTIONS
        # a subscriber of the topic is served (it reconnects by itself after a reset)
        got = []
        sub = EventSubscriber(lambda w, seq, b: got.append(seq), context=ctx)
        try:
            sub.add_publisher("w", endpoint, topic="kv", wait=5)
            end = time.monotonic() + 10
            while not got:
                assert time.monotonic() < end, "no batch reached the subscriber"
                child.stdin.write("rss\n")
                child.stdin.flush()
                child.stdout.readline()
                sub.poll_once(50)
        finally:
            sub.stop()
    finally:
        peer.close()
        child.stdin.close()
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()  # the old code: freeing its subscriptions held its shutdown
            child.wait()
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
    ({"hwm": MAX_HWM + 1}, f"hwm {MAX_HWM + 1}: at most {MAX_HWM}"),
    ({"hwm": 2**31 - 1}, "hwm 2147483647: at most"),
    ({"buffer_bytes": 0}, "buffer_bytes"),
    ({"buffer_bytes": 2**40 + 1}, "buffer_bytes"),
])
def test_settings_past_their_bound_are_refused(kwargs, what):
    with pytest.raises(InvalidArgumentError, match=f"^{what}"):
        EventPublisher(LOCAL, **kwargs)
    EventPublisher(LOCAL, hwm=MAX_HWM, buffer_bytes=2**40).shutdown()  # the bounds themselves


def test_replays_in_progress_are_capped():
    # Peers asking for a replay and reading nothing each held up to REPLAY_HWM batches in their
    # queue, with no bound on their number; past MAX_REPLAYS a request is left unanswered.
    cap = getattr(pubmod, "MAX_REPLAYS", 64)
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=500, context=ctx)
    stalled = []
    try:
        one = encode_batch(KVEventBatch(0.0, [BlockRemoved(list(range(2**40, 2**40 + 200)), None)]))
        for _ in range(500):
            pub.publish(one)
        assert pub.flush(10)
        for _ in range(cap + 36):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.connect(pub.replay_endpoint)
            d.send_multipart(replay_request(0))
            stalled.append(d)
        deadline = time.monotonic() + 10
        while pub.stats()["replay_requests"] < cap + 36:
            assert time.monotonic() < deadline, pub.stats()
            time.sleep(0.01)
        st = pub.stats()
        assert st.get("replay_busy") == 36 and len(pub._replays) == cap, st
        # the stalled peers leave: their replays end, and a reading peer is answered in full
        for d in stalled:
            d.close()
        stalled.clear()
        deadline = time.monotonic() + 10
        while pub._replays:
            assert time.monotonic() < deadline, pub.stats()
            time.sleep(0.01)
        assert _replay_from(pub, ctx, 0) == list(range(500))
    finally:
        for d in stalled:
            d.close()
        pub.shutdown()
        ctx.term()
