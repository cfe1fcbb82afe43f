"""The scheduler side of the connector: host-tier lookups, load and store planning, completion.

The host tier is the Rust :class:`kvslots.HostCache`, keyed by vLLM's own block hashes (their
64-bit external form), so host-tier events use the same keys as vLLM's device-tier events.

Which device blocks may be stored: block ``i`` of a request only once all of its ``block_size``
positions hold verified KV, i.e. ``(i + 1) * block_size <= num_computed_tokens -
num_in_flight_tokens`` (vLLM advances ``num_computed_tokens`` by the scheduled drafts and takes
the rejected ones back after verification; in-flight tokens are not verified yet). Draft KV is
never stored, whatever K and acceptance do.

A request's blocks are not stored in the step it is first scheduled (or resumed): its prefix
hit may be on blocks another request computes in that same step.

Copies are synchronous within the step they are planned for, on every worker rank: stores at the
very start of the step (vLLM's ``handle_preemptions`` hook, before the forward), loads before the
forward (``start_load_kv``; vLLM runs it first in steps with synchronous loads). So the blocks of
a request that finished since the last step are copied before any forward can reuse them, and
``request_finished`` never has to hold blocks. A store's host block becomes visible (registered,
``BlockStored``) only when every rank has reported the step done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..._core import HostCache
from ...events import external_block_hash
from .metadata import KVSlotsMetadata, KVSlotsWorkerMetadata, LoadSpec

logger = logging.getLogger(__name__)


@dataclass
class _StepOps:
    """A step's copies awaiting the workers' acks (its store runs live in the HostCache)."""

    load_host_blocks: list[list[int]] = field(default_factory=list)
    acks: int = 0
    failed_store_host_blocks: set[int] = field(default_factory=set)


@dataclass
class _Req:
    request: Any
    lora_id: int | None
    hashes: list[int] = field(default_factory=list)  # external form of request.block_hashes
    next_block: int = 0  # blocks below were already considered for storing
    store_at: int = 0  # verified tokens at which block next_block becomes storable
    due: int = -1  # the build step at which this request is next checked for storable blocks
    planned_load: LoadSpec | None = None
    hit_blocks: int = 0
    local_blocks: int = 0

    def external_hashes(self, n: int) -> list[int]:
        """The first n block hashes in external (u64) form, converted once each."""
        block_hashes = self.request.block_hashes
        while len(self.hashes) < n:
            self.hashes.append(external_block_hash(block_hashes[len(self.hashes)]))
        return self.hashes


def verified_tokens(request: Any) -> int:
    """Tokens whose KV is computed and verified (drafts in flight excluded)."""
    return request.num_computed_tokens - request.num_in_flight_tokens


class SchedulerSide:
    def __init__(self, *, block_size: int, num_host_blocks: int, eagle_block_drop: bool,
                 expected_workers: int, max_decode_tokens: int = 1) -> None:
        """``max_decode_tokens``: the most tokens a decoding request verifies in one step (1 + K).
        A request is checked for storable blocks only at the first step at which a block could
        have filled, so a step costs a fraction of the batch, not the whole batch."""
        self.block_size = block_size
        self.max_decode_tokens = max(1, max_decode_tokens)
        self._due: dict[int, list[str]] = {}
        self.host = HostCache(num_host_blocks, block_size)
        self.eagle_block_drop = eagle_block_drop
        self.expected_workers = expected_workers
        self.requests: dict[str, _Req] = {}
        self.step = 0
        self._inflight: dict[int, _StepOps] = {}
        self._planned_loads: list[LoadSpec] = []
        # Stores of finished requests, sent with the next metadata.
        self._deferred_store_dev: list[int] = []
        self._deferred_store_host: list[int] = []
        self.stats = {"hit_tokens": 0, "loaded_blocks": 0, "stored_blocks": 0, "failed_loads": 0,
                      "failed_stores": 0}

    # ---- lookups ----
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        bs = self.block_size
        st = self._state(request)
        # vLLM needs at least one token to compute, so never the whole prompt.
        max_blocks = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        local = num_computed_tokens // bs
        if max_blocks <= local:
            return 0
        hit = self.host.match_prefix(st.external_hashes(max_blocks)[:max_blocks])
        if self.eagle_block_drop and hit > 0:
            # The draft KV at a block's last position depends on the next token, which the new
            # request may not share: vLLM trims its local hits the same way.
            hit -= 1
        if hit <= local:
            return 0
        st.local_blocks, st.hit_blocks = local, hit
        return (hit - local) * bs

    def after_alloc(self, request: Any, device_blocks: list[int], num_external_tokens: int) -> None:
        st = self._state(request)
        if st.planned_load is not None:  # a second call for the same request: keep the first plan
            return
        if num_external_tokens <= 0:
            return
        # The external range starts right after vLLM's (block-aligned) local hit.
        n = num_external_tokens // self.block_size
        lo = st.local_blocks
        if lo + n > st.hit_blocks:
            logger.warning("kvslots: %s asks %d external blocks after %d local, only %d hit",
                           request.request_id, n, lo, st.hit_blocks)
            return
        hashes = st.external_hashes(lo + n)[lo:lo + n]
        try:
            host_blocks = self.host.begin_load(request.request_id, hashes)
        except ValueError as e:  # evicted since the lookup (cannot happen within one step)
            logger.warning("kvslots: cannot load %s: %s", request.request_id, e)
            return
        st.planned_load = LoadSpec(request.request_id, list(device_blocks[lo:lo + n]), host_blocks)
        self._planned_loads.append(st.planned_load)
        self.stats["hit_tokens"] += num_external_tokens

    # ---- per step ----
    def build(self, preempted_req_ids: Iterable[str], block_ids_of: Callable[[str], list[int]],
              first_scheduled: Iterable[str] = ()) -> KVSlotsMetadata:
        """``first_scheduled``: requests scheduled for the first time since they arrived or were
        preempted. Their prefix hit may be on blocks another request computes in this very step
        (vLLM caches a block when it is scheduled), so none of their blocks is stored yet."""
        self.step += 1
        ops = _StepOps()
        for rid in preempted_req_ids:
            st = self.requests.get(rid)
            if st is not None:
                self._drop_planned_load(st)
                st.next_block, st.store_at = 0, 0  # its blocks are gone: what the host lacks is recomputed
        loads, self._planned_loads = [l for l in self._planned_loads if l is self._plan_of(l.req_id)], []
        for spec in loads:
            self.requests[spec.req_id].planned_load = None
            ops.load_host_blocks.append(spec.host_blocks)
            self.stats["loaded_blocks"] += len(spec.host_blocks)

        dev, host = self._deferred_store_dev, self._deferred_store_host
        self._deferred_store_dev, self._deferred_store_host = [], []
        skip = set(preempted_req_ids)
        skip.update(first_scheduled)
        bs = self.block_size
        requests = self.requests
        # The hot path at large batches: only the requests due this step are looked at.
        for rid in self._due.pop(self.step, ()):
            st = requests.get(rid)
            if st is None or st.due != self.step:
                continue  # finished, or a stale entry
            req = st.request
            verified = req.num_computed_tokens - req.num_in_flight_tokens
            if verified >= st.store_at and rid not in skip:
                full = min(verified // bs, len(req.block_hashes))
                if full > st.next_block:
                    self._plan_store(st, st.next_block, full, block_ids_of(rid), dev, host, self.step)
                    st.next_block = full
                st.store_at = (st.next_block + 1) * bs
            self._check_later(rid, st, verified)
        meta = KVSlotsMetadata(
            step=self.step,
            store_device_blocks=np.asarray(dev, dtype=np.int64),
            store_host_blocks=np.asarray(host, dtype=np.int64),
            loads=loads,
        )
        if dev or ops.load_host_blocks:
            self._inflight[self.step] = ops
        return meta

    def _check_later(self, rid: str, st: _Req, verified: int) -> None:
        req = st.request
        if req.num_computed_tokens < req.num_prompt_tokens:
            wait = 1  # a prefill chunk can fill any number of blocks
        else:
            # Verified tokens grow by at most max_decode_tokens a step: no block can fill sooner.
            wait = max(1, (st.store_at - verified) // self.max_decode_tokens)
        st.due = self.step + wait
        self._due.setdefault(st.due, []).append(rid)

    def _plan_store(self, st: _Req, lo: int, hi: int, device_blocks: Any, dev: list[int],
                    host: list[int], step: int) -> None:
        """Begins storing blocks lo..hi of a request as part of ``step`` (one Rust call)."""
        hashes = st.external_hashes(hi)
        req = st.request
        # The plain list behind vLLM's read-only view: slicing it is several times cheaper.
        tokens = getattr(req, "_all_token_ids", None) or req.all_token_ids
        bs = self.block_size
        started = self.host.begin_store_run(step, hashes[lo:hi], hashes[lo - 1] if lo > 0 else None,
                                            tokens[lo * bs:hi * bs], st.lora_id)
        for i, hb in started:
            dev.append(device_blocks[lo + i])
            host.append(hb)
        self.stats["stored_blocks"] += len(started)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Plans the stores of the blocks the request verified last, for the next step (whose
        stores run before any forward can reuse the freed blocks). Never holds blocks."""
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return False
        self._drop_planned_load(st)
        full = min(verified_tokens(request) // self.block_size, len(request.block_hashes), len(block_ids))
        if full > st.next_block:
            self._plan_store(st, st.next_block, full, block_ids, self._deferred_store_dev,
                             self._deferred_store_host, self.step + 1)
        return False

    def complete(self, meta: KVSlotsWorkerMetadata | None) -> None:
        """Applies the workers' reports: a step's copies are done once every rank acked it."""
        if meta is None:
            return
        for step, n in meta.acks.items():
            ops = self._inflight.get(step)
            if ops is None:
                continue
            ops.acks += n
            ops.failed_store_host_blocks |= meta.failed_store_host_blocks.get(step, set())
            self.stats["failed_loads"] += len(meta.failed_loads.get(step, ()))
            if ops.acks < self.expected_workers:
                continue  # a block is visible only once every rank has copied its shard
            del self._inflight[step]
            self.stats["failed_stores"] += len(ops.failed_store_host_blocks)
            self.host.complete_step(step, sorted(ops.failed_store_host_blocks))
            for blocks in ops.load_host_blocks:
                self.host.end_load(blocks)

    def has_pending_work(self) -> bool:
        return bool(self._inflight or self._deferred_store_dev)

    # ---- helpers ----
    def _state(self, request: Any) -> _Req:
        st = self.requests.get(request.request_id)
        if st is None or st.request is not request:
            lora = getattr(request, "lora_request", None)
            st = _Req(request, getattr(lora, "lora_int_id", None) if lora else None)
            self.requests[request.request_id] = st
            st.due = self.step + 1
            self._due.setdefault(st.due, []).append(request.request_id)
        return st

    def _plan_of(self, rid: str) -> LoadSpec | None:
        st = self.requests.get(rid)
        return st.planned_load if st else None

    def _drop_planned_load(self, st: _Req) -> None:
        if st.planned_load is not None:
            self.host.end_load(st.planned_load.host_blocks)
            st.planned_load = None
