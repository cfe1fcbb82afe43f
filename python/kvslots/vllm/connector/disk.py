"""The disk tier under the host tier: the connector's scheduler part (:class:`DiskScheduler`) and
worker part (:class:`DiskWorker`).

Spill. With a disk tier, the host tier (Rust ``HostCache``) keeps the tokens, parent and
successor of each block; a block it evicts is handed to :class:`DiskScheduler`, which takes a
disk slot for it (``DiskIndex.begin_write``) and ships ``(host block, slot, ...)`` in the step's
metadata. The worker copies the host block's bytes to its background writer *before* that step's
stores reuse the host block (both run in ``handle_preemptions``); a full writer queue drops the
spill. Finished writes travel back in the worker metadata and register the block on disk
(``BlockStored``, medium ``STORAGE``).

Hits. A lookup continues on disk where the host hit ends, with the EAGLE last-block rule applied
to the last block of the whole hit. The disk blocks of a hit are pinned until the step that
loads them is acked. The worker reads them (positioned reads, the GIL released) into a small
staging region and copies them into the device blocks vLLM allocated, in ``start_load_kv``:
**synchronously, before the forward** (vLLM's async-load path is not used yet). A record that
fails its checksum is not loaded: its device blocks are reported as load errors (vLLM
recomputes them), a warning is logged once per block, and the block is dropped from the index.

A disk hit leaves the block on disk (it is not moved up); the host tier may store it again from
the device, so after a hit a block can be in both tiers.

One worker rank (tensor parallel size 1): each rank would need its own file and the scheduler
would have to agree across them; the connector refuses a disk tier otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._core import DiskIndex, DiskStore

logger = logging.getLogger(__name__)

FILE_NAME = "kvslots-disk-tier.kvs"


@dataclass(frozen=True)
class DiskLayout:
    """What the disk file belongs to; the scheduler and the worker compute the same one."""

    num_layers: int
    bytes_per_block: int
    dtype: str
    fingerprint: int

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_config: Any, bytes_per_block: int) -> "DiskLayout":
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        layers = sorted(n for g in kv_cache_config.kv_cache_groups for n in g.layer_names)
        dtype = str(cc.cache_dtype if cc.cache_dtype != "auto" else mc.dtype).replace("torch.", "")
        spec = vllm_config.speculative_config
        parts = [mc.model, str(getattr(mc, "revision", None)), dtype, str(cc.block_size), ",".join(layers),
                 str(bytes_per_block), str(getattr(spec, "model", None) if spec is not None else None)]
        fp = int.from_bytes(hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest(), "little")
        return cls(num_layers=len(layers), bytes_per_block=bytes_per_block, dtype=dtype[:32], fingerprint=fp)

    def kwargs(self) -> dict[str, Any]:
        return dict(num_layers=self.num_layers, bytes_per_block=self.bytes_per_block, dtype=self.dtype,
                    fingerprint=self.fingerprint)


def external(h: Any) -> int:
    """vLLM's 64-bit external form of a block hash (as the host tier keys it)."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")
    return int(h) & ((1 << 64) - 1)


@dataclass
class DiskLoad:
    req_id: str
    slots: list[int]
    hashes: list[int]
    device_blocks: list[int]


@dataclass
class DiskStepMeta:
    """One step's disk work for the worker: spills run before the step's host stores."""

    #: (host block, disk slot, hash, token ids, successor, parent, lora id)
    spills: list[tuple[int, int, int, list[int], int | None, int | None, int | None]] = field(default_factory=list)
    loads: list[DiskLoad] = field(default_factory=list)


class DiskScheduler:
    def __init__(self, planner: Any, *, directory: str, num_slots: int, block_size: int, layout: DiskLayout,
                 eagle: bool) -> None:
        self.planner = planner
        self.block_size = block_size
        self.eagle = eagle
        self.path = os.path.join(directory, FILE_NAME)
        planner.enable_spill()
        self.index = DiskIndex(num_slots, block_size)
        # The workers opened (or started afresh) the file before the scheduler exists.
        restored, damaged, why = self.index.restore_from_file(self.path, **layout.kwargs())
        if why is not None:
            logger.info("kvslots disk tier: %s not reused (%s)", self.path, why)
        else:
            logger.info("kvslots disk tier: %d blocks found again in %s (%d damaged records skipped)",
                        restored, self.path, damaged)
        self._sources: dict[str, tuple[int, int]] = {}
        self._hits: dict[str, tuple[int, int, int]] = {}  # req -> (first disk block, disk blocks, host tokens)
        self._loads: list[DiskLoad] = []
        self._pins: dict[int, list[int]] = {}  # step -> pinned slots
        self.stats = {"hit_tokens": 0, "spilled_blocks": 0, "spills_not_taken": 0, "corrupt_blocks": 0}
        self.worker_stats: dict[str, int] = {}

    def lookup(self, request: Any, num_computed_tokens: int, host_tokens: int) -> int:
        """Tokens of the hit found on disk past the device and host hit."""
        bs = self.block_size
        hashes = request.block_hashes
        max_blocks = min((request.num_tokens - 1) // bs, len(hashes))
        k = num_computed_tokens // bs + host_tokens // bs
        if k >= max_blocks or self.index.num_stored == 0:
            return 0
        # The host hit stopped at k: if the host holds block k, its last block was dropped by
        # the EAGLE rule and nothing beyond may be served.
        first = external(hashes[k])
        if self.planner.lookup_block(first) is not None:
            return 0
        ext = [first] + [external(h) for h in hashes[k + 1:max_blocks]]
        d = self.index.match_prefix(ext)
        if d and self.eagle:
            succ = self.index.successor(ext[d - 1])
            pos = (k + d) * bs
            if succ is None or pos >= request.num_tokens or request.all_token_ids[pos] != succ:
                d -= 1
        if d == 0:
            return 0
        self._hits[request.request_id] = (k, d, host_tokens)
        return d * bs

    def host_part(self, request: Any, num_external_tokens: int) -> int:
        """Of the external tokens vLLM accepted, those that come from the host tier."""
        hit = self._hits.get(request.request_id)
        return num_external_tokens if hit is None else min(num_external_tokens, hit[2])

    def after_alloc(self, request: Any, device_blocks: list[int], num_external_tokens: int) -> None:
        hit = self._hits.pop(request.request_id, None)
        if hit is None:
            return
        k, d, host_tokens = hit
        n = min(d, max(0, num_external_tokens - host_tokens) // self.block_size)
        if n == 0:
            return
        ext = [external(h) for h in request.block_hashes[k:k + n]]
        try:
            slots = self.index.begin_read(ext)
        except Exception as e:  # evicted since the lookup: vLLM recomputes (load error below)
            logger.warning("kvslots disk tier: cannot load %s: %s", request.request_id, e)
            slots = []
        self._loads.append(DiskLoad(request.request_id, slots, ext, list(device_blocks[k:k + n])))
        if len(self._sources) > 4096:  # vLLM asks only with prefix-cache stats on
            self._sources.clear()
        self._sources[request.request_id] = (min(host_tokens, num_external_tokens), n * self.block_size)

    def hit_sources(self, request_id: str, num_external_tokens: int) -> tuple[int, int]:
        """(host tokens, disk tokens) of the request's last planned load."""
        host, disk = self._sources.pop(request_id, (num_external_tokens, 0))
        disk = min(disk, num_external_tokens)
        return num_external_tokens - disk, disk

    def forget(self, request_id: str) -> None:
        self._hits.pop(request_id, None)
        self._sources.pop(request_id, None)

    def build(self, step: int) -> DiskStepMeta | None:
        spills = []
        for hb, h, parent, lora, succ, tokens in self.planner.take_spills():
            slot = self.index.begin_write(h, tokens, succ, parent, lora)
            if slot is None:
                self.stats["spills_not_taken"] += 1
                continue
            spills.append((hb, slot, h, tokens, succ, parent, lora))
        self.stats["spilled_blocks"] += len(spills)
        loads, self._loads = self._loads, []
        if loads:
            self._pins[step] = [s for ld in loads for s in ld.slots]
            self.stats["hit_tokens"] += sum(len(ld.device_blocks) for ld in loads) * self.block_size
        if not spills and not loads:
            return None
        return DiskStepMeta(spills=spills, loads=loads)

    def complete(self, meta: Any) -> None:
        """The worker's report: finished writes, acked steps (their reads unpin), bad records."""
        for slot, ok in getattr(meta, "disk_done", ()):
            self.index.complete_write(slot, ok)
        for step in list(self._pins):
            if step in meta.acks:
                self.index.end_read(self._pins.pop(step))
        for h in getattr(meta, "disk_corrupt", ()):
            if self.index.remove(h):
                self.stats["corrupt_blocks"] += 1
        if getattr(meta, "disk_stats", None):
            self.worker_stats = meta.disk_stats

    def metrics(self) -> dict[str, int]:
        s = self.index.stats()
        out = {f"disk_{k}": v for k, v in s.items()}
        out.update({f"disk_{k}": v for k, v in self.stats.items()})
        out.update({f"disk_worker_{k}": v for k, v in self.worker_stats.items()})
        return out


class DiskWorker:
    STAGING_BLOCKS = 16

    def __init__(self, *, directory: str, num_slots: int, block_size: int, layout: DiskLayout,
                 queue_len: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.layout = layout
        self.path = os.path.join(directory, FILE_NAME)
        self.store = DiskStore(self.path, num_slots=num_slots, block_size=block_size, queue_len=queue_len,
                               **layout.kwargs())
        if self.store.opened.startswith("discarded"):
            logger.warning("kvslots disk tier: %s %s; starting it afresh", self.path, self.store.opened)
        self.staging: Any = None
        self._warned: set[int] = set()

    def register(self, kv_caches: dict[str, Any], copier: Any, num_device_blocks: int, threads: int) -> None:
        from ..transfer import BlockCopier

        if copier.bytes_per_block != self.layout.bytes_per_block:
            raise RuntimeError(f"kvslots disk tier: blocks of {copier.bytes_per_block} bytes, the layout says "
                               f"{self.layout.bytes_per_block}")
        self.host_np = copier.host.numpy()
        # Disk reads land here, then go to the device blocks like a host-tier load.
        self.staging = BlockCopier(kv_caches, num_device_blocks, self.STAGING_BLOCKS, threads=threads)
        self.staging_np = self.staging.host.numpy()

    def spill(self, disk: DiskStepMeta) -> None:
        for hb, slot, h, tokens, succ, parent, lora in disk.spills:
            self.store.submit(slot, self.host_np[hb], h, tokens, succ, parent, lora)

    def load(self, disk: DiskStepMeta, load_errors: set[int], corrupt: set[int]) -> None:
        n_stage = self.STAGING_BLOCKS
        for ld in disk.loads:
            if len(ld.slots) != len(ld.device_blocks):  # not pinned at the scheduler
                load_errors.update(ld.device_blocks)
                continue
            for lo in range(0, len(ld.slots), n_stage):
                slots = ld.slots[lo:lo + n_stage]
                n = len(slots)
                bad = self.store.read_into(slots, ld.hashes[lo:lo + n], self.staging_np[:n])
                good = n if not bad else bad[0][0]
                if good:
                    self.staging.load(list(range(good)), ld.device_blocks[lo:lo + good])
                    self.staging.synchronize()  # the staging rows are read into again next
                if bad:
                    for i, why in bad:
                        corrupt.add(ld.hashes[lo + i])
                        self.store.invalidate(slots[i])  # still pinned: not reused before this
                        if ld.hashes[lo + i] not in self._warned:
                            self._warned.add(ld.hashes[lo + i])
                            logger.warning("kvslots disk tier: block %#x of %s not loaded (%s); recomputed",
                                           ld.hashes[lo + i], ld.req_id, why)
                    # vLLM recomputes from the first failed block on.
                    load_errors.update(ld.device_blocks[lo + good:])
                    break

    def take_done(self) -> list[tuple[int, bool]]:
        return self.store.take_done()
