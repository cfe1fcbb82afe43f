"""KVSlotsConnector: kvslots inside vLLM as a KV connector (``KVConnectorBase_V1``).

    --kv-transfer-config '{"kv_connector": "KVSlotsConnector",
                           "kv_connector_module_path": "kvslots.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_cache_gb": 8}}'

vLLM owns the device blocks. The connector offloads device blocks full of verified tokens to a
host-memory tier managed by the Rust core (keyed by vLLM's own block hashes) and loads host
prefix hits back into the device blocks vLLM allocates, target and draft layers alike. It is a
best-effort cache: a store that does not happen is a future miss, never an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable, cast

import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...events import MEDIUM_CPU, MEDIUM_STORAGE
from ...config.connector import ConnectorConfig, ConnectorConfigError
from ...errors import ArgumentTypeError, DiskTierError, InvalidStateError, KVSlotsError
from ..compat import check_supported, features
from .metadata import EMPTY_METADATA, KVSlotsMetadata, KVSlotsWorkerMetadata
from .scheduler_side import SchedulerSide
from .worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def bytes_per_block(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one block over every layer of this worker (target and draft)."""
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(kv_cache_config.num_blocks, 1)


class KVSlotsConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        check_supported()
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        if hash_block_size != self.block_size:
            raise ConnectorConfigError(
                f"KVSlotsConnector needs hash_block_size == block_size (got {hash_block_size} and "
                f"{self.block_size})")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConnectorConfigError(
                f"KVSlotsConnector supports one KV cache group (full attention; draft layers "
                f"included), got {len(kv_cache_config.kv_cache_groups)}")
        num_host = self.config.num_host_blocks(bytes_per_block(kv_cache_config))
        spec = vllm_config.speculative_config
        drop = self.config.use_eagle_block_drop(bool(spec is not None and spec.use_eagle_block_drop()))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._publisher: Any = None
        self._dp_rank = vllm_config.parallel_config.data_parallel_rank
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        # vLLM publishes KV events (ours merged into its batches) only when enabled.
        self._vllm_events = bool(events_cfg is not None and events_cfg.enable_kv_cache_events
                                 and events_cfg.publisher != "null")
        # vLLM's own ZMQ publisher only msgpack-encodes the batch: our events go to it as
        # msgspec.Raw wire bytes (the published bytes are the same), no structs built per event.
        # Other publishers may read the events: they get vLLM's structs. vLLM 0.33's BlockStored
        # layout differs from the core's (0.32) one, so 0.33 gets structs too. (With the EAGLE
        # rule our BlockStored carry lookahead_token_ids and are 0.33's bytes; on 0.32 the raw
        # bytes keep that field, which a 0.32 decoder skips.)
        self._raw_events = bool(self._vllm_events and cast(Any, events_cfg).publisher == "zmq"
                                and not features().block_stored_lookahead)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                block_size=self.block_size,
                num_host_blocks=num_host,
                eagle_block_drop=drop,
                expected_workers=vllm_config.parallel_config.world_size,
                max_decode_tokens=1 + (spec.num_speculative_tokens if spec is not None else 0),
            )
            if self.config.events_endpoint:
                try:
                    self._publisher = _make_publisher(self.config, self._dp_rank)
                except KVSlotsError as e:  # a malformed or taken address: named as the config's key
                    raise ConnectorConfigError(
                        f"kv_connector_extra_config.events_endpoint={self.config.events_endpoint!r} "
                        f"(events_replay_endpoint={self.config.events_replay_endpoint!r}): {e}") from e
            # Without a reader, stores skip reading the token ids the events would carry.
            self._sched.planner.events_wanted = self._vllm_events or self._publisher is not None
            _warn_cpu_reservation(vllm_config)
        else:
            self._worker = WorkerSide(num_device_blocks=kv_cache_config.num_blocks,
                                      num_host_blocks=num_host, copy_threads=self.config.copy_threads)
        logger.info("KVSlotsConnector (%s): %d host blocks, eagle block drop %s", role.name, num_host, drop)
        self._disk_sched: Any = None
        self._disk_worker: Any = None
        self._disk_corrupt: set[int] = set()
        self._disk_loaded: list[tuple[str, int]] = []
        self._disk_drained: set[str] = set()  # reads finished before a sleep, not yet reported
        self._ran: dict[str, KVSlotsMetadata | None] = {}  # per step hook, the metadata it last ran
        self._tier_stats: Any = None
        self._bytes_per_block = bytes_per_block(kv_cache_config)
        if self.config.disk_path is not None:
            self._init_disk(vllm_config, kv_cache_config, role, drop)
        # Disaggregated prefill/decode (kv_producer / kv_consumer): .pd, None otherwise.
        from .pd import make_pd

        self._pd_sched, self._pd_worker = make_pd(vllm_config, kv_cache_config, role == KVConnectorRole.SCHEDULER,
                                                  self.config, self.block_size)

    def _init_disk(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", role: KVConnectorRole,
                   eagle: bool) -> None:
        from .disk import DiskLayout, DiskScheduler, DiskWorker

        if vllm_config.parallel_config.world_size != 1:
            raise ConnectorConfigError("kv_connector_extra_config.disk_path: the disk tier needs one worker rank "
                                       f"(world size {vllm_config.parallel_config.world_size})")
        bpb = bytes_per_block(kv_cache_config)
        layout = DiskLayout.of(vllm_config, kv_cache_config, bpb)
        n = self.config.num_disk_blocks(bpb)
        _check_disk_index_fits(n, self.config)
        _check_disk_queue_fits(self.config, self.config.num_host_blocks(bpb), bpb)
        path = self.config.disk_path or ""
        if self._sched is not None:
            self._disk_sched = DiskScheduler(self._sched.planner, directory=path, num_slots=n,
                                             block_size=self.block_size, layout=layout, eagle=eagle)
        else:
            try:
                self._disk_worker = DiskWorker(directory=path, num_slots=n, block_size=self.block_size,
                                               layout=layout, queue_len=self.config.disk_queue_len)
            except (OSError, DiskTierError) as e:  # the directory or its file cannot be made, or is in use
                raise ConnectorConfigError(f"kv_connector_extra_config.disk_path={path!r}: {e}") from e
        logger.info("KVSlotsConnector (%s): disk tier of %d blocks in %s", role.name, n, path)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("KVSlotsConnector: with a disk tier, set kv_transfer_config kv_load_failure_policy="
                           "\"recompute\": a corrupt disk block then is recomputed instead of failing its request")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        if self._pd_sched is not None:
            remote = self._pd_sched.matched(request, num_computed_tokens)
            if remote is not None:
                return remote
        n = self._sched.num_new_matched_tokens(request, num_computed_tokens)
        if self._disk_sched is not None:
            d = self._disk_sched.lookup(request, num_computed_tokens, n)
            if d:  # read in the background: the request waits, not the batch
                return n + d, True
        return n, False

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[Any, int]:
        if self._disk_sched is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        host, disk = self._disk_sched.hit_sources(request.request_id, num_external_tokens)
        out = {CacheHitSource.HOST: host, CacheHitSource.DISK: disk}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        if self._pd_sched is not None and self._pd_sched.after_alloc(request, blocks.get_block_ids()[0],
                                                                     num_external_tokens):
            self._sched.track(request)  # pulled from the prefill worker; mirrored for stores from now on
            return
        host_tokens = num_external_tokens
        if self._disk_sched is not None and num_external_tokens > 0:
            host_tokens = self._disk_sched.host_part(request, num_external_tokens)
            self._disk_sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)
        if host_tokens > 0:
            self._sched.after_alloc(request, blocks.get_block_ids()[0], host_tokens)
        else:
            self._sched.track(request)  # mirrored from now on, for stores

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        # One Rust call: mirrors the step's block tables, plans stores, loads and events.
        assert self._sched is not None
        meta = self._sched.build(scheduler_output)
        if self._disk_sched is not None:
            disk = self._disk_sched.build(scheduler_output.total_num_scheduled_tokens == 0)
            if disk is not None:
                meta = dataclasses.replace(meta, step=self._sched.step, disk=disk)
        if self._pd_sched is not None:
            pd = self._pd_sched.build()
            if pd is not None:
                meta = dataclasses.replace(meta, step=self._sched.step, pd=pd)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._sched is not None
        self._sched.complete(connector_output.kv_connector_worker_meta)  # type: ignore[arg-type]
        if self._disk_sched is not None and connector_output.kv_connector_worker_meta is not None:
            self._disk_sched.complete(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        if self._disk_sched is not None:
            self._disk_sched.forget(request.request_id)
        held = self._sched.request_finished(request, block_ids)
        if self._pd_sched is not None:
            keep, params = self._pd_sched.request_finished(request, block_ids)
            return held or keep, params
        return held, None

    def take_events(self) -> Iterable[Any]:
        events = self._take_host_events()
        if self._disk_sched is None or not self._disk_sched.index.num_pending_events():
            return events
        return [*events, *self._take_disk_events()]

    def _take_disk_events(self) -> list[Any]:
        # The disk tier's BlockStored / BlockRemoved, medium STORAGE, like the host tier's.
        idx = self._disk_sched.index
        if self._publisher is not None:
            self._publisher.publish(idx.events_msgpack(time.time(), MEDIUM_STORAGE, self._dp_rank))
        if not self._vllm_events:
            idx.discard_events()
            return []
        if self._raw_events:  # vLLM's ZMQ publisher: each event's wire bytes, as the host tier's
            return idx.drain_events_raw(msgspec.Raw, MEDIUM_STORAGE)
        return _decode_events(idx.events_msgpack(0.0, MEDIUM_STORAGE, None, drain=True))

    def _take_host_events(self) -> Iterable[Any]:
        assert self._sched is not None
        host = self._sched.host
        if not host.num_pending_events():
            return ()
        payload = None
        if self._publisher is not None:
            # Our own stream: the Rust core encodes the batch in vLLM's wire format directly.
            payload = host.events_msgpack(time.time(), MEDIUM_CPU, self._dp_rank)
            self._publisher.publish(payload)
        if not self._vllm_events:
            host.discard_events()  # vLLM publishes no KV events: nothing to build
            return ()
        # vLLM's stream (--kv-events-config): vLLM merges these into its own batches.
        if self._raw_events:  # its ZMQ publisher: each event's wire bytes, one call
            return host.drain_events_raw(msgspec.Raw, MEDIUM_CPU)
        # Otherwise msgspec decodes the core's msgpack straight into vLLM's event structs.
        if payload is None:
            return _decode_events(host.drain_events_msgpack(0.0, MEDIUM_CPU, None))  # one call
        host.discard_events()
        return _decode_events(payload)

    # ---- metrics: per-tier figures on vLLM's /metrics (see stats.py) ----
    def get_kv_connector_stats(self) -> Any:
        if self._sched is None:
            return None
        if self._tier_stats is None:
            from .stats import TierStats

            self._tier_stats = TierStats(self._bytes_per_block)
        return self._tier_stats.collect(self._sched, self._disk_sched)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from .stats import KVSlotsConnectorStats

        # Copied: aggregate() adds into its own dicts. A part that is not a mapping (None, a
        # list) was a TypeError from dict(); it is dropped: metrics never stop the engine.
        if not isinstance(data, Mapping):
            data = {}
        parts = {k: data.get(k) for k in ("gauges", "counters")}
        return KVSlotsConnectorStats(data={k: dict(v) if isinstance(v, Mapping) else {} for k, v in parts.items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from .stats import KVSlotsPromMetrics

        return KVSlotsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        if self._sched is not None:
            self._sched.host.clear()
            if self._disk_sched is not None:
                self._disk_sched.reset()  # the weights may change: nothing on disk may come back
        return True

    def shutdown(self) -> None:
        if self._disk_worker is not None:
            self._disk_worker.close()
        if self._pd_worker is not None:
            self._pd_worker.close()
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        worker = self._worker_side("register_kv_caches")
        before = worker.copier, worker._kv_caches
        worker.register_kv_caches(kv_caches)  # changes nothing if it raises
        if self._disk_worker is not None:
            try:
                self._disk_worker.register(kv_caches, worker.copier, worker.num_device_blocks,
                                           self.config.copy_threads)
            except BaseException:
                # Tensors the disk file does not fit: the copies go on over the earlier ones.
                worker.copier, worker._kv_caches = before
                raise
        if self._pd_worker is not None:
            self._pd_worker.register(kv_caches, worker.num_device_blocks)

    # Sleep mode (vLLM 0.33 calls these; 0.32 has no such hooks). Sleep level >= 1 already resets
    # the connector (reset_cache: the host tier is dropped and AllBlocksCleared published, as the
    # weights may change before wake-up). The worker drops its views of the device KV tensors,
    # whose memory is released or remapped while asleep, and rebuilds them on wake-up.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            if self._disk_worker is not None and self._disk_worker.num_pending and self._worker.copier is not None:
                # Disk reads in flight land in the host region and go on to device blocks, both
                # about to go away: finished (and copied) now, reported at the next step.
                done = self._disk_worker.poll(self._worker._load_errors, self._disk_corrupt, 60.0)
                self._disk_loaded.extend(done)
                self._disk_drained.update(r for r, _ in done)
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()
            if self._disk_worker is not None and self._worker.copier is not None:
                # The host region is new: spills and disk reads must use it, not the old one.
                self._disk_worker.register(self._worker._kv_caches or {}, self._worker.copier,
                                           self._worker.num_device_blocks, self.config.copy_threads)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this at the start of every step, before the forward: the step's stores run
        # here, so blocks freed since the last step are copied before they can be overwritten.
        worker = self._worker_side("handle_preemptions")
        meta = self._once(_step_meta(kv_connector_metadata, "handle_preemptions"), "handle_preemptions")
        if self._disk_worker is not None and meta.disk is not None:
            # Host blocks evicted to disk are read before this step's stores and disk reads
            # reuse them (a reset's wipe is queued first).
            self._disk_worker.spill(meta.disk)
        worker.store(meta)
        self._ran["handle_preemptions"] = meta

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        worker = self._worker_side("start_load_kv")
        meta = self._connector_metadata
        if meta is None:  # vLLM's own accessor asserted (nothing at all under python -O)
            raise InvalidStateError("KVSlotsConnector.start_load_kv: no connector metadata is bound for this "
                                    "step (bind_connector_metadata comes first)")
        meta = self._once(_step_meta(meta, "start_load_kv"), "start_load_kv")
        worker.load(meta)
        if self._pd_worker is not None:
            self._pd_worker.on_step(meta.pd)  # pulls start on a background thread
        if self._disk_worker is not None and meta.disk is not None and meta.disk.loads:
            self._disk_worker.start(meta.disk)  # async: finished in get_finished
        self._ran["start_load_kv"] = meta

    def _once(self, meta: KVSlotsMetadata, call: str) -> KVSlotsMetadata:
        # A step's copies run once (vLLM calls each hook once a step): a second call with its
        # metadata queued its spills again (each write reported twice: the scheduler's index
        # refuses the second) and its disk reads and P/D pulls again (a repeated pull reads the
        # prefill worker's blocks after the first one's ack let it free them). The callers note
        # the metadata once it has run: a call refused before copying anything may come again.
        if self._ran.get(call) is meta and not meta.is_empty():
            raise InvalidStateError(f"KVSlotsConnector.{call} was called twice for the step {meta.step}")
        return meta

    def _worker_side(self, call: str) -> WorkerSide:
        if self._worker is None:
            raise InvalidStateError(f"KVSlotsConnector.{call} is a worker-side call; this is the scheduler's "
                                    "connector")
        return self._worker

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None or not self._disk_news():
            return None, None
        # Disk reads done since the last step: copied to the device here, at the step boundary,
        # their failed blocks reported by get_block_ids_with_load_errors in this same pass. A
        # step with no forward (meta.disk.idle) holds up no batch: it waits a little for them.
        disk = getattr(getattr(self, "_connector_metadata", None), "disk", None)
        wait = self._disk_worker.IDLE_WAIT_S if disk is not None and disk.idle else 0.0
        done = self._disk_worker.poll(self._worker._load_errors, self._disk_corrupt, wait) \
            if self._disk_worker.num_pending and self._worker.copier is not None else []
        self._disk_loaded.extend(done)
        recving = {r for r, _ in done} | self._disk_drained
        self._disk_drained = set()
        return None, (recving or None)

    def _disk_news(self) -> bool:
        """Disk reads in flight, or finished before a sleep and not yet reported."""
        return self._disk_worker is not None and bool(self._disk_worker.num_pending or self._disk_drained)

    def has_connector_metadata(self) -> bool:
        # vLLM calls wait_for_layer_load / save_kv_layer around every attention layer only when
        # this is True; both do nothing here, so a step without copies skips them all.
        m = self._connector_metadata
        return m is not None and m is not EMPTY_METADATA

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before any layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # stores copy committed blocks only, in start_load_kv

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        KVConnectorTransferResults = _transfer_results_type()  # noqa: N806 (vLLM's class)
        if self._pd_worker is None and not self._disk_news():
            return KVConnectorTransferResults()  # nothing asynchronous under way
        # Both async sources: disk reads (get_finished) and P/D pulls (failed pulls are also
        # reported as received, as vLLM requires, and recomputed).
        _, disk_recving = self.get_finished(finished_req_ids)
        results = KVConnectorTransferResults(finished_recving=set(disk_recving or ()))
        if self._pd_worker is not None:
            sending, recving, failed = self._pd_worker.take_finished()
            results.finished_sending |= sending
            results.finished_recving |= recving
            results.failed_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        meta = self._worker.take_worker_meta()
        if self._disk_worker is not None:
            done = self._disk_worker.take_done()
            if done or self._disk_corrupt or self._disk_loaded:
                meta = meta or KVSlotsWorkerMetadata()
                meta.disk_done, meta.disk_corrupt, self._disk_corrupt = done, self._disk_corrupt, set()
                meta.disk_loaded, self._disk_loaded = self._disk_loaded, []
                meta.disk_stats = self._disk_worker.stats()
        return meta


def _step_meta(meta: Any, call: str) -> KVSlotsMetadata:
    if not isinstance(meta, KVSlotsMetadata):
        raise ArgumentTypeError(f"KVSlotsConnector.{call}: expected the KVSlotsMetadata of this connector's "
                                f"scheduler side, got {type(meta).__name__}")
    return meta


_EVENT_DECODER: Any = None
_TRANSFER_RESULTS: Any = None


def _transfer_results_type() -> Any:
    # Looked up once (an import statement per step costs more than the rest of a no-copy step).
    global _TRANSFER_RESULTS
    if _TRANSFER_RESULTS is None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        _TRANSFER_RESULTS = KVConnectorTransferResults
    return _TRANSFER_RESULTS


def _decode_events(payload: bytes) -> list[Any]:
    """vLLM's own event structs (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) from
    a msgpack ``KVEventBatch``, decoded by msgspec in C.

    With the EAGLE rule the host and disk tiers' ``BlockStored`` carry ``lookahead_token_ids``
    (each block's successor, vLLM 0.33's layout). vLLM 0.33's struct keeps the field; vLLM
    0.32's struct has no such field and msgspec skips it (its structs do not forbid unknown
    fields; tests/test_events_successors.py decodes them with 0.32's own decoder), so there the
    events are 0.32's, without successors."""
    global _EVENT_DECODER
    if _EVENT_DECODER is None:
        _EVENT_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
    return _EVENT_DECODER.decode(payload).events


def _warn_cpu_reservation(vllm_config: "VllmConfig") -> None:
    """On vLLM's CPU backend, says when the workers lost a core to the connector reservation."""
    from vllm.platforms import current_platform

    from ..cpu_cores import reservation_warning

    if current_platform.is_cpu():
        pc = vllm_config.parallel_config
        msg = reservation_warning(pc.tensor_parallel_size * pc.pipeline_parallel_size)
        if msg:
            logger.warning(msg)


#: Host memory the disk tier's index (kvslots._core.DiskIndex) takes per slot, allocated up front
#: (measured: 7.5 GB for 10^8 slots).
DISK_INDEX_BYTES_PER_SLOT = 80


def _check_disk_index_fits(num_slots: int, cfg: ConnectorConfig) -> None:
    """A disk tier whose index cannot fit in this machine's memory is a config error: the index
    would abort the process (a failed allocation in Rust) instead of raising."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    need = num_slots * DISK_INDEX_BYTES_PER_SLOT
    if phys > 0 and need > phys:
        key = "disk_blocks" if cfg.disk_blocks is not None else "disk_gb"
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{key}={getattr(cfg, key)}: a disk tier of {num_slots} blocks needs "
            f"{need / 2**30:.1f} GiB of host memory for its index; this machine has {phys / 2**30:.1f} GiB")


def _check_disk_queue_fits(cfg: ConnectorConfig, num_host_blocks: int, bpb: int) -> None:
    """The disk writer's queue holds a heap copy of each queued block (``disk_queue_len`` + 1
    blocks while the disk lags: measured 999 MB for 1,000 blocks of 1 MiB on a frozen disk), so
    a long queue is a second, unaccounted host tier. It may hold as many blocks as the host tier
    (the memory it costs at most doubles the tier's), or the default's, whichever is more."""
    default = next(f.default for f in dataclasses.fields(ConnectorConfig) if f.name == "disk_queue_len")
    most = max(cast(int, default), num_host_blocks)
    q = cfg.disk_queue_len
    if q > most:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.disk_queue_len={q}: each queued write holds a copy of its block, "
            f"{q + 1} blocks of {bpb} bytes ({(q + 1) * bpb / 2**30:.2f} GiB of host memory) while the disk "
            f"lags, more than the host tier's {num_host_blocks} blocks; at most {most}")


def _make_publisher(cfg: ConnectorConfig, dp_rank: int) -> Any:
    from ...events.publisher import EventPublisher

    return EventPublisher(cfg.events_endpoint or "", cfg.events_replay_endpoint, topic=cfg.events_topic,
                          data_parallel_rank=dp_rank, buffer_steps=cfg.events_buffer_steps, hwm=cfg.events_hwm)


__all__ = ["KVSlotsConnector", "KVSlotsMetadata", "KVSlotsWorkerMetadata", "ConnectorConfig"]
