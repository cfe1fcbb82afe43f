"""Per-tier figures of the KVSlotsConnector on vLLM's own ``/metrics``.

vLLM's path for connector metrics: the scheduler-side connector's ``get_kv_connector_stats()``
(called after each step's output) returns a :class:`KVSlotsConnectorStats`; vLLM puts its
``to_dict()`` in the step's ``SchedulerStats`` and hands it, in the front-end process, to the
:class:`KVSlotsPromMetrics` that ``KVSlotsConnector.build_prom_metrics`` built (and, for the
periodic log line, to ``build_kv_connector_stats``). Nothing here needs prometheus_client of its
own: the metric classes are vLLM's (multiprocess-aware).

Exported, each with vLLM's labels plus ``tier`` (``host`` or ``disk``):

- ``vllm:kvslots_tier_capacity_blocks``, ``vllm:kvslots_tier_used_blocks`` (gauges)
- ``vllm:kvslots_tier_queue_depth`` (gauge): host: blocks being stored or moved up; disk: records
  queued for the writer (as of the worker's last report)
- ``vllm:kvslots_tier_reads_in_flight`` (gauge, disk): async disk hits being read
- ``vllm:kvslots_tier_hit_tokens_total``, ``vllm:kvslots_tier_read_bytes_total``,
  ``vllm:kvslots_tier_written_bytes_total`` (counters). Host: bytes loaded to the device and
  stored into the host tier; disk: bytes the worker read and wrote (as of its last report).

A snapshot is taken at most once a second (``interval``), so the per-step cost is one clock read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

GAUGES = {
    "capacity_blocks": "Blocks the kvslots tier can hold.",
    "used_blocks": "Blocks the kvslots tier holds (found by lookups).",
    "queue_depth": "kvslots tier: host, blocks being stored or moved up; disk, records queued for the writer.",
    "reads_in_flight": "kvslots disk tier: hits being read asynchronously.",
}
COUNTERS = {
    "hit_tokens": "Prompt tokens served from the kvslots tier.",
    "read_bytes": "Bytes read from the kvslots tier (host: loaded to the device; disk: read by the worker).",
    "written_bytes": "Bytes written into the kvslots tier (host: stored; disk: written by the worker).",
}
TIERS = ("host", "disk")


@dataclass
class KVSlotsConnectorStats(KVConnectorStats):
    """``data = {"gauges": {"tier/name": value}, "counters": {"tier/name": increment}}`` (string
    keys only: the dict crosses vLLM's process boundary)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data.setdefault("gauges", {})
        self.data.setdefault("counters", {})

    def reset(self) -> None:
        self.data = {"gauges": {}, "counters": {}}

    def aggregate(self, other: KVConnectorStats) -> "KVSlotsConnectorStats":
        if not isinstance(other, KVSlotsConnectorStats):
            return self
        self.data["gauges"].update(other.data.get("gauges", {}))  # the latest snapshot wins
        c = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            c[k] = c.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        out.update(self.data["gauges"])
        out.update(self.data["counters"])
        return out

    def is_empty(self) -> bool:
        return not self.data["gauges"] and not any(self.data["counters"].values())


class KVSlotsPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = labelnames + ["tier"]
        gauge: Any = self._gauge_cls  # vLLM's (multiprocess-aware) Gauge class
        self._gauges = {n: gauge(name=f"vllm:kvslots_tier_{n}", documentation=doc, labelnames=names,
                                           multiprocess_mode="mostrecent") for n, doc in GAUGES.items()}
        self._counters = {n: self._counter_cls(name=f"vllm:kvslots_tier_{n}", documentation=doc, labelnames=names)
                          for n, doc in COUNTERS.items()}
        self._children: dict[tuple[int, str, str], Any] = {}

    def _child(self, family: dict[str, Any], engine_idx: int, key: str) -> Any:
        tier, _, name = key.partition("/")
        got = self._children.get((engine_idx, tier, name))
        if got is None and name in family and tier in TIERS:
            got = family[name].labels(*self.per_engine_labelvalues[engine_idx], tier)
            self._children[(engine_idx, tier, name)] = got
        return got

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, v in transfer_stats_data.get("gauges", {}).items():
            child = self._child(self._gauges, engine_idx, key)
            if child is not None:
                child.set(v)
        for key, v in transfer_stats_data.get("counters", {}).items():
            child = self._child(self._counters, engine_idx, key)
            if child is not None and v > 0:
                child.inc(v)


class TierStats:
    """Scheduler side: snapshots of both tiers, counters as increments since the last one."""

    def __init__(self, bytes_per_block: int, interval: float = 1.0) -> None:
        self.bytes_per_block = bytes_per_block
        self.interval = interval
        self._last: dict[str, int] = {}
        self._t = float("-inf")

    def collect(self, sched: Any, disk: Any, force: bool = False) -> KVSlotsConnectorStats | None:
        now = time.monotonic()
        if not force and now - self._t < self.interval:
            return None
        self._t = now
        p = sched.planner
        s = p.stats()
        h = p.host_stats()
        bpb = self.bytes_per_block
        gauges = {"host/capacity_blocks": p.num_host_blocks, "host/used_blocks": p.num_cached,
                  "host/queue_depth": p.num_storing}
        totals = {"host/hit_tokens": s["hit_tokens"], "host/read_bytes": s["loaded_blocks"] * bpb,
                  "host/written_bytes": h["stores_completed"] * bpb}
        if disk is not None:
            m = disk.metrics()
            gauges.update({"disk/capacity_blocks": m["disk_capacity_blocks"], "disk/used_blocks": m["disk_used_blocks"],
                           "disk/queue_depth": m.get("disk_worker_queue_depth", 0),
                           "disk/reads_in_flight": m["disk_reads_in_flight"]})
            totals.update({"disk/hit_tokens": m["disk_hit_tokens"], "disk/read_bytes": m.get("disk_worker_bytes_read", 0),
                           "disk/written_bytes": m.get("disk_worker_bytes_written", 0)})
        counters = {k: max(0, v - self._last.get(k, 0)) for k, v in totals.items()}
        self._last = totals
        return KVSlotsConnectorStats(data={"gauges": gauges, "counters": counters})
