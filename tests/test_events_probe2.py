"""Probes of the event sockets from the wire side, mostly by a peer that speaks ZMTP itself (a
raw TCP socket, so it can send what a libzmq peer would buffer or refuse, as fast as the kernel
takes it): what it sends must not hold back the publisher's or the subscriber's other traffic,
nor make either hold memory it need not."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any

import zmq

from kvslots.events import KVEventBatch, encode_batch
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber

LOCAL = "tcp://127.0.0.1:0"


# ---- a ZMTP 3.0 peer over a plain socket ---------------------------------------------------


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


def zmtp_frame(data: bytes, more: bool = False) -> bytes:
    if len(data) < 256:
        return bytes([0x01 if more else 0x00, len(data)]) + data
    return bytes([0x03 if more else 0x02]) + struct.pack(">Q", len(data)) + data


def _greet(s: socket.socket, socket_type: bytes) -> None:
    """The ZMTP 3.0 NULL handshake as a ``socket_type`` peer, either end of ``s``."""
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        assert chunk, "the peer closed the connection during the greeting"
        got += chunk
    s.sendall(_ready(socket_type))


def zmtp_connect(endpoint: str, socket_type: bytes) -> socket.socket:
    """A TCP connection to ``endpoint`` (tcp://host:port) that has done the NULL handshake as a
    ``socket_type`` peer; what is sent on it next is message frames."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    _greet(s, socket_type)
    return s


class Flood:
    """Sends ``chunk`` over a ZMTP connection again and again, from a thread, until stopped."""

    def __init__(self, endpoint: str, socket_type: bytes, chunk: bytes, head: bytes = b"") -> None:
        self.sock = zmtp_connect(endpoint, socket_type)
        self.sock.sendall(head)
        self.chunk = chunk
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.sock.sendall(self.chunk)  # releases the GIL while the kernel takes it
                self.sent += 1
        except OSError:  # the peer dropped us
            pass

    def __enter__(self) -> "Flood":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(10)
        self.sock.close()


@contextmanager
def _child(code: str, **popen: Any):
    """A child process running ``code``, killed when the block ends; yields its first line."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, **popen)
    try:
        yield child.stdout.readline()
    finally:
        child.kill()
        child.wait(10)


@contextmanager
def flood_process(endpoint: str, socket_type: bytes, message: bytes, connections: int = 2, head: bytes = b""):
    """Floods ``endpoint`` with ``message`` (ZMTP frames) over ``connections`` connections from
    a child process (no GIL shared with the sockets under test) while the block runs; ``head``
    is sent once first on each."""
    code = (f"import sys, time; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            f"from test_events_probe2 import Flood\n"
            f"floods = [Flood({endpoint!r}, {socket_type!r}, {message!r} * 100_000, {head!r}).__enter__() "
            f"for _ in range({connections})]\n"
            f"print('flooding', flush=True)\n"
            f"sys.stdin.read()\n")
    with _child(code, stdin=subprocess.PIPE) as first:
        assert first == b"flooding\n"
        yield


# ---- the publisher's replay socket ---------------------------------------------------------


def test_a_flood_of_replay_requests_does_not_hold_back_live_batches():
    """A peer sending requests (here garbage, one 1-byte frame each) faster than the sender
    thread reads them kept it in its read loop: no queued batch was sent while the flood lasted
    (batches arrived seconds late). It now reads a bounded number per round and sends the
    queued batches between."""
    payload = encode_batch(KVEventBatch(0.0, []))
    ctx = zmq.Context()
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=16)
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        deadline = time.monotonic() + 10
        while True:  # the SUB is connected once a batch reaches it
            pub.publish(payload)
            if sub.poll(50):
                while sub.poll(0):
                    sub.recv_multipart()
                break
            assert time.monotonic() < deadline, "the SUB never received a batch"
        with flood_process(pub.replay_endpoint, b"DEALER", zmtp_frame(b"x")):
            wait = time.monotonic() + 10
            while pub.stats()["replay_malformed"] < 100_000:  # the flood is being read
                assert time.monotonic() < wait, pub.stats()
                time.sleep(0.01)
            delays = []
            for _ in range(10):
                t0 = time.monotonic()
                pub.publish(payload)
                arrived = sub.poll(3000)
                delays.append(time.monotonic() - t0 if arrived else float("inf"))
                if arrived:
                    sub.recv_multipart()
                time.sleep(0.05)
            malformed = pub.stats()["replay_malformed"]
        assert malformed > 100_000, "the flood did not reach the publisher"
        assert max(delays) < 1.0, f"live batches held back by the flood: {delays}"
        assert pub.stats()["published"] >= 11 and pub.stats()["errors"] == 0
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)


# ---- the subscriber's replay socket --------------------------------------------------------


def _publish_for(pub: EventPublisher, seconds: float) -> None:
    """An empty batch every 10 ms for ``seconds``."""
    payload = encode_batch(KVEventBatch(0.0, []))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pub.publish(payload)
        time.sleep(0.01)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextmanager
def flooding_server(socket_type: bytes, message: bytes):
    """A child process listening on 127.0.0.1 that does the ZMTP handshake as ``socket_type``
    with the first peer to connect and then sends it ``message`` (frames) again and again;
    yields its endpoint."""
    code = (f"import socket, sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            f"from test_events_probe2 import _greet\n"
            f"srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(4)\n"
            f"print(srv.getsockname()[1], flush=True)\n"
            f"c, _ = srv.accept(); _greet(c, {socket_type!r})\n"
            f"chunk = {message!r} * 10_000\n"
            f"while True: c.sendall(chunk)\n")
    with _child(code, stderr=subprocess.DEVNULL) as first:
        yield f"tcp://127.0.0.1:{int(first)}"


def test_a_replay_server_flooding_the_subscriber_cannot_grow_it_without_bound():
    """The replay (DEALER) socket had no receive high-water mark: a replay server sending
    faster than the poll loop reads (here 1 KB replies nobody asked for) grew the subscriber
    by some 400 MB a second for as long as it sent. Its pipe now holds ``hwm`` messages, as
    the live socket's does, and another publisher's batches keep being applied."""
    reply = zmtp_frame(b"", True) + zmtp_frame(b"", True) + zmtp_frame(bytes(8), True) + zmtp_frame(b"p" * 1000)
    got: list[tuple[str, int]] = []
    sub = EventSubscriber(lambda w, seq, b: got.append((w, seq)), hwm=1000)
    pub = EventPublisher(LOCAL)
    try:
        with flooding_server(b"ROUTER", reply) as replay:
            sub.add_publisher("hostile", "tcp://127.0.0.1:1", replay_endpoint=replay)
            sub.add_publisher("good", pub.endpoint)
            sub.start()
            time.sleep(0.5)  # connected, flooding
            before = _rss_mib()
            _publish_for(pub, 3.0)
            grown = _rss_mib() - before
        assert grown < 200, f"the subscriber grew by {grown:.0f} MiB in 3 s"
        wait = time.monotonic() + 10
        while not any(w == "good" for w, _ in got):
            assert time.monotonic() < wait, "no batch of the good publisher was applied"
            time.sleep(0.01)
    finally:
        sub.stop()
        pub.shutdown()


# ---- the subscriber's live sockets ---------------------------------------------------------


def test_a_publisher_flooding_its_socket_does_not_hold_back_the_others():
    """A publisher flooding its live socket (well-formed messages under one seq: duplicates,
    the dearest kind to handle) was read 10,000 messages per round of the poll loop, and every
    other publisher's batches waited for them: 130-150 ms median delay, 300 ms at worst. Rounds
    now read 1,000 per socket."""
    live = zmtp_frame(b"", True) + zmtp_frame(bytes(8), True) + zmtp_frame(encode_batch(KVEventBatch(0.0, [])))
    sent: dict[int, float] = {}
    arrived: dict[int, float] = {}

    def on_batch(worker, seq, batch):
        if worker == "good":
            arrived[seq] = time.monotonic()

    sub = EventSubscriber(on_batch)
    pub = EventPublisher(LOCAL)
    try:
        with flooding_server(b"PUB", live) as hostile:
            sub.add_publisher("hostile", hostile)
            sub.add_publisher("good", pub.endpoint)
            sub.start()
            payload = encode_batch(KVEventBatch(0.0, []))
            deadline = time.monotonic() + 10
            while not arrived or sub.publisher_counters("hostile")["duplicates"] < 100_000:
                assert time.monotonic() < deadline, (arrived, sub.publisher_counters("hostile"))
                pub.publish(payload)
                time.sleep(0.02)
            arrived.clear()
            for _ in range(40):
                sent[pub.next_seq] = time.monotonic()
                pub.publish(payload)
                time.sleep(0.02)
            wait = time.monotonic() + 10
            while not all(s in arrived for s in sent):
                assert time.monotonic() < wait, "the good publisher's batches were not all applied"
                time.sleep(0.01)
        delays = sorted(arrived[s] - t for s, t in sent.items())
        assert delays[len(delays) // 2] < 0.06, f"median delay {delays[len(delays) // 2] * 1e3:.0f} ms"
    finally:
        sub.stop()
        pub.shutdown()


def test_a_round_of_the_poll_loop_reads_a_bounded_number_of_one_sockets_messages():
    ctx = zmq.Context()
    flood = ctx.socket(zmq.PUB)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.bind(LOCAL)
    sub = EventSubscriber(lambda *a: None, context=ctx)
    try:
        sub.add_publisher("w", flood.getsockopt_string(zmq.LAST_ENDPOINT), wait=5)
        deadline = time.monotonic() + 10
        while sub.counters["malformed"] == 0:  # subscribed
            assert time.monotonic() < deadline
            flood.send(b"x")
            sub.poll_once(10)
        for _ in range(5000):
            flood.send(b"x")
        time.sleep(0.5)
        first = sub.poll_once(1000)
        assert 0 < first <= 1000
        total = first
        while total < 5000:
            handled = sub.poll_once(1000)
            assert 0 < handled <= 1000
            total += handled
    finally:
        sub.stop()
        flood.close(linger=0)
        ctx.term()


# ---- the publisher's live socket -----------------------------------------------------------


def test_a_huge_subscription_frame_drops_the_peer_instead_of_being_buffered():
    """All a PUB socket reads is subscriptions, but it took frames of any size: a peer declaring
    a 2 GiB subscription and sending its bytes grew the publisher by 700 MB a second. A frame
    past SUBSCRIPTION_MAX_FRAME (plus the topic's length) now drops that peer's connection;
    subscribers, with a topic longer than the bound too, are served as before."""
    topic = "t" * 3000
    got: list[int] = []
    pub = EventPublisher(LOCAL, topic=topic)
    sub = EventSubscriber(lambda w, seq, b: got.append(seq))
    try:
        huge = bytes([0x02]) + (2**31).to_bytes(8, "big") + b"\x01"  # a 2 GiB frame, more to come
        before = _rss_mib()
        with flood_process(pub.endpoint, b"SUB", b"y" * 1000, connections=1, head=huge):
            sub.add_publisher("w", pub.endpoint, topic=topic, wait=5)
            sub.start()
            _publish_for(pub, 3.0)
            grown = _rss_mib() - before
        assert grown < 200, f"the publisher grew by {grown:.0f} MiB in 3 s"
        assert len(got) > 100 and pub.stats()["errors"] == 0
    finally:
        sub.stop()
        pub.shutdown()


def test_the_subscriber_does_not_keep_the_big_payloads_it_applied():
    """The window that tells a duplicate from a restart kept the last 64 applied payloads
    themselves: a publisher sending frames near max_frame_bytes made the subscriber hold 64 of
    them (4 GiB at 64 MiB each), per publisher. It now keeps a big payload's length and digest;
    duplicates and restarts are told apart as before."""
    import gc

    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(LOCAL)
    resets: list[tuple[int, int]] = []
    sub = EventSubscriber(lambda *a: None, lambda w, last, new: resets.append((last, new)), context=ctx,
                          decode=False)
    try:
        sub.add_publisher("w", raw.getsockopt_string(zmq.LAST_ENDPOINT), wait=5)
        deadline = time.monotonic() + 10
        while sub.next_seq("w") is None:  # subscribed: batch 0 arrived
            assert time.monotonic() < deadline
            raw.send_multipart([b"", (0).to_bytes(8, "big"), b"first"])
            sub.poll_once(20)
        gc.collect()
        before = _rss_mib()
        big = 16 << 20
        for seq in range(1, 49):  # 768 MiB in all, read one at a time
            raw.send_multipart([b"", seq.to_bytes(8, "big"), bytes([seq]) * big], copy=False)
            while sub.next_seq("w") != seq + 1:
                assert time.monotonic() < deadline + 60
                sub.poll_once(100)
        gc.collect()
        grown = _rss_mib() - before
        assert grown < 200, f"the subscriber holds {grown:.0f} MiB after applying 768 MiB"
        # The same big batch again is a duplicate; another one under that seq is a restart.
        raw.send_multipart([b"", (48).to_bytes(8, "big"), bytes([48]) * big])
        while sub.publisher_counters("w")["duplicates"] == 0:
            assert time.monotonic() < deadline + 90
            sub.poll_once(100)
        assert resets == []
        raw.send_multipart([b"", (47).to_bytes(8, "big"), bytes([99]) * big])
        while not resets:
            assert time.monotonic() < deadline + 90
            sub.poll_once(100)
        assert resets == [(48, 47)]
    finally:
        sub.stop()
        raw.close(linger=0)
        ctx.term()


# ---- topics --------------------------------------------------------------------------------


def test_a_replay_gives_only_batches_of_the_subscribed_topic():
    """The live stream is filtered by the subscription's topic prefix, but replies were taken
    whatever their topic frame: a subscriber of topic "a" caught up on a publisher of topic "b"
    applied its 5 buffered batches (and said it was in sync), then none of its live ones. Such
    replies are now malformed, as the end marker is still the end."""
    from kvslots.events.protocol import REPLAY_END, parse_replay_reply

    seq1 = (1).to_bytes(8, "big")
    assert parse_replay_reply([b"", b"kvslots", seq1, b"p"], b"kv") == (1, b"p")
    assert parse_replay_reply([b"", b"other", seq1, b"p"], b"kv") is None
    assert parse_replay_reply([b"", seq1, b"p"], b"kv") == (1, b"p")  # no topic frame to judge
    assert parse_replay_reply([b"", b"", b"\xff" * 8, b""], b"kv") == (REPLAY_END, b"")

    payload = encode_batch(KVEventBatch(0.0, []))
    pub = EventPublisher(LOCAL, LOCAL, topic="b")
    got: dict[str, list[int]] = {"a": [], "b": []}
    sub = EventSubscriber(lambda w, seq, batch: got[w].append(seq))
    try:
        for _ in range(5):
            pub.publish(payload)
        assert pub.flush(5)
        sub.start()
        assert sub.add_publisher("a", pub.endpoint, pub.replay_endpoint, topic="a", start_seq=0, wait=10)
        assert sub.add_publisher("b", pub.endpoint, pub.replay_endpoint, topic="b", start_seq=0, wait=10)
        assert got == {"a": [], "b": [0, 1, 2, 3, 4]}
        assert sub.publisher_counters("a")["malformed"] == 5 and sub.next_seq("a") == 0
    finally:
        sub.stop()
        pub.shutdown()
