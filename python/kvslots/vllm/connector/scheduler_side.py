"""The scheduler side of the connector: host-tier lookups, load and store planning, completion.

All of it lives in the Rust :class:`kvslots._core.ConnectorPlanner` (the rules are documented in
``rust/core/src/connector.rs``): the host tier, keyed by vLLM's own block hashes (their 64-bit
external form, so host-tier events use the same keys as vLLM's device-tier events), and a mirror
of every scheduled request (its device block ids, computed and scheduled tokens). Each engine
step is planned in **one call** over vLLM's scheduler output: no Python loop over the batch, the
requests or the blocks.

Which device blocks may be stored: block ``i`` of a request only once all of its ``block_size``
positions hold verified KV, i.e. ``(i + 1) * block_size <= num_computed_tokens -
num_in_flight_tokens`` (vLLM advances ``num_computed_tokens`` by the scheduled drafts and takes
the rejected ones back after verification). Draft KV is never stored, whatever K and acceptance
do. A request is looked at only at the first step a block could have filled.

A request's blocks are not stored in the step it is first scheduled (or resumed): its prefix
hit may be on blocks another request computes in that same step. A preempted request's full
verified blocks are stored in the step that preempts it (the copies run before the forward that
may reuse the freed blocks); a finished request's last blocks at the start of the next step.

EAGLE-family drafters: each stored block records the token that followed it when its draft KV
was written; the last block of a host hit is served only when the request's next token is that
token, so an EAGLE request gets the same host hit as a non-speculative one.

Copies are synchronous within the step they are planned for, on every worker rank: stores at the
very start of the step (vLLM's ``handle_preemptions`` hook, before the forward), loads before the
forward (``start_load_kv``). A store's host block becomes visible (registered, ``BlockStored``)
only when every rank has reported the step done.
"""

from __future__ import annotations

import logging
from typing import Any

from ..._core import ConnectorPlanner
from ...errors import KVSlotsError
from .metadata import EMPTY_METADATA, KVSlotsMetadata, KVSlotsWorkerMetadata, LoadSpec

logger = logging.getLogger(__name__)


def verified_tokens(request: Any) -> int:
    """Tokens whose KV is computed and verified (drafts in flight excluded)."""
    return request.num_computed_tokens - request.num_in_flight_tokens


class SchedulerSide:
    def __init__(self, *, block_size: int, num_host_blocks: int, eagle_block_drop: bool,
                 expected_workers: int, max_decode_tokens: int = 1) -> None:
        """``max_decode_tokens``: the most tokens a decoding request verifies in one step (1 + K).
        ``eagle_block_drop``: the successor rule for the last block of a hit (EAGLE family)."""
        self.block_size = block_size
        self.eagle_block_drop = eagle_block_drop
        self.planner = ConnectorPlanner(block_size, num_host_blocks, eagle_block_drop,
                                        expected_workers=expected_workers,
                                        max_decode_tokens=max(1, max_decode_tokens))

    @property
    def host(self) -> ConnectorPlanner:
        """The host tier (registered hashes, held blocks, events) is the planner's."""
        return self.planner

    @property
    def step(self) -> int:
        return self.planner.step

    @property
    def expected_workers(self) -> int:
        return self.planner.expected_workers

    @expected_workers.setter
    def expected_workers(self, n: int) -> None:
        self.planner.expected_workers = n

    @property
    def stats(self) -> dict[str, int]:
        return self.planner.stats()

    # ---- lookups ----
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        return self.planner.lookup(request, num_computed_tokens)

    def after_alloc(self, request: Any, device_blocks: Any, num_external_tokens: int) -> None:
        try:
            self.planner.after_alloc(request, device_blocks, num_external_tokens)
        except KVSlotsError as e:  # evicted since the lookup, or vLLM asked more than we offered
            logger.warning("kvslots: cannot load %s: %s", request.request_id, e)

    def track(self, request: Any) -> None:
        self.planner.track(request)

    # ---- per step ----
    def build(self, scheduler_output: Any) -> KVSlotsMetadata:
        step, dev, host, loads = self.planner.build(scheduler_output)
        if not dev and not loads:
            return EMPTY_METADATA  # nothing to copy: one shared object, pickled by reference
        return KVSlotsMetadata(step=step, store_device_blocks=dev, store_host_blocks=host,
                               loads=[LoadSpec(r, d, h) for r, d, h in loads] if loads else [])

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Plans the stores of the blocks the request verified last, for the next step (whose
        stores run before any forward can reuse the freed blocks). Never holds blocks."""
        self.planner.finish(request, block_ids)
        return False

    def complete(self, meta: KVSlotsWorkerMetadata | None) -> None:
        """Applies the workers' reports: a step's copies are done once every rank acked it."""
        if meta is None or not meta.acks:
            return
        failed_stores, failed_loads = meta.failed_store_host_blocks, meta.failed_loads
        for step, n in meta.acks.items():
            failed = failed_stores.get(step) if failed_stores else None
            self.planner.complete(step, n, sorted(failed) if failed else None,
                                  len(failed_loads[step]) if failed_loads and step in failed_loads else 0)

    def has_pending_work(self) -> bool:
        return self.planner.has_pending_work()
