"""Subscribing to workers' KV event streams: vLLM's ZMQ PUB + ROUTER-replay protocol.

This module is the only place the indexer talks ZMQ. The service sees it through
:class:`EventSink` (what it is told) and the small surface of :class:`ZmqSubscription`
(``add``/``remove``/``start``/``stop``/``status``), so the loop can be swapped for
``kvslots.events.subscriber`` without touching the service.

Wire protocol (vLLM 0.32 ``ZmqEventPublisher``):
- live: multipart ``(topic, seq as 8-byte big-endian, msgpack KVEventBatch)``;
- replay: send ``(b"", start_seq as 8-byte big-endian)`` to the ROUTER; it answers each buffered
  batch with seq >= start as ``(b"", topic, seq, payload)`` and ends with ``(b"", b"", -1, b"")``.
  Replies without the topic frame (``(b"", seq, payload)``) are accepted too.

Sequence rules, per worker:
- the next expected batch is applied; one already applied (through a replay) is skipped;
- a jump forward is a gap: the missing batches are replayed. If the publisher no longer has them
  (or has no replay endpoint) the gap cannot be healed: the worker's entries are dropped and
  whatever the publisher still buffers is replayed from its start, so the index never keeps
  blocks whose removal it may have missed;
- a live seq at or below the last live seq means the publisher restarted: its entries are
  dropped (its cache is gone) and its new stream is replayed from 0. A restarted publisher can
  also be *past* our last seq by the time we reconnect (the protocol has no incarnation id), so
  the first live message after a lost connection is treated the same way: entries dropped and
  rebuilt from the publisher's replay buffer (under-claiming for a moment beats claiming blocks
  a dead process held);
- when a worker is added, its publisher's buffer is replayed from where the sink says to resume
  (0 for an empty index; the shared cursor for the Redis backend), so a late-started indexer
  learns the blocks already cached;
- a frame that is not 3 parts, has no 8-byte seq, or whose payload does not decode is counted as
  malformed and skipped (the sequence still advances past it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import EventDecodeError
from .config import WorkerSpec

log = logging.getLogger("kvslots.indexer")

END_SEQ = -1


class EventSink(Protocol):
    """What the subscription tells the service."""

    def on_batch(self, worker: str, seq: int, payload: bytes) -> None:
        """Apply one batch. Raise ``EventDecodeError`` for a payload that is not a batch."""

    def on_reset(self, worker: str, reason: str) -> None:
        """Drop every entry of the worker (publisher restart, unhealable gap)."""

    def resume_seq(self, worker: str) -> int:
        """First seq the index does not have for this worker (0 when it has nothing)."""

    def on_signal(self, worker: str, what: str, n: int = 1) -> None:
        """Counters: ``gap``, ``replay``, ``replay_failed``, ``malformed``, ``reset``."""


@dataclass
class StreamStatus:
    """What the subscription knows about one stream (served by ``GET /workers``)."""

    applied_seq: int = -1
    last_live_seq: int | None = None
    syncing: bool = False
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    unhealed_gaps: int = 0
    resets: int = 0
    malformed: int = 0
    last_batch_at: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Stream:
    spec: WorkerSpec
    sub: zmq.Socket
    status: StreamStatus = field(default_factory=StreamStatus)
    monitor: zmq.Socket | None = None
    # Whether this publisher has shown a seq at or past our resume point (so an older seq on
    # the live stream is an overlap with a replay, not a restart).
    verified: bool = False
    # The connection dropped since the last live message: the publisher may have restarted.
    reconnected: bool = False


class ZmqSubscription:
    """One thread, one poller over every worker's SUB socket; replays inline."""

    def __init__(self, sink: EventSink, *, replay_timeout: float = 2.0, context: zmq.Context | None = None):
        self._sink = sink
        self._timeout = replay_timeout
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._streams: dict[str, _Stream] = {}
        self._by_socket: dict[zmq.Socket, _Stream] = {}
        self._by_monitor: dict[zmq.Socket, _Stream] = {}
        self._poller = zmq.Poller()
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running = threading.Event()
        self._lock = threading.Lock()  # guards the status snapshot only

    # ---- control (any thread) ----

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="kvslots-indexer-sub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for s in list(self._streams.values()):
            self._close_monitor(s)
            s.sub.close(linger=0)
        self._streams.clear()
        self._by_socket.clear()
        if self._own_ctx:
            self._ctx.term()

    def add(self, spec: WorkerSpec) -> None:
        self._call(("add", spec))

    def remove(self, name: str) -> None:
        self._call(("remove", name))

    def status(self) -> dict[str, dict]:
        with self._lock:
            return {n: s.status.as_dict() for n, s in self._streams.items()}

    def syncing(self) -> list[str]:
        with self._lock:
            return [n for n, s in self._streams.items() if s.status.syncing]

    def _call(self, cmd: tuple) -> None:
        """Runs a command on the subscription thread and waits for it (so an added worker is
        subscribed, and its initial replay done, when this returns)."""
        if self._thread is None or threading.current_thread() is self._thread:
            self._do(cmd)
            return
        done = threading.Event()
        box: list = []
        self._commands.put((cmd, done, box))
        if not done.wait(timeout=self._timeout * 4 + 5):
            raise TimeoutError(f"subscription thread did not run {cmd[0]!r}")
        if box:
            raise box[0]

    # ---- the loop ----

    def _run(self) -> None:
        while self._running.is_set():
            self._drain_commands()
            try:
                ready = dict(self._poller.poll(50))
            except zmq.ZMQError as e:  # a socket closed under us while stopping
                if self._running.is_set():
                    log.warning("poll failed: %s", e)
                continue
            for sock in ready:
                mst = self._by_monitor.get(sock)
                if mst is not None:
                    self._on_monitor(mst)
                    continue
                st = self._by_socket.get(sock)
                if st is None:
                    continue
                # Bounded drain per socket so one busy worker cannot starve the others.
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_live(st, frames)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, done, box = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._do(cmd)
            except Exception as e:  # reported to the caller
                box.append(e)
            finally:
                done.set()

    def _do(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            spec: WorkerSpec = cmd[1]
            if spec.name in self._streams:
                raise ValueError(f"worker {spec.name!r} is already subscribed")
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
            sub.connect(spec.endpoint)
            st = _Stream(spec, sub)
            # Connection events: vLLM's protocol has no publisher incarnation id, and a restarted
            # publisher can be past our last seq by the time we reconnect.
            st.monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            with self._lock:
                self._streams[spec.name] = st
            self._by_socket[sub] = st
            self._by_monitor[st.monitor] = st
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(st.monitor, zmq.POLLIN)
            st.status.applied_seq = self._sink.resume_seq(spec.name) - 1
            if spec.replay:
                # Learn what the worker already caches, from its replay buffer.
                self._initial_sync(st)
        elif cmd[0] == "remove":
            st = self._streams.get(cmd[1])
            if st is None:
                return
            self._poller.unregister(st.sub)
            self._by_socket.pop(st.sub, None)
            self._close_monitor(st)
            st.sub.close(linger=0)
            with self._lock:
                del self._streams[cmd[1]]

    def _on_monitor(self, st: _Stream) -> None:
        assert st.monitor is not None
        while True:
            try:
                ev = recv_monitor_message(st.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                log.info("worker %s: publisher connection lost", st.spec.name)
                st.reconnected = True

    def _close_monitor(self, st: _Stream) -> None:
        if st.monitor is None:
            return
        self._by_monitor.pop(st.monitor, None)
        try:
            self._poller.unregister(st.monitor)
        except KeyError:
            pass
        try:
            st.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        st.monitor.close(linger=0)
        st.monitor = None

    # ---- sequence handling ----

    def _on_live(self, st: _Stream, frames: list[bytes]) -> None:
        status, name = st.status, st.spec.name
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(st, f"live message of {len(frames)} frame(s)")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            self._malformed(st, f"negative seq {seq} on the live stream")
            return
        if status.last_live_seq is not None and seq <= status.last_live_seq:
            # PUB/SUB delivers in order: going back means a new publisher (a restart).
            log.warning("worker %s: seq went back from %d to %d: publisher restarted", name,
                        status.last_live_seq, seq)
            self._reset(st, "publisher restart")
            status.last_live_seq = None
        elif st.reconnected and status.last_live_seq is not None:
            # Reconnected, seq moved on: a restarted publisher may already be past our last seq.
            # Rebuild from its buffer rather than risk claiming blocks a dead process held.
            log.warning("worker %s: reconnected at seq %d; rebuilding its entries from the publisher",
                        name, seq)
            self._reset(st, "reconnect")
            status.last_live_seq = None
        st.reconnected = False
        first = status.last_live_seq is None
        status.last_live_seq = seq
        if first and seq < status.applied_seq and not st.verified:
            # We resumed from a point this publisher never showed us it reached: it restarted
            # while we were away (or the shared cursor is from its previous life).
            self._reset(st, "publisher restart (below the resume point)")
        st.verified = True
        if seq <= status.applied_seq:
            return  # already applied through a replay
        if seq > status.applied_seq + 1:
            joining = first and status.applied_seq < 0
            if joining and not st.spec.replay:
                pass  # joining mid-stream with no way to fetch the past: start here
            else:
                if not joining:
                    status.gaps += 1
                    self._sink.on_signal(name, "gap")
                    log.info("worker %s: gap of %d batch(es) before seq %d", name,
                             seq - status.applied_seq - 1, seq)
                res = (self._replay(st, status.applied_seq + 1, upto=seq, best_effort=joining)
                       if st.spec.replay else "none")
                if res != "ok" and seq > status.applied_seq + 1:
                    self._unhealable(st, seq)
        if seq > status.applied_seq:
            self._deliver(st, seq, frames[2])

    def _deliver(self, st: _Stream, seq: int, payload: bytes) -> None:
        st.status.applied_seq = seq
        st.status.batches += 1
        st.status.last_batch_at = time.time()
        try:
            self._sink.on_batch(st.spec.name, seq, payload)
        except EventDecodeError as e:
            self._malformed(st, str(e))

    def _malformed(self, st: _Stream, why: str) -> None:
        st.status.malformed += 1
        self._sink.on_signal(st.spec.name, "malformed")
        log.warning("worker %s: malformed frame skipped: %s", st.spec.name, why)

    def _reset(self, st: _Stream, reason: str) -> None:
        st.status.resets += 1
        st.status.applied_seq = -1
        self._sink.on_reset(st.spec.name, reason)
        self._sink.on_signal(st.spec.name, "reset")

    def _unhealable(self, st: _Stream, seq: int) -> None:
        """Batches before `seq` are lost: drop the worker's entries (a missed BlockRemoved would
        leave blocks claimed that are gone) and rebuild from what the publisher still has."""
        st.status.unhealed_gaps += 1
        self._sink.on_signal(st.spec.name, "replay_failed")
        log.warning("worker %s: batches before seq %d are lost; rebuilding its entries", st.spec.name, seq)
        self._reset(st, "unhealable gap")
        if st.spec.replay:
            self._replay(st, 0, upto=seq, best_effort=True)
        st.status.applied_seq = max(st.status.applied_seq, seq - 1)

    def _initial_sync(self, st: _Stream) -> None:
        """On subscribe: fetch what the publisher buffers from our resume point."""
        resumed = st.status.applied_seq >= 0
        res = self._replay(st, st.status.applied_seq + 1, best_effort=not resumed)
        if res == "hole":
            # The shared index stopped at a seq this publisher no longer buffers.
            self._unhealable(st, st.status.applied_seq + 1)
        elif res == "timeout":
            log.warning("worker %s: no replay answer yet; will sync on its first batch", st.spec.name)

    def _replay(self, st: _Stream, start: int, *, upto: int | None = None, best_effort: bool = False) -> str:
        """Requests the batches from `start` and applies them in order. Returns "ok" (nothing
        missing from `start` up to `upto`, or to the buffer's end), "hole" (some are gone), or
        "timeout" (no complete answer)."""
        status, name = st.status, st.spec.name
        assert st.spec.replay
        status.syncing = True
        status.replays += 1
        self._sink.on_signal(name, "replay")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        hole = False
        try:
            sock.connect(st.spec.replay)
            sock.send_multipart([b"", max(start, 0).to_bytes(8, "big")])
            deadline = time.monotonic() + self._timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    log.warning("worker %s: replay from %d timed out", name, start)
                    return "timeout"
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    seq_b, payload = frames[1], frames[2]
                elif len(frames) == 2:
                    seq_b, payload = frames
                else:
                    self._malformed(st, f"replay reply of {len(frames)} frame(s)")
                    continue
                if len(seq_b) != 8:
                    self._malformed(st, "replay reply without an 8-byte seq")
                    continue
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    break
                st.verified = True
                if seq <= status.applied_seq:
                    continue
                if seq != status.applied_seq + 1 and not best_effort:
                    hole = True
                    if upto is None or seq <= upto:
                        return "hole"
                self._deliver(st, seq, payload)
            if hole or (upto is not None and status.applied_seq < upto - 1):
                return "hole"
            return "ok"
        except zmq.ZMQError as e:
            log.warning("worker %s: replay failed: %s", name, e)
            return "timeout"
        finally:
            sock.close(linger=0)
            status.syncing = False
