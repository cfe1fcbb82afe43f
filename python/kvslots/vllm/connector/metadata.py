"""What the scheduler-side connector tells the workers each step, and what they report back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """One request's host-tier hit: copy host blocks into the device blocks vLLM allocated."""

    req_id: str
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass
class KVSlotsMetadata(KVConnectorMetadata):
    """One step's copies. Workers run the stores (device -> host) at the very start of the step,
    before the forward and before any load (host -> device). Only blocks full of verified tokens
    are ever stored. Block ids are plain lists (or arrays): vLLM pickles the metadata to its
    worker processes every step, and a list pickles several times faster than an array.

    A step without copies gets :data:`EMPTY_METADATA`, one shared object pickled as a reference
    to it: a step with nothing to copy costs the workers nothing."""

    step: int
    store_device_blocks: Sequence[int] | np.ndarray = field(default_factory=list)
    store_host_blocks: Sequence[int] | np.ndarray = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    #: The disk tier's spills and loads (``disk.DiskStepMeta``), None without any.
    disk: Any = None
    #: Disaggregated prefill/decode holds and pulls (``pd.PDStepMeta``), None without any.
    pd: Any = None

    def is_empty(self) -> bool:
        return not (len(self.store_device_blocks) or self.loads or self.disk or self.pd)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self is EMPTY_METADATA:
            return "EMPTY_METADATA"  # pickled as the module's global: no fields, no copies
        return super().__reduce_ex__(protocol)


#: The metadata of every step without copies (never mutated).
EMPTY_METADATA = KVSlotsMetadata(step=0, store_device_blocks=(), store_host_blocks=(), loads=[])


@dataclass
class KVSlotsWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step: how many worker ranks finished its copies, and which copies failed on any
    rank. vLLM aggregates one of these per rank before the scheduler sees it."""

    acks: dict[int, int] = field(default_factory=dict)
    failed_store_host_blocks: dict[int, set[int]] = field(default_factory=dict)
    failed_loads: dict[int, set[str]] = field(default_factory=dict)
    #: Disk tier: finished writes (slot, written), hashes of records found corrupt, writer stats.
    disk_done: list[tuple[int, bool]] = field(default_factory=list)
    disk_corrupt: set[int] = field(default_factory=set)
    disk_stats: dict[str, int] = field(default_factory=dict)
    #: Disk tier: async reads finished, [(request id, blocks loaded from the first)].
    disk_loaded: list[tuple[str, int]] = field(default_factory=list)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVSlotsWorkerMetadata":
        assert isinstance(other, KVSlotsWorkerMetadata)
        out = KVSlotsWorkerMetadata(dict(self.acks), {k: set(v) for k, v in self.failed_store_host_blocks.items()},
                                    {k: set(v) for k, v in self.failed_loads.items()})
        for step, n in other.acks.items():
            out.acks[step] = out.acks.get(step, 0) + n
        for step, blocks in other.failed_store_host_blocks.items():
            out.failed_store_host_blocks.setdefault(step, set()).update(blocks)
        for step, reqs in other.failed_loads.items():
            out.failed_loads.setdefault(step, set()).update(reqs)
        out.disk_done = list(self.disk_done) + list(other.disk_done)
        out.disk_corrupt = set(self.disk_corrupt) | set(other.disk_corrupt)
        out.disk_stats = dict(self.disk_stats or other.disk_stats)
        out.disk_loaded = list(self.disk_loaded) + list(other.disk_loaded)
        return out
