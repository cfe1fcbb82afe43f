"""What a remote peer can make an event publisher or subscriber hold: replay memory per peer
(``REPLAY_HWM``), frame sizes (``MAXMSGSIZE``), and IPv6 literals end to end. Real ZMQ sockets;
the publisher whose memory is measured runs in a child process, so the peers' own buffers in
this process do not count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from kvslots.events import BlockRemoved, KVEventBatch, encode_batch
from kvslots.events import publisher as pubmod
from kvslots.events.protocol import REPLAY_END, parse_replay_reply, replay_request
from kvslots.events.publisher import EventPublisher
from kvslots.events.subscriber import EventSubscriber

LOCAL = "tcp://127.0.0.1:0"


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition",
               state: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; {state() if state else ''}")
        time.sleep(0.005)


def batch(i: int, hashes: int = 1) -> bytes:
    """A valid batch; ``hashes`` 9-byte block hashes make it about 9 * hashes bytes."""
    return encode_batch(KVEventBatch(float(i), [BlockRemoved([2**40 + k for k in range(hashes)], None)]))


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[int] = []

    def on_batch(self, worker, seq, b) -> None:
        with self.lock:
            self.got.append(seq)

    def seqs(self) -> list[int]:
        with self.lock:
            return list(self.got)


def dealer(ctx: zmq.Context, endpoint: str, rcvhwm: int = 1000) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVHWM, rcvhwm)
    d.connect(endpoint)
    return d


# ---- 1. replay memory per peer ---------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from kvslots.events import BlockRemoved, KVEventBatch, encode_batch
    from kvslots.events.publisher import EventPublisher

    n, hashes = int(sys.argv[1]), int(sys.argv[2])
    def batch(i):
        return encode_batch(KVEventBatch(float(i), [BlockRemoved([2**40 + k for k in range(hashes)], None)]))
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=n)
    for i in range(n):
        pub.publish(batch(i))
    pub.flush()
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    print(pub.endpoint, pub.replay_endpoint, len(batch(0)), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "rss":
            st = pub.stats()
            print(rss(), st["replay_refused"], st["replay_truncated"], st["replayed"], flush=True)
        elif cmd[0] == "gap":  # three batches, the second not sent live
            pub._test_drop_on_wire(pub.next_seq + 1)
            for i in range(3):
                pub.publish(batch(i))
            pub.flush()
            print(pub.next_seq, flush=True)
""")

PEERS = 50
#: The bound the probe asserts: 50 peers x REPLAY_HWM (64) queued replies x the batch size,
#: plus room. Measured: 1.5 KB batches grew the publisher by ~8 MiB, 30 KB ones by ~77 MiB;
#: before the bound, the 1.5 KB probe grew it by 1.2 GB in 8 s.
def replayed(sock: zmq.Socket, pause_every: int = 0) -> list[int]:
    """The sequence numbers of one replay, read up to its end marker (pausing 20 ms every
    pause_every replies when asked: a slow reader)."""
    got = []
    while True:
        assert sock.poll(5000)
        seq, _ = parse_replay_reply(sock.recv_multipart())
        if seq == REPLAY_END:
            return got
        got.append(seq)
        if pause_every and len(got) % pause_every == 0:
            time.sleep(0.02)


def rss_bound(batch_bytes: int) -> int:
    return PEERS * pubmod.REPLAY_HWM * batch_bytes * 3 // 2 + 16 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
@pytest.mark.parametrize(("BUFFER", "HASHES"), [(10_000, 170), (2_000, 3_400)], ids=["1.5KB", "30KB"])
def test_peers_that_never_read_replays_cannot_grow_the_publisher(BUFFER, HASHES):
    """50 peers ask for replays of the whole buffer over and over and never read their DEALER
    sockets: the publisher (another process) grows by less than rss_bound, refuses the repeated
    requests, and a normal subscriber meanwhile catches up on the whole buffer and heals a gap."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(BUFFER), str(HASHES)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sub = None
    try:
        assert child.stdin is not None and child.stdout is not None
        endpoint, replay_ep, size = child.stdout.readline().split()
        assert 8 * HASHES < int(size) < 10 * HASHES

        def ask(cmd: str) -> list[int]:
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            return [int(x) for x in child.stdout.readline().split()]

        base = ask("rss")[0]
        peers = [dealer(ctx, replay_ep) for _ in range(PEERS)]
        rec = Recorder()
        sub = EventSubscriber(rec.on_batch, replay_timeout_ms=5000, context=ctx)
        sub.start()
        deadline = time.monotonic() + 4.0
        added = False
        while time.monotonic() < deadline:
            for d in peers:
                d.send_multipart(replay_request(0), zmq.NOBLOCK)
            if not added:  # once the peers are attached and their queues filling
                sub.add_publisher("w", endpoint, replay_ep, start_seq=0)
                added = True
            time.sleep(0.1)
        wait_until(lambda: len(rec.seqs()) == BUFFER, 30, "the catch-up replay")
        assert rec.seqs() == list(range(BUFFER))
        time.sleep(0.5)  # live subscription settled
        next_seq = ask("gap")[0]
        wait_until(lambda: rec.seqs()[-1:] == [next_seq - 1], 30, "the gap healed")
        assert rec.seqs() == list(range(next_seq))
        assert sub.counters["gaps"] == 1 and sub.counters["lost"] == 0
        rss, refused, truncated, replayed = ask("rss")
        growth = rss - base
        print(f"publisher RSS growth with {PEERS} non-reading peers: {growth / 2**20:.1f} MiB "
              f"(refused {refused}, truncated {truncated}, replayed {replayed})")
        assert growth < rss_bound(int(size))
        assert refused >= PEERS  # each peer asked again while its first replay was stuck
    finally:
        if sub is not None:
            sub.stop()
        ctx.destroy(linger=0)
        child.kill()
        child.wait()


def test_a_replay_waits_for_a_slow_reader_and_a_stalled_one_is_truncated(monkeypatch):
    """A peer whose queue is full gets the rest of its replay as it reads (in order, nothing
    dropped, then the end marker); one that stops reading for REPLAY_STALL_S is dropped and
    counted; a second request while the first is under way is refused and counted."""
    monkeypatch.setattr(pubmod, "REPLAY_STALL_S", 0.5)
    n = 3000  # of 9 KB: 27 MB, more than the loopback's socket buffers hold for a stalled peer
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=n)
    ctx = zmq.Context()
    try:
        one = batch(0, 1000)
        for i in range(n):
            pub.publish(one)
        assert pub.flush(5)
        slow = dealer(ctx, pub.replay_endpoint, rcvhwm=10)
        slow.send_multipart(replay_request(0))
        wait_until(lambda: pub.stats()["replay_requests"] == 1, what="the request")
        slow.send_multipart(replay_request(5))
        wait_until(lambda: pub.stats()["replay_refused"] == 1, what="the second request refused")
        got = replayed(slow, pause_every=50)  # reads slowly: the publisher's queue for it fills
        assert got == list(range(n))
        assert pub.stats()["replay_truncated"] == 0

        stalled = dealer(ctx, pub.replay_endpoint, rcvhwm=10)
        stalled.send_multipart(replay_request(0))
        wait_until(lambda: pub.stats()["replay_truncated"] == 1, 10, "the stalled replay truncated")
        stalled.send_multipart(replay_request(0))  # accepted again once the old one is dropped
        wait_until(lambda: pub.stats()["replay_requests"] == 4, what="the new request")
        assert pub.stats()["replay_refused"] == 1

        gone = dealer(ctx, pub.replay_endpoint, rcvhwm=10)
        gone.send_multipart(replay_request(0))
        wait_until(lambda: pub.stats()["replay_requests"] == 5, what="the last request")
        gone.close(linger=0)  # disconnects mid-replay: dropped at the next retry
        wait_until(lambda: pub.stats()["replay_truncated"] >= 2, 10, "the gone peer's replay dropped")
        assert pub.stats()["errors"] == 0
    finally:
        ctx.destroy(linger=0)
        pub.shutdown()


def test_replay_from_past_the_end_and_of_batches_evicted_meanwhile():
    """A start past the buffer (up to 2**64-1) gets just the end marker; a replay whose batches
    leave the buffer while its peer is slow goes on from what is still buffered, in order."""
    pub = EventPublisher(LOCAL, LOCAL, buffer_steps=2000)
    ctx = zmq.Context()
    try:
        one = batch(0, 1000)
        for _ in range(2000):
            pub.publish(one)
        assert pub.flush(5)
        for start in (2000, 2**63, 2**64 - 1):
            d = dealer(ctx, pub.replay_endpoint)
            d.send_multipart(replay_request(start))
            assert d.poll(5000)
            assert parse_replay_reply(d.recv_multipart())[0] == REPLAY_END
        slow = dealer(ctx, pub.replay_endpoint, rcvhwm=10)
        slow.send_multipart(replay_request(0))
        wait_until(lambda: pub.stats()["replay_requests"] == 4, what="the request")
        time.sleep(0.2)  # its queue fills
        for _ in range(1000):  # half the buffer is replaced
            pub.publish(one)
        assert pub.flush(5)
        got = replayed(slow)
        # What it took before the eviction, then from what is still buffered up to 1999 (the
        # last batch when it asked; later ones reach a subscriber live).
        k = next(i for i, s in enumerate(got) if s != i) if got != list(range(len(got))) else len(got)
        assert got == list(range(k)) + list(range(max(k, 1000), 2000))
        st = pub.stats()
        assert st["errors"] == 0 and st["replay_truncated"] == 0
    finally:
        ctx.destroy(linger=0)
        pub.shutdown()


# ---- 2. frame size on the subscriber's sockets -----------------------------------------------

HOSTILE_PUB = textwrap.dedent("""
    import sys, time, zmq
    from kvslots.events import KVEventBatch, encode_batch
    big = int(sys.argv[1])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:0")
    print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    pub.recv()  # a subscriber is there
    def send(seq, payload):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
    send(0, encode_batch(KVEventBatch(0.0, [])))
    time.sleep(0.2)
    send(1, b"x" * big)  # a frame far past the subscriber's bound
    for seq in range(2, 1000):  # normal batches, through the reconnect
        time.sleep(0.01)
        send(seq, encode_batch(KVEventBatch(float(seq), [])))
""")


def _mem(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("reset_on_reconnect", [False, True])
def test_an_oversized_frame_drops_the_connection_and_later_batches_arrive(reset_on_reconnect):
    """A publisher sends a 256 MiB frame to a subscriber bounded at 1 MiB: ZMQ drops the
    connection before buffering the frame (this process's peak memory grows by far less than
    the frame), reconnects, and the batches sent after it are applied."""
    big = 256 * 2**20
    child = subprocess.Popen([sys.executable, "-c", HOSTILE_PUB, str(big)], stdout=subprocess.PIPE, text=True)
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, max_frame_bytes=2**20, reset_on_reconnect=reset_on_reconnect)
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak RSS, to the RSS now
            measure = True
        except OSError:
            measure = False
        base = _mem("VmRSS")
        sub.add_publisher("w", endpoint, start_seq=0)
        sub.start()
        wait_until(lambda: rec.seqs() and rec.seqs()[-1] >= 100, 30, "batches after the big frame")
        seqs = rec.seqs()
        assert seqs[0] == 0 and 1 not in seqs and seqs == sorted(set(seqs))
        assert sub.counters["malformed"] == 0 and sub.counters["lost"] >= 1
        if reset_on_reconnect:
            assert sub.counters["resets"] >= 1
        if measure:
            growth = _mem("VmHWM") - base
            print(f"subscriber peak RSS growth with a {big >> 20} MiB frame: {growth / 2**20:.1f} MiB")
            assert growth < 32 * 2**20
    finally:
        sub.stop()
        child.kill()
        child.wait()


def test_the_replay_socket_refuses_an_oversized_reply_and_the_stream_goes_on():
    """A replay server that answers with a frame past the bound: the DEALER's connection is
    dropped, the replay is given up (no answer), and the live stream keeps being applied."""
    ctx = zmq.Context()
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch, context=ctx, max_frame_bytes=2**16, replay_timeout_ms=300)
    try:
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        router = ctx.socket(zmq.ROUTER)
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        sub.add_publisher("w", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", start_seq=0)
        sub.start()
        ident, _, start = router.recv_multipart()  # the catch-up request
        router.send_multipart([ident, b"", b"", start, b"x" * (2**16 + 1)])
        wait_until(lambda: sub.counters["replay_given_up"] == 1, 10, "the replay given up")
        seq = 5

        def live() -> bool:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(KVEventBatch(1.0, []))])
            return 5 in rec.seqs()

        wait_until(live, 10, "a live batch applied")
        assert sub.counters["malformed"] == 0
        for s in (sub._by_id["w"].sub, sub._by_id["w"].dealer):
            assert s is None or s.getsockopt(zmq.MAXMSGSIZE) == 2**16
    finally:
        sub.stop()
        ctx.destroy(linger=0)


# ---- 3. IPv6 literals ------------------------------------------------------------------------


def _ipv6_loopback() -> str | None:
    """Why the machine cannot take a test over ::1, or None."""
    import socket

    if not socket.has_ipv6:
        return "Python has no IPv6 support"
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"cannot bind ::1: {e}"
    return None


def test_publisher_to_subscriber_over_ipv6_loopback(capsys):
    """A publisher bound on tcp://[::1]:0 (live and replay) and a subscriber connected to the
    [::1] endpoints it reports: the catch-up replay and a gap healed by replay both go over IPv6."""
    why = _ipv6_loopback()
    if why is not None:
        with capsys.disabled():
            print(f"\nskipped: no IPv6 loopback here ({why})")
        pytest.skip(f"no IPv6 loopback: {why}")
    pub = EventPublisher("tcp://[::1]:0", "tcp://[::1]:0")
    rec = Recorder()
    sub = EventSubscriber(rec.on_batch)
    try:
        assert pub.endpoint.startswith("tcp://[::1]:") and pub.replay_endpoint.startswith("tcp://[::1]:")
        for i in range(3):
            pub.publish(batch(i))
        assert pub.flush(5)
        assert sub.add_publisher("w", pub.endpoint, pub.replay_endpoint, start_seq=0, wait=10), (
            sub.publisher_status("w"), sub.counters, pub.stats)
        assert rec.seqs() == [0, 1, 2]  # the catch-up replay, over the replay socket
        sub.start()
        pub._test_drop_on_wire(4)
        n = 3
        while rec.seqs()[-1:] != [n - 1] and n < 500:  # until the live stream is joined
            pub.publish(batch(n))
            n += 1
            time.sleep(0.01)
        for _ in range(3):
            pub.publish(batch(n))
            n += 1
        wait_until(lambda: rec.seqs()[-1:] == [n - 1], 10, "the live stream over IPv6",
                   lambda: (rec.seqs()[-5:], sub.publisher_status("w"), sub.counters, pub.stats))
        assert rec.seqs() == list(range(n))
        assert sub.counters["lost"] == 0
    finally:
        sub.stop()
        pub.shutdown()


@pytest.mark.parametrize("endpoint", ["tcp://[::1:5557", "tcp://[zz]:5557", "tcp://[1.2.3.4]:5557",
                                      "tcp://[::1]]:5557", "tcp://[]:5557", "tcp://[::1]"])
def test_malformed_bracketed_hosts_are_refused_before_any_socket(endpoint):
    from kvslots.errors import InvalidArgumentError
    from kvslots.events.protocol import check_endpoint

    with pytest.raises(InvalidArgumentError, match="not an IPv6 address in brackets"):
        check_endpoint(endpoint)
    with pytest.raises(InvalidArgumentError, match="not an IPv6 address in brackets"):
        EventPublisher(endpoint)
    sub = EventSubscriber(lambda *a: None)
    try:
        with pytest.raises(InvalidArgumentError, match="not an IPv6 address in brackets"):
            sub.add_publisher("w", endpoint)
        with pytest.raises(InvalidArgumentError, match="not an IPv6 address in brackets"):
            sub.add_publisher("w", "tcp://127.0.0.1:5557", replay_endpoint=endpoint)
        assert sub.publishers() == []
    finally:
        sub.stop()


@pytest.mark.parametrize("value", [0, -1, 2**63, 10**400, 1.5, float("nan"), "64", None, True])
def test_max_frame_bytes_is_checked(value):
    from kvslots.errors import KVSlotsError

    with pytest.raises(KVSlotsError, match="max_frame_bytes"):
        EventSubscriber(lambda *a: None, max_frame_bytes=value)


def test_an_ipc_path_past_the_os_limit_is_refused_before_any_socket(tmp_path):
    # ZMQ failed only when the socket was made: kvslots serve passed such an endpoint on to vLLM,
    # whose engine failed after loading the model. The rank's _dp suffix counts too.
    from kvslots.errors import InvalidArgumentError
    from kvslots.events.protocol import MAX_IPC_PATH, check_endpoint

    ok = "ipc:///" + "a" * (MAX_IPC_PATH - 1)
    assert check_endpoint(ok) == ok
    with pytest.raises(InvalidArgumentError, match="longer than"):
        check_endpoint(ok, data_parallel_rank=1)
    with pytest.raises(InvalidArgumentError, match="longer than"):
        check_endpoint(ok + "a")
    with pytest.raises(InvalidArgumentError, match="longer than"):
        EventPublisher("ipc:///" + "a" * 5000)
    short = f"ipc://{tmp_path}/e.sock"
    if len(short) - len("ipc://") <= MAX_IPC_PATH:
        EventPublisher(short).shutdown()  # a path within the limit still binds
