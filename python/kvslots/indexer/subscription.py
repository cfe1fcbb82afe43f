"""The indexer's side of its workers' KV event streams.

The protocol (ZMQ framing, sequence numbers, gaps healed by replay, restarts, malformed frames)
is :class:`kvslots.events.subscriber.EventSubscriber`'s; this module only sets it up the way an
index needs it and adapts it to the service, which it sees through :class:`EventSink`:

- payloads are handed over undecoded: the Rust ``PrefixIndex`` decodes the msgpack itself, and
  raises ``EventDecodeError`` for a payload that is not a batch (counted as malformed);
- batches that cannot be had (gone from the publisher's buffer, no replay endpoint, replay
  given up) drop the worker's entries, which are rebuilt from what the publisher still buffers,
  or after a replay given up from the batches that follow (``resync_on_loss``): the index never
  keeps blocks whose removal it may have missed;
- replay traffic is bounded (backoff with jitter, a rate cap per worker, a gap given up after a
  few useless requests, then a cool-down; see ``EventSubscriber``): a broken replay server costs
  a few requests, counted in ``replay_given_up`` / ``replay_skipped``, and live batches keep
  being applied;
- the first live message after a lost connection is taken as a possible restart
  (``reset_on_reconnect``): entries dropped and rebuilt from the publisher's buffer;
- when a worker is added, its publisher's buffer is replayed from where the sink says the index
  stops (0 for an empty index; the shared cursor for the Redis backend), and :meth:`add`
  returns once that replay is done, so a late-started indexer knows what is already cached;
- per-worker status (``GET /workers``) and signals for the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import Any, Protocol, cast

import zmq

from ..events.protocol import MAX_FRAME_BYTES
from ..events.subscriber import EventSubscriber
from .config import WorkerSpec

log = logging.getLogger("kvslots.indexer")

#: EventSubscriber counters -> the signals the service counts.
SIGNALS = {
    "gaps": "gap",
    "replay_requests": "replay",
    "resyncs": "replay_failed",
    "resets": "reset",
    "malformed": "malformed",
    "replay_given_up": "replay_given_up",
    "replay_skipped": "replay_skipped",
    "reopened": "reopened",
}


class EventSink(Protocol):
    """What the subscription tells the service."""

    def on_batch(self, worker: str, seq: int, payload: bytes) -> None:
        """Apply one batch. Raise ``EventDecodeError`` for a payload that is not a batch."""

    def on_reset(self, worker: str, reason: str) -> None:
        """Drop every entry of the worker (publisher restart, batches lost)."""

    def resume_seq(self, worker: str) -> int:
        """First seq the index does not have for this worker (0 when it has nothing)."""

    def on_signal(self, worker: str, what: str, n: int = 1) -> None:
        """Counters: ``gap``, ``replay``, ``replay_failed``, ``malformed``, ``reset``,
        ``replay_given_up``, ``replay_skipped``, ``reopened``."""


class Subscription:
    """Every worker's stream, on one :class:`EventSubscriber` and its one polling thread."""

    def __init__(self, sink: EventSink, *, replay_timeout: float = 2.0, max_frame_bytes: int = MAX_FRAME_BYTES,
                 context: zmq.Context | None = None):
        self._sink = sink
        self._wait = replay_timeout * 4 + 5  # for add/remove to be carried out
        self._sub = EventSubscriber(
            self._on_batch,
            self._on_reset,
            replay_timeout_ms=max(1, int(replay_timeout * 1000)),
            max_frame_bytes=max_frame_bytes,
            context=context,
            decode=False,
            on_count=self._on_count,
            resync_on_loss=True,
            reset_on_reconnect=True,
            thread_name="kvslots-indexer-sub",
        )
        self._last_batch_at: dict[str, float] = {}
        self._started = False
        self._lock = threading.Lock()

    # ---- control (any thread) ----

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self._sub.start()

    def stop(self) -> None:
        self._sub.stop()

    def add(self, spec: WorkerSpec) -> None:
        """Subscribes to a worker; returns once its catch-up replay is done (or given up)."""
        start = self._sink.resume_seq(spec.name)
        if not self._sub.add_publisher(spec.name, spec.endpoint, spec.replay, spec.topic,
                                       start_seq=start, wait=self._wait):
            log.warning("worker %s: still catching up from its publisher's buffer", spec.name)

    def remove(self, name: str) -> None:
        """Unsubscribes; no batch of the worker is applied once this returns."""
        try:
            self._sub.remove_publisher(name, wait=self._wait)
        except KeyError:
            return
        self._last_batch_at.pop(name, None)

    def status(self) -> dict[str, dict[str, Any]]:
        out = {}
        for publisher in self._sub.publishers():
            name = cast(str, publisher)  # add() names each by its worker
            try:
                st = self._sub.publisher_status(name)
            except KeyError:  # removed meanwhile
                continue
            next_seq = st["next_seq"]
            out[name] = {
                "applied_seq": -1 if next_seq is None else next_seq - 1,
                "last_live_seq": st["last_live_seq"],
                "syncing": st["replaying"],
                "batches": st["applied"],
                "gaps": st["gaps"],
                "replays": st["replay_requests"],
                "unhealed_gaps": st["resyncs"],
                "replays_given_up": st["replay_given_up"],
                "replays_skipped": st["replay_skipped"],
                "replay_paused_s": round(st["replay_paused_s"], 3),
                "resets": st["resets"],
                "malformed": st["malformed"],
                "reopened": st["reopened"],
                "last_batch_at": self._last_batch_at.get(name),
            }
        return out

    def syncing(self) -> list[str]:
        """Workers whose publisher is replaying to us (their entries may lag)."""
        return [name for name, st in self.status().items() if st["syncing"]]

    # ---- EventSubscriber callbacks (its polling thread) ----

    # The subscriber's callbacks: a publisher's id is what add() gave it, the worker's name.

    def _on_batch(self, publisher: Hashable, seq: int, payload: bytes) -> None:
        worker = cast(str, publisher)
        self._last_batch_at[worker] = time.time()
        self._sink.on_batch(worker, seq, payload)

    def _on_reset(self, publisher: Hashable, last_seq: int, new_seq: int) -> None:
        self._sink.on_reset(cast(str, publisher), f"its stream starts over at seq {new_seq} after {last_seq}")

    def _on_count(self, publisher: Hashable, name: str, n: int) -> None:
        what = SIGNALS.get(name)
        if what is not None:
            self._sink.on_signal(cast(str, publisher), what, n)
