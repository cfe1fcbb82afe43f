"""Publishing KV event batches over ZMQ, on the wire exactly as vLLM's ``ZmqEventPublisher``.

A subscriber built for vLLM reads this publisher, and :class:`kvslots.events.subscriber.EventSubscriber`
reads both. The frames (live PUB messages with 8-byte sequence numbers, replay requests and
replies on an optional ROUTER socket, the end-of-replay marker) and the bind/connect rule are
those of :mod:`.protocol`.

Batches are queued by :meth:`EventPublisher.publish` (any thread) and sent by one background
thread that owns both sockets, because ZMQ sockets are not thread-safe. ``publish`` encodes a
struct batch in the caller's thread and queues its bytes, so a batch that cannot be encoded is
refused at the call (the sender thread used to drop it, counting an error). That is the work the
sender thread did, moved, not repeated: msgspec holds the GIL while it encodes, so it took the
same interpreter time there. Pre-encoded payloads (``SlotManager.drain_events_msgpack``, what the
connector publishes) are queued as they are, so the hot path builds no Python object per event.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, Union

import msgspec
import zmq

from .. import _args, _fds
from ..errors import ArgumentTypeError, EventDecodeError, InvalidArgumentError, InvalidStateError, NoCopy
from ._wakeup import WakePipe
from .codec import EventBatch, decode_batch, encode_struct
from .protocol import (
    END_SEQ,
    MAX_HWM,
    check_endpoint,
    check_process,
    fork_generation,
    is_bind_endpoint,
    is_ipv6,
    live_message,
    offset_endpoint_port,
    parse_replay_request,
    replay_end,
    replay_reply,
)

# END_SEQ, is_bind_endpoint and offset_endpoint_port are defined in .protocol; importable here too.
__all__ = ["END_SEQ", "EventPublisher", "is_bind_endpoint", "offset_endpoint_port"]

log = logging.getLogger(__name__)

#: Largest frame the replay ROUTER accepts (a request's frames are an empty delimiter and 8 bytes).
REPLAY_MAX_FRAME = 1024

#: Largest frame the PUB socket accepts beyond the topic's length: all a PUB reads is its
#: subscribers' subscriptions. A ZMTP 3.1 peer (libzmq >= 4.3) sends each as a SUBSCRIBE command
#: (a length byte, "SUBSCRIBE", the prefix: 10 bytes more than the prefix), a ZMTP 3.0 one as a
#: flag byte and the prefix: so a prefix longer than 246 bytes plus the topic's length (255 from a
#: 3.0 peer) drops the peer's connection. Without the bound ZMQ buffered it whole (a peer
#: declaring a 2 GiB subscription grew the publisher by 700 MB/s as it sent the bytes). A
#: subscription longer than the topic
#: matches none of its messages; each byte of a distinct one costs the socket's subscription trie
#: ~47 bytes (1 KiB ones: 47 KB each). ZMQ keeps every distinct subscription a peer sends until it
#: leaves, with no option to bound their number: a known limit (30,000 of 200 B: +281 MB). An
#: XPUB that counted them and made the socket again past a bound (17e4654) looped: every SUB
#: re-sends all its subscriptions at each reconnect, so one peer holding 1,100 crossed the bound
#: again after each reset, and every subscriber lost its entries at each.
SUBSCRIPTION_MAX_FRAME = 256

#: Replay messages queued for one peer at most (the ROUTER's send high-water mark). With
#: ROUTER_MANDATORY a full queue is an EAGAIN, not a silent drop: the replay waits and resumes
#: where it stopped, so a peer that never reads holds at most this many batches of ours (it was
#: the whole buffer, twice, per peer: 50 such peers grew the process by 1.2 GB in 8 s). 64 keeps
#: a reading subscriber's catch-up fast (10,000 batches of 1.5 KB in 0.4 s; 0.27 s at 256, 1 s
#: at 16) while 50 stalled peers cost 8 MiB with 1.5 KB batches, 77 MiB with 30 KB ones.
REPLAY_HWM = 64
#: Replays in progress at most (one per peer): each holds up to REPLAY_HWM batches in its peer's
#: queue, and peers were not counted (500 peers asking at once and reading nothing: 500 x 64
#: batches). A request past them drops the replay whose peer took something longest ago if that
#: peer took nothing for REPLAY_EVICT_AFTER_S (counted replay_evicted; it is sent its end marker,
#: so a reading subscriber asks again at once); else the request waits (MAX_WAITING_REPLAYS).
#: Refusing alone let 64 peers that ask and never read block every real replay until
#: REPLAY_STALL_S; evicting at every request let a flood of new routing ids evict a fast-reading
#: replay again and again (1,312 of 20,000 replayed), and grew the process without bound (an
#: evicted replay's batches stay queued until its peer leaves: 800 such peers +506 MiB).
MAX_REPLAYS = 64
#: A replay is evicted for a new request only when its peer has taken nothing for this long: the
#: queued batches then grow by at most MAX_REPLAYS x REPLAY_HWM per this time.
REPLAY_EVICT_AFTER_S = 1.0
#: Requests that wait for a replay slot at most (a few bytes each, served in order); past them a
#: request is not answered (counted replay_busy): the subscriber gives the gap up.
MAX_WAITING_REPLAYS = 16
#: A replay the peer has taken nothing of for this long is dropped (counted replay_truncated).
REPLAY_STALL_S = 10.0
#: Replay requests read per wake-up of the sender thread, at most. Queued batches are sent between
#: such turns: the loop read requests until none was left, so a peer sending them (or garbage)
#: faster than it reads them kept every live batch waiting (one such peer: 132 ms median delay;
#: two: batches over 5 s late). A turn of 1,000 garbage frames takes about 2 ms.
REPLAY_REQUESTS_PER_ROUND = 1000
#: Most bytes of batches the replay buffer keeps by default (``buffer_bytes``): past them the
#: oldest leave it, as past ``buffer_steps``. buffer_steps alone pinned any amount (10,000
#: batches of 64 MiB: 640 GiB); a replay asking for one that left gets the rest (a hole).
DEFAULT_BUFFER_BYTES = 1 << 30
MAX_BUFFER_BYTES = 1 << 40
#: Retries of a replay whose peer's queue is full: after 1 ms, doubling up to 100 ms.
_RETRY_MIN, _RETRY_MAX = 0.001, 0.1

Payload = Union[EventBatch, msgspec.Struct, bytes, bytearray, memoryview]


@dataclass
class _Replay:
    """One peer's replay in progress: batches ``next`` .. ``stop - 1``, then the end marker."""

    next: int
    stop: int  # the publisher's next_seq when asked: later batches reach the peer live
    progress_at: float  # when the peer last took a message
    retry_at: float = 0.0
    delay: float = _RETRY_MIN


class EventPublisher(NoCopy):
    """Publishes KV event batches with sequence numbers and a replay buffer.

    Parameters
    ----------
    endpoint:
        PUB address; bound when :func:`is_bind_endpoint` says so (``tcp://*:5557``,
        ``tcp://127.0.0.1:0``, ipc, inproc), else connected (to a subscriber that binds).
        ``bind`` overrides the rule. Shifted by ``data_parallel_rank`` as vLLM does.
    replay_endpoint:
        ROUTER address for replay requests (always bound), or None for no replay.
    topic:
        First frame of every message (subscribers filter on its prefix).
    data_parallel_rank:
        Written into batches whose rank is None (vLLM does the same); for pre-encoded bytes the
        caller passes it to the encoder.
    buffer_steps:
        How many recent batches the replay buffer keeps.
    buffer_bytes:
        How many bytes of recent batches the replay buffer keeps at most (the newest batch is
        always kept); :data:`DEFAULT_BUFFER_BYTES` by default, at most :data:`MAX_BUFFER_BYTES`.
    hwm:
        High-water mark of the PUB socket (messages; beyond it ZMQ drops for slow subscribers),
        at most :data:`MAX_HWM`.
    max_queue_size:
        Batches waiting to be sent; when full, :meth:`publish` blocks (as vLLM's publisher does)
        rather than drop a batch before it has a sequence number, which no subscriber could see.
    linger_ms:
        How long :meth:`shutdown` lets ZMQ deliver messages still in flight.
    context:
        A ZMQ context to use; by default the publisher makes its own and terminates it on
        shutdown.
    """

    _copy_refusal = "it owns ZMQ sockets and a sender thread"

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        max_queue_size: int = 100_000,
        bind: bool | None = None,
        linger_ms: int = 1000,
        context: zmq.Context | None = None,
    ) -> None:
        if "_thread" in vars(self):  # __init__ again: the first one's thread and bound sockets ran on, unreachable
            raise InvalidStateError("the event publisher is already made: make a new one")
        # Every argument is checked before a socket exists, so a bad one leaks nothing.
        data_parallel_rank = _args.integer(data_parallel_rank, "data_parallel_rank", 0, _args.C_INT_MAX)
        endpoint = check_endpoint(endpoint, "endpoint", data_parallel_rank)
        if replay_endpoint is not None:
            replay_endpoint = check_endpoint(replay_endpoint, "replay_endpoint", data_parallel_rank)
        topic = _args.text(topic, "topic")
        # Kept at the range the connector's config documents (events_buffer_steps), which dates
        # from the old replay HWM of 2 * (buffer_steps + 1); replays no longer depend on it.
        buffer_steps = _args.integer(buffer_steps, "buffer_steps", 1, _args.C_INT_MAX // 2 - 1)
        # 0 is ZMQ's "no limit": at least 1. At most MAX_HWM: a subscriber that stops reading is
        # queued up to hwm messages, ~200 bytes each besides the batches.
        hwm = _args.integer(hwm, "hwm", 1, MAX_HWM)
        buffer_bytes = _args.integer(buffer_bytes, "buffer_bytes", 1, MAX_BUFFER_BYTES)
        max_queue_size = _args.integer(max_queue_size, "max_queue_size", 1)
        bind = _args.flag(bind, "bind", optional=True)
        linger_ms = _args.integer(linger_ms, "linger_ms", -1, _args.C_INT_MAX)
        if context is not None and not isinstance(context, zmq.Context):
            raise ArgumentTypeError(f"context must be a zmq.Context, got {type(context).__name__}")
        self.data_parallel_rank = data_parallel_rank
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._max_queue = max_queue_size
        self._linger_ms = linger_ms
        # What the context, the wake-up pipe and the sockets open (a passed-in context may not
        # have started its threads yet): past the limit libzmq would abort the process.
        _fds.require(_fds.ZMQ_CONTEXT + 4 + 2 * (replay_endpoint is not None), "an event publisher")
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context

        # Shared with publish(): the queue and the flags, under one lock.
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._queue: deque[bytes] = deque()  # encoded by publish()
        self._closed = False
        self._released = False  # sockets, pipe and context closed
        self._in_flight = 0  # batches taken from the queue but not yet sent

        # Owned by the sender thread once it runs.
        self._buffer: deque[tuple[int, bytes]] = deque()  # at most buffer_steps and buffer_bytes
        self._buffer_steps = buffer_steps
        self._max_buffer_bytes = buffer_bytes
        self._buffered_bytes = 0
        self._next_seq = 0
        self._drop_on_wire: set[int] = set()
        self._replays: dict[bytes, _Replay] = {}  # by peer identity; at most one per peer
        self._waiting: dict[bytes, tuple[int, int]] = {}  # requests past MAX_REPLAYS: (start, stop)
        self._stats = dict.fromkeys(
            ("published", "dropped_on_wire", "replay_requests", "replayed", "replay_malformed",
             "replay_refused", "replay_busy", "replay_evicted", "replay_truncated", "errors"),
            0,
        )

        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._wakeup = WakePipe()
        try:
            ep = offset_endpoint_port(endpoint, data_parallel_rank)
            assert ep is not None
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, linger_ms)
            self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_FRAME + len(self._topic))
            if is_ipv6(ep):
                self._pub.setsockopt(zmq.IPV6, 1)
            if is_bind_endpoint(ep) if bind is None else bind:
                self._pub.bind(ep)
                ep = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(ep)
            self.endpoint: str = ep
            self.replay_endpoint: str | None = None
            rep = offset_endpoint_port(replay_endpoint, data_parallel_rank)
            if rep is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A replay is sent as the peer takes it (see REPLAY_HWM): a full queue raises
                # EAGAIN and a gone peer EHOSTUNREACH instead of ROUTER dropping silently.
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A request is an 8-byte sequence number: a peer sending a bigger frame is
                # disconnected by ZMQ instead of having it buffered whole (a 300 MB frame cost
                # the worker 300 MB).
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME)
                if is_ipv6(rep):
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(rep)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:  # the address is taken, not local, or malformed
            self._close_sockets()
            raise InvalidArgumentError(
                f"cannot open the event publisher on {endpoint!r} (replay {replay_endpoint!r}): {e}",
                details={"errno": e.errno},
            ) from e
        except BaseException:
            self._close_sockets()
            raise

        self._forks = fork_generation()
        self._thread = threading.Thread(
            target=self._run, name=f"kvslots-event-publisher[{self.endpoint}]", daemon=True
        )
        self._thread.start()

    # ---- producer side (any thread) --------------------------------------------------------

    def publish(self, batch: Payload) -> None:
        """Queues one batch: a ``KVEventBatch`` (kvslots' or vLLM's; its rank set to
        ``data_parallel_rank`` when None) or its msgpack bytes. A struct is encoded here, in the
        caller's thread and read back: one that cannot be encoded, or whose encoding is no
        ``KVEventBatch`` a subscriber can decode, raises :class:`ArgumentTypeError` or
        :class:`InvalidArgumentError` and queues nothing. Bytes are queued as they are. Blocks
        only while the queue is full."""
        check_process(self._forks, "the event publisher")
        if self._closed:  # before touching the batch (checked again under the lock)
            raise InvalidStateError("the event publisher is shut down")
        rank: Any = 0
        if isinstance(batch, msgspec.Struct):  # ours, or vLLM's own KVEventBatch
            try:
                rank = getattr(batch, "data_parallel_rank", 0)
            except Exception as e:  # a property of a struct subclass that raises
                raise ArgumentTypeError(f"publish() cannot read the batch's data_parallel_rank: {e!r}") from e
            wire = batch
            if rank is None:  # encoded with the rank; the batch itself gets it once queued
                try:
                    wire = msgspec.structs.replace(batch, data_parallel_rank=self.data_parallel_rank)
                except Exception as e:  # a data_parallel_rank that is no field (a property)
                    raise ArgumentTypeError(f"publish() cannot set the batch's data_parallel_rank: {e!r}") from None
            payload = encode_struct(wire)
            try:
                # Read back as subscribers read it: any struct encodes (an event, a batch of
                # ints, a str ts), and one that does not decode was numbered and sent, a hole
                # every subscriber counted as malformed and the caller never heard of.
                decode_batch(payload)
            except EventDecodeError as e:
                raise InvalidArgumentError(f"publish(): the {type(batch).__name__} is not a KVEventBatch "
                                           f"on the wire: {e}") from None
        elif isinstance(batch, (bytearray, memoryview)):
            try:
                payload = bytes(batch)
            except ValueError as e:  # a released memoryview
                raise InvalidArgumentError(f"publish() cannot read the payload: {e}") from None
        elif isinstance(batch, bytes):
            payload = batch
        else:
            raise ArgumentTypeError(f"publish() takes a KVEventBatch or bytes, got {type(batch).__name__}")
        with self._lock:
            while len(self._queue) >= self._max_queue and not self._closed:
                self._not_full.wait()
            if self._closed:
                raise InvalidStateError("the event publisher is shut down")
            was_empty = not self._queue
            self._queue.append(payload)
        if was_empty:
            self._wakeup.wake()
        if rank is None:
            try:  # in place, as vLLM's publisher does
                batch.data_parallel_rank = self.data_parallel_rank  # type: ignore[union-attr]
            except Exception:  # a frozen struct (AttributeError): the copy sent had it
                pass

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued batch has been handed to ZMQ; False on timeout."""
        check_process(self._forks, "the event publisher")
        timeout = _args.timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (self._queue or self._in_flight) and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
            return not self._queue and not self._in_flight

    @property
    def next_seq(self) -> int:
        """The sequence number the next sent batch gets."""
        return self._next_seq

    def stats(self) -> dict[str, int]:
        """Counters: published, dropped_on_wire (test hook), replay_requests, replayed (batches
        resent), replay_malformed, replay_refused (requests from a peer whose previous replay is
        still being sent), replay_busy (requests left unanswered: ``MAX_REPLAYS`` were in
        progress, each of whose peers took something within ``REPLAY_EVICT_AFTER_S``, and
        ``MAX_WAITING_REPLAYS`` requests waited already), replay_evicted
        (replays dropped for a new request while ``MAX_REPLAYS`` were in progress: the one whose
        peer took something longest ago, over ``REPLAY_EVICT_AFTER_S`` ago), replay_truncated
        (replays dropped before their end: the peer took nothing for ``REPLAY_STALL_S`` or
        disconnected), errors; plus queued and next_seq."""
        with self._lock:
            queued = len(self._queue) + self._in_flight
        return {**self._stats, "queued": queued, "next_seq": self._next_seq}

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Sends what is queued (up to ``timeout``), stops the thread and closes the sockets (and
        the context when the publisher made it). Idempotent. In a forked child it only marks
        this copy shut down: the thread and sockets are the parent's."""
        timeout = _args.timeout(timeout)
        if fork_generation() != self._forks:  # before any lock: one held at the fork stays held here
            self._closed = True
            return
        with self._lock:
            first = not self._closed
            self._closed = True
            self._not_full.notify_all()
        if first:
            self._wakeup.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():  # it releases everything as it ends (_run)
            log.warning("event publisher thread did not stop within %s s", timeout)
            return
        self._release()

    close = shutdown

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- test hook -------------------------------------------------------------------------

    def _test_drop_on_wire(self, *seqs: int) -> None:
        """Test hook: the batches that get these sequence numbers are buffered for replay but
        not sent on the PUB socket (a forced gap)."""
        with self._lock:
            self._drop_on_wire.update(seqs)

    # ---- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wakeup.fileno(), zmq.POLLIN)  # poll() answers with the fd
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._round(poller):
                pass
        finally:
            self._close_thread_sockets()
            if self._closed:
                # Shut down: the pipe and the context too, here, since a shutdown() whose
                # timeout ran out returned without them (3 descriptors each, never closed).
                self._release()

    def _round(self, poller: zmq.Poller) -> bool:
        """One wake-up of the sender thread; True when it should exit."""
        try:
            ready = dict(poller.poll(self._retry_timeout_ms()))
            if self._replay is not None and self._replay in ready:
                self._serve_replays()
            self._resume_replays()
            if self._wakeup.fileno() in ready:
                # Drain the pipe before taking the queue: a publish() after this point
                # writes a fresh wake-up byte.
                self._wakeup.drain()
        except Exception:  # never let the thread die: publish() would queue forever
            self._stats["errors"] += 1
            log.exception("event publisher loop error")
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            self._in_flight = len(items)
            closed = self._closed
            if items:
                self._not_full.notify_all()
        for item in items:
            self._send(item)
        with self._lock:
            self._in_flight = 0
            self._idle.notify_all()
            return closed and not self._queue

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._buffered_bytes += len(payload)
        while len(self._buffer) > self._buffer_steps or (
                self._buffered_bytes > self._max_buffer_bytes and len(self._buffer) > 1):
            self._buffered_bytes -= len(self._buffer.popleft()[1])
        if seq in self._drop_on_wire:
            self._drop_on_wire.discard(seq)
            self._stats["dropped_on_wire"] += 1
            return
        assert self._pub is not None
        try:
            self._pub.send_multipart(live_message(self._topic, seq, payload), copy=False)
            self._stats["published"] += 1
        except zmq.ZMQError:
            # PUB does not block or fail on slow peers; this is a closed or broken socket.
            # The batch stays in the replay buffer, so subscribers see a healable gap.
            self._stats["errors"] += 1
            log.exception("event publisher send failed (seq %d)", seq)

    def _serve_replays(self) -> None:
        """Reads up to ``REPLAY_REQUESTS_PER_ROUND`` requests (the rest wait for the next round,
        after the queued batches are sent: the ROUTER stays readable, so that round is at once)."""
        assert self._replay is not None
        for _ in range(REPLAY_REQUESTS_PER_ROUND):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request = parse_replay_request(frames)
            if request is None:
                self._stats["replay_malformed"] += 1
                n = self._stats["replay_malformed"]
                if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th, ...: a flood cannot flood the log
                    log.warning("malformed replay request (%d frames; %d so far)", len(frames), n)
                continue
            client, start = request
            self._stats["replay_requests"] += 1
            if client in self._replays or client in self._waiting:
                # One replay per peer: a peer asking again before it took the last one's end
                # marker would only pile up copies of the buffer.
                self._stats["replay_refused"] += 1
                continue
            if self._waiting or (len(self._replays) >= MAX_REPLAYS and not self._evict_one()):
                # Every slot's peer took something lately: the request waits its turn (in
                # order), so the subscriber is answered, not left to give its gap up.
                if len(self._waiting) < MAX_WAITING_REPLAYS:
                    self._waiting[client] = (start, self._next_seq)
                else:
                    self._stats["replay_busy"] += 1
                continue
            self._start_replay(client, start, self._next_seq)

    def _start_replay(self, client: bytes, start: int, stop: int) -> None:
        replay = _Replay(start, stop, time.monotonic())
        self._replays[client] = replay
        self._pump(client, replay)

    def _evict_one(self) -> bool:
        """Drops the replay whose peer took something longest ago, if that is over
        ``REPLAY_EVICT_AFTER_S`` ago: its peer is likely not reading (its queue stays in ZMQ until
        it leaves). The peer is sent the end marker: a reading one asks again at once."""
        oldest = min(self._replays, key=lambda c: self._replays[c].progress_at)
        if time.monotonic() - self._replays[oldest].progress_at < REPLAY_EVICT_AFTER_S:
            return False
        del self._replays[oldest]
        self._stats["replay_evicted"] += 1
        assert self._replay is not None
        try:
            self._replay.send_multipart(replay_end(oldest), zmq.NOBLOCK)
        except zmq.ZMQError:  # its queue is full (not reading) or it left
            pass
        return True

    def _start_waiting(self) -> None:
        while self._waiting and (len(self._replays) < MAX_REPLAYS or self._evict_one()):
            client = next(iter(self._waiting))
            start, stop = self._waiting.pop(client)
            self._start_replay(client, start, stop)

    def _retry_timeout_ms(self) -> int | None:
        """How long the sender thread may sleep: until the next replay retry is due."""
        if not self._replays:
            return None
        due = min(r.retry_at for r in self._replays.values())
        if self._waiting:  # a slot may become free to evict
            due = min(due, time.monotonic() + _RETRY_MAX)
        return max(0, math.ceil((due - time.monotonic()) * 1000.0))

    def _resume_replays(self) -> None:
        now = time.monotonic()
        for client, replay in list(self._replays.items()):
            if replay.retry_at <= now:
                self._pump(client, replay)
        self._start_waiting()

    def _pump(self, client: bytes, replay: _Replay) -> None:
        """Hands the peer as much of its replay as its queue takes; the rest is retried later."""
        assert self._replay is not None
        first = self._buffer[0][0] if self._buffer else self._next_seq
        # Batches that left the buffer meanwhile are skipped: the subscriber sees a hole, as if
        # it had asked later. Buffered seqs are consecutive, so seq s is at index s - first.
        stop = max(replay.stop, first)
        replay.next = min(max(replay.next, first), stop)  # a start past the buffer: just the end
        sent = 0
        try:
            for seq, payload in islice(self._buffer, replay.next - first, stop - first):
                self._replay.send_multipart(
                    replay_reply(client, self._topic, seq, payload), zmq.NOBLOCK, copy=False
                )
                replay.next = seq + 1
                sent += 1
                self._stats["replayed"] += 1
            self._replay.send_multipart(replay_end(client), zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full (REPLAY_HWM)
            now = time.monotonic()
            if sent:
                replay.progress_at, replay.delay = now, _RETRY_MIN
            elif now - replay.progress_at >= REPLAY_STALL_S:
                self._stats["replay_truncated"] += 1
                del self._replays[client]
                return
            else:
                replay.delay = min(2 * replay.delay, _RETRY_MAX)
            replay.retry_at = now + replay.delay
            return
        except zmq.ZMQError as e:
            del self._replays[client]
            if e.errno == errno.EHOSTUNREACH:  # the peer disconnected
                self._stats["replay_truncated"] += 1
            else:
                self._stats["errors"] += 1
                log.exception("replay to a subscriber failed")
            return
        del self._replays[client]

    def _close_thread_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=None)  # keep each socket's LINGER option
        self._pub = self._replay = None

    def _release(self) -> None:
        """Closes the sockets, the pipe and the context, once (the thread, or shutdown())."""
        with self._lock:
            release, self._released = not self._released, True
        if release:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._close_thread_sockets()
        self._wakeup.close()
        if self._own_ctx:
            self._ctx.term()
