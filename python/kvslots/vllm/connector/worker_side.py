"""The worker side of the connector: one host region per worker rank, whole-block copies.

Each rank (tensor-parallel shard) copies its own shard of every block; the metadata is the same
for all ranks, and a step's copies count as done at the scheduler only when every rank has
acked them (see :class:`KVSlotsWorkerMetadata`).
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import InvalidStateError
from .metadata import KVSlotsMetadata, KVSlotsWorkerMetadata

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, *, num_device_blocks: int, num_host_blocks: int, copy_threads: int = 1) -> None:
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.copy_threads = copy_threads
        self.copier: Any = None
        self._kv_caches: dict[str, Any] | None = None
        self._asleep_caches: dict[str, Any] | None = None
        self._meta = KVSlotsWorkerMetadata()
        self._load_errors: set[int] = set()
        self._loads_in_flight = False
        self.stats = {"stored_blocks": 0, "loaded_blocks": 0, "failed_stores": 0, "failed_loads": 0}

    def unregister_kv_caches(self) -> None:
        """Sleep: forget the device tensors (their memory goes away or is remapped) and the host
        region with them; the scheduler side has cleared the host tier. Idempotent."""
        if self.copier is not None:
            self._settle_loads()  # not into memory that is going away
            self._asleep_caches = self._kv_caches
            self.copier = None

    def restore_kv_caches(self) -> None:
        """Wake-up: the same tensors (vLLM remaps their memory at the same addresses) are
        registered again with an empty host region. Idempotent."""
        if self.copier is None and self._asleep_caches is not None:
            caches, self._asleep_caches = self._asleep_caches, None
            self.register_kv_caches(caches)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from ..transfer import BlockCopier

        # Every attention layer vLLM registered, the draft model's layers included: a host block
        # holds the target's and the drafter's KV, so a restored prefix drafts like a computed one.
        # Tensors BlockCopier refuses change nothing (it raises before anything is kept).
        copier = BlockCopier(kv_caches, self.num_device_blocks, self.num_host_blocks, threads=self.copy_threads)
        self._settle_loads()  # the last step's loads end in the tensors registered before
        self._kv_caches, self.copier = kv_caches, copier
        logger.info("kvslots: %d layers, %d host blocks of %d bytes", len(kv_caches),
                    self.num_host_blocks, self.copier.bytes_per_block)

    def store(self, meta: KVSlotsMetadata) -> None:
        """Device -> host copies. vLLM calls this (handle_preemptions) at the start of every step,
        before the forward: blocks freed since the last step are copied before anyone else's
        forward can overwrite them."""
        self._settle_loads()  # the last step's: their host rows may be reused now
        if not len(meta.store_device_blocks):
            return
        self._require_copier()
        try:
            self.copier.store(meta.store_device_blocks, meta.store_host_blocks)
            self.copier.synchronize()
            self.stats["stored_blocks"] += len(meta.store_device_blocks)
        except Exception:
            logger.exception("kvslots: store of %d blocks failed", len(meta.store_device_blocks))
            self._meta.failed_store_host_blocks.setdefault(meta.step, set()).update(
                int(b) for b in meta.store_host_blocks)
            self.stats["failed_stores"] += len(meta.store_device_blocks)
        self._ack(meta.step)

    def load(self, meta: KVSlotsMetadata) -> None:
        """Host -> device copies of prefix hits (start_load_kv: before the forward, as vLLM runs
        it first in any step that has synchronous loads). On a GPU the forward's stream waits for
        them on the device (``fence``), so its kernels are queued while the loads run; the host
        waits for them at the next step's start, before their host rows can be handed out again."""
        if not meta.loads:
            return
        self._require_copier()
        for load in meta.loads:
            try:
                self.copier.load(load.host_blocks, load.device_blocks)
                self.stats["loaded_blocks"] += len(load.host_blocks)
            except Exception:
                logger.exception("kvslots: load for %s failed", load.req_id)
                self._load_errors.update(load.device_blocks)
                self._meta.failed_loads.setdefault(meta.step, set()).add(load.req_id)
                self.stats["failed_loads"] += 1
        self.copier.fence()
        self._loads_in_flight = True
        self._ack(meta.step)

    def _settle_loads(self) -> None:
        """Blocks until the loads ``load`` left in flight (fenced, not waited for) are done."""
        if self._loads_in_flight:
            self._loads_in_flight = False
            if self.copier is not None:
                self.copier.synchronize()

    def _ack(self, step: int) -> None:
        # One ack per rank and step, whichever of store/load ran.
        self._meta.acks[step] = 1

    def _require_copier(self) -> None:
        if self.copier is None:
            raise InvalidStateError("kvslots: register_kv_caches was not called before the first copy "
                                    "(or the KV caches are unregistered: asleep)")

    def take_worker_meta(self) -> KVSlotsWorkerMetadata | None:
        if not self._meta.acks:
            return None
        meta, self._meta = self._meta, KVSlotsWorkerMetadata()
        return meta

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
