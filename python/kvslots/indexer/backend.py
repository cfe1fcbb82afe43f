"""Where the index lives: in this process (default) or in Redis (shared by replicas)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, cast

from .._core import ApplyStats, PrefixIndex
from .config import IndexerConfig, WorkerSpec

TIER_NAMES = ("GPU", "CPU", "STORAGE")

# (worker, blocks, (gpu, cpu, storage) blocks, score), as PrefixIndex.lookup returns them
Match = tuple[str, int, Any, float]


@dataclass
class ScoreResult:
    matches: list[Match]
    stale: bool
    stale_reasons: list[str] = field(default_factory=list)


class Backend:
    """The index as the service uses it. `apply`, `clear_worker`, `remove_worker` are called by
    the subscription thread; `score` and the registry calls by HTTP handlers (any thread)."""

    name = "?"
    #: Exceptions meaning the backend's store is unreachable (HTTP 503, nothing changed).
    unavailable: tuple[type[BaseException], ...] = ()

    def __init__(self, cfg: IndexerConfig):
        self.cfg = cfg
        weights = {t: float(w) for t, w in cfg.tier_weights.items()}
        self.hasher = PrefixIndex(tier_weights=weights)  # chain keys and scoring helpers

    # lifecycle
    def start(self, service: Any) -> None: ...
    def close(self) -> None: ...

    # whether this replica should subscribe to the workers' streams
    def should_subscribe(self) -> bool:
        return True

    # registry of workers (specs)
    def register(self, spec: WorkerSpec, *, replace: bool = True) -> bool:
        raise NotImplementedError

    def unregister(self, name: str, *, spec: WorkerSpec | None = None) -> bool:
        """Removes the worker (only if its spec is `spec`, when given); False if absent."""
        raise NotImplementedError

    def specs(self) -> dict[str, WorkerSpec]:
        raise NotImplementedError

    # the index (subscription thread)
    def add_worker(self, name: str, *, eagle: bool = False) -> None:
        """Adds the worker if missing and sets whether the EAGLE last-block rule applies to it."""
        raise NotImplementedError

    def remove_worker(self, name: str) -> None:
        raise NotImplementedError

    def clear_worker(self, name: str) -> None:
        raise NotImplementedError

    def apply(self, worker: str, seq: int, payload: bytes, tier: str) -> ApplyStats:
        raise NotImplementedError

    def resume_seq(self, worker: str) -> int:
        return 0

    # reads (HTTP threads)
    def score(self, tokens: list[int], block_size: int, lora_id: int | None, lora_name: str | None) -> ScoreResult:
        raise NotImplementedError

    def size(self) -> dict[str, int]:
        raise NotImplementedError

    def health(self) -> tuple[bool, dict]:
        return True, {}

    def status_of_streams(self) -> dict[str, dict] | None:
        """Stream status published by whichever replica subscribes (None: ask the local one)."""
        return None


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, cfg: IndexerConfig):
        super().__init__(cfg)
        self.index = PrefixIndex(capacity=cfg.capacity, tier_weights=dict(cfg.tier_weights))
        self._specs: dict[str, WorkerSpec] = {}
        self._lock = threading.Lock()

    def register(self, spec: WorkerSpec, *, replace: bool = True) -> bool:
        with self._lock:
            if spec.name in self._specs and not replace:
                return False
            self._specs[spec.name] = spec
            return True

    def unregister(self, name: str, *, spec: WorkerSpec | None = None) -> bool:
        with self._lock:
            if name not in self._specs or spec is not None and self._specs[name] != spec:
                return False
            del self._specs[name]
            return True

    def specs(self) -> dict[str, WorkerSpec]:
        with self._lock:
            return dict(self._specs)

    def add_worker(self, name: str, *, eagle: bool = False) -> None:
        if name not in self.index.workers():
            self.index.add_worker(name)
        self.index.set_worker_eagle(name, eagle)

    def remove_worker(self, name: str) -> None:
        if name in self.index.workers():
            self.index.remove_worker(name)

    def clear_worker(self, name: str) -> None:
        if name in self.index.workers():
            self.index.clear_worker(name)

    def apply(self, worker: str, seq: int, payload: bytes, tier: str) -> ApplyStats:
        return self.index.apply(worker, payload, tier)

    def score(self, tokens, block_size, lora_id, lora_name) -> ScoreResult:
        return ScoreResult(self.index.lookup(tokens, block_size, lora_id, lora_name), stale=False)

    def size(self) -> dict[str, int]:
        st = self.index.stats()  # these three are counts, never None
        return {"keys": cast(int, st["keys"]), "entries": cast(int, st["entries"]),
                "evictions": cast(int, st["evictions"])}
