"""What the scheduler-side connector tells the workers each step, and what they report back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

_EMPTY = np.zeros(0, dtype=np.int64)


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
    are ever stored."""

    step: int
    store_device_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    store_host_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    loads: list[LoadSpec] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (len(self.store_device_blocks) or self.loads)


@dataclass
class KVSlotsWorkerMetadata(KVConnectorWorkerMetadata):
    """Per step: how many worker ranks finished its copies, and which copies failed on any
    rank. vLLM aggregates one of these per rank before the scheduler sees it."""

    acks: dict[int, int] = field(default_factory=dict)
    failed_store_host_blocks: dict[int, set[int]] = field(default_factory=dict)
    failed_loads: dict[int, set[str]] = field(default_factory=dict)

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
        return out
