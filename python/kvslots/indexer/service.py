"""The indexer service: the backend, the subscription and the metrics, wired together."""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sized
from collections.abc import Set as AbstractSet
from typing import Any

from .._core import ApplyStats
from .._ratelog import RateLimitedLog
from ..errors import ArgumentTypeError, ConfigError, InvalidArgumentError, OutOfDescriptorsError
from . import fds
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
        # The command validates its config; one built in code gets the same rules (a block size
        # of 0 was taken, a NaN replay timeout a ValueError in the subscription).
        if not isinstance(cfg, IndexerConfig):
            raise ArgumentTypeError(f"cfg must be an IndexerConfig, got {type(cfg).__name__}")
        cfg.validate()
        self.cfg = cfg
        self.metrics = Metrics()
        # What a worker's stream triggers, bounded per worker (a flood of bad frames was a flood of lines).
        self._worker_log = RateLimitedLog(log)
        self.backend = backend or make_backend(cfg)
        self.sub = Subscription(self, replay_timeout=cfg.replay_timeout, max_frame_bytes=cfg.max_frame_mb * 2**20)
        self._subscribed: dict[str, WorkerSpec] = {}
        #: The HTTP connection cap the workers' descriptors come out of (``kvslots indexer`` sets
        #: it, :meth:`use_connection_cap`); None: not kept.
        self.connection_cap: fds.ConnectionCap | None = None
        self._sync_lock = threading.Lock()
        self._life_lock = threading.Lock()  # start and stop, once each
        self._started = self._stopped = False
        self.started_at = time.time()
        self.metrics.add_gauges(self._gauges)

    # ---- lifecycle ----

    def start(self) -> None:
        """Starts the subscription and the backend; with the memory backend, returns once every
        worker is subscribed and caught up. A worker that cannot be subscribed (more workers than
        the file descriptor limit holds, an address ZMQ refuses) is a ConfigError. A second call
        does nothing."""
        with self._life_lock:
            if self._started:
                return
            self._started = True
        # Before any socket is opened: past the limit, the first worker that does not fit failed
        # with 'Too many open files' after as many as fitted were opened.
        fds.check_workers_fit(len(self.cfg.workers), sum(w.replay is not None for w in self.cfg.workers))
        self.sub.start()
        for spec in self.cfg.workers:
            # The command line / config file is authoritative for the workers it names.
            self.backend.register(spec, replace=True)
        self.backend.start(self)
        if isinstance(self.backend, MemoryBackend):
            failed = self.sync_subscriptions(self.backend.specs)
            if failed:  # a worker given on the command line or in the file
                name, e = next(iter(failed.items()))
                if _out_of_fds(e):  # the server's limit, said as such (not 'cannot connect')
                    raise ConfigError(f"worker {name!r}: cannot subscribe to its stream: {fds.out_of_fds_message()}: "
                                      f"raise the limit, or split the {len(self.cfg.workers)} workers between "
                                      "indexers") from e
                raise _subscribe_error(self.backend.specs().get(name), name, e)

    def stop(self) -> None:
        """Stops the backend and the subscription; a second call does nothing."""
        with self._life_lock:
            if self._stopped:
                return
            self._stopped = True
        self.backend.close()
        self.sub.stop()

    # ---- workers ----

    def use_connection_cap(self, cap: fds.ConnectionCap) -> None:
        """Keeps ``cap`` in step with the workers subscribed, and refuses an added worker
        (:meth:`add_worker`) whose descriptors it cannot spare."""
        with self._sync_lock:
            self.connection_cap = cap
            cap.set_workers(len(self._subscribed))

    def sync_subscriptions(
        self, specs: Mapping[str, WorkerSpec] | Callable[[], Mapping[str, WorkerSpec]]
    ) -> dict[str, Exception]:
        """Subscribes to exactly `specs` (the backend decides: all workers, or none on a Redis
        replica that is not the writer). A callable is called under the lock: a snapshot taken
        before it could be stale by then (a worker removed meanwhile would come back).

        Returns the workers that could not be subscribed, with why; each is left out entirely
        (not subscribed, not in the index), so a later call tries again. With a connection cap
        (:meth:`use_connection_cap`), a worker not in the config whose descriptors it cannot
        spare is one of them (an :class:`OutOfDescriptorsError`, not tried)."""
        failed: dict[str, Exception] = {}
        with self._sync_lock:
            if callable(specs):
                specs = specs()
            cap = self.connection_cap
            configured = {w.name for w in self.cfg.workers}  # checked at start-up (fds.check_workers_fit)
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
                    if cap is not None and name not in configured:
                        # As POST /workers' reserve(): a worker another replica added (learned
                        # through Redis) took the connections' descriptors unchecked.
                        try:
                            cap.check(len(self._subscribed) + 1, f"worker {name!r}")
                        except OutOfDescriptorsError as e:
                            failed[name] = e
                            continue
                    self.backend.add_worker(name, eagle=spec.eagle)
                    self._subscribed[name] = spec  # before add: its catch-up batches need the tier
                    try:
                        self.sub.add(spec)
                    except Exception as e:
                        del self._subscribed[name]
                        self.sub.remove(name)
                        self.backend.remove_worker(name)
                        failed[name] = e
                        if _out_of_fds(e):  # every other would fail alike (and log it): tried next call
                            break
            if self.connection_cap is not None:
                self.connection_cap.set_workers(len(self._subscribed))
        return failed

    def add_worker(self, spec: WorkerSpec) -> bool:
        """Registers a worker; False if the name is taken. If its stream cannot be subscribed
        to, nothing is left of it and the error is raised (a ConfigError when ZMQ refuses the
        address)."""
        if not isinstance(spec, WorkerSpec):
            raise ArgumentTypeError(f"spec must be a WorkerSpec, got {type(spec).__name__}")
        cap = self.connection_cap
        if cap is not None:  # before anything is kept: an OutOfDescriptorsError when it cannot be spared
            cap.reserve(f"worker {spec.name!r}")
        try:
            if not self.backend.register(spec, replace=False):
                return False
            if isinstance(self.backend, MemoryBackend):
                failed = self.sync_subscriptions(self.backend.specs)
                if spec.name in failed:
                    self.backend.unregister(spec.name, spec=spec)
                    self.sync_subscriptions(self.backend.specs)
                    raise _subscribe_error(spec, spec.name, failed[spec.name])
                _log_failed(failed)
            return True
        finally:
            if cap is not None:
                cap.release()

    def remove_worker(self, name: str) -> bool:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"name must be a str, got {type(name).__name__}")
        if not self.backend.unregister(name):
            return False
        if isinstance(self.backend, MemoryBackend):
            _log_failed(self.sync_subscriptions(self.backend.specs))
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
            self._worker_log.log(logging.WARNING, (worker, "not_applied"), "worker %s: batch %d not applied: %s",
                           worker, seq, e)
            return
        self.metrics.applied(worker, st)

    def on_reset(self, worker: str, reason: str) -> None:
        self._worker_log.log(logging.WARNING, (worker, "reset"), "worker %s: dropping its entries (%s)", worker, reason)
        self.backend.clear_worker(worker)

    def resume_seq(self, worker: str) -> int:
        return self.backend.resume_seq(worker)

    def on_signal(self, worker: str, what: str, n: int = 1) -> None:
        self.metrics.signal(worker, what, n)

    # ---- reads ----

    def score(self, tokens: list[int], block_size: int | None, lora_id: int | None,
              lora_name: str | None) -> dict[str, Any]:
        bs = block_size or self.cfg.block_size
        # A generator: the backend consumed it, then len() failed; a set or a mapping has no order.
        if not isinstance(tokens, Sized) or isinstance(tokens, (AbstractSet, Mapping)):
            raise ArgumentTypeError(f"token_ids must be a sequence of integers, got {type(tokens).__name__}")
        # A longer prompt's first max_tokens are scored: a prefix's score holds for the prompt too,
        # and long prompts are where a prefix hit matters most (they were refused: round robin).
        n = len(tokens)
        truncated = n > self.cfg.max_tokens
        if truncated:
            tokens = list(itertools.islice(tokens, self.cfg.max_tokens))
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
            "prompt_blocks": n // bs,  # the whole prompt's, scored or not
            "truncated": truncated,
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


#: What ZMQ says of an address it will not connect to (the client's fault, not the server's).
_REFUSED_ADDRESS = {errno.EINVAL, errno.ENAMETOOLONG, errno.EPROTONOSUPPORT, errno.EAFNOSUPPORT}
#: What it says when the process (EMFILE) or the system (ENFILE) has no descriptor left.
_NO_FDS = {errno.EMFILE, errno.ENFILE}


def _errno(e: Exception) -> int | None:
    """The errno of a subscription's failure: ZMQ's, or the one its kvslots error carries."""
    code = getattr(e, "errno", None)
    if code is None:
        code = (getattr(e, "details", None) or {}).get("errno", getattr(e.__cause__, "errno", None))
    return code


def _out_of_fds(e: Exception) -> bool:
    return _errno(e) in _NO_FDS


def _subscribe_error(spec: WorkerSpec | None, name: str, e: Exception) -> Exception:
    """A ConfigError when the worker's address is refused; else `e` itself (a server-side
    failure, e.g. out of file descriptors)."""
    code = _errno(e)
    if code in _REFUSED_ADDRESS or (code is None and isinstance(e, (ConfigError, InvalidArgumentError))):
        where = f" at {spec.endpoint}" if spec is not None else ""
        err = ConfigError(f"worker {name!r}: cannot subscribe to its stream{where}: {' '.join(str(e).split())}")
        err.__cause__ = e
        return err
    return e


def _log_failed(failed: dict[str, Exception]) -> None:
    # Another caller's worker, rolled back by that caller.
    for name, e in failed.items():
        log.warning("worker %s: cannot subscribe to its stream: %s", name, e)


def _entry(blocks: int, tier_blocks, score: float, bs: int) -> dict[str, Any]:
    return {
        "blocks": blocks,
        "tokens": blocks * bs,
        "tiers": {t: {"blocks": b, "tokens": b * bs} for t, b in zip(TIER_NAMES, tier_blocks, strict=True)},
        "score": score,
    }
