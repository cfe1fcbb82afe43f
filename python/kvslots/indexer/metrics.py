"""Prometheus metrics of the indexer, on a registry of its own (several services can live in one
process, as in the tests)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

PREFIX = "kvslots_indexer"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batches = Counter(f"{PREFIX}_batches", "Event batches applied", ["worker"], registry=r)
        self.events = Counter(f"{PREFIX}_events_applied", "KV events applied", ["worker"], registry=r)
        self.blocks = Counter(f"{PREFIX}_block_events", "Block events applied (stored or removed blocks)",
                              ["worker", "kind"], registry=r)
        self.skipped = Counter(
            f"{PREFIX}_skipped", "Events or blocks skipped, by reason (orphan_blocks: parent unknown; "
            "unresolved_blocks: unknown hash; invalid_events; unknown_events; unknown_medium_events)",
            ["worker", "reason"], registry=r)
        self.gaps = Counter(f"{PREFIX}_gaps", "Sequence gaps detected", ["worker"], registry=r)
        self.replays = Counter(f"{PREFIX}_replays", "Replay requests sent", ["worker"], registry=r)
        self.replay_failures = Counter(f"{PREFIX}_unhealed_gaps",
                                       "Gaps replay could not heal (worker entries rebuilt)", ["worker"], registry=r)
        self.replays_given_up = Counter(
            f"{PREFIX}_replay_given_up", "Gaps whose replay was given up (server silent, useless "
            "answers, too many requests); logged as errors", ["worker"], registry=r)
        self.replays_skipped = Counter(
            f"{PREFIX}_replay_skipped", "Gaps not replayed while the replay endpoint cools down "
            "after a give-up", ["worker"], registry=r)
        self.resets = Counter(f"{PREFIX}_resets", "Worker entries dropped (publisher restart, unhealed gap)",
                              ["worker"], registry=r)
        self.reopened = Counter(f"{PREFIX}_reopened_connections", "Worker connections ZMQ dropped for good "
                                "(a frame past max_frame_mb) and the indexer reopened", ["worker"], registry=r)
        self.malformed = Counter(f"{PREFIX}_malformed_frames", "Frames or payloads skipped as malformed",
                                 ["worker"], registry=r)
        self.lookups = Histogram(
            f"{PREFIX}_lookup_seconds", "Time to score one prompt against the index",
            buckets=(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1),
            registry=r)
        self.stale_answers = Counter(f"{PREFIX}_stale_scores", "Scores answered with stale=true", registry=r)

    def add_gauges(self, fn: Callable[[], dict[str, float]]) -> None:
        """Index size and state, read at scrape time."""

        class _Collector:
            def collect(self):  # noqa: D401 - prometheus_client protocol
                for name, value in fn().items():
                    g = GaugeMetricFamily(f"{PREFIX}_{name}", name.replace("_", " "))
                    g.add_metric([], float(value))
                    yield g

            def describe(self):
                return []

        self.registry.register(_Collector())

    def signal(self, worker: str, what: str, n: int = 1) -> None:
        c = {"gap": self.gaps, "replay": self.replays, "replay_failed": self.replay_failures,
             "reset": self.resets, "malformed": self.malformed,
             "replay_given_up": self.replays_given_up, "replay_skipped": self.replays_skipped,
             "reopened": self.reopened}.get(what)
        if c is not None:
            c.labels(worker).inc(n)

    def applied(self, worker: str, st) -> None:
        self.batches.labels(worker).inc()
        self.events.labels(worker).inc(st.events)
        if st.stored_blocks:
            self.blocks.labels(worker, "stored").inc(st.stored_blocks)
        if st.removed_blocks:
            self.blocks.labels(worker, "removed").inc(st.removed_blocks)
        for reason in ("orphan_blocks", "unresolved_blocks", "invalid_events", "unknown_events",
                       "unknown_medium_events"):
            v = getattr(st, reason)
            if v:
                self.skipped.labels(worker, reason).inc(v)
