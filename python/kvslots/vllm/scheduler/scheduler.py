"""vLLM schedulers whose KV cache manager is the kvslots Rust core (scheduler mode).

    vllm serve MODEL --scheduler-cls kvslots.vllm.KVSlotsScheduler ...

vLLM's scheduler has no hook for its KV cache manager: it constructs ``KVCacheManager`` from a
module global in ``__init__``. :class:`KVSlotsScheduler` points that global at
:class:`~.kv_cache_manager.KVSlotsKVCacheManager` for the duration of its own construction (so
the connector, if any, binds to it as it would to vLLM's), and checks the configuration first:
what scheduler mode does not support stops the engine with an error that names it.

Everything else is vLLM's scheduler, unchanged: the same requests are scheduled, the same tokens,
the same prefix hits, the same preemptions. With a dynamic speculative-decoding schedule
(``num_speculative_tokens_per_batch_size``) the lookahead slots of a step are reserved at
allocation and materialised once the step's K is known, for that K rather than the largest.

With async scheduling (vLLM turns it on for EAGLE on GPU) the same class builds the async
variant, :class:`KVSlotsAsyncScheduler`. vLLM's scheduler interface is not public: this module
is tested against the vLLM versions in ``SUPPORTED_VLLM``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import vllm.v1.core.sched.scheduler as _sched_mod
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..compat import SUPPORTED, check_supported
from .kv_cache_manager import KVSlotsKVCacheManager, SchedulerModeError

logger = logging.getLogger(__name__)

#: vLLM versions scheduler mode is tested against (its scheduler interface is not public).
SUPPORTED_VLLM = tuple(f"{a}.{b}." for a, b in SUPPORTED)

_construct_lock = threading.Lock()


def _check_vllm_version() -> None:
    # An unsupported vLLM stops here, naming the supported range (kvslots.vllm.compat).
    check_supported()


def _check_config(vllm_config: Any) -> None:
    model_config = vllm_config.model_config
    if getattr(model_config, "is_encoder_decoder", False):
        raise SchedulerModeError(
            "kvslots scheduler mode does not support encoder-decoder models (encoder KV caches); "
            "use --slot-manager vllm (vLLM's own KV cache manager)")
    if getattr(vllm_config, "diffusion_config", None) is not None:
        # vLLM picks its diffusion scheduler only when no --scheduler-cls is given.
        raise SchedulerModeError(
            "kvslots scheduler mode does not support diffusion models (vLLM's diffusion scheduler); "
            "use --slot-manager vllm (vLLM's own KV cache manager)")
    if getattr(vllm_config, "is_mm_encoder_only", False):
        raise SchedulerModeError(
            "kvslots scheduler mode does not support encoder-only multimodal instances; "
            "use --slot-manager vllm (vLLM's own KV cache manager)")


class KVSlotsScheduler(Scheduler):
    """vLLM's scheduler over the kvslots device-block allocator. Builds
    :class:`KVSlotsAsyncScheduler` when async scheduling is on."""

    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any) -> "KVSlotsScheduler":
        if (cls is KVSlotsScheduler and vllm_config is not None
                and getattr(vllm_config.scheduler_config, "async_scheduling", False)):
            cls = KVSlotsAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        _check_vllm_version()
        _check_config(vllm_config)
        spec = vllm_config.speculative_config
        defer = bool(spec is not None and getattr(spec, "num_speculative_tokens_per_batch_size", None)
                     and vllm_config.num_lookahead_tokens > 0)

        def manager(*margs: Any, **mkwargs: Any) -> KVSlotsKVCacheManager:
            return KVSlotsKVCacheManager(*margs, defer_lookahead=defer, **mkwargs)

        with _construct_lock:
            saved = _sched_mod.KVCacheManager
            _sched_mod.KVCacheManager = manager  # type: ignore[assignment,misc]
            try:
                super().__init__(vllm_config, *args, **kwargs)
            finally:
                _sched_mod.KVCacheManager = saved  # type: ignore[assignment,misc]
        assert isinstance(self.kv_cache_manager, KVSlotsKVCacheManager)
        logger.info("kvslots scheduler mode: %d device blocks of %d tokens in the Rust core%s",
                    self.kv_cache_manager.num_gpu_blocks, self.kv_cache_manager.block_size,
                    " (lookahead for each step's K)" if defer else "")

    def _build_kv_connector_meta(self, connector: Any, scheduler_output: Any) -> Any:
        # The step's output is complete but for the connector's metadata: materialise the
        # deferred lookahead now, so that the connector sees every block the workers will.
        self._finish_deferred(scheduler_output)
        return super()._build_kv_connector_meta(connector, scheduler_output)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        self._finish_deferred(out)
        return out

    def _finish_deferred(self, scheduler_output: Any) -> None:
        m = cast(KVSlotsKVCacheManager, self.kv_cache_manager)  # built by __init__
        if m.defer_lookahead and m.num_deferred():
            m.finish_deferred(scheduler_output, self.num_spec_tokens)


class KVSlotsAsyncScheduler(KVSlotsScheduler, AsyncScheduler):
    """The async-scheduling variant (vLLM's ``AsyncScheduler`` over the kvslots allocator)."""


__all__ = ["KVSlotsScheduler", "KVSlotsAsyncScheduler", "SUPPORTED_VLLM"]
