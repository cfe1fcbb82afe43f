"""The KV cache manager of scheduler mode: vLLM's ``KVCacheManager`` interface over the Rust
device-block allocator (:class:`kvslots._core.DeviceKVManager`).

The calls vLLM's scheduler makes per request and per step (``allocate_slots``, ``get_blocks``,
``get_block_ids``, ``free``, ``cache_blocks``) are the Rust class's own methods: one Rust call,
no Python frame, no object per block. What the scheduler gets back is a
:class:`kvslots._core.KVBlocks`, which answers ``get_block_ids()`` like vLLM's ``KVCacheBlocks``.
This module adds the rest of the interface: prefix-hit lookup with EAGLE's last-block drop,
prefix-cache stats, KV events in vLLM's exact shape, reset, and the few internals vLLM's scheduler
and connectors read (``coordinator``, ``block_pool``).

Supported: one KV cache group of full attention (MLA included), the block hashes computed at the
block size, no context parallelism. Anything else is refused at start-up by
:func:`check_supported`, naming the feature.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, cast

from ..._core import DeviceKVManager, KVBlocks
from ...errors import ArgumentTypeError, ConfigError, InvalidArgumentError, KVSlotsError
from ...slots.reference import _int

logger = logging.getLogger(__name__)

USE_VLLM = "use --slot-manager vllm (vLLM's own KV cache manager) for this model or configuration"


class SchedulerModeError(ConfigError):
    """A configuration scheduler mode does not support (raised at engine start-up)."""


def _refuse(feature: str) -> SchedulerModeError:
    return SchedulerModeError(f"kvslots scheduler mode does not support {feature}; {USE_VLLM}")


def _layer_specs(spec: Any) -> list[Any]:
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict):
        return list(inner.values())
    return [spec]


def check_supported(kv_cache_config: Any, *, scheduler_block_size: int, hash_block_size: int,
                    dcp_world_size: int = 1, pcp_world_size: int = 1, metrics_collector: Any = None,
                    enable_caching: bool = True, num_prefill_lookahead: int = 0,
                    use_eagle: bool = False) -> None:
    """Raises :class:`SchedulerModeError` for what scheduler mode cannot serve exactly."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, EncoderOnlyAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = sorted({type(s).__name__ for g in groups for s in _layer_specs(g.kv_cache_spec)})
        raise _refuse(f"{len(groups)} KV cache groups (hybrid models: sliding window, Mamba, "
                      f"cross-attention or mixed layer types; here {', '.join(kinds) or 'none'})")
    group = groups[0]
    role = getattr(group, "role", None)
    if role is not None and getattr(role, "value", role) not in ("default", None, "DEFAULT"):
        raise _refuse(f"KV cache group role {role!r} (HiSparse)")
    if getattr(group, "host_resident", False) or getattr(kv_cache_config, "hisparse_host_num_blocks", None):
        raise _refuse("host-resident KV cache groups (HiSparse)")
    for spec in _layer_specs(group.kv_cache_spec):
        if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
            raise _refuse(f"encoder KV caches ({type(spec).__name__}: encoder-decoder or encoder-only models)")
        manager = KVCacheSpecRegistry.get_manager_class(spec, None)
        if manager is not FullAttentionManager:
            name = getattr(manager, "__name__", None)
            raise _refuse(f"{type(spec).__name__} layers (vLLM manages them with {name}; sliding window, "
                          f"chunked local attention, Mamba and the like)")
        if getattr(spec, "prefix_replay_tokens", 0):
            raise _refuse("bounded prefix replay (sliding-window replay groups)")
    if hash_block_size != scheduler_block_size:
        raise _refuse(f"hash_block_size {hash_block_size} != block_size {scheduler_block_size} "
                      f"(partial prefix-cache hits)")
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise _refuse(f"context parallelism (decode {dcp_world_size}, prefill {pcp_world_size})")
    if metrics_collector is not None:
        raise _refuse("--kv-cache-metrics (per-block residency sampling)")
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    if retention not in (None, 0):
        raise _refuse(f"prefix_cache_retention_interval={retention}")
    if enable_caching and use_eagle and scheduler_block_size < num_prefill_lookahead:
        raise SchedulerModeError(
            f"Multi-module MTP with prefix caching requires block_size (={scheduler_block_size}) >= "
            f"num_speculative_tokens (={num_prefill_lookahead})")


class _Null:
    """vLLM's null block, for code that reads ``block_pool.null_block``."""

    block_id = 0
    is_null = True
    ref_cnt = 0
    block_hash = None


class _BlockView:
    """A block as vLLM's code reads it (``block_id``, ``block_hash``, ``ref_cnt``); cold paths only."""

    __slots__ = ("block_id", "_m")

    def __init__(self, m: "KVSlotsKVCacheManager", block_id: int) -> None:
        self.block_id = block_id
        self._m = m

    @property
    def block_hash(self) -> bytes | None:
        return self._m.registered_hash(self.block_id)

    @property
    def ref_cnt(self) -> int:
        return self._m.refcount(self.block_id)

    is_null = False

    def __repr__(self) -> str:
        return f"Block({self.block_id})"


class _BlockPool:
    """The part of vLLM's ``BlockPool`` its scheduler and connectors call."""

    def __init__(self, m: "KVSlotsKVCacheManager") -> None:
        self._m = m
        self.null_block = _Null()
        self.enable_caching = m.enable_caching
        self.hash_block_size = m.block_size
        self.enable_kv_cache_events = m.enable_kv_cache_events

    @property
    def num_gpu_blocks(self) -> int:
        return self._m.num_gpu_blocks

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Gives back blocks handed out by ``pop_blocks_for_free`` (deferred frees)."""
        self._m.release_blocks(list(ordered_blocks))

    def get_num_free_blocks(self) -> int:
        return self._m.num_free_blocks()

    def get_usage(self) -> float:
        return self._m.usage

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._m.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self._m.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        return self._m._take_raw_events()

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[Any] | None:
        b = self._m._lookup_hash(block_hash)
        return None if b is None else [_BlockView(self._m, b) for _ in kv_cache_group_ids]


class _SingleTypeManager:
    """What vLLM's scheduler reads of ``coordinator.single_type_managers[0]``."""

    def __init__(self, m: "KVSlotsKVCacheManager", spec: Any) -> None:
        self._m = m
        self.kv_cache_spec = spec
        self.block_size = m.block_size
        self.kv_cache_group_id = 0
        self.enable_caching = m.enable_caching
        self.use_eagle = m.use_eagle
        self.records_new_block_ids = m.records_new_block_ids
        self.retains_longer_hit = False
        self.has_positionally_stable_blocks = True

    def take_new_block_ids(self) -> list[int]:
        return self._m.take_new_block_ids()


class _Coordinator:
    """What vLLM's scheduler reads of ``kv_cache_manager.coordinator``."""

    enable_partial_hash_hits = False
    num_reprefillable_tokens = 0
    retention_interval = None

    def __init__(self, m: "KVSlotsKVCacheManager", spec: Any) -> None:
        self._m = m
        self.single_type_managers = (_SingleTypeManager(m, spec),)
        self.block_pool = m.block_pool
        self.eagle_group_ids = {0} if m.use_eagle else set()
        self.scheduler_block_size = m.block_size
        self.num_reprefillable_tokens = m.num_reprefillable_tokens

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Any = (),
                                   num_encoder_tokens: int = 0, total_computed_tokens: int = 0,
                                   num_local_computed_tokens: int = 0, num_tokens_main_model: int = 0,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        extra = 0
        if new_computed_blocks:
            hit = new_computed_blocks[0] if isinstance(new_computed_blocks, tuple) else new_computed_blocks
            extra = len(hit)
        return max(self._m.num_blocks_to_allocate(request_id, num_tokens) - extra, 0)

    def get_blocks(self, request_id: str) -> tuple[list[Any], ...]:
        return ([_BlockView(self._m, b) for b in self._m.block_ids(request_id)],)

    def new_step_starts(self) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return self._m.reset_prefix_cache()

    def free(self, request_id: str) -> None:
        self._m.free_request(request_id)


class KVSlotsKVCacheManager(DeviceKVManager):
    """vLLM's ``KVCacheManager``, backed by the Rust core. Constructed by vLLM's scheduler with
    ``KVCacheManager``'s arguments (see :class:`kvslots.vllm.KVSlotsScheduler`)."""

    def __new__(cls, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                hash_block_size: int, max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                use_eagle: bool = False, num_prefill_lookahead: int = 0, log_stats: bool = False,
                enable_kv_cache_events: bool = False, dcp_world_size: int = 1, pcp_world_size: int = 1,
                metrics_collector: Any = None, watermark: float = 0.0,
                enable_mamba_shared_prefix_checkpoint: bool = False, *, defer_lookahead: bool = False,
                **_: Any) -> "KVSlotsKVCacheManager":
        check_supported(kv_cache_config, scheduler_block_size=scheduler_block_size,
                        hash_block_size=hash_block_size, dcp_world_size=dcp_world_size,
                        pcp_world_size=pcp_world_size, metrics_collector=metrics_collector,
                        enable_caching=enable_caching, num_prefill_lookahead=num_prefill_lookahead,
                        use_eagle=use_eagle or bool(getattr(next(iter(kv_cache_config.kv_cache_groups), None),
                                                            "is_eagle_group", False)))
        # vLLM's SchedulerConfig.watermark is a fraction in [0, 1): NaN or infinity here was
        # int()'s ValueError / OverflowError, a str or None a TypeError.
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise SchedulerModeError(f"watermark must be a fraction in [0, 1), got {watermark!r:.60}")
        return super().__new__(
            cls, kv_cache_config.num_blocks, kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
            max_model_len=max_model_len, enable_caching=enable_caching,
            record_evictions=enable_kv_cache_events,
            record_new_blocks=bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False)),
            num_reprefillable_tokens=max(0, num_prefill_lookahead - 1),
            watermark_blocks=int(watermark * kv_cache_config.num_blocks),
            defer_lookahead=defer_lookahead)

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, num_prefill_lookahead: int = 0, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False, *, defer_lookahead: bool = False,
                 num_hash_lookahead_tokens: int = 0, **_: Any) -> None:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        group = kv_cache_config.kv_cache_groups[0]
        self.kv_cache_config = kv_cache_config
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        # vLLM's coordinator: the EAGLE drop applies to flagged groups, or to all when none is.
        self.use_eagle = bool(group.is_eagle_group) or use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self._stats_cls = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = 1
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.mamba_shared_prefix_checkpoint = False
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.records_new_block_ids = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        self.defer_lookahead = defer_lookahead
        # vLLM 0.33 (EAGLE, no connector): each block hash also covers the next L tokens, so
        # request.block_hashes only reaches a block once L tokens follow it; the Rust core
        # commits only blocks that have a hash. Events carry those tokens (lookahead_token_ids).
        if num_hash_lookahead_tokens is None:
            num_hash_lookahead_tokens = 0
        if isinstance(num_hash_lookahead_tokens, bool) or not isinstance(num_hash_lookahead_tokens, int) \
                or not 0 <= num_hash_lookahead_tokens < 1 << 31:
            raise SchedulerModeError(f"num_hash_lookahead_tokens must be an integer in [0, 2**31), "
                                     f"got {num_hash_lookahead_tokens!r:.60}")
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.kv_cache_event_metadata = (
            (get_kv_cache_spec_kind(group.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(group.kv_cache_spec)),)
        self._set_watermark_statuses([RequestStatus.WAITING, RequestStatus.PREEMPTED])
        self._events: list[Any] = []
        self._int_hashes = False
        if enable_kv_cache_events:
            import vllm.envs as envs

            self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        self.block_pool = _BlockPool(self)
        self.coordinator = _Coordinator(self, group.kv_cache_spec)

    # ---- lookups ----
    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[KVBlocks, int, int]:
        """The longest prefix-cache hit (full blocks, never the whole prompt: the last token is
        recomputed), the last block dropped for EAGLE-family drafters, as vLLM does.
        ``max_cache_hit_length`` (vLLM 0.33) caps the hit; 0.32 never passes it."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        # Integers as the bindings read them (int() took True as 1, "5" as 5, 3.9 as 3, and
        # raised ValueError for NaN).
        rid = _request_id(request)
        if max_cache_hit_length is None:
            limit = _int(request.num_tokens, "request.num_tokens", 0, 1 << 64, rid) - 1
        else:
            limit = _int(max_cache_hit_length, "max_cache_hit_length", -(1 << 63), 1 << 64, rid)
        blocks = self.computed_blocks(request, max(0, limit) // self.block_size, self.use_eagle)
        n = blocks.num_blocks
        if (n and self.enable_kv_cache_events
                and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
            self._emit_cached_block_events(request, n)
        return blocks, n * self.block_size, 0

    def get_computed_blocks_for_connector(self, request: Any, max_cache_hit_length: int | None = None
                                          ) -> tuple[KVBlocks, int, int, bool]:
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def truncate_computed_blocks(self, blocks: KVBlocks, num_computed_tokens: int) -> KVBlocks:
        # kvslots errors (InvalidArgumentError is a ValueError, as these were), the count read
        # as the bindings read one (True was 1; a str or a non-KVBlocks raised Python's errors).
        bs = self.block_size
        if not isinstance(blocks, KVBlocks):
            raise ArgumentTypeError(f"invalid argument: blocks must be KVBlocks, got {type(blocks).__name__}")
        tokens = _int(num_computed_tokens, "num_computed_tokens", 0, 1 << 64)
        if tokens % bs:
            raise InvalidArgumentError(f"invalid argument: num_computed_tokens {tokens} is not block aligned ({bs})")
        n = tokens // bs
        if n > blocks.num_blocks:
            raise InvalidArgumentError(f"invalid argument: cannot truncate {blocks.num_blocks} blocks to {n}")
        if n == 0:
            return self.empty_kv_cache_blocks
        return KVBlocks(cast("tuple[list[int], ...]", blocks.get_block_ids())[0][:n])

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> KVBlocks:
        ids = [b if isinstance(b, int) else b.block_id for b in blocks[0]] if blocks and blocks[0] else []
        return KVBlocks(ids) if ids else self.empty_kv_cache_blocks

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        ids = self.block_ids(request_id)
        return (ids[: -(-num_computed_tokens // self.block_size)],)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]

    def _lookup_hash(self, block_hash: bytes) -> int | None:
        class _R:
            block_hashes = [block_hash]
            num_tokens = 2 * self.block_size

        b = self.computed_blocks(_R(), 1, False)
        return cast("tuple[list[int], ...]", b.get_block_ids())[0][0] if b.num_blocks else None

    # ---- stats ----
    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._stats_cls()
        return stats

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    # ---- per step ----
    def new_step_starts(self) -> None:
        return None

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None  # full attention skips nothing

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        return []

    def reset_prefix_cache(self) -> bool:
        if not self.reset():
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet",
                           self.num_held_blocks() - 1)
            return False
        if self.enable_kv_cache_events:
            from vllm.distributed.kv_events import AllBlocksCleared

            self._flush_evictions()
            self._events.append(AllBlocksCleared())
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        logger.info("Successfully reset prefix cache")
        return True

    # ---- KV events, in vLLM's exact shape ----
    def _ext(self, h: bytes) -> Any:
        if self._int_hashes:
            return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF
        return h

    def _flush_evictions(self) -> None:
        evicted = self.drain_evicted()
        if not evicted:
            return
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved

        self._events.extend(BlockRemoved(block_hashes=[self._ext(h)], medium=MEDIUM_GPU, group_idx=0)
                            for h in evicted)

    def _prepare_stored(self, request: Any, start: int, end: int) -> Any:
        """Called by the Rust class before a call that will register blocks ``start..end`` of
        the request's table changes anything: their BlockStored, built here (it reads the
        request, which may raise) so that an error leaves the allocation undone."""
        if not self.enable_kv_cache_events:
            return None
        return self._stored_event(request, start, end, start)

    def _on_alloc(self, request: Any, start: int, end: int, stored: Any = None) -> None:
        """Called by the Rust class after an allocation that registered blocks ``start..end`` of
        the request's table or evicted cached blocks: BlockRemoved for each eviction, then the
        run's BlockStored (``stored``, from ``_prepare_stored``), as vLLM's block pool emits
        them. Only queues what was built: nothing here reads the request."""
        if not self.enable_kv_cache_events:
            self.drain_evicted()
            return
        self._flush_evictions()
        if stored is None and end > start:
            stored = self._stored_event(request, start, end, start)
        if stored is not None:
            self._events.append(stored)

    def _stored_event(self, request: Any, start: int, end: int, parent_index: int) -> Any:
        """The BlockStored of blocks ``start..end``. What reading the request's fields raises is
        the request's fault (InvalidArgumentError, ArgumentTypeError for a TypeError); what
        building the event raises is not (a vLLM whose BlockStored changed): a KVSlotsError
        naming the request. Either keeps the error as its cause."""
        from vllm.distributed.kv_events import MEDIUM_GPU, BlockStored
        from vllm.v1.core import kv_cache_utils as kcu

        try:
            fields = self._stored_fields(kcu, request, start, end, parent_index)
        except KVSlotsError:
            raise
        except Exception as e:
            kind = ArgumentTypeError if isinstance(e, TypeError) else InvalidArgumentError
            raise kind(f"invalid argument: cannot read the request's fields for its KV event: {e}",
                       _request_id(request)) from e
        try:
            extra = fields.pop("extra")
            return BlockStored(**fields, medium=MEDIUM_GPU, extra_keys=kcu.to_event_extra_keys(extra))
        except KVSlotsError:
            raise
        except Exception as e:
            rid = _request_id(request)
            raise KVSlotsError(f"building the KV event for request {rid!r} failed: {e}", rid) from e

    def _stored_fields(self, kcu: Any, request: Any, start: int, end: int, parent_index: int) -> dict[str, Any]:
        bs = self.block_size
        hashes = request.block_hashes
        ext = self._ext
        extra: list[Any] = []
        mm_idx = 0
        la = self.num_hash_lookahead_tokens
        lookahead: dict[str, Any] = {}
        if la:
            # As vLLM 0.33's block pool: extra keys over the hashed window, the tokens after
            # each block in lookahead_token_ids.
            toks = request.all_token_ids
            lookahead["lookahead_token_ids"] = [list(toks[(i + 1) * bs:(i + 1) * bs + la])
                                                for i in range(start, end)]
        for i in range(start, end):
            if la:
                # vLLM 0.33 only (num_hash_lookahead_tokens is 0 on 0.32)
                keys, mm_idx = cast(Any, kcu).generate_lookahead_block_hash_extra_keys(
                    request, i * bs, (i + 1) * bs, (i + 1) * bs + la, mm_idx)
            else:
                keys, mm_idx = kcu.generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        return dict(**lookahead,
            block_hashes=[ext(h) for h in hashes[start:end]],
            parent_block_hash=ext(hashes[parent_index - 1]) if parent_index > 0 else None,
            token_ids=request.all_token_ids[start * bs:end * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra=extra,
            group_idx=0,
            session_id=getattr(request, "session_id", None),
        )

    def _emit_cached_block_events(self, request: Any, n: int) -> None:
        # vLLM's emit_cached_block_events: the reused prefix, from block 0, parent None.
        self._events.append(self._stored_event(request, 0, n, 0))

    def _take_raw_events(self) -> list[Any]:
        if not self.enable_kv_cache_events:
            self.drain_evicted()
            return []
        self._flush_evictions()
        events, self._events = self._events, []
        return events

    def take_events(self) -> list[Any]:
        if not self.enable_kv_cache_events:
            if self.num_evicted_pending():
                self.drain_evicted()
            return []
        from vllm.distributed.kv_events import BlockStored

        events = self._take_raw_events()
        kind, sliding_window = self.kv_cache_event_metadata[0]
        for ev in events:
            if isinstance(ev, BlockStored) and ev.group_idx == 0:
                ev.kv_cache_spec_kind = kind
                ev.kv_cache_spec_sliding_window = sliding_window
        return events

    # ---- scheduler mode ----
    def finish_deferred(self, scheduler_output: Any, num_spec_tokens: int) -> int:
        """Materialises the lookahead deferred this step for the step's K (dynamic speculative
        decoding) and appends the new block ids to the step's output, as the workers' block
        tables expect (append-only). Returns the number of blocks added."""
        k = scheduler_output.num_spec_tokens_to_schedule
        cut = max(0, num_spec_tokens - k) if k is not None else 0
        added = self.finish_step(cut, scheduler_output.num_scheduled_tokens)
        if not added:
            return 0
        new = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        pos = {rid: i for i, rid in enumerate(cached.req_ids)}
        total = 0
        for rid, ids in added:
            total += len(ids)
            if rid in new:
                new[rid].block_ids[0].extend(ids)
                continue
            i = pos[rid]
            cur = cached.new_block_ids[i]
            if cur is None:
                cached.new_block_ids[i] = (list(ids),)
            else:
                cur[0].extend(ids)
        return total

    def check(self, requests: Iterable[Any] = ()) -> None:
        """Every invariant (tests): the allocator's own, and for each live request that every
        registered block of its table holds verified tokens under the request's own hash."""
        problem = self.check_invariants()
        if problem:
            raise AssertionError(problem)
        bs = self.block_size
        for req in requests:
            ids = self.block_ids(req.request_id)
            for i, b in enumerate(ids):
                h = self.registered_hash(b)
                if h is None:
                    continue
                assert (i + 1) * bs <= req.num_tokens, (
                    f"{req.request_id}: block {b} at {i} is registered but holds unverified positions "
                    f"({req.num_tokens} verified tokens)")
                assert i < len(req.block_hashes) and req.block_hashes[i] == h, (
                    f"{req.request_id}: block {b} at {i} is registered under another hash")


__all__ = ["KVSlotsKVCacheManager", "SchedulerModeError", "check_supported", "USE_VLLM"]


def _request_id(request: Any) -> str | None:
    """The request's id for an error about it; None when it has no str one (or reading fails)."""
    try:
        rid = request.request_id
    except Exception:
        return None
    return rid if isinstance(rid, str) else None
