"""The indexer service: the backend, the subscription and the metrics, wired together."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .._core import ApplyStats
from .backend import TIER_NAMES, Backend, MemoryBackend, ScoreResult
from .config import IndexerConfig, WorkerSpec
from .metrics import Metrics
from .subscription import Subscription

log = logging.getLogger("kvslots.indexer")


def make_backend(cfg: IndexerConfig) -> Backend:
    if cfg.backend == "redis":
        from .redis_backend import RedisBackend

        return RedisBackend(cfg)
    return MemoryBackend(cfg)


class IndexerService:
    """Implements the subscription's sink (`on_batch`, `on_reset`, `resume_seq`, `on_signal`)."""

    def __init__(self, cfg: IndexerConfig, backend: Backend | None = None):
        self.cfg = cfg
        self.metrics = Metrics()
        self.backend = backend or make_backend(cfg)
        self.sub = Subscription(self, replay_timeout=cfg.replay_timeout)
        self._subscribed: dict[str, WorkerSpec] = {}
        self._sync_lock = threading.Lock()
        self.started_at = time.time()
        self.metrics.add_gauges(self._gauges)

    # ---- lifecycle ----

    def start(self) -> None:
        self.sub.start()
        for spec in self.cfg.workers:
            # The command line / config file is authoritative for the workers it names.
            self.backend.register(spec, replace=True)
        self.backend.start(self)
        if isinstance(self.backend, MemoryBackend):
            self.sync_subscriptions(self.backend.specs())

    def stop(self) -> None:
        self.backend.close()
        self.sub.stop()

    # ---- workers ----

    def sync_subscriptions(self, specs: dict[str, WorkerSpec]) -> None:
        """Subscribes to exactly `specs` (the backend decides: all workers, or none on a Redis
        replica that is not the writer)."""
        with self._sync_lock:
            for name, spec in list(self._subscribed.items()):
                if specs.get(name) != spec:
                    self.sub.remove(name)
                    del self._subscribed[name]
                    if name not in specs:
                        self.backend.remove_worker(name)
                    else:  # changed endpoint: a different stream, start over
                        self.backend.clear_worker(name)
            for name, spec in specs.items():
                if name not in self._subscribed:
                    self.backend.add_worker(name, eagle=spec.eagle)
                    self._subscribed[name] = spec
                    try:
                        self.sub.add(spec)
                    except Exception:
                        del self._subscribed[name]
                        raise

    def add_worker(self, spec: WorkerSpec) -> bool:
        """Registers a worker; False if the name is taken."""
        if not self.backend.register(spec, replace=False):
            return False
        if isinstance(self.backend, MemoryBackend):
            self.sync_subscriptions(self.backend.specs())
        return True

    def remove_worker(self, name: str) -> bool:
        if not self.backend.unregister(name):
            return False
        if isinstance(self.backend, MemoryBackend):
            self.sync_subscriptions(self.backend.specs())
        return True

    def local_stream_status(self) -> dict[str, dict]:
        return self.sub.status()

    def workers(self) -> list[dict[str, Any]]:
        streams = self.backend.status_of_streams()
        if streams is None:
            streams = self.sub.status()
        out = []
        for name, spec in sorted(self.backend.specs().items()):
            d = spec.to_dict()
            d["stream"] = streams.get(name)
            out.append(d)
        return out

    # ---- sink ----

    def on_batch(self, worker: str, seq: int, payload: bytes) -> None:
        spec = self._subscribed.get(worker)
        tier = spec.tier if spec else "GPU"
        try:
            st: ApplyStats = self.backend.apply(worker, seq, payload, tier)
        except Exception as e:
            from ..errors import EventDecodeError

            if isinstance(e, EventDecodeError):
                raise
            log.warning("worker %s: batch %d not applied: %s", worker, seq, e)
            return
        self.metrics.applied(worker, st)

    def on_reset(self, worker: str, reason: str) -> None:
        log.warning("worker %s: dropping its entries (%s)", worker, reason)
        self.backend.clear_worker(worker)

    def resume_seq(self, worker: str) -> int:
        return self.backend.resume_seq(worker)

    def on_signal(self, worker: str, what: str, n: int = 1) -> None:
        self.metrics.signal(worker, what, n)

    # ---- reads ----

    def score(self, tokens: list[int], block_size: int | None, lora_id: int | None,
              lora_name: str | None) -> dict[str, Any]:
        bs = block_size or self.cfg.block_size
        t0 = time.perf_counter()
        res: ScoreResult = self.backend.score(tokens, bs, lora_id, lora_name)
        self.metrics.lookups.observe(time.perf_counter() - t0)
        reasons = list(res.stale_reasons)
        syncing = self.sub.syncing()
        if syncing:
            reasons.append(f"replaying: {', '.join(sorted(syncing))}")
        stale = res.stale or bool(syncing)
        if stale:
            self.metrics.stale_answers.inc()
        workers: dict[str, Any] = {}
        for name in self.backend.specs():
            workers[name] = _entry(0, (0, 0, 0), 0.0, bs)
        for name, blocks, tier_blocks, score in res.matches:
            workers[name] = _entry(blocks, tier_blocks, score, bs)
        return {
            "block_size": bs,
            "prompt_blocks": len(tokens) // bs,
            "stale": stale,
            "stale_reasons": reasons,
            "workers": workers,
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        ok, detail = self.backend.health()
        return ok, {
            "ok": ok,
            "backend": self.backend.name,
            "workers": len(self.backend.specs()),
            "uptime_s": round(time.time() - self.started_at, 3),
            **detail,
        }

    def _gauges(self) -> dict[str, float]:
        size = self.backend.size()
        return {
            "index_keys": size.get("keys", 0),
            "index_entries": size.get("entries", 0),
            "index_evictions": size.get("evictions", 0),
            "workers": len(self._subscribed),
            "syncing_workers": len(self.sub.syncing()),
        }


def _entry(blocks: int, tier_blocks, score: float, bs: int) -> dict[str, Any]:
    return {
        "blocks": blocks,
        "tokens": blocks * bs,
        "tiers": {t: {"blocks": b, "tokens": b * bs} for t, b in zip(TIER_NAMES, tier_blocks, strict=True)},
        "score": score,
    }
