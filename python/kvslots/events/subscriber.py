"""A client for KV event streams: vLLM's ``ZmqEventPublisher`` and kvslots' own
:class:`~kvslots.events.publisher.EventPublisher` (same wire format, :mod:`.protocol`).

It hands each publisher's batches to a callback exactly once and in sequence order, healing gaps
from the publisher's replay socket::

    def on_batch(worker_id, seq, batch):       # batch: kvslots.events.KVEventBatch
        ...
    def on_reset(worker_id, last_seq, new_seq):  # drop what you hold of this publisher
        ...

    sub = EventSubscriber(on_batch, on_reset)
    sub.add_publisher("worker-0", "tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")
    sub.start()            # poll thread; callbacks run on it
    ...
    sub.stop()

This is the one implementation of the subscriber side of the protocol; the indexer
(``kvslots.indexer``) subscribes through it too.

Per publisher, with ``next`` the sequence number expected next (sequence numbers are the wire's
unsigned 8-byte integers, 0 to 2**64-1, compared as such):

* ``seq == next``: applied.
* ``seq > next``: a gap. With a replay endpoint the subscriber asks for everything from ``next``,
  holds live batches meanwhile, applies the replayed ones in order and then the held ones; what
  the publisher no longer buffers (a hole before the first reply) is counted as ``lost`` and
  skipped, while replies lost on the way (a ROUTER past its send high-water mark drops them,
  vLLM's keeps ZMQ's default of 1000) are asked for again. Without a replay endpoint, the
  missing batches are counted as lost at once.
* ``seq < next``: a duplicate if its payload equals the one applied under that number (dropped);
  otherwise the publisher restarted (sequence numbers start again at 0 per publisher instance):
  ``on_reset`` is called, and the stream starts over from 0 (replaying 0.. if it can).

The first batch seen fixes ``next`` unless ``start_seq`` was given to :meth:`add_publisher`; then
the subscriber asks for a replay from ``start_seq`` at once (to catch up on a publisher that ran
before it connected, or to resume where an earlier subscriber stopped). A live ``seq`` below
``start_seq`` from a publisher that never showed us a number at or past it is a restart too.
Frames that are not ``(topic, 8-byte seq, payload)`` and payloads that do not decode are counted
as ``malformed`` and skipped (an undecodable payload still uses up its sequence number, so it is
not re-requested forever). A replayed batch whose topic frame does not start with the
subscription's ``topic`` is malformed too: the live stream is filtered by it, and the replay
handed over another topic's batches. Nothing a publisher sends stops the loop.

Replays that fail (the server never answers, answers without the batches asked for, answers
garbage or old batches, drops its end marker; the endpoint is wrong or unreachable) cost a
bounded number of requests, and live batches keep being applied:

* A request that moved the stream on (replayed batches, or showed a hole the publisher no longer
  buffers) is followed at once by the next one if still needed. One that healed nothing is
  retried after ``replay_backoff_ms``, doubling each time up to ``replay_backoff_max_ms``, with
  jitter (a random 50-100% of the step).
* Every request to a publisher also takes a token from its bucket (``replay_max_rate`` per
  second, as many in a burst): no more than that goes out, whatever the stream does.
* A gap is given up after ``replay_max_attempts`` requests in a row that healed nothing, after
  a request that got no answer at all within ``replay_timeout_ms`` (the server is down or not
  one; asking again would hold live batches back longer), when it has been open for
  ``replay_max_wait_ms``, or when more than 100,000 batches are held back for it. Giving up is
  logged once as an error and counted (``replay_given_up``); the live batches held back are
  applied and the missing ones counted as ``lost`` (``resync_on_loss``: the stream starts over
  from the held batches, see below). Then the publisher's replay endpoint is left alone for a
  cool-down (``replay_backoff_max_ms``, doubling per gap given up in a row up to 60 s, with
  jitter): gaps meanwhile are handled as if it had none (counted as ``replay_skipped``). A
  replay that completes ends the streak.
* Replies only keep a replay alive while they bring batches at or past ``next``: a server that
  repeats old batches times out like a silent one. A reply further ahead of the live stream
  than any queue could hold (a million batches, or 4 x ``hwm``) is malformed, not a jump.

Two options, for consumers whose state must never miss a batch (the indexer: a lost
``BlockRemoved`` would leave a block claimed forever):

* ``resync_on_loss``: batches that cannot be had (gone from the publisher's buffer, no replay
  socket, replay given up) are not skipped silently: ``on_reset`` is called and the stream is
  rebuilt (counted as ``resyncs``) from what the publisher still buffers, or after a replay
  given up, from the batches that come next. Missing batches before the first one of a stream
  that starts from nothing (``start_seq=0``, or after a reset) are no loss: the stream starts
  where the publisher's buffer does.
* ``reset_on_reconnect``: the first live message after the connection to a publisher dropped
  resets the stream (``on_reset``, then a replay from 0). vLLM's protocol has no incarnation id,
  so without this a publisher that restarts and sends more batches than the old one did before
  we hear from it looks like a gap.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import _fds
from .._args import C_INT_MAX, callback, flag, hashable, integer, number, text
from .._args import timeout as _timeout
from ..errors import (
    ArgumentTypeError,
    ConcurrentUseError,
    DuplicateWorkerError,
    EventDecodeError,
    InvalidArgumentError,
    InvalidStateError,
    KVSlotsError,
    NoCopy,
    OutOfDescriptorsError,
    UnknownWorkerError,
)
from ..errors import short_repr as _shown
from .._ratelog import RateLimitedLog
from ._wakeup import WakePipe
from .codec import DECODE_ERRORS, KVEventBatch
from .protocol import (
    MAX_FRAME_BYTES,
    REPLAY_END,
    SEQ_MAX,
    check_endpoint,
    check_process,
    fork_generation,
    is_ipv6,
    parse_live,
    parse_replay_reply,
    replay_request,
)

log = logging.getLogger(__name__)


@contextmanager
def _as_key(worker_id: Any) -> Iterator[None]:
    """Runs a lookup of ``worker_id`` in a dict: its own ``__hash__`` / ``__eq__`` raising (an
    object passed the hashable check, then raised when compared with a key of equal hash) is
    an ArgumentTypeError, not that error."""
    try:
        yield
    except KVSlotsError:
        raise
    except Exception as e:
        raise ArgumentTypeError(f"worker_id {type(worker_id).__name__} cannot be used as a key: hashing or "
                                f"comparing it raised {type(e).__name__}") from e


def _equals_itself(worker_id: Any) -> bool:
    """False for a key unequal to itself (NaN); an ``__eq__`` that raises or gives no truth value
    counts as equal (such a key is found by identity, as before)."""
    try:
        return bool(worker_id == worker_id)
    except Exception:
        return True


class _StateLock:
    """The subscriber's state lock. A caller's ``worker_id`` is hashed and compared under it
    (its own ``__hash__`` / ``__eq__`` / ``__repr__``): that code calling the subscriber again
    from the same thread is refused with :class:`ConcurrentUseError` instead of waiting on the
    lock for ever. Other threads wait as for any lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the holding thread (only it sets or reads its own id)

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            raise ConcurrentUseError("the event subscriber is in the middle of a call in this thread (code run "
                                     "by a worker_id's __hash__, __eq__ or __repr__ called it again); nothing "
                                     "was changed")
        self._lock.acquire()
        self._owner = me

    def __exit__(self, *exc: Any) -> None:
        self._owner = None
        self._lock.release()


OnBatch = Callable[[Hashable, int, Any], Any]
OnReset = Callable[[Hashable, int, int], Any]
OnCount = Callable[[Hashable, str, int], Any]

COUNTERS = (
    "received",  # live messages with a well-formed (topic, seq, payload)
    "applied",  # batches handed to on_batch (live or replayed)
    "gaps",  # sequence jumps seen on the live stream
    "replayed",  # batches applied from a replay
    "duplicates",  # batches dropped as already applied
    "resets",  # on_reset calls: publisher restarts (and resyncs)
    "malformed",  # frames or payloads skipped
    "lost",  # sequence numbers skipped because no replay could supply them
    "resyncs",  # losses answered by a reset and a rebuild (resync_on_loss)
    "replay_requests",  # replay requests sent
    "replay_failures",  # replay requests unanswered (timed out) or that could not be sent
    "replay_given_up",  # gaps whose replay was given up (attempts, time or answers exhausted)
    "replay_skipped",  # gaps not replayed: the replay endpoint cools down after a give-up
    "callback_errors",  # exceptions raised by on_batch / on_reset
    "reopened",  # live connections ZMQ dropped for good (a frame past max_frame_bytes), reopened
)

_HELD_WINDOW = 64  # applied payloads' fingerprints kept to tell a duplicate from a restart
# A payload up to this size is its own fingerprint; a bigger one is known by its length and a
# 16-byte BLAKE2b digest. The window kept the payloads themselves: a publisher sending frames
# near max_frame_bytes made the subscriber hold 64 of them (4 GiB at 64 MiB each) per publisher.
_FINGERPRINT_BYTES = 4096
# Messages read from one socket per round of the loop, at most; every other socket is read in
# between. It was 10,000: a publisher flooding its socket held every other publisher's batches
# back by 10,000 of its messages per round (130-150 ms median, 300 ms at worst); 1,000 is
# about 15 ms of them, and a busy publisher's own throughput does not suffer (200,000 small
# batches applied in 5.5-7 s, 9.8 s at 10,000).
_DRAIN_PER_ROUND = 1000
_MAX_HELD = 100_000  # batches held back for one replay; past it the replay is given up
_COOLDOWN_MAX = 60.0  # seconds: the longest a replay endpoint is left alone after give-ups
# ZMQ follows a lost connection with EVENT_CONNECT_RETRIED when it reconnects by itself; after a
# protocol error (a frame past MAXMSGSIZE) it never does. Seconds to wait for that event before
# reopening the connection ourselves.
_RELINK_GRACE = 0.2

_LIVE, _REPLAY, _MONITOR = 0, 1, 2  # what a registered socket is to its peer


def _fingerprint(payload: bytes) -> Any:
    """What tells two payloads apart: a small one itself (bytes), a big one its length and
    digest (a tuple, never equal to bytes)."""
    if len(payload) <= _FINGERPRINT_BYTES:
        return payload
    return len(payload), hashlib.blake2b(payload, digest_size=16).digest()


def _wait_seconds(wait: Any) -> float | None:
    """``wait=`` of add/remove_publisher: None (do not wait) or seconds, infinity included."""
    return None if wait is None else max(0.0, number(wait, "wait", finite=False))


@dataclass
class _Peer:
    worker_id: Hashable
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    start_seq: int | None
    sub: zmq.Socket | None = None
    dealer: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    error: Exception | None = None  # why the sockets could not be opened
    opened: bool = False  # sockets open, catch-up replay (start_seq) requested
    next: int | None = None
    live_last: int = -1  # last seq seen on the live stream (it only moves forward)
    seen: bool = False  # this publisher instance has shown us a seq (live or replayed)
    fresh: bool = False  # the stream starts from nothing: what precedes the buffer is no loss
    reconnected: bool = False  # the live connection dropped since the last live message
    relink_at: float | None = None  # dropped, ZMQ not reconnecting (yet): reopen it then
    recent: deque[tuple[int, Any]] = field(default_factory=lambda: deque(maxlen=_HELD_WINDOW))  # (seq, _fingerprint)
    replaying: bool = False  # a replay is under way: requested, or waiting to be (pending)
    pending: bool = False  # the request waits for replay_deadline (backoff, rate cap)
    replay_deadline: float = 0.0  # the current request times out, or the pending one is sent
    replay_got: bool = False  # the current replay delivered a batch (not just the end marker)
    # One gap (or catch-up) and the requests made for it:
    gap_since: float | None = None  # when its first request was wanted; None: no gap open
    replay_from: int | None = None  # next when its last request was sent (None: none sent)
    fails: int = 0  # its requests in a row that healed nothing
    sent: int = 0  # its requests sent
    # Across gaps:
    tokens: float | None = None  # rate cap: requests that may be sent now (None: a full bucket)
    tokens_at: float = 0.0
    give_ups: int = 0  # gaps given up in a row (each doubles the cool-down)
    cooldown_until: float = 0.0  # no replay requests before this: gaps are lost at once
    held: dict[int, bytes] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # The id's repr, made once by errors.short_repr (never raising, at most 80 characters): the poll
    # loop logs this and never calls the caller's __repr__ (nor its __hash__: the log limiter's
    # keys are id(peer)), which may raise.
    shown: str = ""

    def __post_init__(self) -> None:
        self.shown = self.shown or _shown(self.worker_id)


class EventSubscriber(NoCopy):
    """Subscribes to any number of KV event publishers; see the module docstring.

    ``on_batch(worker_id, seq, batch)`` gets every batch once, in order, per publisher: a
    decoded ``KVEventBatch``, or with ``decode=False`` the msgpack payload as ``bytes`` (for
    consumers that decode it themselves). ``on_batch`` may raise
    :class:`kvslots.EventDecodeError` to say a payload is not a batch: it is counted as
    malformed. ``on_reset(worker_id, last_seq, new_seq)`` is called when the publisher's stream
    starts over (``last_seq`` is -1 if nothing had been applied). ``on_count(worker_id, name,
    n)`` is called whenever one of a publisher's ``COUNTERS`` grows by ``n`` (for metrics). All
    run on the polling thread (or in :meth:`poll_once`); exceptions raised by ``on_batch`` and
    ``on_reset`` are logged and counted, never propagated.

    ``replay_timeout_ms`` bounds the wait for a replay's next useful message; ``hwm`` is the
    receive high-water mark of the SUB and replay sockets (messages a publisher can have
    waiting in this process). ``max_frame_bytes`` is the largest frame taken
    from a publisher (:data:`~.protocol.MAX_FRAME_BYTES` by default): ZMQ drops the connection
    of one that sends a bigger frame before buffering it, and the subscriber reopens it
    (counted ``reopened``); the batch is missed (a gap, or with ``reset_on_reconnect`` a
    reset), later ones are applied. ``resync_on_loss`` and ``reset_on_reconnect``: see the
    module docstring. Bounds on replay traffic (see "Replays that fail" in the module
    docstring): ``replay_max_attempts`` requests in a row that heal nothing give a gap up;
    ``replay_backoff_ms`` is the wait before the first retry, doubling per retry up to
    ``replay_backoff_max_ms`` (which also starts the cool-down after a give-up), each with
    jitter; ``replay_max_rate`` caps the requests per second to one publisher (with a burst of
    as many); ``replay_max_wait_ms`` caps how long one gap holds live batches back.
    """

    _copy_refusal = "it owns ZMQ sockets, a polling thread and each publisher's state"

    def __init__(
        self,
        on_batch: OnBatch,
        on_reset: OnReset | None = None,
        *,
        replay_timeout_ms: float = 2000,
        hwm: int = 100_000,
        context: zmq.Context | None = None,
        decode: bool = True,
        on_count: OnCount | None = None,
        resync_on_loss: bool = False,
        reset_on_reconnect: bool = False,
        thread_name: str = "kvslots-event-subscriber",
        replay_max_attempts: int = 5,
        replay_backoff_ms: float = 50,
        replay_backoff_max_ms: float = 2000,
        replay_max_rate: float = 5.0,
        replay_max_wait_ms: float = 30_000,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        if "_thread" in vars(self):  # __init__ again: the first one's thread and sockets ran on, unreachable
            raise InvalidStateError("the event subscriber is already made: make a new one")
        callback(on_batch, "on_batch")
        callback(on_reset, "on_reset", optional=True)
        callback(on_count, "on_count", optional=True)
        replay_timeout_ms = number(replay_timeout_ms, "replay_timeout_ms", positive=True)
        hwm = integer(hwm, "hwm", 0, C_INT_MAX)  # RCVHWM is a C int
        if context is not None and not isinstance(context, zmq.Context):
            raise ArgumentTypeError(f"context must be a zmq.Context, got {type(context).__name__}")
        for name, value in (("decode", decode), ("resync_on_loss", resync_on_loss),
                            ("reset_on_reconnect", reset_on_reconnect)):
            flag(value, name)
        text(thread_name, "thread_name")
        replay_max_attempts = integer(replay_max_attempts, "replay_max_attempts", 1)
        replay_backoff_ms = number(replay_backoff_ms, "replay_backoff_ms", 0)
        replay_backoff_max_ms = number(replay_backoff_max_ms, "replay_backoff_max_ms", replay_backoff_ms)
        replay_max_rate = number(replay_max_rate, "replay_max_rate", positive=True)
        replay_max_wait_ms = number(replay_max_wait_ms, "replay_max_wait_ms", positive=True)
        self._max_frame = integer(max_frame_bytes, "max_frame_bytes", 1, 2**63 - 1)  # an int64
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._on_count = on_count
        self._resync_on_loss = resync_on_loss
        self._reset_on_reconnect = reset_on_reconnect
        self._thread_name = thread_name
        self._replay_timeout = replay_timeout_ms / 1000.0
        self._max_attempts = replay_max_attempts
        self._backoff = replay_backoff_ms / 1000.0
        self._backoff_max = replay_backoff_max_ms / 1000.0
        self._rate = float(replay_max_rate)
        self._burst = max(1.0, self._rate)
        self._max_wait = replay_max_wait_ms / 1000.0
        self._random = random.Random()  # jitter
        # What a publisher's frames trigger, bounded per publisher (a flood of bad frames was a
        # flood of log lines).
        self._peer_log = RateLimitedLog(log)
        # How far a replay may run ahead of the live stream (batches in flight to us).
        self._max_ahead = max(2**20, 4 * hwm)
        self._hwm = hwm
        # The context's mailbox and the wake-up pipe; its threads start with the first socket
        # (_open_peer checks again then).
        _fds.require(1 + 2, "an event subscriber")
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._ctx_started = False  # a passed-in one may not be either: checked all the same
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch) if decode else None

        self._forks = fork_generation()
        self._lock = _StateLock()
        self._commands: deque[tuple[str, Any]] = deque()
        self._queued = self._done = 0  # commands queued, and applied by the polling thread
        self._by_id: dict[Hashable, _Peer] = {}  # every added publisher (as callers see it)
        # Owned by the polling thread, keyed by id(peer): it never hashes or compares a caller's
        # worker_id (whose __hash__ / __eq__ may raise).
        self._peers: dict[int, _Peer] = {}
        self._sockets: dict[zmq.Socket, tuple[_Peer, int]] = {}  # socket -> (peer, _LIVE...)
        self._monitors = 0  # monitor sockets registered
        self._poller = zmq.Poller()
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._wakeup = WakePipe()
        self._poller.register(self._wakeup.fileno(), zmq.POLLIN)  # poll() answers with the fd
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        # Held by whoever polls the sockets (ZMQ sockets are not thread-safe: two threads in
        # poll_once aborted the process in libzmq): the poll thread from start() to its end, or
        # a poll_once / add_publisher(wait=...) call. Whoever releases it after stop() closes
        # the sockets (_end_poll), so a stop() that does not wait for a poll leaks nothing.
        self._poll_lock = threading.Lock()
        self._poller_ident: int | None = None  # the thread holding _poll_lock
        self._cleaned = False
        self._progress = threading.Condition()  # notified after each round while _waiting
        self._waiting = 0

    # ---- public API (any thread) ----------------------------------------------------------

    def add_publisher(
        self,
        worker_id: Hashable,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = None,
        wait: float | None = None,
    ) -> bool:
        """Connects to a publisher's PUB ``endpoint`` (and its ROUTER ``replay_endpoint``),
        subscribing to ``topic`` (a prefix; "" is everything). With ``start_seq`` the stream
        is read from that sequence number on, replaying what was published before.

        With ``wait`` (seconds), returns once the sockets are open and the catch-up replay is
        done or given up (True), or when ``wait`` runs out (False); a connection that cannot be
        made raises :class:`InvalidArgumentError` (ZMQ's error as its ``__cause__``) here, or
        :class:`OutOfDescriptorsError` when the process is out of file descriptors, and the
        publisher is not added. Without it, the sockets are opened by the polling thread
        later, and returns True."""
        check_process(self._forks, "the event subscriber")
        hashable(worker_id, "worker_id")
        endpoint = check_endpoint(endpoint, "endpoint")  # exact str values from here on
        if replay_endpoint is not None:
            replay_endpoint = check_endpoint(replay_endpoint, "replay_endpoint")
        topic = text(topic, "topic")
        if start_seq is not None:
            start_seq = integer(start_seq, "start_seq", 0, SEQ_MAX + 1)
        wait = _wait_seconds(wait)
        with self._lock:
            if self._closed:
                raise InvalidStateError("the event subscriber is stopped")
            with _as_key(worker_id):
                # A key unequal to itself (NaN) is found by no other object: added twice it was
                # two publishers, neither of which remove_publisher could find.
                if not _equals_itself(worker_id):
                    raise InvalidArgumentError(f"worker_id {_shown(worker_id)} is not equal to itself (NaN?)")
                if worker_id in self._by_id:
                    raise DuplicateWorkerError(f"publisher {_shown(worker_id)} is already added")
                peer = _Peer(worker_id, endpoint, replay_endpoint, topic.encode(), start_seq)
                self._by_id[worker_id] = peer
            self._commands.append(("add", peer))
            self._queued += 1
        self._wakeup.wake()
        if wait is None:
            return True
        synced = self._wait_for(lambda: peer.error is not None or self._synced(peer), wait)
        if peer.error is not None:
            code = getattr(peer.error, "errno", None)
            # Out of descriptors is this process's limit, not a bad address.
            cls = OutOfDescriptorsError if code in (errno.EMFILE, errno.ENFILE) else InvalidArgumentError
            raise cls(
                f"cannot connect to publisher {peer.shown} at {endpoint!r}: {peer.error}",
                details={**getattr(peer.error, "details", {}), "errno": code},
            ) from peer.error
        return synced

    def remove_publisher(self, worker_id: Hashable, *, wait: float | None = None) -> bool:
        """Disconnects from a publisher; its held state and counters are dropped (the totals
        keep what it contributed). With ``wait`` (seconds), returns once the sockets are closed,
        so that no callback for it runs any more (True), or when ``wait`` runs out (False)."""
        check_process(self._forks, "the event subscriber")
        hashable(worker_id, "worker_id")
        wait = _wait_seconds(wait)
        with self._lock:
            with _as_key(worker_id):
                peer = self._by_id.pop(worker_id, None)
            if peer is None:
                raise UnknownWorkerError(f"no publisher {_shown(worker_id)}")
            self._commands.append(("remove", peer))
            self._queued += 1
            ticket = self._queued
        self._wakeup.wake()
        if wait is None:
            return True
        return self._wait_for(lambda: self._done >= ticket, wait)

    def publishers(self) -> list[Hashable]:
        with self._lock:
            return list(self._by_id)

    @property
    def counters(self) -> dict[str, int]:
        """Totals over all publishers (see ``COUNTERS``)."""
        return dict(self._totals)

    def publisher_counters(self, worker_id: Hashable) -> dict[str, int]:
        return dict(self._peer(worker_id).counters)

    def publisher_status(self, worker_id: Hashable) -> dict[str, Any]:
        """One publisher's stream: ``next_seq`` (None before its first batch),
        ``last_live_seq`` (None before the first live message of this publisher instance),
        ``replaying``, ``in_sync`` (see :meth:`in_sync`), ``replay_paused_s`` (seconds left of
        the cool-down after a replay was given up: gaps are not replayed meanwhile) and its
        counters."""
        peer = self._peer(worker_id)
        return {
            "next_seq": peer.next,
            "last_live_seq": peer.live_last if peer.live_last >= 0 else None,
            "replaying": peer.replaying,
            "in_sync": self._in_sync(peer),
            "replay_paused_s": max(0.0, peer.cooldown_until - time.monotonic()),
            **peer.counters,
        }

    def next_seq(self, worker_id: Hashable) -> int | None:
        """The sequence number expected next from a publisher (None before its first batch)."""
        return self._peer(worker_id).next

    def in_sync(self, worker_id: Hashable) -> bool:
        """Whether the publisher's stream is applied up to the last batch received: no replay
        under way and no batch held back waiting for one."""
        return self._in_sync(self._peer(worker_id))

    def start(self) -> None:
        """Runs the poll loop on a background thread."""
        check_process(self._forks, "the event subscriber")
        with self._lock:
            if self._closed:
                raise InvalidStateError("the event subscriber is stopped")
            if self._thread is not None:
                raise InvalidStateError("the event subscriber is already started")
            if not self._poll_lock.acquire(blocking=False):  # released by the thread as it ends
                raise ConcurrentUseError("the event subscriber is being polled (poll_once() in another thread, "
                                         "or start() from one of its callbacks)")
            thread = self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        try:
            thread.start()
        except BaseException as e:  # no thread to be had ("can't start new thread")
            with self._lock:
                self._thread = None
            self._poll_lock.release()
            raise InvalidStateError(f"cannot start the event subscriber's thread: {e}") from e

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stops the loop thread (if started) and closes every socket. Idempotent; a stopped
        subscriber cannot be restarted. In a forked child it only marks this copy stopped: the
        thread and sockets are the parent's."""
        timeout = _timeout(timeout)
        if fork_generation() != self._forks:  # before any lock: one held at the fork stays held here
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            thread = self._thread
        self._wakeup.wake()
        if thread is threading.current_thread() or self._poller_ident == threading.get_ident():
            return  # called from a callback: the poll running it closes everything as it returns
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # it closes the sockets as it ends (_end_poll)
                log.warning("event subscriber thread did not stop within %s s", timeout)
            return
        # poll_once in another thread: wait for it (woken above) rather than close the sockets
        # under it; if it outlasts the timeout, it closes them as it returns.
        if self._poll_lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._cleanup()
            finally:
                self._poll_lock.release()
        else:
            log.warning("event subscriber: poll_once() in another thread did not return within %s s", timeout)

    @contextmanager
    def _polling(self, wait_s: float = 0.0, *, taken: bool = False) -> Iterator[bool]:
        """The calling thread polls the sockets inside the block: the one home of the
        ``_poll_lock`` rule. Takes the lock (waiting up to ``wait_s``; ``taken``: start() took it
        for this thread) and yields True, or yields False when another thread holds it; on exit
        releases it through :meth:`_end_poll`, which closes everything after stop()."""
        if not taken and not self._poll_lock.acquire(timeout=wait_s):
            yield False
            return
        self._poller_ident = threading.get_ident()
        try:
            yield True
        finally:
            self._end_poll()

    def _end_poll(self) -> None:
        """Releases ``_poll_lock``; after stop(), closes everything (once)."""
        self._poller_ident = None
        self._poll_lock.release()
        if self._closed and self._poll_lock.acquire(blocking=False):
            try:
                self._cleanup()
            finally:
                self._poll_lock.release()

    def _cleanup(self) -> None:
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
        for peer in list(self._peers.values()):
            self._close_peer(peer)
        self._peers.clear()
        self._wakeup.close()
        if self._own_ctx:
            self._ctx.term()

    close = stop

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def poll_once(self, timeout_ms: float = 0) -> int:
        """One round of the loop: applies pending add/remove calls, waits up to ``timeout_ms``
        for messages, handles every message ready, and expires overdue replays. Returns the
        number of messages handled. Not after :meth:`start`; a call while another is running (in
        another thread, or from one of its callbacks) raises :class:`ConcurrentUseError`."""
        timeout_ms = number(timeout_ms, "timeout_ms", 0, C_INT_MAX)  # ZMQ waits forever below 0
        check_process(self._forks, "the event subscriber")
        if self._closed:
            raise InvalidStateError("the event subscriber is stopped")
        if self._thread is not None:
            raise InvalidStateError("the event subscriber runs its own poll thread (start() was called)")
        with self._polling() as mine:
            if not mine:
                raise ConcurrentUseError("poll_once() is already running (in another thread, or this call comes "
                                         "from one of its callbacks)")
            if self._closed:  # stopped meanwhile
                raise InvalidStateError("the event subscriber is stopped")
            return self._poll(timeout_ms)

    # ---- state, as other threads see it ---------------------------------------------------

    def _peer(self, worker_id: Hashable) -> _Peer:
        hashable(worker_id, "worker_id")
        with self._lock, _as_key(worker_id):
            peer = self._by_id.get(worker_id)
        if peer is None:
            raise UnknownWorkerError(f"no publisher {_shown(worker_id)}")
        return peer

    @staticmethod
    def _in_sync(peer: _Peer) -> bool:
        return peer.opened and not peer.replaying and not peer.held

    @staticmethod
    def _synced(peer: _Peer) -> bool:
        return peer.opened and not peer.replaying

    def _wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        """Until ``done()`` (checked after each round of the loop) or ``timeout``. Without a
        poll thread, runs the rounds itself, one caller at a time (a poll_once in another thread
        runs them meanwhile); on the polling thread (a callback), does not wait."""
        deadline = time.monotonic() + timeout
        while self._thread is None:
            if done() or self._closed or self._poller_ident == threading.get_ident():
                return done()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._polling(min(left, 0.05)) as mine:
                # not mine: another thread polls, and may get done() there
                if mine and self._thread is None and not self._closed:
                    self._poll(min(10, max(1, int(min(left, 1.0) * 1000))))
        if self._thread is threading.current_thread():
            return done()
        with self._progress:
            self._waiting += 1
            try:
                while not done():
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return False
                    self._progress.wait(min(left, 0.05))
                return True
            finally:
                self._waiting -= 1

    # ---- loop ----------------------------------------------------------------------------

    def _poll(self, timeout_ms: float) -> int:
        self._apply_commands()
        self._notify_waiters()
        timeout = float(timeout_ms)
        now = time.monotonic()
        for peer in self._peers.values():
            if peer.replaying:
                timeout = min(timeout, max(0.0, (peer.replay_deadline - now) * 1000.0))
            if peer.relink_at is not None:
                timeout = min(timeout, max(0.0, (peer.relink_at - now) * 1000.0))
        handled = 0
        ready = self._poller.poll(int(timeout))  # whole ms, as Poller.poll rounds a float itself
        if self._monitors:
            # Connection events first: they say how to read the live messages beside them.
            ready.sort(key=lambda e: self._sockets.get(e[0], (None, _LIVE))[1] != _MONITOR)
        for sock, _ in ready:
            if sock == self._wakeup.fileno():
                self._wakeup.drain()
                continue
            entry = self._sockets.get(sock)
            if entry is None:
                continue
            peer, kind = entry
            if kind == _MONITOR:
                self._on_monitor(peer, sock)
            else:
                handled += self._drain_socket(peer, sock, kind == _REPLAY)
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.relink_at is not None and now >= peer.relink_at:
                self._relink(peer)
            if peer.replaying and now >= peer.replay_deadline:
                self._replay_timed_out(peer)
        self._notify_waiters()
        return handled

    def _notify_waiters(self) -> None:
        if self._waiting:
            with self._progress:
                self._progress.notify_all()

    def _run(self) -> None:
        # taken by start(); released as the loop ends, which closes the sockets after stop(),
        # whether stop() still waits or not
        with self._polling(taken=True):
            while not self._stopping:
                try:
                    self._poll(1000)
                except Exception:  # a bug here must not silently stop event delivery
                    log.exception("event subscriber loop error")
                    time.sleep(0.01)

    def _apply_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                op, arg = self._commands.popleft()
            try:
                if op == "add":
                    self._open_peer(arg)
                else:
                    peer = self._peers.pop(id(arg), None)
                    if peer is not None:
                        self._close_peer(peer)
            finally:
                self._done += 1

    def _open_peer(self, peer: _Peer) -> None:
        sub = monitor = None
        if not self._ctx_started:
            try:
                # The context's first socket starts its threads, and libzmq aborts the process
                # when their descriptors cannot be made (later sockets fail as ZMQErrors).
                _fds.require(_fds.ZMQ_CONTEXT + 4, "an event subscription")  # SUB, monitor pair, TCP
            except OutOfDescriptorsError as e:
                self._refuse_peer(peer, e)
                return
        try:
            # Making the socket fails too, on a context the caller passed in and terminated:
            # that ZMQError escaped add_publisher, leaving the publisher listed, never opened.
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, self._hwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, peer.topic)
            if is_ipv6(peer.endpoint):
                sub.setsockopt(zmq.IPV6, 1)
            sub.connect(peer.endpoint)
            # The monitor is a socket pair of its own: when descriptors run out it is what fails,
            # and a SUB socket left open then kept ctx.term() in stop() waiting for ever.
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        except zmq.ZMQError as e:
            if monitor is not None:
                monitor.close(linger=0)
            if sub is not None:
                sub.close(linger=0)
            self._refuse_peer(peer, e)
            return
        self._ctx_started = True
        peer.sub = sub
        self._register(sub, peer, _LIVE)
        peer.monitor = monitor
        self._register(monitor, peer, _MONITOR)
        self._peers[id(peer)] = peer
        if peer.replay_endpoint is not None:
            self._new_dealer(peer)
        if peer.start_seq is not None:
            peer.next = peer.start_seq
            peer.fresh = peer.start_seq == 0
            if peer.dealer is not None:
                self._request_replay(peer)
        peer.opened = True

    def _refuse_peer(self, peer: _Peer, e: Exception) -> None:
        log.error("cannot connect to %s at %s: %s", peer.shown, peer.endpoint, e)
        with self._lock:
            try:
                if self._by_id.get(peer.worker_id) is peer:
                    del self._by_id[peer.worker_id]
            except Exception:  # its own __hash__ / __eq__ raised: it stays listed, failed
                pass
        peer.error = e

    def _close_peer(self, peer: _Peer) -> None:
        peer.opened = False
        if peer.monitor is not None and peer.sub is not None:
            try:
                peer.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (peer.sub, peer.dealer, peer.monitor):
            if sock is not None:
                self._unregister(sock)
                sock.close(linger=0)
        peer.sub = peer.dealer = peer.monitor = None

    def _register(self, sock: zmq.Socket, peer: _Peer, kind: int) -> None:
        self._sockets[sock] = (peer, kind)
        self._monitors += kind == _MONITOR
        self._poller.register(sock, zmq.POLLIN)

    def _unregister(self, sock: zmq.Socket) -> None:
        entry = self._sockets.pop(sock, None)
        if entry is not None:
            self._monitors -= entry[1] == _MONITOR
            self._poller.unregister(sock)

    def _new_dealer(self, peer: _Peer) -> None:
        """(Re)creates the replay socket; a fresh one drops replies to abandoned requests."""
        if peer.dealer is not None:
            self._unregister(peer.dealer)
            peer.dealer.close(linger=0)
            peer.dealer = None
        assert peer.replay_endpoint is not None
        dealer = None
        try:
            # Making it fails when descriptors run out: the peer goes on live-only (no dealer),
            # rather than the error stopping the loop.
            dealer = self._ctx.socket(zmq.DEALER)
            # A replay is a burst: the pipe takes as many messages as the live one (a full pipe
            # stops reading the connection; vLLM's ROUTER may then drop replies, which are
            # asked for again). It was unbounded (0): a replay server sending faster than the
            # loop reads grew the subscriber by 400 MB/s for as long as it liked.
            dealer.setsockopt(zmq.RCVHWM, self._hwm)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
            if is_ipv6(peer.replay_endpoint):
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(peer.replay_endpoint)
        except zmq.ZMQError as e:
            if dealer is not None:
                dealer.close(linger=0)
            log.error("cannot connect to the replay socket of %s at %s: %s", peer.shown,
                      peer.replay_endpoint, e)
            return
        peer.dealer = dealer
        self._register(dealer, peer, _REPLAY)

    def _on_monitor(self, peer: _Peer, sock: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                log.info("publisher %s: connection lost", peer.shown)
                peer.reconnected = self._reset_on_reconnect
                peer.relink_at = time.monotonic() + _RELINK_GRACE
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
                peer.relink_at = None  # ZMQ reconnects by itself

    def _relink(self, peer: _Peer) -> None:
        """Reopens a live connection ZMQ dropped for good (it never reconnects after a protocol
        error such as a frame past ``max_frame_bytes``)."""
        peer.relink_at = None
        if peer.sub is None:
            return
        self._count(peer, "reopened")
        self._peer_log.log(logging.WARNING, (id(peer), "reopened"), "publisher %s: connection "
                           "dropped (a frame past %d bytes?); reconnecting", peer.shown, self._max_frame)
        try:
            peer.sub.disconnect(peer.endpoint)
        except zmq.ZMQError:  # already gone with its session
            pass
        try:
            peer.sub.connect(peer.endpoint)
        except zmq.ZMQError as e:  # it resolved before; a name that no longer does, say
            log.error("cannot reconnect to %s at %s: %s", peer.shown, peer.endpoint, e)

    # ---- per-message logic ----------------------------------------------------------------

    def _count(self, peer: _Peer, name: str, n: int = 1) -> None:
        peer.counters[name] += n
        self._totals[name] += n
        if self._on_count is not None:
            try:
                self._on_count(peer.worker_id, name, n)
            except BaseException as e:
                if self._passes_through(e):
                    raise
                # Rate-limited like on_batch's: a publisher's flood of bad frames is a count each.
                self._peer_log.log(logging.ERROR, (id(peer), "on_count"), "on_count callback failed for %s",
                                   peer.shown, exc_info=True)

    def _passes_through(self, e: BaseException) -> bool:
        """Whether a callback's exception leaves the loop: on the poll thread none does (a
        SystemExit, or a KeyboardInterrupt raised by hand, ended the thread: no batch was
        delivered after it, silently for SystemExit); in poll_once, what is no Exception
        (Ctrl-C) is the caller's."""
        return not isinstance(e, Exception) and self._thread is not threading.current_thread()

    def _drain_socket(self, peer: _Peer, sock: zmq.Socket, is_replay: bool) -> int:
        n = 0
        while n < _DRAIN_PER_ROUND:  # bounded, so one busy publisher cannot starve the others
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if is_replay:
                self._on_replay_frames(peer, frames)
            else:
                self._on_live_frames(peer, frames)
            if sock not in self._sockets:  # the replay socket was replaced meanwhile
                break
        return n

    def _on_live_frames(self, peer: _Peer, frames: list[bytes]) -> None:
        msg = parse_live(frames)
        if msg is None:
            self._count(peer, "malformed")
            return
        self._count(peer, "received")
        self._on_live(peer, *msg)

    def _on_replay_frames(self, peer: _Peer, frames: list[bytes]) -> None:
        msg = parse_replay_reply(frames, peer.topic)  # a batch of another topic is malformed here
        if msg is None:
            self._count(peer, "malformed")
            return
        seq, payload = msg
        if not peer.replaying or peer.pending:
            return  # a late reply to a request we gave up on, or that already ended
        if seq == REPLAY_END:
            self._finish_replay(peer, ok=True)
            return
        if peer.live_last >= 0 and seq - peer.live_last > self._max_ahead:
            # Further ahead of the live stream than any queue could hold: not a batch of this
            # publisher (taking it would turn every live batch after it into a "duplicate").
            self._count(peer, "malformed")
            return
        first, peer.replay_got = not peer.replay_got, True
        peer.seen = True
        assert peer.next is not None
        if seq < peer.next:
            # Not progress: a server repeating old batches does not keep the replay alive.
            self._count(peer, "duplicates")
            return
        peer.replay_deadline = self._reply_deadline(peer, time.monotonic())
        while seq > peer.next and peer.next in peer.held:  # live batches fill the hole
            self._apply(peer, peer.next, peer.held.pop(peer.next))
        if seq > peer.next:
            if not first:
                # A reply sends the buffered batches from next on without a hole: this one is
                # in the stream, not in the buffer (a ROUTER past its high-water mark drops
                # replies; vLLM's keeps the default of 1000). Held until a new request
                # fetches the rest.
                peer.held.setdefault(seq, payload)
                self._check_held(peer)
                return
            self._lose(peer, seq)  # the publisher's buffer no longer reaches back to next
        if peer.held.pop(seq, None) is not None:
            self._count(peer, "duplicates")
        self._apply(peer, seq, payload, replayed=True)

    def _on_live(self, peer: _Peer, seq: int, payload: bytes) -> None:
        if peer.reconnected:
            peer.reconnected = False
            if peer.live_last >= 0:
                self._reset(peer, seq, payload, "reconnected; it may have restarted")
                return
        if peer.next is None:
            peer.next = seq  # first contact: the stream starts here
        if seq < peer.next or seq <= peer.live_last:
            # Either the live stream lags behind a replay (a duplicate), or it went backwards:
            # one instance's live numbers only increase, so that is a restart, unless it is
            # the very batch we already have under that number. A publisher that never showed
            # us a number cannot lag behind a replay: below start_seq, it restarted.
            known = self._known_payload(peer, seq)
            if known is not None:
                duplicate = known == _fingerprint(payload)
            elif not peer.seen:
                duplicate = seq >= peer.next - 1
            else:
                duplicate = seq > peer.live_last
            if not duplicate:
                self._reset(peer, seq, payload, f"seq {seq} after {peer.next - 1}")
                return
            peer.seen = True
            self._count(peer, "duplicates")
            peer.live_last = max(peer.live_last, seq)
            return
        if seq > max(peer.live_last, peer.next - 1) + 1 and not (
            peer.live_last < 0 and (peer.replaying or peer.fresh)
        ):
            # Counted even while a replay is under way, but not for a stream's first live
            # message while it catches up or starts from nothing (it joins, there is no gap).
            self._count(peer, "gaps")
        peer.seen = True
        peer.live_last = seq
        if peer.replaying:
            peer.held[seq] = payload
            self._check_held(peer)
            return
        if seq > peer.next:
            if peer.dealer is not None:
                if time.monotonic() >= peer.cooldown_until:
                    peer.held[seq] = payload
                    self._request_replay(peer)
                    return
                # The replay endpoint failed us just now: as if it had none, for a while.
                self._count(peer, "replay_skipped")
            self._lose(peer, seq)
        self._apply(peer, seq, payload)

    @staticmethod
    def _known_payload(peer: _Peer, seq: int) -> Any:
        """The fingerprint of the payload held or applied under ``seq``; None if unknown."""
        held = peer.held.get(seq)
        if held is not None:
            return _fingerprint(held)
        for s, p in reversed(peer.recent):
            if s == seq:
                return p
            if s < seq:
                break
        return None

    def _notify_reset(self, peer: _Peer, new_seq: int, why: str) -> None:
        last = (peer.next or 0) - 1
        self._count(peer, "resets")
        self._peer_log.log(logging.WARNING, (id(peer), "reset"), "publisher %s: stream starts over at seq %d "
                     "after %d (%s)", peer.shown, new_seq, last, why)
        if self._on_reset is not None:
            try:
                self._on_reset(peer.worker_id, last, new_seq)
            except BaseException as e:
                if self._passes_through(e):
                    raise
                self._count(peer, "callback_errors")
                self._peer_log.log(logging.ERROR, (id(peer), "on_reset"), "on_reset callback failed for %s",
                                   peer.shown, exc_info=True)

    def _reset(self, peer: _Peer, seq: int, payload: bytes, why: str) -> None:
        """The publisher restarted: its new stream starts at 0."""
        self._notify_reset(peer, seq, f"publisher restart: {why}")
        if peer.replaying:
            sent, peer.replaying, peer.pending = not peer.pending, False, False
            if sent and peer.replay_endpoint is not None:
                self._new_dealer(peer)  # drops the replies to the old stream's request
        self._end_gap(peer)
        peer.held.clear()
        peer.recent.clear()
        # The new stream starts at 0; seqs before this one were missed while reconnecting.
        peer.next = 0
        peer.live_last = -1
        peer.seen = False
        peer.fresh = True
        self._on_live(peer, seq, payload)

    def _lose(self, peer: _Peer, seq: int) -> bool:
        """The batches from ``next`` up to ``seq`` cannot be had: counted as lost. With
        ``resync_on_loss``, unless the stream starts from nothing, ``on_reset`` tells the
        consumer to drop the publisher's state, and True is returned: what the publisher still
        buffers rebuilds it."""
        assert peer.next is not None
        self._count(peer, "lost", seq - peer.next)
        if not self._resync_on_loss or peer.fresh:
            return False
        self._count(peer, "resyncs")
        self._notify_reset(peer, seq, f"batches {peer.next}..{seq - 1} are lost")
        peer.recent.clear()
        return True

    def _request_replay(self, peer: _Peer) -> None:
        """A replay from ``next`` is wanted (a gap, a catch-up, the rest of a replay): sends the
        request now, schedules it (backoff after a request that healed nothing; the rate cap),
        or gives the gap up (too many requests that healed nothing, or open too long)."""
        assert peer.next is not None
        now = time.monotonic()
        if peer.gap_since is None:
            peer.gap_since, peer.replay_from, peer.fails, peer.sent = now, None, 0, 0
        elif peer.replay_from is not None:
            # Progress: the last request moved the stream on (replayed batches, or a hole it
            # showed to be gone from the publisher's buffer). Retries for progress are at once.
            peer.fails = 0 if peer.next > peer.replay_from else peer.fails + 1
        if peer.fails >= self._max_attempts:
            self._give_up(peer, f"{peer.sent} replay requests, the last {peer.fails} healed nothing")
            return
        delay = 0.0
        if peer.fails:
            step = min(self._backoff_max, self._backoff * 2 ** (peer.fails - 1))
            delay = step * self._random.uniform(0.5, 1.0)
        delay = max(delay, self._token_wait(peer, now))
        if now + delay >= peer.gap_since + self._max_wait:
            self._give_up_late(peer)
            return
        if delay <= 0:
            self._send_replay_request(peer)
            return
        peer.replaying = peer.pending = True  # live batches are held meanwhile
        peer.replay_deadline = now + delay

    def _token_wait(self, peer: _Peer, now: float) -> float:
        """Refills the publisher's request bucket; seconds until it holds a request."""
        if peer.tokens is None:
            peer.tokens = self._burst
        else:
            peer.tokens = min(self._burst, peer.tokens + (now - peer.tokens_at) * self._rate)
        peer.tokens_at = now
        return 0.0 if peer.tokens >= 1.0 else (1.0 - peer.tokens) / self._rate

    def _send_replay_request(self, peer: _Peer) -> None:
        assert peer.next is not None
        now = time.monotonic()
        peer.pending = False
        if peer.dealer is None:  # its socket could not be reopened
            peer.replaying = False
            self._give_up(peer, "no replay socket")
            return
        self._token_wait(peer, now)
        peer.tokens = (peer.tokens or 0.0) - 1.0  # may go below 0 if sent when due: paid later
        try:
            peer.dealer.send_multipart(replay_request(peer.next), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._count(peer, "replay_failures")
            peer.replaying = False
            self._new_dealer(peer)  # drops whatever is queued on the old one
            self._give_up(peer, f"cannot send a replay request: {e}")
            return
        self._count(peer, "replay_requests")
        peer.sent += 1
        peer.replay_from = peer.next
        peer.replaying = True
        peer.replay_got = False
        peer.replay_deadline = self._reply_deadline(peer, now)

    def _reply_deadline(self, peer: _Peer, now: float) -> float:
        """When the replay times out without a further useful reply: ``replay_timeout`` from
        now, but no later than the gap's ``replay_max_wait`` (however much a replay streams)."""
        deadline = now + self._replay_timeout
        if peer.gap_since is not None:
            deadline = min(deadline, peer.gap_since + self._max_wait)
        return deadline

    def _give_up_late(self, peer: _Peer) -> None:
        self._give_up(peer, f"not healed within {self._max_wait:g} s ({peer.sent} requests)")

    def _replay_timed_out(self, peer: _Peer) -> None:
        if peer.pending:  # not a timeout: the scheduled request is due
            self._send_replay_request(peer)
            return
        if peer.gap_since is not None and time.monotonic() >= peer.gap_since + self._max_wait:
            self._give_up_late(peer)  # however the replay was going
            return
        if peer.replay_got and peer.replay_endpoint is not None:
            # It delivered, then went quiet: the rest of it (or its end marker) was dropped on
            # the way. Ask again from where we are, on a fresh socket (a retry that advances
            # is at once; one that does not backs off, and counts toward giving up).
            self._peer_log.log(logging.INFO, (id(peer), "stalled"), "replay from %s stalled at seq %s; asking again",
                         peer.shown, peer.next)
            peer.replaying = False
            self._new_dealer(peer)
            self._request_replay(peer)
            return
        # Nothing at all within the timeout: the server is down, busy, or not a replay server.
        # Asking again would only hold live batches back longer.
        self._count(peer, "replay_failures")
        peer.replaying = False
        self._new_dealer(peer)  # drops the request still queued if it never connected
        self._give_up(peer, f"no answer within {self._replay_timeout:g} s")

    def _give_up(self, peer: _Peer, why: str) -> None:
        """The replay cannot heal the gap: logged (once per gap) and counted, the replay
        endpoint is left alone for a cool-down, and the held live batches are applied, the
        missing ones counted as lost (``resync_on_loss``: the stream starts over from them)."""
        now = time.monotonic()
        peer.give_ups += 1
        cooldown = min(_COOLDOWN_MAX, self._backoff_max * 2 ** min(peer.give_ups - 1, 32))
        cooldown *= self._random.uniform(0.5, 1.0)
        peer.cooldown_until = now + cooldown
        self._count(peer, "replay_given_up")
        log.error("publisher %s: gave up the replay from seq %s (%s); applying the %d live "
                  "batches held back, no replay requests for %.1f s", peer.shown, peer.next,
                  why, len(peer.held), cooldown)
        if peer.replaying and not peer.pending:
            self._new_dealer(peer)  # late replies to the abandoned request are dropped with it
        peer.replaying = peer.pending = False
        self._end_gap(peer)
        self._finish_replay(peer, ok=False)

    @staticmethod
    def _end_gap(peer: _Peer) -> None:
        peer.gap_since = peer.replay_from = None
        peer.fails = peer.sent = 0

    def _check_held(self, peer: _Peer) -> None:
        if len(peer.held) > _MAX_HELD:
            self._give_up(peer, f"more than {_MAX_HELD} batches held back")

    def _finish_replay(self, peer: _Peer, *, ok: bool) -> None:
        """Ends the current replay and applies the held live batches in order. ``ok``: it ended
        with its end marker (what it could not supply is asked for again); else it was given
        up (what is missing is lost)."""
        peer.replaying = peer.pending = False
        assert peer.next is not None
        for seq in sorted(peer.held):
            if seq > peer.next:
                if ok and peer.dealer is not None:
                    # The replay was served before these were published, or lost replies on
                    # the way: ask again. (What the publisher no longer has shows as a hole
                    # before the first reply.) A server that keeps answering without them
                    # is given up after a few tries.
                    self._request_replay(peer)
                    return
                self._lose(peer, seq)  # resync_on_loss: the stream starts over from here
            payload = peer.held.pop(seq)
            if seq < peer.next:
                self._count(peer, "duplicates")
                continue
            self._apply(peer, seq, payload)
        if ok:  # healed: the replay endpoint works
            self._end_gap(peer)
            peer.give_ups = 0

    def _apply(self, peer: _Peer, seq: int, payload: bytes, replayed: bool = False) -> None:
        peer.next = seq + 1
        peer.fresh = False
        peer.recent.append((seq, _fingerprint(payload)))
        batch: Any = payload
        if self._decoder is not None:
            try:
                batch = self._decoder.decode(payload)
            except DECODE_ERRORS:  # bad UTF-8 or deep nesting too: not only DecodeError
                self._count(peer, "malformed")
                self._peer_log.log(logging.WARNING, (id(peer), "malformed"), "undecodable batch %d from %s skipped",
                             seq, peer.shown)
                return
        try:
            self._on_batch(peer.worker_id, seq, batch)
        except EventDecodeError as e:
            self._count(peer, "malformed")
            self._peer_log.log(logging.WARNING, (id(peer), "malformed"), "batch %d from %s is not a batch: %s",
                         seq, peer.shown, e)
            return
        except BaseException as e:
            if self._passes_through(e):
                raise
            self._count(peer, "callback_errors")
            self._peer_log.log(logging.ERROR, (id(peer), "callback"), "on_batch callback failed for %s seq %d",
                         peer.shown, seq, exc_info=True)
        self._count(peer, "applied")
        if replayed:
            self._count(peer, "replayed")
