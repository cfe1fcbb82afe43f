"""Replay servers and publishers that do not heal a gap: replay traffic stays bounded (backoff with
jitter, a rate cap, a gap given up after a few useless requests, then a cool-down), giving up is
logged once and counted, and the live stream keeps being applied. Real ZMQ sockets on loopback;
sequence numbers up to 2**64-1."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from kvslots.errors import ArgumentTypeError, InvalidArgumentError
from kvslots.events import KVEventBatch, encode_batch
from kvslots.events.protocol import (
    END_SEQ,
    REPLAY_END,
    SEQ_MAX,
    parse_live,
    parse_replay_reply,
    replay_request,
)
from kvslots.events.subscriber import EventSubscriber
from ports import free_port

LOCAL = "tcp://127.0.0.1:0"
LOGGER = "kvslots.events.subscriber"
MAX_REQUESTS = 20  # over a whole test (a few seconds); unbounded retries sent ~10,000 a second

Frames = list[bytes]


def seqb(n: int) -> bytes:
    return n.to_bytes(8, "big")


def payload(seq: int) -> bytes:
    return encode_batch(KVEventBatch(float(seq % 1_000_000), []))


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[int] = []
        self.resets: list[tuple[int, int]] = []

    def on_batch(self, worker, seq, batch) -> None:
        with self.lock:
            self.got.append(seq)

    def on_reset(self, worker, last, new) -> None:
        with self.lock:
            self.resets.append((last, new))

    def seqs(self) -> list[int]:
        with self.lock:
            return list(self.got)


# ---- a replay server that misbehaves -------------------------------------------------------

END: Frames = [b"", b"", END_SEQ, b""]
GARBAGE: list[Frames] = [[b"junk"], [b"", b"x"], [b"", b"", b"short", b"p"], [b"", b"", b"", b"", b""]]


def _stale(start: int) -> list[Frames]:  # old batches, never the ones asked for
    return [[b"", b"", seqb(s), payload(s)] for s in range(max(0, start - 3), start)]


ANSWERS: dict[str, Callable[[int], list[Frames]]] = {
    "silent": lambda start: [],
    "end_only": lambda start: [END],  # lacks every seq asked for
    "stale": lambda start: [*_stale(start), END],
    "stale_no_end": _stale,  # delivers (nothing useful), then goes quiet
    "garbage": lambda start: [*GARBAGE, END],
    "garbage_no_end": lambda start: list(GARBAGE),
    # Far ahead of anything the live stream showed: 2**62 past it, and 2**64-1 (the end marker's
    # bytes, with a payload: a batch, not the end).
    "far_ahead": lambda start: [
        *([[b"", b"", seqb(start + 2**62), payload(1)]] if start + 2**62 <= SEQ_MAX else []),
        [b"", b"", END_SEQ, payload(2)],
        END,
    ],
}


class ReplayServer:
    """A ROUTER on its own thread that answers each request with ``answer(start)`` (or from
    ``buffer`` when honest) and records every request it receives."""

    def __init__(self, ctx: zmq.Context, answer: Callable[[int], list[Frames]] | None = None) -> None:
        self.answer = answer
        self.buffer: dict[int, bytes] = {}
        self.requests: list[int] = []
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(LOCAL)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(10):
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.requests.append(start)
            if self.answer is not None:
                replies = self.answer(start)
            else:
                replies = [[b"", b"", seqb(s), p] for s, p in sorted(self.buffer.items()) if s >= start]
                replies.append(END)
            for r in replies:
                self.sock.send_multipart([ident, *r], zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


# ---- fixtures -------------------------------------------------------------------------------


class Setup:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.xpub = self.ctx.socket(zmq.XPUB)  # tells us when the subscription has arrived
        self.xpub.setsockopt(zmq.LINGER, 0)
        self.xpub.bind(LOCAL)
        self.endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.servers: list[ReplayServer] = []
        self.subs: list[EventSubscriber] = []
        self.closers: list[Callable[[], None]] = []

    def server(self, answer=None) -> ReplayServer:
        s = ReplayServer(self.ctx, answer)
        self.servers.append(s)
        return s

    def subscriber(self, replay_endpoint: str | None, rec: Recorder, **kw) -> EventSubscriber:
        kw.setdefault("replay_timeout_ms", 200)
        sub = EventSubscriber(rec.on_batch, rec.on_reset, **kw)
        self.subs.append(sub)
        sub.add_publisher("w", self.endpoint, replay_endpoint)
        sub.start()
        wait_until(lambda: self.xpub.poll(0) != 0, 5, "the subscription")
        assert self.xpub.recv()[:1] == b"\x01"
        return sub

    def send(self, seq: int) -> None:
        self.xpub.send_multipart([b"", seqb(seq), payload(seq)])

    def close(self) -> None:
        for sub in self.subs:
            sub.stop()
        for c in self.closers:
            c()
        for s in self.servers:
            s.close()
        self.xpub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def setup():
    before = {t.ident for t in threading.enumerate()}
    s = Setup()
    yield s
    s.close()
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


def stream_with_gaps(setup: Setup, rec: Recorder, first: int, *, n: int = 90, gap_every: int = 10,
                     interval: float = 0.02) -> tuple[list[int], int]:
    """Sends ``first`` (waits until applied), then ``n`` live batches every ``interval`` s, one
    seq skipped before every ``gap_every``-th: about 2 s of a live stream with a gap every
    0.2 s. Returns the seqs sent after ``first`` and the number of gaps."""
    setup.send(first)
    wait_until(lambda: rec.seqs() == [first], 5, "the first batch")
    seqs, seq, gaps = [], first + 1, 0
    for i in range(n):
        if i % gap_every == 0:
            seq += 1
            gaps += 1
        seqs.append(seq)
        seq += 1
    assert seqs[-1] <= SEQ_MAX
    for s in seqs:
        setup.send(s)
        time.sleep(interval)
    return seqs, gaps


def last_of(n: int = 90, gap_every: int = 10) -> int:
    """How far past ``first`` :func:`stream_with_gaps` ends (its last seq is ``first +
    last_of()``)."""
    return n + (n + gap_every - 1) // gap_every


def given_up_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.ERROR and "gave up" in r.getMessage()]


def check_live_flow_and_bounds(sub, rec, first, seqs, gaps, caplog, requests: int) -> None:
    # Everything live is applied, once, in order: the held batches when a gap is given up,
    # the later ones at once while the replay endpoint cools down.
    wait_until(lambda: rec.seqs()[-1:] == [seqs[-1]] and sub.in_sync("w"), 5, "the live stream")
    assert rec.seqs() == [first, *seqs]
    c = sub.counters
    assert requests <= MAX_REQUESTS, c
    assert c["replay_requests"] <= MAX_REQUESTS
    assert c["replay_given_up"] >= 1, c
    assert c["gaps"] == gaps and c["lost"] == gaps  # no gap healed; each missing batch counted
    # Each give-up is logged once, as an error.
    assert len(given_up_logs(caplog)) == c["replay_given_up"]
    assert c["replay_given_up"] + c["replay_skipped"] <= gaps


# ---- the wire's sequence numbers are unsigned -------------------------------------------------


def test_protocol_sequence_numbers_are_unsigned():
    assert parse_live([b"t", seqb(2**63), b"p"]) == (2**63, b"p")
    assert parse_live([b"t", END_SEQ, b"p"]) == (SEQ_MAX, b"p")
    assert parse_live([b"t", b"\x00" * 7, b"p"]) is None
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) == (REPLAY_END, b"")  # vLLM 0.32
    assert parse_replay_reply([b"", END_SEQ, b""]) == (REPLAY_END, b"")  # older vLLM
    assert parse_replay_reply([b"", b"kv", END_SEQ, b"p"]) == (SEQ_MAX, b"p")  # a batch
    assert parse_replay_reply([b"", b"", seqb(2**63), b"p"]) == (2**63, b"p")
    assert parse_replay_reply([b"", b"", b"\xff" * 9, b""]) is None
    assert replay_request(2**63) == (b"", seqb(2**63))
    assert replay_request(2**64) == (b"", seqb(SEQ_MAX)) and replay_request(-5) == (b"", seqb(0))
    sub = EventSubscriber(lambda *a: None)
    for bad in (2**64 + 1, -1):
        with pytest.raises(InvalidArgumentError, match="start_seq must be in"):
            sub.add_publisher("w", "tcp://127.0.0.1:1", start_seq=bad)
    with pytest.raises(ArgumentTypeError):
        sub.add_publisher("w", "tcp://127.0.0.1:1", start_seq=1.5)
    assert sub.publishers() == []
    sub.stop()


# ---- replay servers that never heal the gap ---------------------------------------------------


@pytest.mark.parametrize("mode", list(ANSWERS))
def test_hostile_replay_server_is_bounded_and_live_events_flow(setup, caplog, mode):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    server = setup.server(ANSWERS[mode])
    rec = Recorder()
    sub = setup.subscriber(server.endpoint, rec)
    seqs, gaps = stream_with_gaps(setup, rec, 10)
    check_live_flow_and_bounds(sub, rec, 10, seqs, gaps, caplog, len(server.requests))
    assert server.requests and server.requests[0] == 11  # asked from the first missing seq
    if mode != "silent":
        assert sub.counters["replay_failures"] == 0 or mode.endswith("no_end")


@pytest.mark.parametrize(("mode", "first"), [
    ("end_only", 2**63 - 5), ("silent", 2**63 - 5), ("far_ahead", 2**63 - 5),
    ("end_only", SEQ_MAX - last_of()), ("silent", SEQ_MAX - last_of()),
], ids=["end_only-2**63", "silent-2**63", "far_ahead-2**63", "end_only-2**64-1", "silent-2**64-1"])
def test_hostile_replay_server_at_huge_sequence_numbers(setup, caplog, mode, first):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    server = setup.server(ANSWERS[mode])
    rec = Recorder()
    sub = setup.subscriber(server.endpoint, rec)
    seqs, gaps = stream_with_gaps(setup, rec, first)
    if first > 2**63:
        assert seqs[-1] == SEQ_MAX
    else:
        assert seqs[0] < 2**63 < seqs[-1]
    check_live_flow_and_bounds(sub, rec, first, seqs, gaps, caplog, len(server.requests))
    assert all(first < start <= SEQ_MAX for start in server.requests)
    assert sub.counters["malformed"] == 0 or mode == "far_ahead"


@pytest.mark.parametrize("first", [2**63 - 2, SEQ_MAX - 2], ids=["2**63", "2**64-1"])
def test_gaps_at_huge_sequence_numbers_are_healed(setup, first):
    # An honest server: the gap at 2**63-1 (or 2**64-2) is replayed, and a reply at 2**64-1
    # (its seq frame is the end marker's bytes, with a payload) is a batch, not the end.
    server = setup.server()
    rec = Recorder()
    sub = setup.subscriber(server.endpoint, rec)
    for s in (first, first + 1, first + 2):
        server.buffer[s] = payload(s)
    setup.send(first)
    wait_until(lambda: rec.seqs() == [first], 5, "the first batch")
    setup.send(first + 2)  # first + 1 never arrives live
    wait_until(lambda: rec.seqs() == [first, first + 1, first + 2] and sub.in_sync("w"), 5, "the heal")
    c = sub.counters
    assert c["replay_requests"] == 1 and c["replayed"] == 2 and c["duplicates"] == 1 and c["lost"] == 0
    assert c["replay_given_up"] == 0 and c["malformed"] == 0 and c["resets"] == 0
    assert server.requests == [first + 1]
    assert sub.next_seq("w") == first + 3  # 2**64 after the last possible batch
    st = sub.publisher_status("w")
    assert st["last_live_seq"] == first + 2 and st["replay_paused_s"] == 0


def test_a_replay_that_always_advances_a_little_is_rate_capped_and_given_up_in_time(setup, caplog):
    # One batch per request, each real progress, against a gap of 1000: retried at once, so only
    # the rate cap holds it back, and replay_max_wait ends it.
    caplog.set_level(logging.ERROR, logger=LOGGER)
    server = setup.server(lambda start: [[b"", b"", seqb(start), payload(start)], END])
    rec = Recorder()
    sub = setup.subscriber(server.endpoint, rec, replay_max_wait_ms=1000)
    setup.send(10)
    wait_until(lambda: rec.seqs() == [10], 5, "the first batch")
    t0 = time.monotonic()
    live = list(range(1010, 1100))
    for s in live:
        setup.send(s)
        time.sleep(0.02)
    wait_until(lambda: rec.seqs()[-len(live):] == live and sub.in_sync("w"), 5, "the live stream")
    elapsed = time.monotonic() - t0
    k = len(server.requests)
    assert 5 <= k <= min(MAX_REQUESTS, 5 + 5 * elapsed + 1), (k, elapsed)
    c = sub.counters
    healed = c["replayed"]  # one per request (the last one's answer may come too late)
    assert healed in (k - 1, k) and c["replay_failures"] == 0
    assert rec.seqs() == [10, *range(11, 11 + healed), *live]
    assert c["replay_given_up"] == 1 and c["lost"] == 1010 - (11 + healed)
    (record,) = given_up_logs(caplog)
    assert "not healed within 1 s" in record.getMessage()


# ---- the replay endpoint is unreachable or not a replay server -------------------------------


@pytest.mark.parametrize("where", ["unreachable", "not_a_router", "not_zmq"])
def test_replay_endpoint_unreachable_or_wrong(setup, caplog, where):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    if where == "unreachable":
        endpoint = f"tcp://127.0.0.1:{free_port()}"
    elif where == "not_a_router":
        endpoint = setup.endpoint  # the live XPUB: ZMQ refuses a DEALER there
    else:  # a TCP server that accepts and says nothing
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(0.05)
        conns: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    conns.append(listener.accept()[0])
                except OSError:
                    pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()

        def close() -> None:
            stop.set()
            t.join(5)
            for c in conns:
                c.close()
            listener.close()

        setup.closers.append(close)
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    rec = Recorder()
    sub = setup.subscriber(endpoint, rec)
    seqs, gaps = stream_with_gaps(setup, rec, 0)
    c = sub.counters
    check_live_flow_and_bounds(sub, rec, 0, seqs, gaps, caplog, c["replay_requests"])
    assert c["replay_failures"] == c["replay_given_up"]  # unanswered, each given up at once


# ---- a publisher whose numbers jump wildly ---------------------------------------------------


def test_wild_publisher_against_an_unhelpful_server(setup, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    server = setup.server(ANSWERS["end_only"])
    rec = Recorder()
    sub = setup.subscriber(server.endpoint, rec, resync_on_loss=True)
    rng = random.Random(7)
    setup.send(5)
    wait_until(lambda: rec.seqs() == [5], 5, "the first batch")
    t0 = time.monotonic()
    for _ in range(60):  # backwards and forwards, across 2**63, up to 2**64-1
        setup.send(rng.choice([rng.randrange(0, 100), rng.randrange(2**63 - 50, 2**63 + 50),
                               rng.randrange(SEQ_MAX - 100, SEQ_MAX + 1), rng.randrange(0, SEQ_MAX + 1)]))
        time.sleep(0.02)
    # Then it settles down: consecutive numbers from somewhere, which must be applied.
    steady = list(range(2**63 + 1000, 2**63 + 1030))
    for s in steady:
        setup.send(s)
        time.sleep(0.01)
    wait_until(lambda: rec.seqs()[-len(steady):] == steady and sub.in_sync("w"), 5, "the steady stream")
    elapsed = time.monotonic() - t0
    # The rate cap (5 a second, a burst of 5) bounds it whatever the stream does; the cool-down
    # after each give-up keeps it well below.
    assert len(server.requests) <= min(MAX_REQUESTS, 5 + 5 * elapsed + 1), (len(server.requests), elapsed)
    c = sub.counters
    assert c["malformed"] == 0 and c["callback_errors"] == 0
    assert len(given_up_logs(caplog)) == c["replay_given_up"]


# ---- the indexer counts it ---------------------------------------------------------------------


def test_indexer_counts_given_up_replays_and_keeps_applying(setup, caplog):
    caplog.set_level(logging.ERROR, logger=LOGGER)
    from kvslots.indexer import IndexerConfig, IndexerService, WorkerSpec

    server = setup.server(ANSWERS["end_only"])
    cfg = IndexerConfig(workers=[WorkerSpec("a", setup.endpoint, server.endpoint)], block_size=4,
                        replay_timeout=0.2, capacity=None)
    service = IndexerService(cfg)
    setup.closers.append(service.stop)
    service.start()  # subscribes, with a catch-up replay from 0 (answered: nothing to replay)
    wait_until(lambda: setup.xpub.poll(0) != 0, 5, "the subscription")
    assert setup.xpub.recv()[:1] == b"\x01"

    def stream() -> dict:
        return service.sub.status()["a"]

    setup.send(0)
    wait_until(lambda: stream()["applied_seq"] == 0, 5, "the first batch")
    seq, sent = 1, []
    for i in range(40):
        if i % 10 == 0:
            seq += 1  # a gap
        sent.append(seq)
        setup.send(seq)
        seq += 1
        time.sleep(0.02)
    wait_until(lambda: stream()["applied_seq"] == sent[-1] and not stream()["syncing"], 5, "the live stream")
    st = stream()
    def metric(name: str, labels: dict) -> float:
        return service.metrics.registry.get_sample_value(name, labels) or 0.0

    given_up = metric("kvslots_indexer_replay_given_up_total", {"worker": "a"})
    skipped = metric("kvslots_indexer_replay_skipped_total", {"worker": "a"})
    replays = metric("kvslots_indexer_replays_total", {"worker": "a"})
    assert given_up >= 1 and given_up == st["replays_given_up"]
    assert skipped == st["replays_skipped"] and given_up + skipped <= 4
    assert replays == st["replays"] == len(server.requests) <= MAX_REQUESTS
    assert st["batches"] == 1 + len(sent)  # every live batch applied
    assert st["unhealed_gaps"] == 4  # resync_on_loss: each lost gap rebuilt the worker
    assert len(given_up_logs(caplog)) == given_up


def test_publisher_replay_socket_refuses_oversized_frames_and_rate_limits_its_log(caplog):
    """A replay request is 8 bytes: a peer sending a big frame is dropped by ZMQ (MAXMSGSIZE)
    instead of the publisher buffering it whole (a 300 MB frame cost the worker 300 MB), and a
    flood of malformed requests logs a handful of warnings, not one each; real requests still work."""
    from kvslots.events import publisher as pubmod
    from kvslots.events.publisher import EventPublisher

    pub = EventPublisher(LOCAL, replay_endpoint=LOCAL)
    ctx = zmq.Context()
    try:
        assert pub._replay.getsockopt(zmq.MAXMSGSIZE) == pubmod.REPLAY_MAX_FRAME
        pub.publish(payload(0))
        assert pub.flush(5)
        with caplog.at_level(logging.WARNING, logger="kvslots.events.publisher"):
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(pub.replay_endpoint)
            big.send_multipart([b"", b"x" * (pubmod.REPLAY_MAX_FRAME + 1)])
            bad = ctx.socket(zmq.DEALER)
            bad.setsockopt(zmq.LINGER, 0)
            bad.connect(pub.replay_endpoint)
            for _ in range(200):
                bad.send_multipart([b"", b"short"])
            wait_until(lambda: pub.stats()["replay_malformed"] >= 200, what="malformed requests counted")
            assert pub.stats()["replay_malformed"] == 200  # the oversized frame never got through
            warnings = [r for r in caplog.records if "malformed replay request" in r.getMessage()]
            assert 1 <= len(warnings) <= 9  # 1, 2, 4, ..., 128
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.connect(pub.replay_endpoint)
        good.send_multipart(replay_request(0))
        assert good.poll(5000)
        assert parse_replay_reply(good.recv_multipart()) is not None
    finally:
        ctx.destroy(linger=0)
        pub.shutdown()
